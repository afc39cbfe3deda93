"""GGUF loader fuzzer: structure-aware mutations of a valid small model file, each loaded in a guarded worker.

The seed file is a synthetic llama model (ggml_dist.model.synthetic). Its layout is walked once to learn
where every field lives (magic, version, counts, each kv's key / type / value / array length, each string
length, each tensor info's name / n_dims / ne / type / offset, the data section), and each case applies
one or a few mutations that know those fields: counts and lengths set to 0 / 1 / huge / random, value and
tensor type ids set to unknown ids, dims set to 0 / "negative" / huge, offsets past EOF or misaligned,
general.alignment inserted as 0 / 3 / 2**40 / ..., keys and tensor names duplicated, string values
replaced, truncation, appended bytes and plain byte flips.

Each case is written to a file and loaded with load_gguf and LlamaModel.load (metadata, hparams, tensor
checks, weights mapping, tokenizer) in a worker process; a file that loads then encodes a short text and
runs a forward pass (forward_probe: a LlamaContext of 64 cells, the prompt as one batch, two greedy
steps). The project's own errors are GGUFError (and its subclasses), BatchError and ContextFullError
(project_errors()); the case is classified as

    ok          the file loads, its tokenizer encodes, and its forward pass runs
    clean       one of the project's own errors, its message naming the file
    unclear     one of the project's own errors whose message does not name the file (`unclear_errors`;
                failures with --strict-path)
    failure     anything else: another exception type (a ValueError from numpy, an IndexError, int() on a
                bad value, a core-layer error such as ShapeError from a graph the loader let through), a
                case using more than --case-time-limit CPU seconds (a hang; a worker stuck for
                --hard-timeout wall seconds is killed), a worker that dies (a crash), or a traced
                allocation peak above file size + --mem-overhead-mb

Memory is measured with tracemalloc inside the worker (numpy reports its buffers to tracemalloc, so
arrays count too; the file's memory map does not, it is the file): the per-case peak of traced memory
above what was live before the case, minus the file size, is `peak_mem_over_file_mb`. The worker also
runs under RLIMIT_AS (its address space after imports + --as-headroom-mb) so an allocation that escaped
tracing still fails (MemoryError) instead of exhausting the machine; the workers' maxrss growth is
reported as a second, independent number.

The workers run the numpy reference kernels, which check every index. --compiled-share F runs that
share of the cases (drawn per case) through the compiled numba kernels instead, the ones users run,
which check no bounds: the workers are then spawned (fresh interpreters with their own OpenMP, one
kernel thread each), so a kernel that crashes takes down a worker, not the run. Such a case is a failure
of kind "crash" (counted in `crashes`), saved like any other, and the worker is started again; `by_path`
gives every outcome per kernel path. A compiled case that meets a kernel the warm-up did not compile,
and is slow or too big only on that account, is measured again (`jit_reruns`).

Failing inputs are written to --failures-dir as case-NNNNN-<mutation>.gguf with a .txt beside each (its
kernel path included); `--replay PATH` reloads one file (or every .gguf in a directory) in this process,
with the compiled kernels, and prints the outcome.

    ggml-dist bench fuzz-gguf --cases 10000 --json
    ggml-dist bench fuzz-gguf --cases 2000 --compiled-share 0.25 --json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from .fuzz_cases import MUTATIONS, SEED_SPEC, Layout, make_case, seed_file
from .fuzz_probe import run_case, warm_up
from .fuzz_workers import _death, _JitStarted, _Worker

__all__ = ["MUTATIONS", "PATHS", "SEED_SPEC", "FuzzReport", "Layout", "compiled_case", "make_case", "replay",
           "run_case", "run_fuzz", "seed_file", "warm_up"]


# ---------------------------------------------------------------------------------------------------
# the run

PATHS = ("numpy", "compiled")       # the kernel paths a case can run: the numpy reference, numba's


def compiled_case(seed: int, index: int, share: float) -> bool:
    """Whether the index-th case of a run takes the compiled kernels: a draw of its own (not the case's
    mutation stream, so a case's bytes do not depend on the share), a pure function of its args."""
    return share >= 1.0 or (share > 0.0 and random.Random(f"compiled {seed} {index}").random() < share)


@dataclass
class FuzzReport:
    fuzz_cases: int = 0
    fuzz_failures: int = 0                  # every failure, crashes included
    crashes: int = 0                        # failures where the worker died (a signal: SIGSEGV, SIGBUS...)
    ok: int = 0
    clean_errors: int = 0                   # one of project_errors(), its message naming the file
    unclear_errors: int = 0                 # one of project_errors(), its message not naming the file
    max_case_s: float = 0.0                 # CPU seconds of the slowest case
    max_case_wall_s: float = 0.0            # wall seconds of the slowest case (includes waiting for a CPU)
    peak_mem_over_file_mb: float = 0.0
    maxrss_growth_mb: float = 0.0
    seed: int = 0
    seed_file_bytes: int = 0
    wall_s: float = 0.0
    compiled_share: float = 0.0             # the share of cases drawn for the compiled kernels
    jit_reruns: int = 0                     # compiled cases measured again after a JIT compile (run_case)
    # per kernel path ("numpy", "compiled"): cases, each outcome, crashes, and the kernels it ran
    # ("numpy"; "vnni", "avx2" or "float": qpack's choice on this host)
    by_path: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_mutation: dict[str, dict[str, int]] = field(default_factory=dict)
    failure_kinds: dict[str, int] = field(default_factory=dict)
    unclear_messages: dict[str, int] = field(default_factory=dict)  # stage: type: message head -> count
    failures: list[dict[str, Any]] = field(default_factory=list)
    failures_dir: str | None = None

    def to_json(self, max_failures: int = 20) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["failures"] = self.failures[:max_failures]
        return d


def _head(msg: str) -> str:
    """A message without its quoted values and numbers, to group errors by the check that raised them."""
    import re
    return re.sub(r"'[^']*'|\d+", "_", msg)[:60]


def run_fuzz(n_cases: int, seed: int = 0, jobs: int = 1, failures_dir: str | Path | None = None,
             case_time_limit: float = 2.0, hard_timeout: float = 20.0, mem_overhead_mb: float = 64.0,
             as_headroom_mb: float = 2048.0, strict_path: bool = False, progress: bool = False,
             compiled_share: float = 0.0, jit_timeout: float = 600.0) -> FuzzReport:
    """Run n_cases cases over `jobs` worker processes. compiled_share > 0 draws that share of the cases
    (compiled_case) for the compiled kernels, the ones users run, which have no bounds checks: the workers
    are then spawned, fresh interpreters that run either path, so that a kernel that crashes (SIGSEGV)
    takes down a worker, not the run; the case is a failure of kind "crash" (counted in `crashes` and per
    path), saved to failures_dir like any other, and the worker is started again. A compiled case in
    which numba starts compiling a kernel has jit_timeout wall seconds from that start instead of
    hard_timeout (a compile on a busy 2-core host took over 20 s). With compiled_share 0 the workers are
    forked and run the numpy reference only."""
    if not 0.0 <= compiled_share <= 1.0:
        raise ValueError(f"compiled_share = {compiled_share}: must be in [0, 1]")
    t_start = time.perf_counter()
    tally = _Tally(FuzzReport(seed=seed, compiled_share=compiled_share), failures_dir, progress)
    mem_overhead = int(mem_overhead_mb * (1 << 20))
    spawned = compiled_share > 0.0
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmpdir:
        lay = Layout.walk(seed_file(os.path.join(tmpdir, "seed.gguf")).read_bytes())
        tally.rep.seed_file_bytes = len(lay.raw)
        method = "spawn" if spawned or "fork" not in mp.get_all_start_methods() else "fork"
        ctx = mp.get_context(method)
        wargs = (case_time_limit, mem_overhead, int(as_headroom_mb * (1 << 20)), strict_path)

        def new_worker() -> _Worker:
            w = _Worker(ctx, tmpdir, wargs, spawned)
            if spawned:
                tally.path_kernels["compiled"] = w.kernels
            return w

        workers = [new_worker() for _ in range(max(1, jobs))]
        next_index = 0

        def record(w: _Worker, res: dict[str, Any]) -> None:
            case, w.case = w.case, None
            tally.record(case, res)

        def crashed(i: int, now: float) -> None:
            """Worker i died with a case: record the crash, start another worker."""
            w = workers[i]
            w.proc.join(5)
            record(w, {"outcome": "failure", "kind": "crash", "msg": f"worker {_death(w.proc.exitcode)}",
                       "elapsed": now - w.t0})
            w.kill()
            workers[i] = new_worker()

        def feed(i: int) -> None:
            """Give worker i the next case, if any (a worker found dead on sending crashed with it)."""
            nonlocal next_index
            while next_index < n_cases and workers[i].case is None:
                name, data, descs = make_case(seed, next_index, lay)
                case = (next_index, name, data, descs, spawned and compiled_case(seed, next_index, compiled_share))
                next_index += 1
                try:
                    workers[i].submit(case, hard_timeout)
                except OSError:                         # it died after its last answer
                    crashed(i, time.perf_counter())

        try:
            for i in range(len(workers)):
                feed(i)
            while any(w.case is not None for w in workers):
                busy = [w for w in workers if w.case is not None]
                ready = wait([w.conn for w in busy], timeout=0.5)
                now = time.perf_counter()
                for i, w in enumerate(workers):
                    if w.case is None:
                        continue
                    if w.conn in ready:
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):
                            crashed(i, now)
                        else:
                            if isinstance(msg, _JitStarted):
                                w.deadline = max(w.deadline, now + jit_timeout)
                                continue
                            record(w, msg.res)
                    elif now > w.deadline:
                        record(w, {"outcome": "failure", "kind": "hang",
                                   "msg": f"killed after {now - w.t0:.1f} s (hard timeout {hard_timeout} s, "
                                          f"{jit_timeout} s after a JIT compile starts)",
                                   "elapsed": now - w.t0})
                        w.kill()
                        workers[i] = new_worker()
                    else:
                        continue
                    feed(i)
        finally:
            for w in workers:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
                w.proc.join(2)
                if w.proc.is_alive():
                    w.kill()
    return tally.finish(t_start)


@dataclass
class _Tally:
    """What a run keeps of its cases' results: the report's counts and extremes, per mutation and per
    kernel path, and the failures (each written to failures_dir with a .txt beside it)."""
    rep: FuzzReport
    failures_dir: str | Path | None
    progress: bool
    by_mut: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    by_path: dict[str, Counter] = field(default_factory=lambda: {k: Counter() for k in PATHS})
    path_kernels: dict[str, str] = field(default_factory=lambda: {"numpy": "numpy"})
    kinds: Counter = field(default_factory=Counter)
    unclear: Counter = field(default_factory=Counter)

    def record(self, case: Any, res: dict[str, Any]) -> None:
        rep, (index, name, data, descs, compiled) = self.rep, case
        path = PATHS[compiled]
        rep.fuzz_cases += 1
        self.by_mut[name][res["outcome"]] += 1
        self.by_path[path]["cases"] += 1
        self.by_path[path][res["outcome"]] += 1
        rep.jit_reruns += bool(res.get("jit_rerun"))
        rep.max_case_s = max(rep.max_case_s, res.get("elapsed", 0.0))
        rep.max_case_wall_s = max(rep.max_case_wall_s, res.get("wall", res.get("elapsed", 0.0)))
        rep.peak_mem_over_file_mb = max(rep.peak_mem_over_file_mb, res.get("peak_over_file", 0) / 2**20)
        rep.maxrss_growth_mb = max(rep.maxrss_growth_mb, res.get("maxrss_growth_kb", 0) / 1024)
        if res["outcome"] == "ok":
            rep.ok += 1
        elif res["outcome"] == "clean":
            rep.clean_errors += 1
        elif res["outcome"] == "unclear":
            rep.unclear_errors += 1
            self.unclear[f"{res['stage']}: {res['kind'].split(' ')[0]}: {_head(res['msg'])}"] += 1
        else:
            rep.fuzz_failures += 1
            self.kinds[res["kind"]] += 1
            if res["kind"] == "crash":
                rep.crashes += 1
                self.by_path[path]["crash"] += 1
            info = {"index": index, "mutation": name, "mutations": descs, "path": path, "kind": res["kind"],
                    "msg": res["msg"], "stage": res.get("stage"), "elapsed": round(res.get("elapsed", 0.0), 3)}
            if self.failures_dir is not None:
                d = Path(self.failures_dir)
                d.mkdir(parents=True, exist_ok=True)
                p = d / f"case-{index:05d}-{name}.gguf"
                p.write_bytes(data)
                p.with_suffix(".txt").write_text(json.dumps(info, indent=1) + "\n")
                info["file"] = str(p)
            rep.failures.append(info)
        if self.progress and rep.fuzz_cases % 1000 == 0:
            print(f"{rep.fuzz_cases} cases, {rep.fuzz_failures} failures", file=sys.stderr)

    def finish(self, t_start: float) -> FuzzReport:
        rep = self.rep
        rep.by_mutation = {k: dict(self.by_mut[k]) for k in MUTATIONS if k in self.by_mut}
        rep.by_path = {k: {"kernels": self.path_kernels[k], **dict(self.by_path[k])} for k in PATHS if self.by_path[k]}
        rep.failure_kinds = dict(self.kinds)
        rep.unclear_messages = dict(self.unclear.most_common())
        rep.failures_dir = str(self.failures_dir) if self.failures_dir is not None and rep.fuzz_failures else None
        rep.max_case_s = round(rep.max_case_s, 4)
        rep.max_case_wall_s = round(rep.max_case_wall_s, 4)
        rep.peak_mem_over_file_mb = round(rep.peak_mem_over_file_mb, 3)
        rep.maxrss_growth_mb = round(rep.maxrss_growth_mb, 1)
        rep.wall_s = round(time.perf_counter() - t_start, 1)
        return rep


def replay(path: str | Path) -> list[dict[str, Any]]:
    """Re-run saved inputs (one file or every .gguf in a directory) in this process."""
    p = Path(path)
    files = sorted(p.glob("*.gguf")) if p.is_dir() else [p]
    return [dict(file=str(f), **run_case(str(f))) for f in files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--failures-dir", default="gguf-fuzz-failures",
                    help="where failing inputs are written (only if there are any)")
    ap.add_argument("--case-time-limit", type=float, default=2.0,
                    help="a case using more CPU seconds than this is a hang")
    ap.add_argument("--hard-timeout", type=float, default=20.0, help="kill a worker stuck this long")
    ap.add_argument("--mem-overhead-mb", type=float, default=64.0,
                    help="allowed traced peak above the file size")
    ap.add_argument("--as-headroom-mb", type=float, default=2048.0,
                    help="RLIMIT_AS of a worker: its size after imports plus this (0: no limit)")
    ap.add_argument("--strict-path", action="store_true",
                    help="an unclear error (a project error not naming the file) is a failure")
    ap.add_argument("--compiled-share", type=float, default=0.0,
                    help="share of the cases (0..1) run through the compiled (numba) kernels, in spawned "
                         "workers, where a crash is a counted failure; the rest run the numpy reference")
    ap.add_argument("--replay", help="re-run a saved failing input (file or directory) and exit")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.replay:
        for r in replay(args.replay):
            print(json.dumps(r))
        return 0
    rep = run_fuzz(args.cases, args.seed, args.jobs, args.failures_dir, args.case_time_limit,
                   args.hard_timeout, args.mem_overhead_mb, args.as_headroom_mb, args.strict_path,
                   progress=not args.json, compiled_share=args.compiled_share)
    if args.json:
        print(json.dumps(rep.to_json()))
    else:
        print(f"{rep.fuzz_cases} cases: {rep.ok} ok, {rep.clean_errors} clean errors, "
              f"{rep.unclear_errors} unclear errors (the file not named), {rep.fuzz_failures} failures "
              f"({rep.crashes} crashes); "
              f"max case {rep.max_case_s:.3f} s, traced peak over file "
              f"{rep.peak_mem_over_file_mb:.2f} MB, maxrss growth {rep.maxrss_growth_mb:.1f} MB, "
              f"{rep.wall_s:.0f} s")
        for k, v in rep.by_path.items():
            print(f"  {k + ' kernels':18s} {v}")
        for k, v in rep.by_mutation.items():
            print(f"  {k:18s} {v}")
        for m, n in list(rep.unclear_messages.items())[:20]:
            print(f"  UNCLEAR x{n} {m}")
        for f in rep.failures[:20]:
            print(f"  FAIL {f}")
    return 1 if rep.fuzz_failures or rep.unclear_errors else 0


if __name__ == "__main__":
    sys.exit(main())

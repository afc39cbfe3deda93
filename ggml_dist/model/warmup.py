"""Compiling a model's kernels in the background, so that a first run does not wait a minute for numba.

A cold kernel cache costs a minute or more of compilation on a small machine (every kernel the model's
types need, serial and parallel variants). A first `ggml-dist run` should not sit through that, nor
should two stage actors on one node compile the same kernels side by side. So, in a process that
computes (the CLI's run/serve, a stage actor):

    w = background_compile(path)            None when the cache is ready (or numba is off); else a
                                            watcher, and one compile process per node is running
    w.ready()                               the cache now holds the model's kernels (a stat, at most
                                            once a second)

Until `ready()`, the caller computes with the numpy reference kernels (ComputeOptions(numba=False):
the same bits, several times slower), then switches to the compiled ones (which now load from the
cache in milliseconds). The compile process (warmup_process.py) runs
detached from the caller, so it outlives a short run and the next run finds the cache
warm. The caller takes an exclusive lock (one per node and marker) and hands it to the process; a
caller that finds it taken watches the running compile instead of starting another. The process
decodes a short prompt and single tokens of the same file with the compiled kernels at the caller's
thread count, which compiles every specialization such a run takes, and then writes the ready
marker. The marker's name hashes what the cached code depends on: the kernel sources, numba and
Python, the CPU, the model's weight types and architecture, the thread class.
GGML_DIST_NO_BACKGROUND_COMPILE=1 keeps the old way: compile in the caller, with progress lines. A
kernel cache that cannot be written starts no compile process (it could cache nothing:
backends/cpu/kernel_cache.py says so once, and the caller compiles for itself).

What it compiles is what the caller runs: the kernels of the model's weight types at the caller's thread
count (numba compiles only the kernels and specializations the decode steps call). A run at one thread
(a stage actor, `--threads 1`) takes the serial kernels only; a run at more takes the parallel ones and
the serial ones its small ops keep: each is its own marker (`thread_class`), and a second caller of the
other class compiles only what is still missing. `warm()` (`ggml-dist warmup`) compiles both in the
calling process, for images and cluster nodes, and says how long it took.

What the user sees: one line when the compile starts; then, from the process that started it, a line
every PROGRESS_INTERVAL_S with the kernels done of those expected, the seconds so far and about how many
are left (backends/cpu/compile_progress.py: the kernels' cost as measured, recorded per model
configuration in `kernel_cache_dir()/costs/`, or MEASURED_COSTS below); one line when the compiled
kernels take over; one line, with the compile log's last line, when the compile ended without finishing
(the caller then compiles what it needs itself).

Cold compiles of SmolLM2-135M Q4_1 (VNNI kernels) on the project's 2-vCPU VM: see MEASURED_COSTS (each
kernel's seconds, and the load average they ran at).

A watchdog ends a compile that makes no progress (no kernel compile begun or ended, no decode step) for
STALL_S (GGML_DIST_COMPILE_STALL_S, default 300 s: the longest single kernel here compiles in ~30 s on
this 2-core VM): a thread of the compile process ends it with a line in its log, which frees the lock;
and a watcher whose compile process's `<marker>.progress` is older than twice that (the process
frozen, its thread unable to run) kills it by the pid written there. Either way the watchers see the
lock free without a marker, say so in one line, and compile what they need themselves.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..backends import host
from .gguf import load_gguf

CHECK_INTERVAL_S = 1.0
PROGRESS_INTERVAL_S = 10.0      # a progress line of the background compile this often
STALL_S = 300.0                 # no progress for this long ends the compile (GGML_DIST_COMPILE_STALL_S)

# Each kernel's cold compile, seconds (wall), for model configurations measured here, SmolLM2-135M Q4_1 on
# the project's 2-vCPU VM (Xeon, AVX-512 VNNI) shared with other jobs: t1 by `NUMBA_CACHE_DIR=$(mktemp -d)
# ggml-dist warmup --json` (load average 2.2-4.0: 40.8 s), tn by a first `ggml-dist run` in one process
# at 2 threads (load 3.1: 60.8 s in all, with loading the model and the steps between the kernels). What
# a compile on another machine, or of another configuration, measures is recorded in
# kernel_cache_dir()/costs/ and takes precedence; the estimate scales either by the pace it observes.
MEASURED_COSTS: dict[str, list[tuple[str, float]]] = {
    "llama-F32+Q4_1+Q8_0-vnni-t1": [
        ("kv_inputs.attn_inputs", 0.3), ("qkernels._dequant_rows", 0.3), ("fkernels.rope_cache", 0.2),
        ("fkernels._rope_serial", 0.2), ("fkernels._set_rows_part", 0.7), ("fkernels._add_rms_norm_c", 0.5),
        ("fkernels._swiglu_c", 0.4), ("fkernels.rms_norm", 0.3), ("qpack._prep_mm_v_serial", 7.9),
        ("fkernels._attention_serial", 28.2)],
    "llama-F32+Q4_1+Q8_0-vnni-tn": [
        ("kv_inputs.attn_inputs", 0.5), ("qkernels._dequant_rows", 0.4), ("fkernels.rope_cache", 0.4),
        ("fkernels._rope_serial", 0.4), ("fkernels._set_rows_part", 0.9), ("fkernels._add_rms_norm_c", 0.6),
        ("fkernels._swiglu_c", 0.6), ("fkernels.rms_norm", 0.2), ("fkernels._rms_norm_par", 0.9),
        ("qpack._prep_mm_v", 14.1), ("fkernels._set_rows_par", 1.4), ("fkernels._rope_par", 0.6),
        ("fkernels._attention_par1", 23.6), ("fkernels._add_rms_norm_c_par", 1.2),
        ("fkernels._swiglu_c_par", 1.1), ("fkernels._attention_par", 9.0)],
}


def thread_class(n_threads: int) -> str:
    """The kernels a run at n_threads compiles: "t1" (serial) or "tn" (parallel, and the serial ones
    its small ops keep; the same code for any count above 1)."""
    return "t1" if n_threads <= 1 else "tn"


def stall_s() -> float:
    v = os.environ.get("GGML_DIST_COMPILE_STALL_S", "")
    try:
        return float(v) if v else STALL_S
    except ValueError:
        raise ValueError(f"GGML_DIST_COMPILE_STALL_S must be a number of seconds, not {v!r}") from None


def marker_path(path: str | Path, n_threads: int = 1) -> Path:
    """Where the compile process says the model's kernels for n_threads' class (thread_class) are cached
    (kernel_cache_dir()/ready/KEY)."""
    import numba
    from llvmlite import binding as llvm

    kernel_cache = host.kernel_cache
    h = hashlib.sha256(kernel_cache.backends_stamp().encode())     # every module of backends/cpu/
    f = load_gguf(path)
    types = sorted({t.type.name for t in f.tensors.values()})
    h.update(repr((numba.__version__, sys.version_info[:2], llvm.get_host_cpu_name(),
                   llvm.get_host_cpu_features().flatten(), types, f.get("general.architecture"),
                   [os.environ.get(v) for v in ("GGML_DIST_FORCE_AVX2", "GGML_DIST_NO_AVX2",
                                                "GGML_DIST_NO_VNNI")], thread_class(n_threads))).encode())
    return kernel_cache.kernel_cache_dir() / "ready" / h.hexdigest()[:32]


def costs_key(path: str | Path, n_threads: int) -> str:
    """The configuration a cost manifest describes: architecture, weight types, the packed weights'
    kernels and the thread class ("llama-F32+Q4_1+Q8_0-vnni-t1"); the same across source versions, so an
    upgrade's recompile has its estimate."""
    f = load_gguf(path)
    types = "+".join(sorted({t.type.name for t in f.tensors.values()}))
    return (f"{f.get('general.architecture')}-{types}-{host.kernels_name()}-"
            f"{thread_class(n_threads)}")


def _costs_path(key: str) -> Path:
    kernel_cache = host.kernel_cache
    return kernel_cache.kernel_cache_dir() / "costs" / f"{key}.json"


def expected_costs(key: str) -> list[tuple[str, float]]:
    """The kernels a cold compile of configuration `key` takes, with their measured seconds: what the
    compiles of it here measured (record_costs), else MEASURED_COSTS, else none (no estimate)."""
    try:
        return [(str(k), float(v)) for k, v in json.loads(_costs_path(key).read_text())["kernels"]]
    except (OSError, ValueError, KeyError, TypeError):
        return list(MEASURED_COSTS.get(key, []))


def record_costs(key: str, kernels: Sequence[tuple[str, float]], compiled_s: float) -> None:
    """Keep what a finished compile measured, for the next estimate of the same configuration: the
    kernels it compiled replace their earlier figures, the others (found in the cache this time: a
    compile after a partial one, or after another class's) keep theirs."""
    if not kernels:
        return
    p = _costs_path(key)
    now: dict[str, list[float]] = {}
    for k, v in kernels:
        now.setdefault(k, []).append(round(v, 2))
    merged: dict[str, list[float]] = {}
    for k, v in expected_costs(key):
        merged.setdefault(k, []).append(v)
    merged.update(now)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"last_compile_s": round(compiled_s, 1), "load_average": os.getloadavg(),
                                   "kernels": [[k, v] for k, vs in merged.items() for v in vs]}))
        os.replace(tmp, p)
    except OSError:
        pass                                # an estimate the next time, no more


class Warmup:
    """Watches the compile process: ready once its marker exists, or once its lock is free without a
    marker (a failed or ended compile: the caller then compiles what it needs itself, as without this
    module, and one line says so); a compile process frozen past twice the stall time is killed."""

    def __init__(self, marker: Path, spawned: bool, say: Callable[[str], None] | None = None) -> None:
        self.marker, self.spawned = marker, spawned     # spawned: by this caller (else by another)
        self.say = say or _stderr
        self.stall_s = stall_s()
        self._ready = False
        self._checked = 0.0
        self._t0 = time.monotonic()
        self._done = threading.Event()
        if spawned:         # one progress line every PROGRESS_INTERVAL_S, from the process that started it
            threading.Thread(target=self._progress, name="ggml-dist-compile-watch", daemon=True).start()

    def ready(self) -> bool:
        if not self._ready and time.monotonic() - self._checked >= CHECK_INTERVAL_S:
            self._checked = time.monotonic()
            if self.marker.exists():
                self._ready = True
                self._done.set()
                self.say(f"the compiled kernels take over now ({self._finished_text()}): faster from this step on, "
                         f"the same results")
            elif not _locked(self.marker) or self._killed_frozen():
                self._ready = True
                self._done.set()
                self.say(f"the background kernel compile ended without finishing ({self._log_tail()}; its log: "
                         f"{self.marker}.log); this process compiles the kernels it needs itself, now")
        return self._ready

    def status(self) -> dict | None:
        """The compile process's last progress (compile_progress.CompileStatus.to_json), if it wrote one."""
        try:
            return json.loads(status_path(self.marker).read_text())
        except (OSError, ValueError):
            return None

    def _progress(self) -> None:
        while not self._done.wait(PROGRESS_INTERVAL_S):
            st = self.status()
            if st is None:
                self.say(f"kernels compiling in the background: starting, {time.monotonic() - self._t0:.0f} s")
                continue
            of = f" of {max(st['n_expected'], st['n_done'])}" if st.get("n_expected") else ""
            left = f", about {st['eta_s']:.0f} s left" if st.get("eta_s") is not None else ""
            self.say(f"kernels compiling in the background: {st['n_done']}{of} done, "
                     f"{time.monotonic() - self._t0:.0f} s{left}")

    def _finished_text(self) -> str:
        try:
            return f"compiled in the background in {json.loads(self.marker.read_text())['compiled_s']:.0f} s"
        except (OSError, ValueError, KeyError, TypeError):
            return "compiled in the background"

    def _log_tail(self) -> str:
        try:
            lines = [ln for ln in Path(f"{self.marker}.log").read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        return f"its last line: {lines[-1].strip()[:200]}" if lines else "no output"

    def _killed_frozen(self) -> bool:
        """Kill the compile process if its progress file is older than twice the stall time."""
        progress = progress_path(self.marker)
        try:
            age = time.time() - progress.stat().st_mtime
            pid = int(progress.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        if age < 2 * self.stall_s or not _is_compile_process(pid):
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        t0 = time.monotonic()                   # its exit frees the lock: the runs waiting on it go on
        while _locked(self.marker) and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        self.say(f"the background kernel compile (pid {pid}) made no progress for {age:.0f} s: killed it")
        return True


def background_compile(path: str | Path, say: Callable[[str], None] | None = None) -> Warmup | None:
    """None if the compiled kernels are off or already cached for this model; else start the compile
    process unless one runs already, and return its watcher. `say` gets one line for the user
    (default: stderr)."""
    if not host.COMPILED_DEFAULT or os.environ.get("GGML_DIST_NO_BACKGROUND_COMPILE", "") in ("1", "true", "yes"):
        return None
    kernel_cache = host.kernel_cache
    if not kernel_cache.cache_writable():       # it would cache nothing; kernel_cache said so, once
        return None
    n_threads = host.kernel_threads.get_threads()    # the caller's: what its steps will run
    marker = marker_path(path, n_threads)
    if marker.exists():
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(marker), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            spawned = False                         # another caller's compile process holds it
        else:
            if marker.exists():                     # it finished just now
                return None
            progress_path(marker).unlink(missing_ok=True)       # an earlier compile's: not this one's
            status_path(marker).unlink(missing_ok=True)
            _spawn(path, marker, lock.fileno(), n_threads)
            spawned = True
    expected = _expected_for(path, n_threads) if spawned else []
    guess = f", about {sum(s for _, s in expected):.0f} s here when not busy" if expected else ""
    (say or _stderr)(f"kernels for this CPU and model are compiling in the background "
                     f"({'started now' if spawned else 'started by another process'}{guess}; cached in "
                     f"{marker.parent.parent}; `ggml-dist warmup --model M` compiles them ahead); until they "
                     f"are ready this process computes with the numpy kernels (the same results, much slower), "
                     f"then switches")
    return Warmup(marker, spawned, say)


def _expected_for(path: str | Path, n_threads: int) -> list[tuple[str, float]]:
    """expected_costs of the model's configuration; none for a file the loader refuses (the compile
    process then fails with the loader's error in its log, and the watchers say so)."""
    from .gguf import GGUFError
    try:
        return expected_costs(costs_key(path, n_threads))
    except (GGUFError, OSError):
        return []


def _spawn(path: str | Path, marker: Path, lock_fd: int, n_threads: int) -> None:
    """The compile process, holding the lock this process took (it inherits the locked file; the lock
    lasts as long as the compile process, so no watcher sees it free before it began). Started through
    a shell that exits at once, so it belongs to no one who could end it: a short run's exit, a Ctrl-C,
    a Ray worker's exit (Ray ends its workers' children) all leave it compiling for the next run. It
    imports the same copy of ggml_dist as this process (a Ray job's stage actor runs a shipped copy)."""
    import ggml_dist
    root = str(Path(ggml_dist.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "ggml_dist.model.warmup_process", str(path),
                                             str(marker), str(lock_fd), str(n_threads)))
    log = shlex.quote(f"{marker}.log")              # the compile's output, kept for a failed compile
    subprocess.run(["/bin/sh", "-c", f"{cmd} </dev/null >>{log} 2>&1 &"], env=env, check=True,
                   pass_fds=(lock_fd,), start_new_session=True)


def lock_path(marker: Path) -> Path:
    return Path(f"{marker}.lock")


def progress_path(marker: Path) -> Path:
    """The compile process's pid; its mtime is the time of its last progress."""
    return Path(f"{marker}.progress")


def status_path(marker: Path) -> Path:
    """The compile process's last CompileStatus, as JSON (kernels done, expected, estimate)."""
    return Path(f"{marker}.status")


def write_marker(marker: Path, path: str | Path, compiled_s: float, kernels: Sequence[tuple[str, float]]) -> None:
    """The ready marker: what was compiled, for whom, how long it took (written last, atomically)."""
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"compiled_s": round(compiled_s, 1), "path": str(path),
                               "load_average": os.getloadavg(), "kernels": [[k, round(v, 2)] for k, v in kernels]}))
    os.replace(tmp, marker)


# -- ahead of time: ggml-dist warmup ------------------------------------------------------------------
@dataclass(slots=True)
class WarmResult:
    """What warm() did: per thread count its class, whether it was cached already, the seconds it took
    and each kernel's."""
    path: str
    cache_dir: str
    classes: list[dict] = field(default_factory=list)
    total_s: float = 0.0
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def summary(self) -> str:
        parts = [f"{c['threads']} thread{'s' if c['threads'] > 1 else ''}: "
                 + ("already cached" if c["cached"] else f"{c['compiled_s']:.1f} s, {len(c['kernels'])} kernels")
                 for c in self.classes]
        la = ", ".join(f"{x:.2f}" for x in self.load_average)
        return (f"ggml-dist warmup: kernels of {Path(self.path).name} ready in {self.total_s:.1f} s "
                f"({'; '.join(parts)}; load average {la}); cached in {self.cache_dir}")

    def to_json(self) -> dict:
        return {"path": self.path, "cache_dir": self.cache_dir, "total_s": round(self.total_s, 1),
                "load_average": list(self.load_average), "classes": self.classes}


def _is_compile_process(pid: int) -> bool:
    """pid is a compile process of this module's (a stale pid may name another process by now)."""
    try:
        return b"ggml_dist.model.warmup_process" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _locked(marker: Path) -> bool:
    """A compile process holds the marker's lock now."""
    with open(lock_path(marker), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

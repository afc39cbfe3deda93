"""CPU speed next to llama.cpp on the same file, in the same run: prompt and decode tok/s, their ratios,
peak RSS, the decode bandwidth achieved (model.bytes_read_per_token() x tok/s), a numpy copy bandwidth and the
host's read bandwidth at the run's threads (bench/bandwidth.py), with decode's share of it.

    ggml-dist bench decode [--model smollm2-135m | a synthetic shape] [--tinyllama] [--threads 2] [--prompt-len 128]
                           [--gen 64] [--llamacpp-flash-attn {default,on,off}] [--rounds 1] [--paired] --json

Each measurement runs in its own subprocess, so peak RSS is the engine's own; llama.cpp is measured
through llama-cpp-python (the dev extra) and skipped with a note when it is not installed. --rounds N
alternates the two N times and reports medians and the median of the rounds' ratios (on a shared VM
the speed of both drifts by tens of percent between runs). --paired puts both in one process that
gives them turns of 8 decode tokens (measure_paired): the ratio of like with like where the host's
speed drifts within seconds, at the cost of the per-engine peak RSS. Both engines decode the same
sequence (the same prompt tokens, greedy) and "tokens_match" says whether they chose the same tokens in
every round; where not, "first_mismatch" says where, and stderr too. A llama.cpp child killed by a signal
is explained in "llamacpp_crash": a SIGSEGV on a CPU whose flags list AMX, from a build with AMX_INT8, is
llama-cpp-python built natively in a VM that does not grant the AMX state (the fix: build it without
AMX, NO_AMX_BUILD).

So that a ratio says what it compares, the JSON names the SIMD of both sides: the host's CPU and its
x86 flags ("host"), the kernel path ours ran ("ours": VNNI, AVX2 or the float kernels) and the flags the
llama.cpp library was built with ("llamacpp": parsed from llama_print_system_info(); a portable AVX2
wheel on an AVX-512 VNNI host is a VNNI-vs-AVX2 comparison, "simd_comparison" says so). Flash attention:
llama.cpp runs with its own default (llama_context_default_params(): "auto" in current llama.cpp, which
turns it on for CPU layers; llama-cpp-python's Llama() would turn it off) unless --llamacpp-flash-attn
says on/off, and the JSON records the setting asked for and the one llama.cpp resolved. Ours has no fused
flash-attention op: the KQ -> softmax -> KQV chain of ggml's non-flash graph, skipping the masked cells.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .bandwidth import copy_gb_s, read_gb_s
from .llamacpp import FLASH_ATTN_CHOICES, _LlamaCpp
from .simd import OURS_ATTENTION, best_tier, host_info, ours_info, parse_system_info, simd_comparison


def _prompt(n_vocab: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, min(n_vocab, 30000), n)]


# ------------------------------------------------------------------------------------------------
# the measurements: each engine in its own child process, or both in one (paired)
class _Ours:
    """Our engine on one file: run(tokens) evaluates them after what its cache holds and returns the
    greedy next token; clear() empties the cache."""

    def __init__(self, path: str, n_ctx: int, threads: int) -> None:
        from ..backends.cpu import threads as kernel_threads
        from ..model.context import ContextParams, LlamaContext
        from ..model.model import LlamaModel
        kernel_threads.set_threads(threads)
        self.model = LlamaModel.load(path)
        self.ctx = LlamaContext(self.model, ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512))
        self.n_vocab, self.n_past = self.model.hp.n_vocab, 0

    def run(self, toks: list[int]) -> int:
        from ..model.ubatch import Batch
        lg = self.ctx.decode(Batch.from_tokens(toks, pos0=self.n_past))
        self.n_past += len(toks)
        return int(np.argmax(lg[-1]))

    def clear(self) -> None:
        self.ctx.clear()
        self.n_past = 0


def _warm(engine: Any, toks: list[int]) -> None:
    """Warm-up: the whole prompt and one decode step (JIT of every kernel the timed steps run, page
    cache), then an empty cache."""
    engine.run(toks)
    engine.run([toks[0]])
    engine.clear()


def _timed(engine: Any, toks: list[int], gen: int) -> tuple[float, float, list[int]]:
    """(prompt s, decode s, tokens): the prompt from an empty cache, then gen greedy tokens one at a time;
    tokens are the prompt's greedy next token and the gen decoded after it (gen + 1)."""
    engine.clear()
    t0 = time.perf_counter()
    tok = engine.run(toks)
    t1 = time.perf_counter()
    out = [tok]
    for _ in range(gen):
        tok = engine.run([tok])
        out.append(tok)
    return t1 - t0, time.perf_counter() - t1, out


def measure_ours(path: str, prompt_len: int, gen: int, threads: int) -> dict[str, Any]:
    ours = _Ours(path, prompt_len + gen + 16, threads)
    toks = _prompt(ours.n_vocab, prompt_len)
    _warm(ours, toks)
    tp, td, out = _timed(ours, toks, gen)
    return {"prompt_tok_s": prompt_len / tp, "decode_tok_s": gen / td, "read_bytes": ours.model.bytes_read_per_token(),
            "weight_bytes": ours.model.weight_bytes(), "peak_rss_mb": peak_rss_mb(), "ours": ours_info(), "tokens": out}


def measure_llamacpp(path: str, prompt_len: int, gen: int, threads: int,
                     flash_attn: str = "default") -> dict[str, Any]:
    ll = _LlamaCpp(path, prompt_len + gen + 16, threads, flash_attn)
    toks = _prompt(ll.n_vocab, prompt_len)
    _warm(ll, toks)
    tp, td, out = _timed(ll, toks, gen)
    return {"prompt_tok_s": prompt_len / tp, "decode_tok_s": gen / td, "peak_rss_mb": peak_rss_mb(),
            "llamacpp": ll.info(), "tokens": out}


PAIRED_CHUNK = 8                        # decode tokens each engine runs in turn in a paired measurement


def measure_paired(path: str, prompt_len: int, gen: int, threads: int, flash_attn: str = "default",
                   rounds: int = 1) -> dict[str, Any]:
    """Ours and llama.cpp in one process, taking turns: per round each runs the prompt from an empty
    cache, then both decode gen tokens in chunks of PAIRED_CHUNK, in turn (ABBA: neither always goes
    first), so both see the machine as it is within a second or so, and a host whose speed drifts by
    tens of percent between processes still gives a ratio of like with like. Both engines share the one
    OpenMP runtime (numba's omp layer and llama.cpp's build load the same libgomp), so no thread pool
    spins against the other's. Both decode the same sequence: the same prompt tokens, then each its own
    greedy choice fed back. "runs": per round, ours' and llama.cpp's figures as the child measurements
    give them, with the greedy tokens each chose (llama.cpp's as {"error"} where llama-cpp-python is
    missing); "decode_chunk_ratios": ours' speed over llama.cpp's per pair of chunks."""
    ours = _Ours(path, prompt_len + gen + 16, threads)
    toks = _prompt(ours.n_vocab, prompt_len)
    _warm(ours, toks)
    engines: dict[str, Any] = {"ours": ours}
    ll_error = ""
    try:
        engines["llamacpp"] = ll = _LlamaCpp(path, prompt_len + gen + 16, threads, flash_attn)
        _warm(ll, toks)
    except ImportError as e:
        ll_error = f"{type(e).__name__}: {e}"
    spent = {k: [[0.0, 0.0] for _ in range(rounds)] for k in engines}     # per round: prompt s, decode s
    chosen: dict[str, list[list[int]]] = {k: [[] for _ in range(rounds)] for k in engines}   # greedy tokens
    chunk_ratios = []
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        tok = {}
        for k in order:
            engines[k].clear()
            t = time.perf_counter()
            tok[k] = engines[k].run(toks)
            spent[k][r][0] = time.perf_counter() - t
            chosen[k][r].append(tok[k])
        for i, c0 in enumerate(range(0, gen, PAIRED_CHUNK)):
            this = {}
            for k in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                for _ in range(min(PAIRED_CHUNK, gen - c0)):
                    tok[k] = engines[k].run([tok[k]])
                    chosen[k][r].append(tok[k])
                this[k] = time.perf_counter() - t
                spent[k][r][1] += this[k]
            if "llamacpp" in this:
                chunk_ratios.append(this["llamacpp"] / this["ours"])

    def figures(k: str, r: int) -> dict[str, Any]:
        (tp, td), toks = spent[k][r], chosen[k][r]
        return {"prompt_tok_s": prompt_len / tp, "decode_tok_s": gen / td, "tokens": toks}
    m = ours.model
    about = {"weight_bytes": m.weight_bytes(), "read_bytes": m.bytes_read_per_token(), "ours": ours_info()}
    ll_about = {"llamacpp": ll.info()} if "llamacpp" in engines else {}
    ours_runs = [{**figures("ours", r), **about} for r in range(rounds)]
    ll_runs = [{**figures("llamacpp", r), **ll_about} if ll_about else {"error": ll_error} for r in range(rounds)]
    return {"runs": [list(p) for p in zip(ours_runs, ll_runs)], "decode_chunk_ratios": chunk_ratios,
            "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """VmHWM of this process (ru_maxrss would carry the parent's peak across exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child_env() -> dict[str, str]:
    """The environment of a child: this checkout's code first on PYTHONPATH (not another installed
    copy), the rest (a llama_cpp put first on PYTHONPATH, GGML_DIST_* switches) as given."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    if Path(root).name not in ("site-packages", "dist-packages"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def run_child(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 3600) -> dict[str, Any]:
    """Run a child that prints one JSON object as its last stdout line; a failure is {"error", "returncode"}
    (the last stderr line, or "exit -11 (SIGSEGV)" for a child killed by a signal), and a child killed by
    a signal also says whether its Python stack (faulthandler's, on stderr) was inside llama_cpp."""
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    if r.returncode == 0:
        return dict(json.loads(r.stdout.strip().splitlines()[-1]))
    err = r.stderr.strip()
    if r.returncode < 0:
        return {"error": f"exit {r.returncode} ({_signal_name(-r.returncode)})", "returncode": r.returncode,
                "in_llama_cpp": bool(re.search(r"[/\\]llama_cpp[/\\]", err))}
    return {"error": err.splitlines()[-1] if err else f"exit {r.returncode}", "returncode": r.returncode}


def _child(which: str, path: str, prompt_len: int, gen: int, threads: int,
           flash_attn: str = "default", rounds: int = 1) -> dict[str, Any]:
    """Run one measurement in a fresh process (own peak RSS, no shared page-cache warm-up); "paired"
    runs measure_paired's rounds. faulthandler is on, so a crash names the Python frame it died in."""
    cmd = [sys.executable, "-X", "faulthandler", "-m", "ggml_dist.bench.decode", "--_child", which,
           "--model", path, "--prompt-len", str(prompt_len), "--gen", str(gen), "--threads", str(threads),
           "--llamacpp-flash-attn", flash_attn, "--rounds", str(rounds)]
    return run_child(cmd, _child_env())


# ------------------------------------------------------------------------------------------------
# checks of a measurement: both engines chose the same tokens; a crashed child explained
def token_check(pairs: Sequence[tuple[Sequence[int] | None, Sequence[int] | None]]) -> dict[str, Any]:
    """Per round, ours' and llama.cpp's greedy tokens (the prompt's next token, then each decode step's):
    {"tokens_match": True, "tokens_compared": n}, or False with "first_mismatch" (round, step: 0 is the
    prompt's next token, and a few tokens of each side from just before it); None where a side did not
    report its tokens."""
    if not pairs or any(a is None or b is None for a, b in pairs):
        return {"tokens_match": None, "tokens_note": "not compared: a side did not report its tokens"}
    for r, (a, b) in enumerate(pairs):
        assert a is not None and b is not None
        n = min(len(a), len(b))
        i = next((j for j in range(n) if a[j] != b[j]), n if len(a) != len(b) else None)
        if i is not None:
            lo = max(0, i - 2)
            return {"tokens_match": False,
                    "first_mismatch": {"round": r, "step": i, "from_step": lo, "ours": list(a[lo:i + 3]),
                                       "llamacpp": list(b[lo:i + 3])}}
    return {"tokens_match": True, "tokens_compared": sum(len(a) for a, _ in pairs if a is not None)}


AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
NO_AMX_BUILD = ("CMAKE_ARGS=\"-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' "
                "-DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'\" "
                "pip install --no-binary :all: llama-cpp-python==0.3.36")


def llamacpp_build_simd(env: dict[str, str] | None = None) -> list[str] | None:
    """The SIMD the llama_cpp a child imports was built with (llama_print_system_info(), read in a child
    of its own, which does not decode); None where it cannot be read."""
    code = "import json, llama_cpp; print(json.dumps({'info': llama_cpp.llama_print_system_info().decode()}))"
    res = run_child([sys.executable, "-c", code], env if env is not None else _child_env(), timeout=120)
    return None if "error" in res else list(parse_system_info(res["info"])["simd"])


def crash_diagnosis(res: dict[str, Any], host_flags: Sequence[str],
                    build_simd: Sequence[str] | None) -> dict[str, Any] | None:
    """A child killed by a signal, explained: None for any other failure. A SIGSEGV on a CPU whose flags
    list AMX, from a llama.cpp built with AMX_INT8 (or whose build could not be read), is the known
    fault of a native llama-cpp-python build in VMs that list AMX without granting its register state:
    "cause" says so and "fix" gives the build without AMX."""
    rc = res.get("returncode")
    if rc is None or rc >= 0:
        return None
    host_amx = [f for f in AMX_FLAGS if f in host_flags]
    build_amx = None if build_simd is None else "AMX_INT8" in build_simd
    out: dict[str, Any] = {"signal": _signal_name(-rc), "returncode": rc, "in_llama_cpp": res.get("in_llama_cpp"),
                           "host_amx_flags": host_amx, "build_amx": build_amx}
    if out["signal"] == "SIGSEGV" and host_amx and build_amx is not False:
        out["cause"] = ("llama.cpp's AMX kernels: this CPU's flags list AMX, but the VM does not grant the "
                        "AMX state, so llama-cpp-python built natively here segfaults on its first decode")
        out["fix"] = f"rebuild llama-cpp-python without AMX: {NO_AMX_BUILD} (or use the portable AVX2 wheel)"
    return out


def _explain_crash(out: dict[str, Any], name: str, res: dict[str, Any], host_flags: Sequence[str] | None,
                   child: str = "llama.cpp") -> None:
    """Add "llamacpp_crash" to a model's entry where the llama.cpp (or paired) child died by a signal, and
    say so on stderr with the fix."""
    if res.get("returncode") is None or res["returncode"] >= 0:
        return
    flags = host_info()["flags"] if host_flags is None else host_flags
    diag = crash_diagnosis(res, flags, llamacpp_build_simd())
    if diag is None:
        return
    out["llamacpp_crash"] = diag
    where = " inside llama_cpp" if diag["in_llama_cpp"] else ""
    msg = f"bench decode: {name}: the {child} child died by {diag['signal']}{where}"
    if "cause" in diag:
        msg += f" on a CPU whose flags list AMX ({' '.join(diag['host_amx_flags'])}): {diag['cause']}; {diag['fix']}"
    print(msg, file=sys.stderr)


def run_model(name: str, path: str, prompt_len: int, gen: int, threads: int, copy: float,
              flash_attn: str = "default", rounds: int = 1, paired: bool = False,
              host_flags: Sequence[str] | None = None, read: float | None = None) -> dict[str, Any]:
    """Ours and llama.cpp, each in a fresh process, alternating `rounds` times, or (paired) in one
    process taking turns every PAIRED_CHUNK tokens (measure_paired). The tok/s are the medians of the
    rounds, a ratio the median of the rounds' own ratios (on a noisy host the speed drifts between runs:
    a ratio of neighbouring runs compares like with like); the rounds' ratios are listed too. Paired,
    the peak RSS is the shared process's ("paired"), not either engine's. Both sides decode the same
    sequence greedily, and "tokens_match" says whether they chose the same tokens in every round (a
    mismatch is named in the entry and on stderr, its ratios still given). A llama.cpp child killed by
    a signal is explained ("llamacpp_crash"; host_flags: /proc/cpuinfo's, read where not given)."""
    out: dict[str, Any] = {"name": name, "threads": threads, "prompt_len": prompt_len, "gen": gen,
                           "rounds": rounds}
    if paired:
        res = _child("paired", path, prompt_len, gen, threads, flash_attn, rounds)
        runs = [(res, res)]                             # {"error"}: the child failed
        if "runs" in res:
            runs = [tuple(r) for r in res["runs"]]
            q = np.percentile(res["decode_chunk_ratios"], [25, 50, 75]) if res["decode_chunk_ratios"] else []
            out["paired"] = {"chunk": PAIRED_CHUNK, "decode_chunk_ratio_quartiles": [round(float(x), 3) for x in q],
                             "peak_rss_mb": round(res["peak_rss_mb"], 1)}
    else:
        runs = [(_child("ours", path, prompt_len, gen, threads),
                 _child("llamacpp", path, prompt_len, gen, threads, flash_attn)) for _ in range(rounds)]
    failed = next((o for o, _ in runs if "error" in o), None)
    if failed is not None:
        out["error"] = failed["error"]
        if paired:                                      # the shared process: llama.cpp may have taken it down
            _explain_crash(out, name, failed, host_flags, "paired (ours and llama.cpp)")
        return out
    ours = [o for o, _ in runs]
    med = {k: float(np.median([o[k] for o in ours])) for k in ("prompt_tok_s", "decode_tok_s")}
    out.update({"prompt_tok_s": round(med["prompt_tok_s"], 2), "decode_tok_s": round(med["decode_tok_s"], 2),
                "peak_rss_mb": None if paired else round(max(o["peak_rss_mb"] for o in ours), 1),
                "decode_gb_s": round(ours[0]["read_bytes"] * med["decode_tok_s"] / 1e9, 3),
                "copy_gb_s": round(copy, 2), "file_mb": round(os.path.getsize(path) / 2**20, 1),
                "read_gb_s": read and round(read, 2),      # the mark (bench/bandwidth.py), and decode's share
                "decode_read_share": read and round(ours[0]["read_bytes"] * med["decode_tok_s"] / 1e9 / read, 3),
                "kernels": ours[0]["ours"]["kernels"], "_ours": ours[0]["ours"]})
    ref_failed = next((r for _, r in runs if "error" in r), None)
    if ref_failed is not None:
        out["llamacpp_note"] = f"llama.cpp not measured: {ref_failed['error']}"
        out.update({"llamacpp_prompt_tok_s": None, "llamacpp_decode_tok_s": None,
                    "decode_ratio": None, "prompt_ratio": None, "llamacpp_flash_attn": None, "tokens_match": None})
        _explain_crash(out, name, ref_failed, host_flags)
        return out
    refs = [r for _, r in runs]
    for k in ("prompt", "decode"):
        ratios = [o[f"{k}_tok_s"] / r[f"{k}_tok_s"] for o, r in runs]
        out[f"llamacpp_{k}_tok_s"] = round(float(np.median([r[f"{k}_tok_s"] for r in refs])), 2)
        out[f"{k}_ratio"] = round(float(np.median(ratios)), 3)
        out[f"{k}_ratios"] = [round(x, 3) for x in ratios]
    out.update({"llamacpp_peak_rss_mb": None if paired else round(max(r["peak_rss_mb"] for r in refs), 1),
                "llamacpp_flash_attn": refs[0]["llamacpp"]["flash_attn"]["resolved"],
                "_llamacpp": refs[0]["llamacpp"]})
    out.update(token_check([(o.get("tokens"), r.get("tokens")) for o, r in runs]))
    if out["tokens_match"] is False:
        m = out["first_mismatch"]
        out["mismatch_notes"] = notes = mismatch_notes(refs[0]["llamacpp"])
        print(f"bench decode: {name}: ours and llama.cpp chose different greedy tokens, first in round "
              f"{m['round']} at step {m['step']} (from step {m['from_step']}: ours {m['ours']}, llama.cpp "
              f"{m['llamacpp']}); the speeds compare different sequences from there"
              + "".join(f"; {n}" for n in notes), file=sys.stderr)
    return out


def mismatch_notes(ll: dict[str, Any]) -> list[str]:
    """What in llama.cpp's run makes its numerics differ from ours (the reasons greedy tokens can part at a
    near-tie): flash attention, a build whose SIMD is not AVX2's."""
    notes = []
    if ll.get("flash_attn", {}).get("resolved") == "enabled":
        notes.append("llama.cpp ran flash attention, ours the non-flash graph (KQ -> softmax -> KQV), which "
                     "sum the attention in other orders; --llamacpp-flash-attn off runs the graph ours runs")
    if "simd" in ll and best_tier(ll["simd"]) != "AVX2":
        notes.append(f"llama.cpp's build is {best_tier(ll['simd'])}, not AVX2: ours follows the orders of "
                     f"ggml's AVX2 kernels, and another build sums some ops in other orders")
    return notes


def summarize(models: list[dict[str, Any]], host: dict[str, Any], flash_attn: str) -> dict[str, Any]:
    """The result object: host, ours, llamacpp (from the first model measured; the per-model raw
    entries are folded in) and simd_comparison next to the per-model figures."""
    ours = next((m.pop("_ours") for m in models if "_ours" in m), None)
    ll = next((m["_llamacpp"] for m in models if "_llamacpp" in m), None)
    for m in models:
        m.pop("_ours", None)
        m.pop("_llamacpp", None)
    if ours is None:
        ours = dict(OURS_ATTENTION)
    if ll is None:
        note = next((m["llamacpp_note"] for m in models if "llamacpp_note" in m), "llama.cpp not measured")
        llamacpp: dict[str, Any] = {"available": False, "note": note,
                                    "flash_attn": {"setting": flash_attn}}
    else:                                               # what the host has and the build does not use
        missing = [f for f in host.get("simd", ()) if f not in ll.get("simd", ())]
        llamacpp = {"available": True, **ll, "host_simd_not_built": missing}
    return {"host": host, "ours": ours, "llamacpp": llamacpp,
            "simd_comparison": simd_comparison(ours, ll, host.get("simd", ())), "models": models}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tinyllama", action="store_true", help="also the synthetic 1.1B Q4_0 model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--llamacpp-flash-attn", choices=FLASH_ATTN_CHOICES, default="default",
                    help="llama.cpp's flash attention: its own default (llama_context_default_params(); "
                         "'auto' in current llama.cpp: on for CPU layers), or forced on/off; ours has no "
                         "fused flash-attention op either way")
    ap.add_argument("--rounds", type=int, default=1,
                    help="ours and llama.cpp alternate this many times (fresh processes): medians, and the "
                         "median of the rounds' ratios")
    ap.add_argument("--paired", action="store_true",
                    help=f"ours and llama.cpp in one process, taking turns every {PAIRED_CHUNK} decode tokens (and "
                         "each round's prompt): ratios of like with like on a host whose speed drifts; no "
                         "per-engine peak RSS")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        if a._child == "ours":
            res = measure_ours(a.model, a.prompt_len, a.gen, a.threads)
        elif a._child == "paired":
            res = measure_paired(a.model, a.prompt_len, a.gen, a.threads, a.llamacpp_flash_attn, a.rounds)
        else:
            res = measure_llamacpp(a.model, a.prompt_len, a.gen, a.threads, a.llamacpp_flash_attn)
        print(json.dumps(res))
        return 0
    from ..model.synthetic import model_path
    copy, read = copy_gb_s(), read_gb_s(a.threads)
    models = [(a.model, str(model_path(a.model)))]
    if a.tinyllama:
        from ..model.synthetic import TINYLLAMA_Q4_0, cached_synthetic
        models.append(("tinyllama-1.1b-q4_0-synthetic", str(cached_synthetic(TINYLLAMA_Q4_0))))
    if a.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    measured = [run_model(n, p, a.prompt_len, a.gen, a.threads, copy, a.llamacpp_flash_attn, a.rounds, a.paired,
                          read=read) for n, p in models]
    print(json.dumps(summarize(measured, host_info(), a.llamacpp_flash_attn)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

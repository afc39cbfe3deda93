"""CPU speed next to llama.cpp on the same file, in the same run: prompt and decode tok/s, their ratios,
peak RSS, the decode bandwidth achieved (weight bytes x tok/s) and a plain numpy copy bandwidth.

    ggml-dist bench decode [--model smollm2-135m] [--tinyllama] [--threads 2] [--prompt-len 128]
                           [--gen 64] --json

Each measurement runs in its own subprocess, so peak RSS is the engine's own; llama.cpp is measured
through llama-cpp-python (the dev extra) and skipped with a note when it is not installed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np


def _prompt(n_vocab: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(100, min(n_vocab, 30000), n)]


def measure_ours(path: str, prompt_len: int, gen: int, threads: int) -> dict[str, Any]:
    from ..backends import threads as kernel_threads
    from ..model.context import ContextParams, LlamaContext
    from ..model.model import LlamaModel
    from ..model.ubatch import Batch
    kernel_threads.set_threads(threads)
    m = LlamaModel.load(path)
    ctx = LlamaContext(m, ContextParams(n_ctx=prompt_len + gen + 16, n_batch=512, n_ubatch=512))
    toks = _prompt(m.hp.n_vocab, prompt_len)
    ctx.decode(Batch.from_tokens(toks[:8]))                     # warm-up: JIT, page cache
    ctx.decode(Batch.from_tokens([toks[8]], pos0=8))
    ctx.clear()
    t0 = time.perf_counter()
    lg = ctx.decode(Batch.from_tokens(toks))
    t1 = time.perf_counter()
    tok = int(np.argmax(lg[-1]))
    for i in range(gen):
        tok = int(np.argmax(ctx.decode(Batch.from_tokens([tok], pos0=prompt_len + i))[-1]))
    t2 = time.perf_counter()
    return {"prompt_tok_s": prompt_len / (t1 - t0), "decode_tok_s": gen / (t2 - t1),
            "weight_bytes": m.weight_bytes(),
            "peak_rss_mb": peak_rss_mb()}


def measure_llamacpp(path: str, prompt_len: int, gen: int, threads: int) -> dict[str, Any]:
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=prompt_len + gen + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    toks = _prompt(llm.n_vocab(), prompt_len)
    llm.eval(toks[:8])
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(toks)
    t1 = time.perf_counter()
    for _ in range(gen):
        llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
    t2 = time.perf_counter()
    return {"prompt_tok_s": prompt_len / (t1 - t0), "decode_tok_s": gen / (t2 - t1),
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


def copy_gb_s() -> float:
    a = np.ones(64 * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


def _child(which: str, path: str, prompt_len: int, gen: int, threads: int) -> dict[str, Any]:
    """Run one measurement in a fresh process (own peak RSS, no shared page-cache warm-up)."""
    cmd = [sys.executable, "-m", "ggml_dist.bench.decode", "--_child", which, "--model", path,
           "--prompt-len", str(prompt_len), "--gen", str(gen), "--threads", str(threads)]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def run_model(name: str, path: str, prompt_len: int, gen: int, threads: int, copy: float) -> dict[str, Any]:
    ours = _child("ours", path, prompt_len, gen, threads)
    ref = _child("llamacpp", path, prompt_len, gen, threads)
    out: dict[str, Any] = {"name": name, "threads": threads, "prompt_len": prompt_len, "gen": gen}
    if "error" in ours:
        out["error"] = ours["error"]
        return out
    out.update({"prompt_tok_s": round(ours["prompt_tok_s"], 2), "decode_tok_s": round(ours["decode_tok_s"], 2),
                "peak_rss_mb": round(ours["peak_rss_mb"], 1),
                "decode_gb_s": round(ours["weight_bytes"] * ours["decode_tok_s"] / 1e9, 3),
                "copy_gb_s": round(copy, 2), "file_mb": round(os.path.getsize(path) / 2**20, 1)})
    if "error" in ref:
        out["llamacpp_note"] = f"llama.cpp not measured: {ref['error']}"
        out.update({"llamacpp_prompt_tok_s": None, "llamacpp_decode_tok_s": None,
                    "decode_ratio": None, "prompt_ratio": None})
    else:
        out.update({"llamacpp_prompt_tok_s": round(ref["prompt_tok_s"], 2),
                    "llamacpp_decode_tok_s": round(ref["decode_tok_s"], 2),
                    "decode_ratio": round(ours["decode_tok_s"] / ref["decode_tok_s"], 3),
                    "prompt_ratio": round(ours["prompt_tok_s"] / ref["prompt_tok_s"], 3),
                    "llamacpp_peak_rss_mb": round(ref["peak_rss_mb"], 1)})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tinyllama", action="store_true", help="also the synthetic 1.1B Q4_0 model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._child:
        fn = measure_ours if a._child == "ours" else measure_llamacpp
        print(json.dumps(fn(a.model, a.prompt_len, a.gen, a.threads)))
        return 0
    from ..model.pull import resolve_model
    copy = copy_gb_s()
    models = [(a.model, str(resolve_model(a.model)))]
    if a.tinyllama:
        from ..model.synthetic import TINYLLAMA_Q4_0, cached_synthetic
        models.append(("tinyllama-1.1b-q4_0-synthetic", str(cached_synthetic(TINYLLAMA_Q4_0))))
    result = {"models": [run_model(n, p, a.prompt_len, a.gen, a.threads, copy) for n, p in models]}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

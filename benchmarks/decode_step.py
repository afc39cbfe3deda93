"""Where a decode step's time goes in one process: the step's wall time, then the bound replay's calls
timed one by one and grouped by the call that ran (the packed matmul, an fkernels call bound by
ops._BINDERS, a ufunc, a generic kernel), and the products grouped by kernel and weight type with the
bytes they read a step, their GB/s and its share of the host's read bandwidth at these threads
(ggml_dist/bench/bandwidth.py: issue 56). Prints one JSON object.

    python benchmarks/decode_step.py [--model smollm2-135m] [--threads 1] [--steps 40] [--prompt-len 9] [--perf]

The per-call timer adds ~0.1 us a call; `step_ms` is measured without it.

--perf adds "perf": the time outside kernels per step (issue 23's item 3), from `perf record` sampling
the calling thread (the one every step's critical path runs on; with 2 threads, kernel launches' other
threads only shorten its kernel time) over --perf-steps further steps. Samples in numba's compiled code
([JIT]), in OpenMP's runtime (a parallel kernel's threads meeting at its end) and in libm count as
kernels; everything else (Python, numba's dispatcher, numpy, libc, the OS) as outside, numpy's few
element loops on a decode step's short rows included.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

_KERNEL_DSOS = ("[JIT]", "libgomp", "libm.so", "libm-")     # perf's DSO names that count as kernels


def perf_split(step: Callable[[], None], n_steps: int, freq: int = 1999) -> dict[str, Any]:
    """Run step() n_steps times under `perf record` of this thread; the share of its samples in
    kernels and outside them, by DSO (see the module docstring)."""
    if shutil.which("perf") is None:
        return {"error": "perf is not installed"}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        rec = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(freq), "-t",
                                str(threading.get_native_id()), "-o", data],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)                                 # perf attaches
        t0 = time.perf_counter()
        for _ in range(n_steps):
            step()
        wall = time.perf_counter() - t0
        rec.send_signal(2)
        _, err = rec.communicate(timeout=60)
        rep = subprocess.run(["perf", "report", "-i", data, "--stdio", "--sort", "dso"], capture_output=True,
                             text=True, timeout=120)
    by_dso: dict[str, float] = {}
    for line in rep.stdout.splitlines():
        m = re.match(r"^\s+([\d.]+)%\s+(\S.*?)\s*$", line)
        if m:
            name = re.sub(r" tid \d+$", "", m.group(2))
            by_dso[name] = by_dso.get(name, 0.0) + float(m.group(1))
    if not by_dso:
        return {"error": f"perf recorded nothing: {err.decode(errors='replace').strip()[-300:]}"}
    inside = sum(v for k, v in by_dso.items() if k.startswith(_KERNEL_DSOS))
    total = sum(by_dso.values())
    step_ms = wall / n_steps * 1e3
    return {"steps": n_steps, "step_ms": round(step_ms, 3), "kernels_pct": round(100 * inside / total, 1),
            "outside_pct": round(100 * (total - inside) / total, 1),
            "outside_ms_per_step": round(step_ms * (total - inside) / total, 3),
            "by_dso": {k: round(v, 2) for k, v in sorted(by_dso.items(), key=lambda kv: -kv[1]) if v >= 0.05}}


def _label(call: Any) -> str:
    f = getattr(call, "func", call)                 # a partial: the generic kernel
    return getattr(f, "__qualname__", type(f).__name__).replace(".<locals>", "")   # an instance: its class


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=9,
                    help="cache cells filled before the steps (bench decode: 128, then 64 steps)")
    ap.add_argument("--perf", action="store_true", help="also the time outside kernels, by perf record")
    ap.add_argument("--perf-steps", type=int, default=200)
    a = ap.parse_args(argv)
    from ggml_dist.backends.cpu import backend as cpu
    from ggml_dist.backends.cpu import threads
    from ggml_dist.bench.bandwidth import by_weight, read_gb_s
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.pull import resolve_model
    from ggml_dist.model.ubatch import Batch
    threads.set_threads(a.threads)
    n_ctx = a.prompt_len + 5 + a.steps * 2 + (a.perf_steps if a.perf else 0) + 16
    ctx = LlamaContext(LlamaModel.load(resolve_model(a.model)), ContextParams(n_ctx=max(1024, n_ctx)))
    ctx.decode(Batch.from_tokens([1 + i % 100 for i in range(a.prompt_len)]))
    pos = a.prompt_len

    def step() -> None:
        nonlocal pos
        ctx.decode(Batch.from_tokens([5], pos0=pos))
        pos += 1
    for _ in range(5):
        step()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    step_s = (time.perf_counter() - t0) / a.steps

    per: dict[str, float] = collections.defaultdict(float)
    n: collections.Counter[str] = collections.Counter()
    each: dict[tuple[int, int], float] = collections.defaultdict(float)     # (graph, call) -> seconds
    graphs: dict[int, Any] = {}
    plain = cpu.BoundGraph.run

    def timed(self: Any) -> None:
        pc = time.perf_counter
        graphs[id(self)] = self
        for call in self.prologue:
            call()
        for i, call in enumerate(self.calls):
            t = pc()
            call()
            k, dt = _label(call), pc() - t
            per[k] += dt
            n[k] += 1
            each[id(self), i] += dt
    cpu.BoundGraph.run = timed                      # type: ignore[method-assign]
    try:
        for _ in range(a.steps):
            step()
    finally:
        cpu.BoundGraph.run = plain                  # type: ignore[method-assign]
    calls = {k: {"ms_per_step": round(v / a.steps * 1e3, 3), "calls_per_step": n[k] // a.steps,
                 "us_per_call": round(v / n[k] * 1e6, 2)} for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    out = {"model": a.model, "threads": a.threads, "prompt_len": a.prompt_len, "step_ms": round(step_s * 1e3, 3),
           "tok_s": round(1 / step_s, 2), "replay_ms_timed": round(sum(per.values()) / a.steps * 1e3, 3),
           "calls_per_step": sum(n.values()) // a.steps, "calls": calls}
    # each product's bytes a step against the host's read bandwidth at these threads (issue 56)
    read = read_gb_s(a.threads)
    timed_calls = [(_label(graphs[g].calls[i]), graphs[g].call_nodes[i], s) for (g, i), s in each.items()]
    out["read_gb_s"] = round(read, 2)
    out["products"] = by_weight(timed_calls, a.steps, read, ctx.model.hp.n_expert_used)
    weights_s = sum(p["ms_per_step"] for p in out["products"]) / 1e3
    out["products_gb_s"] = round(sum(p["mb_per_step"] for p in out["products"]) * 2**20 / weights_s / 1e9, 2)
    out["products_share_of_step"] = round(weights_s / step_s, 3)
    if a.perf:
        out["perf"] = perf_split(step, a.perf_steps)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

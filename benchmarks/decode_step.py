"""Where a decode step's time goes in one process: the step's wall time, then the bound replay's calls
timed one by one and grouped by the call that ran (the packed matmul, an fkernels call bound by
ops._BINDERS, a ufunc, a generic kernel). Prints one JSON object.

    python benchmarks/decode_step.py [--model smollm2-135m] [--threads 1] [--steps 40]

The per-call timer adds ~0.1 us a call; `step_ms` is measured without it.
"""
from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Any


def _label(call: Any) -> str:
    f = getattr(call, "func", call)                 # a partial: the generic kernel
    return getattr(f, "__qualname__", repr(f)).replace(".<locals>", "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args(argv)
    from ggml_dist.backends.cpu import backend as cpu
    from ggml_dist.backends.cpu import threads
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.pull import resolve_model
    from ggml_dist.model.ubatch import Batch
    threads.set_threads(a.threads)
    ctx = LlamaContext(LlamaModel.load(resolve_model(a.model)), ContextParams(n_ctx=512))
    ctx.decode(Batch.from_tokens(list(range(1, 10))))
    pos = 9

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
    plain = cpu.BoundGraph.run

    def timed(self: Any, opts: Any) -> None:
        pc = time.perf_counter
        for call in self.calls:
            t = pc()
            call(opts)
            k = _label(call)
            per[k] += pc() - t
            n[k] += 1
    cpu.BoundGraph.run = timed                      # type: ignore[method-assign]
    try:
        for _ in range(a.steps):
            step()
    finally:
        cpu.BoundGraph.run = plain                  # type: ignore[method-assign]
    calls = {k: {"ms_per_step": round(v / a.steps * 1e3, 3), "calls_per_step": n[k] // a.steps,
                 "us_per_call": round(v / n[k] * 1e6, 2)} for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    print(json.dumps({"model": a.model, "threads": a.threads, "step_ms": round(step_s * 1e3, 3),
                      "tok_s": round(1 / step_s, 2), "replay_ms_timed": round(sum(per.values()) / a.steps * 1e3, 3),
                      "calls": calls}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

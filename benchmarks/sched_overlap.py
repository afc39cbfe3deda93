"""Pipeline overlap of the scheduler: 4 micro-batches over two asynchronous CPU-kind backends.

Half 1 of the graph runs on an AccelDevice (weights in its buffer), half 2 on the CPU backend. With
n_copies=1 the micro-batches run one after another (the input shares compute memory with the previous
micro-batch, so the host synchronises before writing it); with n_copies>1 micro-batch m+1's first half
runs while m's second half runs. Prints one JSON object: wall times per n_copies and the overlap ratio
wall(1)/wall(k) (ideal for 2 stages and 4 micro-batches: 8/5 = 1.6).

Usage: python benchmarks/sched_overlap.py [--k 1024] [--n 256] [--layers 2] [--trace out.json]
"""
from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")            # one core per backend: overlap, not BLAS threads

import argparse
import json
import math
import time

import numpy as np

from ggml_dist.backends.accel import AccelDevice
from ggml_dist.backends.base import BufferUsage, tensor_alloc, tensor_array
from ggml_dist.backends.cpu.backend import CPUDevice
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType
from ggml_dist.scheduler.sched import Sched
from ggml_dist.scheduler.trace import TraceRecorder


def _weights(buft, n: int, k: int, rng: np.random.Generator) -> list:
    ctx = Context(1 << 20, no_alloc=True)
    ws = [ctx.new_tensor(GGMLType.F32, (k, k)).set_name(f"{buft.name}.w{i}") for i in range(n)]
    step = (k * k * 4 + buft.alignment - 1) // buft.alignment * buft.alignment
    buf = buft.alloc_buffer(step * n)
    buf.usage = BufferUsage.WEIGHTS
    for i, w in enumerate(ws):
        tensor_alloc(buf, w, i * step)
        tensor_array(w)[...] = rng.standard_normal((1, 1, k, k)).astype(np.float32)
    return ws


def _build(w1: list, w2: list, k: int, n: int):
    ctx = Context(1 << 20, no_alloc=True)
    x = ctx.new_tensor(GGMLType.F32, (k, n)).set_name("x").set_input()
    h = x
    for w in w1 + w2:                                  # ne = (k, n) throughout
        h = ops.scale(ctx, ops.mul_mat(ctx, w, h), 1.0 / math.sqrt(k))
    h.set_name("out").set_output()
    g = Graph(256)
    g.build_forward_expand(h)
    return g, x, h


def run(n_copies: int, w1, w2, backends, k: int, n: int, n_ubatch: int, inputs,
        trace: TraceRecorder | None = None) -> tuple[float, list[np.ndarray]]:
    sched = Sched(backends, n_copies=n_copies)
    for _ in range(2):                                 # warm-up: reserve the buffers, touch the pages
        g, x, y = _build(w1, w2, k, n)
        sched.reset()
        sched.alloc_graph(g)
        x.buffer.set_tensor(x, inputs[0])
        sched.graph_compute(g)
    sched.reset()
    sched.synchronize()                                # next alloc uses copy 0
    sched.set_trace(trace)
    outs: list[np.ndarray] = []
    t0 = time.perf_counter()
    for m in range(n_ubatch):
        g, x, y = _build(w1, w2, k, n)
        sched.reset()
        if not sched.alloc_graph(g):
            raise RuntimeError("allocation failed")
        if n_copies == 1:
            sched.synchronize()
        x.buffer.set_tensor(x, inputs[m])
        sched.graph_compute_async(g)
        backends[-1].submit(lambda y=y: outs.append(tensor_array(y).copy()))
    sched.synchronize()
    return time.perf_counter() - t0, outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=1024)
    ap.add_argument("--n", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2, help="matmuls per half")
    ap.add_argument("--ubatches", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--trace", default=None, help="write a Perfetto trace of the n_copies=4 run here")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    cpu_dev, acc = CPUDevice("CPU"), AccelDevice("ACC0")
    backends = [acc.init_backend(async_compute=True), cpu_dev.init_backend(async_compute=True)]
    w1 = _weights(acc.buft, a.layers, a.k, rng)
    w2 = _weights(cpu_dev.buft, a.layers, a.k, rng)
    inputs = [rng.standard_normal((a.n, a.k)).astype(np.float32) for _ in range(a.ubatches)]
    walls: dict[int, float] = {}
    results: dict[int, list[np.ndarray]] = {}
    half_ms: dict[str, float] = {}
    for nc in (1, 2, 3, 4):
        best = math.inf
        for r in range(a.repeat):
            tr = TraceRecorder() if (nc == 1 and r == 0) or (nc == 4 and r == 0) else None
            wall, outs = run(nc, w1, w2, backends, a.k, a.n, a.ubatches, inputs, tr)
            best = min(best, wall)
            results[nc] = outs
            if tr is not None and nc == 1:
                for b in ("ACC0", "CPU"):
                    d = [e.dur_us for e in tr.events if e.backend == b]
                    half_ms[b] = round(sum(d) / max(len(d), 1) / 1e3, 3)
            if tr is not None and nc == 4 and a.trace:
                tr.write(a.trace)
        walls[nc] = best
    identical = all(all(np.array_equal(x, y) for x, y in zip(results[1], results[nc])) for nc in results)
    print(json.dumps({
        "benchmark": "sched_overlap", "k": a.k, "n": a.n, "matmuls_per_half": a.layers,
        "n_ubatch": a.ubatches, "cpu_count": os.cpu_count(), "half_ms": half_ms,
        "wall_ms": {str(k): round(v * 1e3, 2) for k, v in walls.items()},
        "overlap_ratio": {str(k): round(walls[1] / v, 3) for k, v in walls.items()},
        "ideal_ratio": round(2 * a.ubatches / (a.ubatches + 1), 3),
        "results_identical": identical,
    }))


if __name__ == "__main__":
    main()

"""What a bound call costs outside its kernel's work, hot and cold: a decode step streams its weights
through the caches between two calls of the same kernel, so the Python, numpy and numba objects of each
call come from memory, not from L1/L2. Prints one JSON object:

    python benchmarks/cold_call.py [--sweep-mb 16] [--repeats 400]

{"sweep_mb", "calls": {name: {"hot_us", "cold_us", "arrays"}}}: hot = back-to-back calls (mean), cold =
the median of single calls each after summing a --sweep-mb buffer (which evicts L1/L2 and part of L3).
The calls: an empty compiled function, a numba entry point given 4 and 20 small arrays, a tiny Q8_0
product's bound call (64 x 32, one token: its 20 arrays travel as one pointer block, entry.py), and a
bound SWIGLU of 8 values (3 arrays). One thread.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from numba import njit


def _entry(fn: Callable, *args: object) -> Callable[[], object]:
    fn(*args)
    return partial(fn.overloads[fn.signatures[0]].entry_point, *args)      # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep-mb", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=400)
    a = ap.parse_args(argv)
    from ggml_dist.backends.cpu import fkernels, qpack, threads
    from ggml_dist.backends.cpu import quants as Q
    from ggml_dist.core.types import GGMLType
    threads.set_threads(1)
    rng = np.random.default_rng(0)
    arrays = [np.zeros(64, np.float32) for _ in range(20)]
    pw = qpack.PackedWeight(GGMLType.Q8_0, Q.quantize(GGMLType.Q8_0, rng.standard_normal((64, 32)).astype(np.float32)))
    x, out = rng.standard_normal((1, 32)).astype(np.float32), np.zeros((1, 64), np.float32)
    g = rng.standard_normal((1, 1, 1, 8)).astype(np.float32)
    calls: dict[str, tuple[Callable[[], object], int]] = {
        "empty": (_entry(njit(lambda: 0)), 0),
        "entry, 4 arrays": (_entry(njit(lambda a, b, c, d: a[0]), *arrays[:4]), 4),
        "entry, 20 arrays": (_entry(njit(lambda a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t: a[0]),
                                    *arrays), 20),
        "Q8_0 64x32 product, bound": (pw.bind(x, out), 20),
        "SWIGLU of 8, bound": (fkernels.bind_swiglu(g, g.copy(), g.copy()), 3),
    }
    sweep = np.ones(a.sweep_mb << 20, np.uint8)
    res = {}
    for name, (f, n_arrays) in calls.items():
        f()
        t0 = time.perf_counter()
        for _ in range(10 * a.repeats):
            f()
        hot = (time.perf_counter() - t0) / (10 * a.repeats)
        cold = []
        for _ in range(a.repeats):
            sweep.sum()
            t0 = time.perf_counter()
            f()
            cold.append(time.perf_counter() - t0)
        res[name] = {"hot_us": round(hot * 1e6, 2), "cold_us": round(float(np.median(cold)) * 1e6, 2),
                     "arrays": n_arrays}
    print(json.dumps({"sweep_mb": a.sweep_mb, "calls": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

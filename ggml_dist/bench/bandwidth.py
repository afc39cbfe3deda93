"""What a memory-bound decode is held to (issue 56): the host's bandwidth, and the share of it each product
of a decode step reaches.

    copy_gb_s()             numpy's one-thread copy of 64 MiB (a rough figure, kept for comparison)
    read_gb_s(threads)      the host's read bandwidth at `threads` threads: the median of 9 f32
                            matrix-vector products over 1 GiB by numpy's BLAS, in a child with that
                            thread count (the figure the issue's 0.85 is of; the best of 5 gave one
                            43 GB/s among 30-33 on this VM)
    weight_bytes(nodes)     the weight bytes a call's nodes read (a product's matrix; a mixture's
                            experts: the chosen ones' share)
    by_weight(calls, ...)   a decode step's timed calls grouped by kernel and weight type: ms a step,
                            MB a step, GB/s, and that against read_gb_s (benchmarks/decode_step.py)
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from ..backends.base import BufferUsage
from ..core.tensor import Op, Tensor


def copy_gb_s() -> float:
    a = np.ones(64 * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    return best


_READ_PROBE = """
import time, numpy as np
a = np.ones((2**28 // 4096, 4096), np.float32)     # 1 GiB, read once by each product
x = np.ones(4096, np.float32)
rates = []
for _ in range(9):
    t = time.perf_counter()
    a @ x
    rates.append(a.nbytes / (time.perf_counter() - t) / 1e9)
print(sorted(rates)[4])
"""


def read_gb_s(threads: int) -> float:
    """The median of 9 f32 matrix-vector products over 1 GiB, numpy's BLAS at `threads` threads, in GB/s."""
    n = str(threads)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": n, "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
    out = subprocess.run([sys.executable, "-c", _READ_PROBE], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _is_weight(t: Tensor | None) -> bool:
    return t is not None and t.buffer is not None and t.buffer.usage == BufferUsage.WEIGHTS


def weight_bytes(nodes: list[Tensor], n_expert_used: int = 0) -> tuple[int, str]:
    """The weight bytes the nodes of one call read, and their types ("" where they read none). A
    MUL_MAT_ID reads its chosen experts only: n_expert_used of its stacked experts, per token at most;
    a GET_ROWS the rows it takes."""
    total, types = 0, set()
    for t in nodes:
        for x in t.src:
            if _is_weight(x):
                assert x is not None
                b = x.nbytes
                if t.op == Op.MUL_MAT_ID and x.n_dims == 3 and n_expert_used:
                    b = b * min(n_expert_used * t.ne[2], x.ne[2]) // x.ne[2]
                elif t.op == Op.GET_ROWS:                 # the rows it takes (a token's embedding)
                    b = x.nb[1] * t.ne[1]
                total += b
                types.add(x.type.name)
    return total, "+".join(sorted(types))


def by_weight(timed: list[tuple[str, list[Tensor], float]], n_steps: int, read: float | None,
              n_expert_used: int = 0) -> list[dict[str, Any]]:
    """timed: (kernel label, the call's nodes, seconds over n_steps steps) per call of a step. Grouped by
    label and weight type, most time first; the groups that read no weight are left to the caller."""
    groups: dict[tuple[str, str], tuple[float, int, int]] = {}     # (seconds, bytes, calls) a group
    for label, nodes, seconds in timed:
        nbytes, types = weight_bytes(nodes, n_expert_used)
        if nbytes:
            s, b, n = groups.get((label, types), (0.0, 0, 0))
            groups[label, types] = (s + seconds, b + nbytes, n + 1)
    out = []
    for (label, types), (seconds, nbytes, n) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        per_step = seconds / n_steps
        gbs = nbytes / per_step / 1e9 if per_step else 0.0
        out.append({"kernel": label, "weights": types, "calls_per_step": n, "ms_per_step": round(per_step * 1e3, 3),
                    "mb_per_step": round(nbytes / 2**20, 2), "gb_s": round(gbs, 2),
                    "read_share": round(gbs / read, 3) if read else None})
    return out

"""The CPU kernel of ALL_GATHER (core/ops_collective.py): this rank's part goes to the backend's
collective (ComputeOptions.collective), and every rank's part comes back into dst, in rank order along
ne[0] for each token column. A copy of f32 values: the gathered bits are the parts' bits.

While it waits for the other ranks it lets go of the compiled kernels' launch lock (threads.released):
ranks that are threads of one process launch their kernels under that one lock, and a rank holding it
while it waits would keep the others from ever reaching the exchange.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

import numpy as np

from ...core.tensor import Op, Tensor


def _all_gather(t: Tensor, dst: np.ndarray, srcs: list, opts) -> None:
    coll = opts.collective
    if coll is None:
        raise RuntimeError(f"ALL_GATHER '{t.name}' on a backend without a collective: create its backend "
                           f"with ComputeOptions(collective=...) (one rank of a tensor-parallel group)")
    parts_ne0 = t.op_params
    assert len(parts_ne0) == coll.size, f"'{t.name}' gathers {len(parts_ne0)} parts, the group has {coll.size} ranks"
    part = np.ascontiguousarray(srcs[0][0, 0])              # (n_tokens, n_part)
    assert part.shape[1] == parts_ne0[coll.rank], f"'{t.name}': rank {coll.rank}'s part is {part.shape[1]} wide"
    threads = sys.modules.get(f"{__package__}.threads")     # not imported: nobody holds its lock (no numba)
    with threads.released() if threads is not None else nullcontext():
        parts = coll.all_gather(part)
    off = 0
    for r, p in enumerate(parts):
        assert p.shape == (part.shape[0], parts_ne0[r]), f"'{t.name}': rank {r}'s part has shape {p.shape}"
        dst[0, 0, :, off:off + p.shape[1]] = p
        off += p.shape[1]


KERNELS = {Op.ALL_GATHER: _all_gather}

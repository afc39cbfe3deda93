"""The CPU kernels of the exchanges (core/ops_collective.py). ALL_GATHER: this rank's part goes to the
backend's collective (ComputeOptions.collective), and every rank's part comes back into dst, in rank
order along ne[0] for each token column. GATHER_EXPERTS: this rank's rows of the slots whose experts it
owns go to the collective, and every rank's rows come back into their slots. EXPERT_IDS: the router's ids
as a rank's local ones. Copies of f32 values: the gathered bits are the parts' bits.

While it waits for the other ranks it lets go of the compiled kernels' launch lock (threads.released):
ranks that are threads of one process launch their kernels under that one lock, and a rank holding it
while it waits would keep the others from ever reaching the exchange.
"""
from __future__ import annotations

import sys
from contextlib import nullcontext

import numpy as np

from ...core.tensor import Op, Tensor


def _collective(t: Tensor, opts):
    coll = opts.collective
    if coll is None:
        raise RuntimeError(f"{t.op.name} '{t.name}' on a backend without a collective: create its backend "
                           f"with ComputeOptions(collective=...) (one rank of a tensor-parallel group)")
    return coll


def _exchange(coll, part: np.ndarray) -> list[np.ndarray]:
    threads = sys.modules.get(f"{__package__}.threads")     # not imported: nobody holds its lock (no numba)
    with threads.released() if threads is not None else nullcontext():
        return coll.all_gather(part)


def _all_gather(t: Tensor, dst: np.ndarray, srcs: list, opts) -> None:
    coll = _collective(t, opts)
    parts_ne0 = t.op_params
    assert len(parts_ne0) == coll.size, f"'{t.name}' gathers {len(parts_ne0)} parts, the group has {coll.size} ranks"
    part = np.ascontiguousarray(srcs[0][0, 0])              # (n_tokens, n_part)
    assert part.shape[1] == parts_ne0[coll.rank], f"'{t.name}': rank {coll.rank}'s part is {part.shape[1]} wide"
    parts = _exchange(coll, part)
    off = 0
    for r, p in enumerate(parts):
        assert p.shape == (part.shape[0], parts_ne0[r]), f"'{t.name}': rank {r}'s part has shape {p.shape}"
        dst[0, 0, :, off:off + p.shape[1]] = p
        off += p.shape[1]


def _owners(ids: np.ndarray, bounds: tuple) -> np.ndarray:
    """The rank that owns each selected expert id (bounds: each rank's first expert, then E)."""
    if ids.size and (ids.min() < 0 or ids.max() >= bounds[-1]):
        raise IndexError(f"an expert id outside 0..{bounds[-1] - 1}")
    return np.searchsorted(np.asarray(bounds), ids, side="right") - 1


def _expert_ids(t: Tensor, dst: np.ndarray, srcs: list, opts) -> None:
    lo, hi = t.op_params
    ids = srcs[0][0, 0]                                     # (n_tokens, k)
    dst[0, 0] = np.where((ids >= lo) & (ids < hi), ids - lo, -1)


def _gather_experts(t: Tensor, dst: np.ndarray, srcs: list, opts) -> None:
    coll = _collective(t, opts)
    bounds = t.op_params
    assert len(bounds) == coll.size + 1, f"'{t.name}' places experts on {len(bounds) - 1} ranks, not {coll.size}"
    y, owner = srcs[0][0], _owners(srcs[1][0, 0], bounds)  # (n_tokens, k, n), (n_tokens, k)
    parts = _exchange(coll, np.ascontiguousarray(y[owner == coll.rank]))       # (rows owned, n), slot order
    out = dst[0]
    for r, p in enumerate(parts):
        mask = owner == r
        assert p.shape == (int(mask.sum()), y.shape[2]), f"'{t.name}': rank {r} sent rows of shape {p.shape}"
        out[mask] = p


KERNELS = {Op.ALL_GATHER: _all_gather, Op.EXPERT_IDS: _expert_ids, Op.GATHER_EXPERTS: _gather_experts}

"""The op builders of tensor and expert parallelism's exchanges: ALL_GATHER, and EXPERT_IDS with
GATHER_EXPERTS. ggml has no such ops (llama.cpp's meta backend gathers between graphs); here they are
nodes, so that the allocator plans their results and the scheduler places them like any other op, and a
rank's whole layer stays one graph.

    all_gather(ctx, part, parts)    part: this rank's slice, ne = (n_part, n_tokens); the result
                                    ne = (sum(parts), n_tokens): every rank's part of each token column,
                                    concatenated along dim 0 in rank order

op_params are the ranks' part sizes in rank order (`parts`); the kernels (backends/cpu/gather.py)
calls the backend's collective, which knows this rank's index. Never in place (gallocr's INPLACE_OPS
does not list it): the result is larger than the part, and every rank reads its part while it writes.

A mixture of experts' layer (model/moe.py) on a rank that holds experts [lo, hi) of E:

    ids   = expert_ids(ctx, selected, lo, hi)       the router's top-k (every rank chose the same), as
                                                    this rank's local ids; -1 where another rank owns it
    y     = MUL_MAT_ID(my experts, x, ids)          a slot of id -1 is not computed: its row is 0
    y_all = gather_experts(ctx, y, selected, bounds)    every slot's row from the rank that owns its
                                                    expert (bounds: each rank's first expert, then E)

Each slot's row is computed whole on one rank, so y_all holds one process's bits; the weighting and the
slots' sum that follow run on every rank, in llama.cpp's order. A rank sends only the rows of the slots
it owns (n_tokens * k * n_embd floats over all ranks, not K times that).
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from .context import Context
from .ops import _check, _node
from .tensor import Op, Tensor, is_contiguous
from .types import GGMLType


def all_gather(ctx: Context, part: Tensor, parts: Sequence[int]) -> Tensor:
    """The ranks' parts concatenated along dim 0 per token column; parts: every rank's ne[0], in rank order."""
    _check(part.type == GGMLType.F32 and is_contiguous(part), "ALL_GATHER", "the part must be a contiguous F32",
           part)
    _check(part.ne[2] == 1 and part.ne[3] == 1, "ALL_GATHER", "the part must be a matrix (n_part, n_tokens)",
           part)
    _check(len(parts) >= 1 and all(n > 0 for n in parts) and part.ne[0] in parts, "ALL_GATHER",
           f"the part's ne[0] must be one of the ranks' part sizes {list(parts)}", part)
    return _node(ctx, Op.ALL_GATHER, GGMLType.F32, (sum(parts), part.ne[1]), [part], tuple(int(n) for n in parts))


def expert_ids(ctx: Context, selected: Tensor, lo: int, hi: int) -> Tensor:
    """selected (I32 expert ids, ne = (k, n_tokens), rows of any stride: the router's top-k view) as the
    ids of a rank holding experts lo..hi-1: id - lo where lo <= id < hi, else -1. ne = (k, n_tokens)."""
    _check(selected.type == GGMLType.I32 and selected.ne[2] == 1 and selected.ne[3] == 1, "EXPERT_IDS",
           "the selected ids must be a 2-D I32 tensor", selected)
    _check(0 <= lo < hi, "EXPERT_IDS", f"the rank's experts {lo}..{hi - 1} are not a range", selected)
    return _node(ctx, Op.EXPERT_IDS, GGMLType.I32, (selected.ne[0], selected.ne[1]), [selected], (lo, hi))


def gather_experts(ctx: Context, y: Tensor, selected: Tensor, bounds: Sequence[int]) -> Tensor:
    """Every slot's expert output from the rank that owns its expert: y (F32, ne = (n, k, n_tokens)), this
    rank's MUL_MAT_ID over its experts' ids; selected (ne = (k, n_tokens)) the router's global ids;
    bounds[r] the first expert of rank r, bounds[-1] the expert count. ne = y's."""
    _check(y.type == GGMLType.F32 and is_contiguous(y) and y.ne[3] == 1, "GATHER_EXPERTS",
           "y must be a contiguous F32 (n, k, n_tokens)", y)
    _check(selected.type == GGMLType.I32 and selected.ne[:2] == y.ne[1:3] and selected.ne[2] == 1, "GATHER_EXPERTS",
           "one selected id per slot of y", y, selected)
    _check(len(bounds) >= 2 and bounds[0] == 0 and all(a < b for a, b in pairwise(bounds)), "GATHER_EXPERTS",
           f"bounds {list(bounds)} must rise from 0, a range of experts per rank", y)
    return _node(ctx, Op.GATHER_EXPERTS, GGMLType.F32, y.ne[:3], [y, selected], tuple(int(b) for b in bounds))

"""The op builder of tensor parallelism's exchange: ALL_GATHER. ggml has no such op (llama.cpp's meta
backend gathers between graphs); here it is a node, so that the allocator plans its result and the
scheduler places it like any other op, and a rank's whole layer stays one graph.

    all_gather(ctx, part, parts)    part: this rank's slice, ne = (n_part, n_tokens); the result
                                    ne = (sum(parts), n_tokens): every rank's part of each token column,
                                    concatenated along dim 0 in rank order

op_params are the ranks' part sizes in rank order (`parts`); the kernel (backends/cpu/collective.py)
calls the backend's collective, which knows this rank's index. Never in place (gallocr's INPLACE_OPS
does not list it): the result is larger than the part, and every rank reads its part while it writes.
"""
from __future__ import annotations

from collections.abc import Sequence

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

"""The UNARY op's compiled path: ukernels' twins of numerics.UNARY's numpy functions, where numba is on and
the operands fit (F32; SILU: rows a multiple of 8); ops._unary takes numerics' otherwise (the reference)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.tensor import Tensor, UnaryOp
from ...core.types import GGMLType


def compiled(t: Tensor, x: np.ndarray, dst: np.ndarray, opts: Any) -> bool:
    """Run the node's unary op on x into dst by its compiled kernel and say so; False (nothing written)
    where there is none for it."""
    op = UnaryOp(t.op_param(0))
    if (not opts.numba or op not in (UnaryOp.SILU, UnaryOp.SOFTPLUS) or t.type != GGMLType.F32
            or x.dtype != np.float32 or x.shape != dst.shape or (op == UnaryOp.SILU and x.shape[-1] % 8)):
        return False
    try:
        from . import ukernels
    except ImportError:
        return False
    if op == UnaryOp.SILU:
        ukernels.silu(x, dst)
    elif ukernels.LIBM_EXP_LOG:
        ukernels.softplus(x, dst)
    else:
        return False
    return True

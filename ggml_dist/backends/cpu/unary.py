"""The UNARY op's compiled path: ukernels' twins of numerics.UNARY's numpy functions, where numba is on and
the operands fit (F32, rows a multiple of 8); ops._unary takes numerics' otherwise (the reference)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.tensor import Tensor, UnaryOp
from ...core.types import GGMLType


def compiled(t: Tensor, x: np.ndarray, dst: np.ndarray, opts: Any) -> bool:
    """Run the node's unary op on x into dst by its compiled kernel and say so; False (nothing written)
    where there is none for it."""
    if (not opts.numba or UnaryOp(t.op_param(0)) != UnaryOp.SILU or t.type != GGMLType.F32
            or x.dtype != np.float32 or x.shape != dst.shape or x.shape[-1] % 8):
        return False
    try:
        from . import ukernels
    except ImportError:
        return False
    ukernels.silu(x, dst)
    return True

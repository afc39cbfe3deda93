"""numba kernels of element-wise unary ops, bit for bit with numerics.py's numpy functions (which stay the
reference, and the path without numba; unary.py picks).

* ``silu``: ggml_vec_silu_f32, x / (1 + vexp(-x)) in f32 (numerics.silu), on rows whose length is a
  multiple of 8 (numerics.exp_chunked takes the C library's expf on a row's tail, which numba cannot
  reproduce). The hybrid models' conv output and their gated norm's gate take it on every token.
* ``softplus``: ggml's op_softplus, x > 20 ? x : logf(1 + expf(x)) in f32 (numerics.softplus). numba's
  math.exp/log of a float32 are LLVM's exp/log intrinsics, which become calls to the C library's
  expf/logf, the functions numerics.softplus calls through ctypes (checked equal bit for bit on 500k
  values, random bit patterns among them); with SVML numba could take its vector versions, so then
  unary.py keeps numerics' (LIBM_EXP_LOG). A Gated DeltaNet layer takes it on its gates.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from .fkernels import vexp
from .threads import get_threads, launch

F32 = np.float32
_PARALLEL_WORK = 1 << 15            # elements: under this a launch costs more than the split saves
LIBM_EXP_LOG = not numba.config.USING_SVML                                      # type: ignore[attr-defined]


@njit(cache=True, inline="always")
def _silu_rows(x, dst, r0, r1):
    """dst = silu(x) on rows r0 .. r1-1 of the 4-d arrays (row r = (i3, i2, i1) in C order). A row goes
    through the scratch s, so the loop vectorises even when dst aliases x (in place)."""
    _ne3, ne2, ne1, ne0 = dst.shape
    s = np.empty(ne0, F32)
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        xr, dr = x[i3, i2, i1], dst[i3, i2, i1]
        for i in range(ne0):
            v = xr[i]
            s[i] = v / (F32(1) + vexp(-v))
        for i in range(ne0):
            dr[i] = s[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _silu_serial(x, dst):
    _silu_rows(x, dst, 0, dst.shape[0] * dst.shape[1] * dst.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _silu_par(x, dst, n_chunks):
    n = dst.shape[0] * dst.shape[1] * dst.shape[2]
    n_chunks = min(n, n_chunks)
    for c in prange(n_chunks):
        _silu_rows(x, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


def silu(x: np.ndarray, dst: np.ndarray) -> None:
    """dst = numerics.silu(x) (f32 4-d arrays of one shape, rows a multiple of 8), its rows split across
    the kernels' threads (threads.py) where there are several and enough work."""
    if dst.size >= _PARALLEL_WORK and dst.size > dst.shape[3] and get_threads() > 1:
        with launch() as n:
            _silu_par(x, dst, n)
        return
    _silu_serial(x, dst)


@njit(cache=True, nogil=True, error_model="numpy")
def softplus(x, dst):
    """dst = numerics.softplus(x) on 4-d f32 arrays of one shape (dst may alias x)."""
    for i3 in range(x.shape[0]):
        for i2 in range(x.shape[1]):
            for i1 in range(x.shape[2]):
                xr, dr = x[i3, i2, i1], dst[i3, i2, i1]
                for i in range(xr.shape[0]):
                    v = xr[i]
                    dr[i] = v if v > F32(20) else math.log(F32(F32(1) + math.exp(min(v, F32(20)))))

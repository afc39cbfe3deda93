"""A mixture-of-experts layer's small ops around its MUL_MAT_IDs (model/moe.py), each run as one compiled
call of the same bits as the ops' kernels (fusion.py binds them):

    _combine     MUL(experts, weights), then the k slot views added left to right: the weighted sum
    _topk_rows   the router's ARGSORT of the probabilities [+ GET_ROWS of its top k]
    _norm_rows   SUM_ROWS, CLAMP, DIV of the chosen weights (norm_w)
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

F32 = np.float32
F64 = np.float64


# ------------------------------------------------------------------------------------------------
# the weighted sum of the experts' outputs (model/moe.py: MUL(experts, weights), then the k slot views
# added left to right), one call
@njit(cache=True, nogil=True)
def _combine(y, w, out, acc):
    """out[t] = ((f32(y[t, 0] * w[t, 0]) + f32(y[t, 1] * w[t, 1])) + ...) + f32(y[t, k-1] * w[t, k-1]): ggml's
    MUL and ADDs, each an f32 operation (no fma), token after token; a token's row is written after all
    of its slots are read (acc), so out may start where y does (the allocator's in-place chain)."""
    n_tok, k, n = y.shape
    for t in range(n_tok):
        w0 = w[t, 0]
        for i in range(n):
            acc[i] = y[t, 0, i] * w0
        for s in range(1, k):
            ws = w[t, s]
            for i in range(n):
                acc[i] = acc[i] + y[t, s, i] * ws
        o = out[t]
        for i in range(n):
            o[i] = acc[i]


def bind_combine(y: np.ndarray, w: np.ndarray, out: np.ndarray) -> Callable[[], None] | None:
    """_combine bound to y f32 [n_tok, k, n] C-contiguous, w f32 [n_tok, k], out f32 [n_tok, n] (rows
    contiguous); None where out overlaps y or w other than from y's start (see _combine)."""
    if y.ndim != 3 or w.shape != y.shape[:2] or out.shape != (y.shape[0], y.shape[2]) or \
            not (y.flags.c_contiguous and out.strides[1] == 4 and out.strides[0] >= 0) or \
            not all(a.dtype == F32 for a in (y, w, out)):
        return None
    if np.may_share_memory(out, w) or (np.may_share_memory(out, y) and not (
            out.ctypes.data == y.ctypes.data and out.strides[0] <= y.strides[0])):
        return None
    from .entry import bound
    return bound(_combine, y, w, out, np.empty(y.shape[2], F32))


# ------------------------------------------------------------------------------------------------
# the router's small ops (model/moe.py): ARGSORT of the probabilities [+ GET_ROWS of its top k], and
# SUM_ROWS, CLAMP, DIV of the chosen weights, each run as one call of the same bits as the ops'
@njit(cache=True, nogil=True)
def _topk_rows(p, order, desc, g):
    """order[t] = ops._argsort's of row p[t] (np.argsort(-p[t] if desc else p[t], kind="stable"): a stable
    sort, NaNs last); g[t, j] = p[t, order[t, j]] for j < g.shape[1] (the GET_ROWS of the first k)."""
    for t in range(p.shape[0]):
        row = p[t]
        o = np.argsort(-row if desc else row, kind="mergesort")
        for j in range(row.shape[0]):
            order[t, j] = o[j]
        for j in range(g.shape[1]):
            g[t, j] = row[o[j]]


def bind_topk(p: np.ndarray, order: np.ndarray, desc: bool, g: np.ndarray | None) -> Callable[[], None] | None:
    """_topk_rows bound to p f32 [n_tok, E] (rows contiguous), order int32 [n_tok, E], g f32 [n_tok, k] or
    None; None where an output overlaps another array."""
    g = np.zeros((p.shape[0], 0), F32) if g is None else g
    if p.dtype != F32 or order.dtype != np.int32 or g.dtype != F32 or order.shape != p.shape or \
            g.shape[0] != p.shape[0] or g.shape[1] > p.shape[1]:
        return None
    if any(a.strides[-1] != a.itemsize for a in (p, order, g) if a.size) or \
            np.may_share_memory(order, p) or np.may_share_memory(g, p) or np.may_share_memory(g, order):
        return None
    from .entry import bound
    return bound(_topk_rows, p, order, desc, g)


@njit(cache=True, nogil=True)
def _norm_rows(w, s, c, d, lo, hi):
    """s[t] = ops._sum_rows of w[t] (a sequential double sum, rounded to f32), c[t] = _clamp's
    max(min(s, hi), lo), d[t] = f32(w[t] / c[t]) (the DIV, broadcast); a token's values read before
    its results are written (c may be s, d may be w: the ops in place)."""
    for t in range(w.shape[0]):
        acc = 0.0
        for j in range(w.shape[1]):
            acc += F64(w[t, j])
        st = F32(acc)
        s[t] = st
        ct = np.maximum(np.minimum(st, hi), lo)
        c[t] = ct
        for j in range(w.shape[1]):
            d[t, j] = w[t, j] / ct


def bind_norm(w: np.ndarray, s: np.ndarray, c: np.ndarray, d: np.ndarray, lo: np.float32, hi: np.float32
              ) -> Callable[[], None] | None:
    """_norm_rows bound to w f32 [n_tok, k], s, c f32 [n_tok], d f32 [n_tok, k]; None where the arrays
    overlap other than as the ops in place (c on s, d on w, exactly)."""
    if not all(a.dtype == F32 for a in (w, s, c, d)) or d.shape != w.shape or s.shape != c.shape != (w.shape[0],):
        return None

    def same(a: np.ndarray, b: np.ndarray) -> bool:
        return (a.ctypes.data, a.shape, a.strides) == (b.ctypes.data, b.shape, b.strides)

    def apart(a: np.ndarray, b: np.ndarray) -> bool:
        return not np.may_share_memory(a, b)
    if not ((same(c, s) or apart(c, s)) and (same(d, w) or apart(d, w)) and all(
            apart(x, y) for x in (s, c) for y in (w, d))):
        return None
    from .entry import bound
    return bound(_norm_rows, w, s, c, d, F32(lo), F32(hi))

"""numba kernels of the hybrid models' recurrent ops: the compiled twins of recurrent.py's numpy kernels,
bit for bit (recurrent.py stays the reference, and the path without numba).

* ``gated_delta_net``: ggml_compute_forward_gated_delta_net_one_chunk, its (sequence, head) pairs split
  across the kernels' threads as ggml splits them. Each pair's state is read once into dst's state rows and
  updated there token after token; a token works row by row of M = S^T, since every step of the
  recurrence on row j (the gate, delta[j] from dot(M[j], k), the rank-1 update of M[j], out[j] from
  dot(M[j], q)) reads only row j and the token's vectors: one pass over the state per token, in L1,
  where the numpy reference makes four over whole arrays. Each element sees the reference's float steps in
  the same order, so the bits are the same.

Float steps as recurrent.py emulates them (ggml-numerics.md): ggml_vec_mad_f32's fma is
f32(f64(a) * f64(b) + f64(c)) (numerics.fma32: the product of two f32 is exact in f64, so contracting
it changes nothing); ggml_vec_dot_f32 is four accumulators of 8 lanes over 32-element steps, folded
a0+a2, a1+a3, a0+a1, the lanes summed ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), the n mod 32 tail added in
f32. The gates' expf is computed by the caller in numpy (recurrent.py), exactly as the reference does.
fastmath stays off: LLVM then neither contracts nor reorders the f32 steps.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from .threads import get_threads, launch

F32 = np.float32
F64 = np.float64


@njit(cache=True, inline="always")
def _vec_dot(x, y, acc):
    """ggml_vec_dot_f32 (AVX2) of two contiguous f32 rows, acc a scratch of 32 f32 lanes."""
    n = x.shape[0]
    n32 = n - n % 32
    for j in range(32):
        acc[j] = F32(0)
    for i0 in range(0, n32, 32):
        for j in range(32):
            acc[j] = F32(F64(x[i0 + j]) * F64(y[i0 + j]) + F64(acc[j]))
    sumf = F32(0)
    if n32:
        for j in range(8):
            acc[j] = F32(F32(acc[j] + acc[16 + j]) + F32(acc[8 + j] + acc[24 + j]))
        sumf = F32(F32(F32(acc[0] + acc[4]) + F32(acc[1] + acc[5]))
                   + F32(F32(acc[2] + acc[6]) + F32(acc[3] + acc[7])))
    for i in range(n32, n):
        sumf = F32(sumf + F32(x[i] * y[i]))
    return sumf


@njit(cache=True, nogil=True, error_model="numpy")
def _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, p0, p1):
    """The recurrence of (sequence, head) pairs p0 .. p1-1 (pair p = s * H + h) over every token.
    q [ns_q, n_t, Hq, S], k [ns_k, n_t, Hk, S] (value head h reads key head h mod Hq/Hk, sequence s reads
    s // (n_s / ns)), v [n_s, n_t, H, S], eg = expf(g) [n_s, n_t, H, 1 or S], beta [n_s, n_t, H, 1],
    state [n_s, H, S, S] (M = S^T, as ggml stores it); out [n_s, n_t, H, S] and st [n_s, H, S, S] are
    dst's two parts, contiguous."""
    n_t, H, S = v.shape[1], v.shape[2], v.shape[3]
    per_key = eg.shape[3] != 1
    acc = np.empty(32, F32)
    kk = np.empty(S, F32)
    qq = np.empty(S, F32)
    gk = np.empty(S, F32)
    for p in range(p0, p1):
        s, h = p // H, p % H
        sq, hq = s // (v.shape[0] // q.shape[0]), h % q.shape[2]
        sk, hk = s // (v.shape[0] // k.shape[0]), h % k.shape[2]
        m = st[s, h]
        for j in range(S):
            for i in range(S):
                m[j, i] = state[s, h, j, i]
        for t in range(n_t):
            for i in range(S):
                kk[i] = k[sk, t, hk, i]
                qq[i] = q[sq, t, hq, i]
                gk[i] = eg[s, t, h, i] if per_key else eg[s, t, h, 0]
            b = beta[s, t, h, 0]
            for j in range(S):
                row = m[j]
                for i in range(S):
                    row[i] = F32(row[i] * gk[i])
                delta = F32(F32(v[s, t, h, j] - _vec_dot(row, kk, acc)) * b)
                for i in range(S):
                    row[i] = F32(F64(kk[i]) * F64(delta) + F64(row[i]))
                out[s, t, h, j] = F32(_vec_dot(row, qq, acc) * scale)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _gdn_par(q, k, v, eg, beta, state, out, st, scale, n_chunks):
    n_pairs = v.shape[0] * v.shape[2]
    n_chunks = min(n_pairs, n_chunks)
    for c in prange(n_chunks):
        _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, c * n_pairs // n_chunks,
                   (c + 1) * n_pairs // n_chunks)


def gated_delta_net(q, k, v, eg, beta, state, out, st, scale) -> None:
    """The fused recurrence into out and st (recurrent.gated_delta_net's numerics; arguments as
    _gdn_pairs'), its pairs split across the kernels' threads (threads.py) where there are several."""
    n_pairs = v.shape[0] * v.shape[2]
    if n_pairs > 1 and get_threads() > 1:
        with launch() as n:
            _gdn_par(q, k, v, eg, beta, state, out, st, scale, n)
        return
    _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, 0, n_pairs)

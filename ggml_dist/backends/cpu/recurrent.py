"""CPU kernels of the hybrid models' recurrent layers (ggml-cpu/ops.cpp: ggml_compute_forward_ssm_conv_f32,
ggml_compute_forward_l2_norm_f32, ggml_compute_forward_gated_delta_net_one_chunk), in numpy, with the
float steps of llama.cpp's AVX2 build (ggml-numerics.md): the same signature as ops.py's kernels,
kernel(t, dst, srcs, opts), on 4-d arrays in numpy order (ne reversed).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...core.tensor import Op, Tensor
from .numerics import fma32

F32 = np.float32
F64 = np.float64


def vec_dot_f32(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 (AVX2) along the last axis, broadcasting the others: four accumulators of 8 lanes
    over 32-element steps, element i to accumulator (i mod 32) div 8, lane i mod 8, by fma; folded
    a0+a2, a1+a3, then a0+a1, and the 8 lanes summed ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)); the n mod 32
    tail added in f32, one product at a time."""
    n = x.shape[-1]
    n32 = n - n % 32
    shape = np.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    acc = np.zeros((*shape, 32), F32)
    for i in range(0, n32, 32):
        acc = fma32(x[..., i:i + 32], y[..., i:i + 32], acc)
    a = acc.reshape(*shape, 4, 8)
    a0 = (a[..., 0, :] + a[..., 2, :]).astype(F32)
    a1 = (a[..., 1, :] + a[..., 3, :]).astype(F32)
    lane = (a0 + a1).astype(F32)
    sumf = (((lane[..., 0] + lane[..., 4]) + (lane[..., 1] + lane[..., 5]))
            + ((lane[..., 2] + lane[..., 6]) + (lane[..., 3] + lane[..., 7]))).astype(F32)
    if n32 == 0:
        sumf = np.zeros(shape, F32)
    for i in range(n32, n):
        sumf = (sumf + (x[..., i] * y[..., i]).astype(F32)).astype(F32)
    return sumf


def _ssm_conv(t: Tensor, dst: np.ndarray, srcs: list, opts: Any) -> None:
    """SSM_CONV: x[s, t, i] = sum_k sx[s, i, t + k] * c[i, k], a sequential f32 sum over the d_conv taps
    from 0, each product rounded before it is added (llama.cpp's build does not contract it: checked
    bit for bit against its ggml)."""
    sx, c = srcs[0][0], srcs[1][0, 0]              # [n_s, d_inner, d_conv - 1 + n_t], [d_inner, d_conv]
    rk = _rkernels(opts)
    if rk is not None and sx.dtype == c.dtype == dst.dtype == F32:
        rk.ssm_conv(sx, c, dst[0])                  # the compiled twin: the same bits
        return
    d_conv = c.shape[-1]
    n_t = dst.shape[2]
    out = np.zeros((sx.shape[0], n_t, sx.shape[1]), F32)
    for k in range(d_conv):
        taps = np.swapaxes(sx[:, :, k:k + n_t], 1, 2)          # [n_s, n_t, d_inner]
        out = (out + (taps * c[:, k]).astype(F32)).astype(F32)
    dst[0] = out


def _l2_norm(t: Tensor, dst: np.ndarray, srcs: list, opts: Any) -> None:
    """L2_NORM per row: sum += double(f32(x*x)) in order, scale = 1/max(sqrtf(f32(sum)), eps) in f32,
    y = f32(x*scale)."""
    x = srcs[0].astype(F32, copy=False)
    rk = _rkernels(opts)
    if rk is not None and dst.dtype == F32 and x.shape == dst.shape:
        rk.l2_norm(x, F32(t.op_param(0)), dst)      # the compiled twin: the same bits
        return
    sq = (x * x).astype(F32).astype(F64)
    total = np.add.accumulate(sq, axis=-1)[..., -1:] if x.shape[-1] else np.zeros((*x.shape[:-1], 1))
    norm = np.sqrt(total.astype(F32)).astype(F32)
    scale = (F32(1) / np.maximum(norm, F32(t.op_param(0)))).astype(F32)
    dst[...] = (x * scale).astype(F32)


def gated_delta_net(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                    state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fused recurrence of ggml_compute_forward_gated_delta_net_one_chunk. q, k [n_s, n_t, H, S] (already
    expanded to the value heads), v [n_s, n_t, H, S], g [n_s, n_t, H, 1 or S], beta [n_s, n_t, H, 1],
    state [n_s, H, S, S] as ggml stores it: M[j, i] = S[i, j], so row j of M is column j of S. Per token:
    M *= expf(g) (a scalar gate: one f32 multiply each; a per-key gate scales M's columns);
    delta[j] = (v[j] - dot(M[j], k)) * beta; M[j] += k * delta[j] (fma: ggml_vec_mad_f32);
    out[j] = dot(M[j], q) * (1/sqrtf(S)). Returns (out [n_s, n_t, H, S], the final M)."""
    n_s, n_t, H, S = v.shape
    m = state.astype(F32, copy=True)
    out = np.empty((n_s, n_t, H, S), F32)
    scale = F32(1) / np.sqrt(F32(S))
    for i in range(n_t):
        eg = np.exp(g[:, i].astype(F64)).astype(F32)        # the C library's expf: correctly rounded
        # a scalar gate: ggml_vec_scale_f32 over M; a per-key gate: ggml_vec_mul_f32 on each row of M
        m = (m * (eg[..., None] if eg.shape[-1] == 1 else eg[:, :, None, :])).astype(F32)
        kd = k[:, i, :, None, :]                                         # [n_s, H, 1, S]
        delta = ((v[:, i] - vec_dot_f32(m, kd)).astype(F32) * beta[:, i]).astype(F32)   # [n_s, H, S]
        m = fma32(kd, delta[..., None], m)
        out[:, i] = (vec_dot_f32(m, q[:, i, :, None, :]) * scale).astype(F32)
    return out, m


def _rkernels(opts: Any) -> Any:
    """rkernels (numba) when opts.numba and numba imports, else None: the numpy kernels here."""
    if not opts.numba:
        return None
    try:
        from . import rkernels
    except ImportError:
        return None
    return rkernels


def _heads(x: np.ndarray, n_s: int, H: int) -> np.ndarray:
    """q or k [ns, n_t, H_k, S] read for every value head and sequence, as ggml indexes them: key head
    h mod H_k, sequence s // (n_s / ns)."""
    return x[np.arange(n_s) // (n_s // x.shape[0])][:, :, np.arange(H) % x.shape[2]]


def _gated_delta_net(t: Tensor, dst: np.ndarray, srcs: list, opts: Any) -> None:
    """GATED_DELTA_NET: the output [S, H, n_t, n_s], then the final state [S, S, H, n_s], packed in dst;
    by rkernels' compiled twin where numba is on (the same bits)."""
    q, k, v, g, beta, state = srcs
    n_s, n_t, H, S = v.shape
    rk = _rkernels(opts)
    if rk is not None and dst.flags.c_contiguous and all(a.dtype == F32 for a in srcs):
        flat = dst.reshape(-1)
        n_out = n_s * n_t * H * S
        eg = np.exp(g.astype(F64)).astype(F32)              # gated_delta_net's expf, in numpy as there
        rk.gated_delta_net(q, k, v, eg, beta, state, flat[:n_out].reshape(n_s, n_t, H, S),
                           flat[n_out: n_out + n_s * H * S * S].reshape(n_s, H, S, S),
                           F32(1) / np.sqrt(F32(S)))
        return
    out, m = gated_delta_net(_heads(q, n_s, H), _heads(k, n_s, H), v, g, beta, state)
    flat = dst.reshape(-1)
    flat[: out.size] = out.reshape(-1)
    flat[out.size: out.size + m.size] = m.reshape(-1)


KERNELS = {Op.SSM_CONV: _ssm_conv, Op.L2_NORM: _l2_norm, Op.GATED_DELTA_NET: _gated_delta_net}

"""backends/cpu/ops.py (and numerics, rope, backend): every kernel, run through ReferenceExecutor, against an
independent numpy formulation (float64 where it helps; each test states its tolerance)."""
import threading
import time

import numpy as np
import pytest
from gguf import quants as gq
from gguf.constants import GGMLQuantizationType as GQ

from ggml_dist.backends.base import array_at
from ggml_dist.backends.cpu.backend import CPUDevice
from ggml_dist.backends.cpu.numerics import vexp
from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType, type_size

F32, F16, BF16, I32, I64 = GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.I32, GGMLType.I64
EXACT = ComputeOptions(exact=True)


@pytest.fixture
def ctx():
    return Context(1 << 22)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def run(out, inputs, opts=ComputeOptions()):
    """Build out's graph, run it on the reference executor, return out's value (numpy order, 4-d)."""
    g = Graph()
    g.build_forward_expand(out)
    return ReferenceExecutor(opts).compute(g, inputs)[out]


def new(ctx, type, *ne):
    return ctx.new_tensor(type, ne)


def randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def as4(x):
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def bf16_exact(rng, *shape):
    """Random f32 values representable in bf16, and their bf16 bits."""
    x = randn(rng, *shape)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    return (bits.astype(np.uint32) << 16).view(np.float32), bits


def bf16_rne(x):
    """Independent f32 -> bf16 (round to nearest even) -> f32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32) << 16
    return r.view(np.float32)


# -- element-wise ------------------------------------------------------------------------------------
# ADD/MUL broadcast b over a by repetition (ggml_repeat semantics, b's index modulo its extent)
@pytest.mark.parametrize("fn,npop", [(ops.add, np.add), (ops.mul, np.multiply)])
def test_binary_broadcast(ctx, rng, fn, npop):
    a, b = new(ctx, F32, 6, 4, 3, 2), new(ctx, F32, 6, 2, 1, 2)
    xa, xb = randn(rng, 2, 3, 4, 6), randn(rng, 2, 1, 2, 6)
    got = run(fn(ctx, a, b), {a: xa, b: xb})
    exp = npop(xa, np.tile(xb, (1, 3, 2, 1)))
    np.testing.assert_array_equal(got, exp)                 # f32 elementwise: exact


# ADD with non-contiguous operands (transposed and permuted views) reads through the strides
def test_add_noncontiguous(ctx, rng):
    a, b = new(ctx, F32, 5, 7), new(ctx, F32, 5, 7, 1)
    xa, xb = randn(rng, 7, 5), randn(rng, 1, 7, 5)
    got = run(ops.add(ctx, ops.transpose(ctx, a), ops.permute(ctx, b, 1, 0, 2, 3)), {a: xa, b: xb})
    np.testing.assert_array_equal(got[0, 0], xa.T + xb[0].T)


# F16 operands: computed in f32, rounded to f16 (RNE)
def test_add_f16(ctx, rng):
    a, b = new(ctx, F16, 16, 3), new(ctx, F16, 16, 1)
    xa, xb = randn(rng, 3, 16).astype(np.float16), randn(rng, 1, 16).astype(np.float16)
    out = ops.add(ctx, a, b)
    assert out.type == F16
    got = run(out, {a: xa, b: xb})
    exp = (xa.astype(np.float32) + xb.astype(np.float32)).astype(np.float16)
    np.testing.assert_array_equal(got[0, 0], exp)


# BF16 operand times F32: computed in f32, result rounded to bf16 (RNE)
def test_mul_bf16(ctx, rng):
    a, b = new(ctx, BF16, 16, 3), new(ctx, F32, 16, 3)
    va, bits = bf16_exact(rng, 3, 16)
    xb = randn(rng, 3, 16)
    out = ops.mul(ctx, a, b)
    assert out.type == BF16
    got = run(out, {a: bits, b: xb})
    got32 = (got.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(got32[0, 0], bf16_rne(va * xb))


# SCALE: a*s, and a*s + b (scale_bias); tolerance 1 ulp-ish (rtol 1e-6)
def test_scale(ctx, rng):
    a = new(ctx, F32, 33, 4)
    x = randn(rng, 4, 33)
    np.testing.assert_array_equal(run(ops.scale(ctx, a, 0.37), {a: x})[0, 0], x * np.float32(0.37))
    got = run(ops.scale(ctx, a, 0.37, 1.5), {a: x})[0, 0]
    np.testing.assert_allclose(got, x.astype(np.float64) * np.float32(0.37) + 1.5, rtol=1e-6, atol=1e-6)


# RMS_NORM on rows of a strided view_2d (every other row): float64 formula, rtol 1e-5
def test_rms_norm_strided(ctx, rng):
    a = new(ctx, F32, 64, 8)
    x = randn(rng, 8, 64) * 3
    v = ops.view_2d(ctx, a, 48, 4, 2 * a.nb[1], 8)          # rows 0,2,4,6; columns 2..49
    got = run(ops.rms_norm(ctx, v, 1e-5), {a: x})[0, 0]
    xs = x[::2, 2:50].astype(np.float64)
    exp = xs / np.sqrt((xs * xs).mean(axis=-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-6)


# NORM: (x - mean) / sqrt(var + eps), float64 formula, rtol 1e-5
def test_norm(ctx, rng):
    a = new(ctx, F32, 40, 3, 2)
    x = randn(rng, 2, 3, 40) + 5
    got = run(ops.norm(ctx, a, 1e-6), {a: x})[0]
    xd = x.astype(np.float64)
    c = xd - xd.mean(axis=-1, keepdims=True)
    np.testing.assert_allclose(got, c / np.sqrt((c * c).mean(axis=-1, keepdims=True) + 1e-6),
                               rtol=1e-5, atol=1e-5)


# UNARY SILU vs x*sigmoid(x) in float64 (rtol 1e-6; vexp is <= 2 ulp); GELU vs the tanh formula
# (atol 2e-3: ggml's table rounds input and output to f16)
def test_unary(ctx, rng):
    a = new(ctx, F32, 37, 5)                               # 37: chunks of 8 plus a libm tail
    x = randn(rng, 5, 37) * 4
    xd = x.astype(np.float64)
    got = run(ops.silu(ctx, a), {a: x})[0, 0]
    np.testing.assert_allclose(got, xd / (1 + np.exp(-xd)), rtol=1e-6, atol=1e-7)
    x[0, :3] = [-12.0, 11.0, 0.0]
    got = run(ops.gelu(ctx, a), {a: x})[0, 0]
    xd = x.astype(np.float64)
    exp = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(got, exp, rtol=2e-3, atol=2e-3)
    assert got[0, 0] == 0.0 and got[0, 1] == 11.0


# SWIGLU fused (halves of one row) and split (two tensors): silu(g) * u, rtol 1e-6
def test_swiglu(ctx, rng):
    a, b = new(ctx, F32, 48, 3), new(ctx, F32, 24, 3)
    x, u = randn(rng, 3, 48), randn(rng, 3, 24)
    silu = lambda v: v / (1 + np.exp(-v.astype(np.float64)))   # noqa: E731
    got = run(ops.swiglu(ctx, a), {a: x})[0, 0]
    np.testing.assert_allclose(got, silu(x[:, :24]) * x[:, 24:], rtol=1e-6, atol=1e-6)
    g = new(ctx, F32, 24, 3)
    got = run(ops.swiglu(ctx, g, b), {g: x[:, :24], b: u})[0, 0]
    np.testing.assert_allclose(got, silu(x[:, :24]) * u, rtol=1e-6, atol=1e-6)


# -- MUL_MAT -----------------------------------------------------------------------------------------
def _mm_ref(w, x, r2=1, r3=1):
    """w [A3, A2, M, K], x [B3, B2, N, K] -> [B3, B2, N, M] in float64, w broadcast over dims 2, 3."""
    w = np.repeat(np.repeat(w.astype(np.float64), r3, axis=0), r2, axis=1)
    return np.einsum("abmk,abnk->abnm", w, x.astype(np.float64))


# F32 MUL_MAT with broadcast of a over b's dims 2 and 3; exact and default agree (rtol 1e-5)
@pytest.mark.parametrize("opts", [EXACT, ComputeOptions()], ids=["exact", "default"])
def test_mul_mat_f32_broadcast(ctx, rng, opts):
    a, b = new(ctx, F32, 32, 6, 2, 1), new(ctx, F32, 32, 5, 4, 3)
    w, x = randn(rng, 1, 2, 6, 32), randn(rng, 3, 4, 5, 32)
    got = run(ops.mul_mat(ctx, a, b), {a: w, b: x}, opts)
    np.testing.assert_allclose(got, _mm_ref(w, x, r2=2, r3=3), rtol=1e-5, atol=1e-5)


# MUL_MAT with permuted views (as K @ Q in attention): strides are honoured (rtol 1e-5)
def test_mul_mat_permuted(ctx, rng):
    k, q = new(ctx, F32, 16, 2, 7), new(ctx, F32, 16, 2, 3)    # [D, n_head, n_tok]
    xk, xq = randn(rng, 7, 2, 16), randn(rng, 3, 2, 16)
    kp, qp = ops.permute(ctx, k, 0, 2, 1, 3), ops.permute(ctx, q, 0, 2, 1, 3)   # [D, n_tok, n_head]
    got = run(ops.mul_mat(ctx, kp, qp), {k: xk, q: xq}, EXACT)
    exp = _mm_ref(as4(xk.transpose(1, 0, 2)), as4(xq.transpose(1, 0, 2)))
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
    # a transposed (non-contiguous) activation operand
    b = new(ctx, F32, 3, 16)
    xb = randn(rng, 16, 3)
    w = new(ctx, F32, 16, 4)
    xw = randn(rng, 4, 16)
    got = run(ops.mul_mat(ctx, w, ops.transpose(ctx, b)), {w: xw, b: xb})
    np.testing.assert_allclose(got[0, 0], xb.T.astype(np.float64) @ xw.T, rtol=1e-5, atol=1e-5)


# F16 and BF16 weights: exact=True tight (rtol 1e-5) against the widened weights; default
# (activations rounded to the weight type) loosely (2e-2 of the largest output)
@pytest.mark.parametrize("wtype", [F16, BF16])
def test_mul_mat_half_weights(ctx, rng, wtype):
    a, b = new(ctx, wtype, 64, 8), new(ctx, F32, 64, 3)
    if wtype == F16:
        wv = randn(rng, 8, 64).astype(np.float16)
        feed, w32 = wv, wv.astype(np.float32)
    else:
        w32, feed = bf16_exact(rng, 8, 64)
    x = randn(rng, 3, 64)
    exp = x.astype(np.float64) @ w32.T.astype(np.float64)
    got = run(ops.mul_mat(ctx, a, b), {a: feed, b: x}, EXACT)[0, 0]
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-5)
    got = run(ops.mul_mat(ctx, a, b), {a: feed, b: x})[0, 0]
    assert np.abs(got - exp).max() <= 2e-2 * np.abs(exp).max()


QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def make_qweights(rng, name, m, k):
    """(uint8 rows [m, row_bytes], float32 dequantized [m, k]) for a quantized weight.
    Q4_0..Q8_0 from gguf.quants.quantize; K-quants (which gguf cannot quantize) from random block bytes
    with small f16 super-scales. The dequantized values always come from gguf.quants.dequantize."""
    qt = GQ[name]
    if name.endswith("_K"):
        ts = type_size(GGMLType[name])
        blocks = rng.integers(0, 256, (m, k // 256, ts), dtype=np.uint8)
        d = rng.uniform(0.002, 0.01, (m, k // 256)).astype(np.float16).view(np.uint8).reshape(m, -1, 2)
        if name == "Q6_K":
            blocks[..., 208:210] = d
        else:
            blocks[..., 0:2] = d
            blocks[..., 2:4] = d[..., ::-1] & 0x3F              # dmin: another small positive f16
        rows = blocks.reshape(m, -1)
    else:
        rows = gq.quantize(randn(rng, m, k), qt)
    return rows, gq.dequantize(rows, qt).astype(np.float32)


# GET_ROWS of quantized rows equals gguf's dequantization of those rows (rtol 1e-6)
@pytest.mark.parametrize("name", QTYPES)
def test_get_rows_quantized(ctx, rng, name):
    rows, deq = make_qweights(rng, name, 10, 256)
    a = new(ctx, GGMLType[name], 256, 10)
    ids = new(ctx, I32, 5)
    idx = np.array([3, 0, 9, 3, 7], np.int32)
    got = run(ops.get_rows(ctx, a, ids), {a: rows, ids: idx})[0, 0]
    np.testing.assert_allclose(got, deq[idx], rtol=1e-6, atol=1e-6)


# GET_ROWS of F16 and I32 rows, 3-d ids (one id matrix per a.ne[2] slice): exact
def test_get_rows_f16_i32_3d(ctx, rng):
    a, ids = new(ctx, F16, 8, 6, 2), new(ctx, I32, 3, 2)
    xa = randn(rng, 2, 6, 8).astype(np.float16)
    idx = np.array([[5, 0, 5], [1, 2, 3]], np.int32)
    got = run(ops.get_rows(ctx, a, ids), {a: xa, ids: idx})
    exp = np.stack([xa[0, idx[0]], xa[1, idx[1]]]).astype(np.float32)
    np.testing.assert_array_equal(got[0], exp)
    ai = new(ctx, I32, 4, 5)
    xi = rng.integers(-2**31, 2**31 - 1, (5, 4), dtype=np.int64).astype(np.int32)
    ids1 = new(ctx, I32, 2)
    got = run(ops.get_rows(ctx, ai, ids1), {ai: xi, ids1: np.array([4, 1], np.int32)})
    np.testing.assert_array_equal(got[0, 0], xi[[4, 1]])


# quantized MUL_MAT: exact=True tightly vs dequantized weights (rtol 1e-5 of the output scale);
# default (activations quantized to Q8_0/Q8_1/Q8_K, ggml's vec_dot order) loosely (3e-2)
@pytest.mark.parametrize("name", QTYPES)
def test_mul_mat_quantized(ctx, rng, name):
    m, k, n = 16, 512, 3
    rows, deq = make_qweights(rng, name, m, k)
    a, b = new(ctx, GGMLType[name], k, m), new(ctx, F32, k, n)
    x = randn(rng, n, k)
    exp = x.astype(np.float64) @ deq.T.astype(np.float64)
    scale = np.abs(exp).max()
    got = run(ops.mul_mat(ctx, a, b), {a: rows, b: x}, EXACT)[0, 0]
    assert np.abs(got - exp).max() <= 1e-5 * scale
    got = run(ops.mul_mat(ctx, a, b), {a: rows, b: x})[0, 0]
    assert np.abs(got - exp).max() <= 3e-2 * scale


# -- ROPE --------------------------------------------------------------------------------------------
def _rope_ref(x, pos, n_dims, neox, base=10000.0, ff=None):
    """x [n_tok, n_head, D] float64 rotation with theta_i = p * base^(-2i/n_dims) (/ ff_i)."""
    half = n_dims // 2
    theta = pos[:, None].astype(np.float64) * base ** (-2.0 * np.arange(half) / n_dims)
    if ff is not None:
        theta = theta / ff[:half]
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    y = x.astype(np.float64).copy()
    if neox:
        i0, i1 = np.arange(half), np.arange(half) + half
    else:
        i0, i1 = np.arange(0, n_dims, 2), np.arange(1, n_dims, 2)
    x0, x1 = y[..., i0].copy(), y[..., i1].copy()
    y[..., i0], y[..., i1] = x0 * c - x1 * s, x0 * s + x1 * c
    return y


# ROPE normal and NeoX, full and partial n_dims, against the direct float64 formula at small
# positions (atol 1e-5; ggml's iterated f32 theta drifts only at large positions)
@pytest.mark.parametrize("mode", [ops.ROPE_TYPE_NORM, ops.ROPE_TYPE_NEOX], ids=["norm", "neox"])
@pytest.mark.parametrize("n_dims", [32, 16])
def test_rope(ctx, rng, mode, n_dims):
    a, pos = new(ctx, F32, 32, 3, 6), new(ctx, I32, 6)
    x = randn(rng, 6, 3, 32)
    p = np.array([0, 1, 2, 5, 9, 17], np.int32)
    got = run(ops.rope_ext(ctx, a, pos, None, n_dims, mode, 4096), {a: x, pos: p})[0]
    np.testing.assert_allclose(got, _rope_ref(x, p, n_dims, mode == ops.ROPE_TYPE_NEOX), atol=1e-5)


# ROPE with frequency factors and a non-default base (atol 1e-5)
def test_rope_freq_factors(ctx, rng):
    a, pos, ff = new(ctx, F32, 16, 2, 4), new(ctx, I32, 4), new(ctx, F32, 8)
    x, p = randn(rng, 4, 2, 16), np.array([3, 1, 4, 10], np.int32)
    f = rng.uniform(1, 8, 8).astype(np.float32)
    out = ops.rope_ext(ctx, a, pos, ff, 16, ops.ROPE_TYPE_NEOX, 4096, freq_base=500000.0)
    got = run(out, {a: x, pos: p, ff: f})[0]
    np.testing.assert_allclose(got, _rope_ref(x, p, 16, True, 500000.0, f), atol=1e-5)


# -- attention ---------------------------------------------------------------------------------------
def _softmax(w):
    w = w - w.max(axis=-1, keepdims=True)
    e = np.exp(w)
    return e / e.sum(axis=-1, keepdims=True)


# SOFT_MAX ext with scale and an F16 causal mask (padded rows, broadcast over heads): rtol 1e-5
@pytest.mark.parametrize("n_kv", [8, 21])
def test_soft_max_mask_scale(ctx, rng, n_kv):
    n_q, n_head = 4, 3
    a, m = new(ctx, F32, n_kv, n_q, n_head), new(ctx, F16, n_kv, n_q + 2)
    x = randn(rng, n_head, n_q, n_kv) * 3
    mask = np.zeros((n_q + 2, n_kv), np.float16)
    for i in range(n_q + 2):
        mask[i, n_kv - n_q + i + 1:] = -np.inf
    got = run(ops.soft_max_ext(ctx, a, m, 0.3), {a: x, m: mask})[0]
    exp = _softmax(x.astype(np.float64) * np.float32(0.3) + mask[:n_q].astype(np.float64))
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-7)
    assert np.all(got[:, 0, n_kv - n_q + 1:] == 0)
    got = run(ops.soft_max_ext(ctx, a, None), {a: x})[0]
    np.testing.assert_allclose(got, _softmax(x.astype(np.float64)), rtol=1e-5, atol=1e-7)


# SOFT_MAX with ALiBi (max_bias > 0): head h adds slope_h * mask (rtol 1e-5)
def test_soft_max_alibi(ctx, rng):
    n_kv, n_q, n_head = 8, 2, 4
    a, m = new(ctx, F32, n_kv, n_q, n_head), new(ctx, F32, n_kv, n_q)
    x = randn(rng, n_head, n_q, n_kv)
    mask = -np.abs(randn(rng, n_q, n_kv))
    got = run(ops.soft_max_ext(ctx, a, m, 1.0, 8.0), {a: x, m: mask})[0]
    slopes = 2.0 ** (-8.0 * (np.arange(n_head) + 1) / n_head)      # n_head is a power of two
    exp = _softmax(x + slopes[:, None, None] * mask[None])
    np.testing.assert_allclose(got, exp, rtol=1e-5, atol=1e-7)


# FLASH_ATTN_EXT (GQA, F16 K/V, causal F16 mask) vs explicit softmax(QK^T*scale + mask) V in float64;
# atol 2e-3 because Q is rounded to f16 (K's vec_dot type) as in ggml
def test_flash_attn_ext(ctx, rng):
    D, n_q, n_head, n_kv, n_head_kv = 32, 3, 4, 10, 2
    q = new(ctx, F32, D, n_q, n_head)
    k, v = new(ctx, F16, D, n_kv, n_head_kv), new(ctx, F16, D, n_kv, n_head_kv)
    m = new(ctx, F16, n_kv, n_q)
    xq = randn(rng, n_head, n_q, D)
    xk, xv = randn(rng, n_head_kv, n_kv, D).astype(np.float16), randn(rng, n_head_kv, n_kv, D).astype(np.float16)
    mask = np.zeros((n_q, n_kv), np.float16)
    for i in range(n_q):
        mask[i, n_kv - n_q + i + 1:] = -np.inf
    scale = 1 / np.sqrt(D)
    out = ops.flash_attn_ext(ctx, q, k, v, m, scale)
    got = run(out, {q: xq, k: xk, v: xv, m: mask})[0]                  # [n_q, n_head, D]
    kk = np.repeat(xk.astype(np.float64), 2, axis=0)
    vv = np.repeat(xv.astype(np.float64), 2, axis=0)
    p = _softmax(np.einsum("hqd,hkd->hqk", xq.astype(np.float64), kk) * scale + mask.astype(np.float64))
    exp = np.einsum("hqk,hkd->hqd", p, vv).transpose(1, 0, 2)
    np.testing.assert_allclose(got, exp, atol=2e-3)


# -- copies ------------------------------------------------------------------------------------------
# SET_ROWS writes F32 rows into an F16 tensor at I64 and I32 indices; other rows are untouched
@pytest.mark.parametrize("itype", [I64, I32])
def test_set_rows_f16(ctx, rng, itype):
    a, b, c = new(ctx, F16, 8, 10, 2), new(ctx, F32, 8, 3, 2), new(ctx, itype, 3)
    xa = randn(rng, 2, 10, 8).astype(np.float16)
    xb = randn(rng, 2, 3, 8)
    idx = np.array([7, 2, 4], np.int64 if itype == I64 else np.int32)
    out = ops.set_rows(ctx, a, b, c)
    res = run(out, {a: xa, b: xb, c: idx})
    exp = xa.copy()
    exp[:, idx] = xb.astype(np.float16)                     # RNE, as ggml_cpu_fp32_to_fp16
    np.testing.assert_array_equal(res[0], exp)


# SET_ROWS with per-slice indices (c.ne[1] == b.ne[2]) into an F32 tensor
def test_set_rows_per_slice(ctx, rng):
    a, b, c = new(ctx, F32, 4, 6, 2), new(ctx, F32, 4, 2, 2), new(ctx, I64, 2, 2)
    xa, xb = randn(rng, 2, 6, 4), randn(rng, 2, 2, 4)
    idx = np.array([[0, 5], [3, 1]], np.int64)
    res = run(ops.set_rows(ctx, a, b, c), {a: xa, b: xb, c: idx})
    exp = xa.copy()
    exp[0, idx[0]] = xb[0]
    exp[1, idx[1]] = xb[1]
    np.testing.assert_array_equal(res[0], exp)


# CPY F32 -> F16 rounds to nearest even; element order is the source's logical order
def test_cpy_f32_to_f16(ctx, rng):
    a, b = new(ctx, F32, 6, 4), new(ctx, F16, 24)
    x = randn(rng, 4, 6)
    x[0, :2] = [70000.0, 1 + 2 ** -11]                      # overflow -> inf; a tie rounds to even
    got = run(ops.cpy(ctx, a, b), {a: x, b: np.zeros(24, np.float16)})
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got.reshape(-1), x.reshape(-1).astype(np.float16))
    assert np.isinf(got.reshape(-1)[0]) and got.reshape(-1)[1] == np.float16(1.0)


# CPY into a strided view (every other row of a larger tensor) writes only those rows
def test_cpy_into_strided_view(ctx, rng):
    a, big = new(ctx, F32, 5, 3), new(ctx, F32, 8, 6)
    x = randn(rng, 3, 5)
    dst = ops.view_2d(ctx, big, 5, 3, 2 * big.nb[1], 4)      # rows 0, 2, 4, columns 1..5
    g = Graph()
    out = ops.cpy(ctx, a, dst)
    g.build_forward_expand(out)
    init = randn(rng, 6, 8)
    res = ReferenceExecutor().compute(g, {a: x, big: init})
    exp = init.copy()
    exp[0:6:2, 1:6] = x
    np.testing.assert_array_equal(res[big][0, 0], exp)


# CONT of a transposed/permuted view gives the dense logical order (exact), F32 and large I32
def test_cont_noncontiguous(ctx, rng):
    a = new(ctx, F32, 5, 3, 2)
    x = randn(rng, 2, 3, 5)
    got = run(ops.cont(ctx, ops.permute(ctx, a, 2, 0, 1, 3)), {a: x})[0]
    np.testing.assert_array_equal(got, x.transpose(2, 0, 1))   # ne (3, 2, 5)
    ai = new(ctx, I32, 4, 3)
    xi = (rng.integers(1, 2**30, (3, 4)) | 1).astype(np.int32)       # odd values > 2**24: not f32-exact
    got = run(ops.cont(ctx, ops.transpose(ctx, ai)), {ai: xi})[0, 0]
    np.testing.assert_array_equal(got, xi.T)


# CPY F32 -> Q8_0 equals gguf's quantize_row_q8_0_ref bytes; a same-type quantized copy is byte-exact
def test_cpy_quantized(ctx, rng):
    a, b = new(ctx, F32, 64, 3), new(ctx, GGMLType.Q8_0, 64, 3)
    x = randn(rng, 3, 64)
    got = run(ops.cpy(ctx, a, b), {a: x, b: np.zeros((3, 68), np.uint8)})
    np.testing.assert_array_equal(got[0, 0], gq.quantize(x, GQ.Q8_0))
    rows, _ = make_qweights(rng, "Q4_K", 2, 256)
    s, d = new(ctx, GGMLType.Q4_K, 256, 2), new(ctx, GGMLType.Q4_K, 512)
    got = run(ops.cpy(ctx, s, d), {s: rows, d: np.zeros(288, np.uint8)})
    np.testing.assert_array_equal(got.reshape(-1), rows.reshape(-1))


# CONCAT along each dim equals np.concatenate (exact), including a non-contiguous operand
@pytest.mark.parametrize("dim", range(4))
def test_concat(ctx, rng, dim):
    ne_a, ne_b = [3, 2, 4, 2], [3, 2, 4, 2]
    ne_b[dim] = 5
    a, b = new(ctx, F32, *ne_a), new(ctx, F32, *ne_b)
    xa, xb = randn(rng, *ne_a[::-1]), randn(rng, *ne_b[::-1])
    got = run(ops.concat(ctx, a, b, dim), {a: xa, b: xb})
    np.testing.assert_array_equal(got, np.concatenate([xa, xb], axis=3 - dim))
    t = new(ctx, F32, 2, 3, 4, 2)                                # transposed to [3, 2, 4, 2]
    xt = randn(rng, 2, 4, 3, 2)
    if dim != 0:
        got = run(ops.concat(ctx, ops.transpose(ctx, t), a, dim) if dim != 1 else
                  ops.concat(ctx, a, ops.transpose(ctx, t), 1), {a: xa, t: xt})
        tt = xt.transpose(0, 1, 3, 2)
        exp = np.concatenate([tt, xa] if dim != 1 else [xa, tt], axis=3 - dim)
        np.testing.assert_array_equal(got, exp)


# ARGMAX: index of the first maximum of each row
def test_argmax(ctx, rng):
    a = new(ctx, F32, 37, 5)
    x = randn(rng, 5, 37)
    x[2, 4] = x[2, 30] = 10.0                                   # ties: the first wins
    got = run(ops.argmax(ctx, a), {a: x})
    np.testing.assert_array_equal(got.reshape(-1), np.argmax(x, axis=-1))
    assert got.reshape(-1)[2] == 4


# -- numerics ----------------------------------------------------------------------------------------
# vexp (ggml_v_expf) is within 2 ulp of the correctly rounded exp over the whole f32 range,
# including the subnormal results (|n| > 126 path), overflow to inf and exp(-inf) = +0
def test_vexp_ulp():
    x = np.concatenate([np.linspace(-87.3, 88.7, 200001, dtype=np.float32),
                        np.linspace(-103.0, -87.3, 4001, dtype=np.float32),
                        np.random.default_rng(0).uniform(-20, 20, 100000).astype(np.float32)])
    got = vexp(x)
    ref = np.exp(x.astype(np.float64)).astype(np.float32)
    ulp = np.abs(got.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulp.max() <= 2
    special = vexp(np.array([-np.inf, 89.0, 200.0, 0.0, -200.0], np.float32))
    assert special[0] == 0 and not np.signbit(special[0])
    assert np.isinf(special[1]) and np.isinf(special[2]) and special[3] == 1.0 and special[4] == 0


# -- CPU backend, asynchronous mode ------------------------------------------------------------------
def _tiny_graph(rng):
    ctx = Context(1 << 16, no_alloc=False)
    x, y = ctx.new_tensor(F32, (8, 2)), ctx.new_tensor(F32, (8, 2))
    out = ops.scale(ctx, ops.add(ctx, x, y), 2.0)
    xv, yv = randn(rng, 2, 8), randn(rng, 2, 8)
    array_at(x.buffer.base, x.data, x)[...] = xv
    array_at(y.buffer.base, y.data, y)[...] = yv
    g = Graph()
    g.build_forward_expand(out)
    return g, out, (xv + yv) * np.float32(2.0)


def _value(t):
    return array_at(t.buffer.base, t.data, t)[0, 0].copy()


# async graph_compute returns before the work runs; synchronize waits for it
def test_cpu_async_compute_and_synchronize(rng):
    g, out, exp = _tiny_graph(rng)
    be = CPUDevice().init_backend(async_compute=True)
    gate = threading.Event()
    be.submit(gate.wait)                                        # hold the queue
    be.graph_compute(g)
    assert np.all(_value(out) == 0)                             # not run yet
    gate.set()
    be.synchronize()
    np.testing.assert_array_equal(_value(out), exp)


# event_record on one backend, event_wait on another: the waiter's later work sees the results
def test_cpu_events_order_work_across_backends(rng):
    g, out, exp = _tiny_graph(rng)
    dev = CPUDevice()
    a, b = dev.init_backend(async_compute=True), dev.init_backend(async_compute=True)
    seen = []
    a.submit(lambda: time.sleep(0.1))                           # a is slow to get to the graph
    a.graph_compute(g)
    ev = a.event_record()
    b.event_wait(ev)
    b.submit(lambda: seen.append(_value(out)))
    b.synchronize()
    assert ev.is_set()
    np.testing.assert_array_equal(seen[0], exp)
    a.synchronize()


# a kernel error in the worker is re-raised by synchronize; synchronous mode computes at once
def test_cpu_async_error_and_sync_mode(rng):
    g, out, exp = _tiny_graph(rng)
    be = CPUDevice().init_backend(async_compute=True)
    be.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        be.synchronize()
    be.synchronize()                                            # the error is reported once
    sync = CPUDevice().init_backend()
    sync.graph_compute(g)
    np.testing.assert_array_equal(_value(out), exp)


# ROPE at large positions follows ggml's iterated f32 theta (t_{i+1} = f32(t_i * powf(base, -2/n))),
# emulated here with a scalar f32 loop; atol 2e-6 (the direct formula is ~1e-3 away at p = 30000)
def test_rope_iterated_theta_large_positions(ctx, rng):
    n_dims = 96
    a, pos = new(ctx, F32, n_dims, 1, 3), new(ctx, I32, 3)
    x = randn(rng, 3, 1, n_dims)
    p = np.array([1000, 4000, 30000], np.int32)
    got = run(ops.rope_ext(ctx, a, pos, None, n_dims, ops.ROPE_TYPE_NORM, 4096), {a: x, pos: p})[0]
    f32 = np.float32
    theta_scale = f32(np.float64(10000.0) ** np.float64(f32(-2.0) / f32(n_dims)))
    exp = np.empty_like(x)
    for j, pj in enumerate(p):
        t = f32(pj)
        for i in range(n_dims // 2):
            c, s = f32(np.cos(np.float64(t))), f32(np.sin(np.float64(t)))
            x0, x1 = x[j, 0, 2 * i], x[j, 0, 2 * i + 1]
            exp[j, 0, 2 * i], exp[j, 0, 2 * i + 1] = f32(x0 * c) - f32(x1 * s), f32(x0 * s) + f32(x1 * c)
            t = f32(t * theta_scale)
    np.testing.assert_allclose(got, exp, atol=2e-6)
    direct = _rope_ref(x, p, n_dims, False)
    assert np.abs(direct - exp).max() > 1e-4


# MUL_MAT with weights broadcast over dim 2 (GQA: r2 query heads per KV head) stacks the r2 slices into
# one quants.mul_mat call; the bits equal per-slice calls (ggml's per-slice order: F16 vec_dot for
# ne11 == 1, tinyBLAS for ne11 >= 2; quantized weights), for ne11 in {1, 2, 5}
@pytest.mark.parametrize("wtype", [F16, F32, GGMLType.Q4_1, GGMLType.Q8_0])
@pytest.mark.parametrize("n11", [1, 2, 5])
def test_mul_mat_broadcast_stacked_bits(ctx, rng, wtype, n11):
    from ggml_dist.backends.cpu import quants as Q
    K, M, A2, r2 = 64, 12, 2, 3
    wf = randn(rng, 1, A2, M, K)
    if wtype == F16:
        feed = wf.astype(np.float16)
    elif wtype == F32:
        feed = wf
    else:
        feed = Q.quantize(wtype, wf.reshape(-1, K)).reshape(1, A2, M, -1)
    x = randn(rng, 1, A2 * r2, n11, K)
    a, b = new(ctx, wtype, K, M, A2, 1), new(ctx, F32, K, n11, A2 * r2, 1)
    got = run(ops.mul_mat(ctx, a, b), {a: feed, b: x})
    for i2 in range(A2 * r2):
        wm = feed[0, i2 // r2]
        if wtype == F16:
            wm = wm.view(np.uint8)
        exp = Q.mul_mat(wtype, wm, x[0, i2])
        assert np.array_equal(got[0, i2], exp), (wtype, n11, i2)

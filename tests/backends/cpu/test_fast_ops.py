"""The numba fast paths of ops.py (backends/cpu/fkernels.py) give the numpy kernels' bits exactly.

Each test runs an op with ComputeOptions.numba on (fkernels) and off (the numpy reference) and compares
the results bit for bit (uint32 views, so NaN payloads and signed zeros count), on awkward shapes: lengths
not a multiple of 8 or 32, -inf masks and fully masked rows, strided and permuted views, dst aliasing src0
as gallocr's in-place reuse allows, and KV-cache style views with padded empty cells.
"""
from dataclasses import replace

import numpy as np
import pytest

from ggml_dist.backends.cpu import ops as cpu_ops
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.cpu import fkernels as fk
from ggml_dist.backends.cpu.ops import KERNELS, ComputeOptions
from ggml_dist.backends.base import tensor_array
from ggml_dist.backends.cpu.backend import compute_graph
from ggml_dist.backends.cpu.reference import _HOST, ReferenceExecutor, _all_tensors
from ggml_dist.core.tensor import nbytes
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import GLUOp
from ggml_dist.core.types import GGMLType

F32, F16, I32, I64 = GGMLType.F32, GGMLType.F16, GGMLType.I32, GGMLType.I64


@pytest.fixture
def ctx():
    return Context(1 << 24)


@pytest.fixture
def rng():
    return np.random.default_rng(77)


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 2: np.uint16, 8: np.uint64}[a.dtype.itemsize])


def assert_same_bits(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert np.array_equal(bits(got), bits(ref)), f"{np.sum(bits(got) != bits(ref))} elements differ"


def run_both(out, inputs, opts=ComputeOptions()):
    """out's value with the numba kernels and with the numpy ones; asserts equal bits, returns it."""
    g = Graph()
    g.build_forward_expand(out)
    res = {}
    for use in (True, False):
        res[use] = ReferenceExecutor(replace(opts, numba=use)).compute(g, inputs)[out]
    assert_same_bits(res[True], res[False])
    return res[True]


def kernel_both(t, make_args):
    """Call t's kernel directly on the arrays make_args() returns ((dst, srcs); dst may be srcs[0], the
    in-place case) with numba on and off; asserts equal bits of dst."""
    outs = []
    for use in (True, False):
        dst, srcs = make_args()
        KERNELS[t.op](t, dst, srcs, ComputeOptions(numba=use))
        outs.append(dst.copy())
    assert_same_bits(outs[0], outs[1])
    return outs[0]


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# -- scalar helpers ----------------------------------------------------------------------------------
# f16_bits is numpy's astype(float16) (RNE, overflow, subnormals, NaN payloads); f16_value is exact
def test_f16_conversions():
    from numba import njit

    @njit
    def enc(x, out):
        for i in range(x.size):
            out[i] = fk.f16_bits(x[i])

    @njit
    def dec(h, out):
        for i in range(h.size):
            out[i] = fk.f16_value(h[i])

    rng = np.random.default_rng(3)
    x = np.concatenate([rng.integers(0, 2 ** 32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        (rng.standard_normal(200_000) * 1e-5).astype(np.float32),
                        np.array([65504, 65519.99, 65520, 1e9, -np.inf, np.nan, 2 ** -24, 2 ** -25, 3 * 2 ** -26,
                                  0.0, -0.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11], np.float32),
                        np.array([0x7F800001, 0x7FA00000, 0xFFC00001], np.uint32).view(np.float32)])
    h = np.empty(x.size, np.uint16)
    enc(x, h)
    with np.errstate(over="ignore"):
        assert np.array_equal(h, x.astype(np.float16).view(np.uint16))
    allh = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    v = np.empty(65536, np.float64)
    dec(allh, v)
    ref = allh.view(np.float16).astype(np.float64)
    finite = np.isfinite(ref)
    assert np.array_equal(v[finite].view(np.uint64), ref[finite].view(np.uint64))
    assert np.array_equal(np.isnan(v), np.isnan(ref)) and np.array_equal(v[np.isinf(ref)], ref[np.isinf(ref)])


# vexp (scalar numba) gives numerics.vexp's bits, incl. nan, inf and the |n| > 126 branches
def test_vexp_scalar_bits():
    from numba import njit

    from ggml_dist.backends.cpu import numerics as nm

    @njit
    def run(x, out):
        for i in range(x.size):
            out[i] = fk.vexp(x[i])

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.integers(0, 2 ** 32, 300_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        rng.uniform(-200, 200, 200_000).astype(np.float32),
                        np.array([np.inf, -np.inf, np.nan, 0, -0.0, 88.7, 88.8, -87.3, -103, -104, 126.5,
                                  -126.5, 192.5, -192.5], np.float32)])
    got = np.empty_like(x)
    run(x, got)
    with np.errstate(all="ignore"):
        assert_same_bits(got, nm.vexp(x))


# -- element-wise and norms --------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [ops.add, ops.mul])
def test_binary_f32(ctx, rng, monkeypatch, fn):
    a, b, c = ctx.new_tensor(F32, (37, 5, 3)), ctx.new_tensor(F32, (37,)), ctx.new_tensor(F32, (37, 1, 3))
    xa, xb, xc = randn(rng, 3, 5, 37), randn(rng, 37), randn(rng, 3, 1, 37)
    run_both(fn(ctx, a, b), {a: xa, b: xb})
    run_both(fn(ctx, a, c), {a: xa, c: xc})
    t = fn(ctx, a, a)
    got = kernel_both(t, lambda: (lambda x: (x, [x, x]))(xa.reshape(1, 3, 5, 37).copy()))
    assert_same_bits(got[0], (xa + xa if fn is ops.add else xa * xa))


@pytest.mark.parametrize("ne0", [1, 7, 64, 576, 1001])
def test_rms_norm_bits(ctx, rng, monkeypatch, ne0):
    a = ctx.new_tensor(F32, (ne0, 4, 3))
    x = randn(rng, 3, 4, ne0, scale=3.0)
    x[0, 0, :] = 0.0                                          # zero row: scale = 1/sqrt(eps)
    x[1, 2, :] *= 1e-20
    run_both(ops.rms_norm(ctx, a, 1e-5), {a: x})
    v = ops.view_2d(ctx, ops.reshape(ctx, a, ne0, 12), max(ne0 - 3, 1), 6, 2 * a.nb[1], 0)   # strided rows
    run_both(ops.rms_norm(ctx, v, 1e-6), {a: x})
    t = ops.rms_norm(ctx, a, 1e-5)
    kernel_both(t, lambda: (lambda y: (y, [y]))(x.reshape(1, 3, 4, ne0).copy()))   # in place


@pytest.mark.parametrize("n", [8, 24, 1536, 13])
@pytest.mark.parametrize("split", [False, True])
def test_swiglu_bits(ctx, rng, monkeypatch, n, split):
    x = randn(rng, 3, 2 * n, scale=4.0)
    x[0, :4] = [-100, 100, 0, -0.0]
    if split:
        g, u = ctx.new_tensor(F32, (n, 3)), ctx.new_tensor(F32, (n, 3))
        run_both(ops.swiglu(ctx, g, u), {g: x[:, :n].copy(), u: x[:, n:].copy()})
    else:
        a = ctx.new_tensor(F32, (2 * n, 3))
        run_both(ops.swiglu(ctx, a), {a: x})
        run_both(ops.glu(ctx, a, None, GLUOp.SWIGLU, swapped=True), {a: x})


# -- softmax -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_kv", [8, 256, 21])
@pytest.mark.parametrize("max_bias", [0.0, 8.0])
def test_soft_max_bits(ctx, rng, monkeypatch, n_kv, max_bias):
    n_q, n_head = 5, 4
    a, m = ctx.new_tensor(F32, (n_kv, n_q, n_head)), ctx.new_tensor(F32, (n_kv, n_q + 3))
    x = randn(rng, n_head, n_q, n_kv, scale=6.0)
    mask = np.zeros((n_q + 3, n_kv), np.float32)
    for i in range(n_q + 3):
        mask[i, n_kv // 2 + i:] = -np.inf                      # causal-ish, padded cells masked
    mask[1, :] = -np.inf                                      # a fully masked row (NaN output)
    x[0, 3, -1] = np.inf                      # past row 3's last unmasked chunk: the whole row is run
    if max_bias:
        mask[2, :3] = -np.abs(randn(rng, 3))
    with np.errstate(all="ignore"):
        got = run_both(ops.soft_max_ext(ctx, a, m, 0.125, max_bias), {a: x, m: mask})
        run_both(ops.soft_max_ext(ctx, a, None, 0.3), {a: x})
        t = ops.soft_max_ext(ctx, a, m, 0.125, max_bias)
        kernel_both(t, lambda: (lambda y: (y, [y, mask.reshape(1, 1, n_q + 3, n_kv)]))(
            x.reshape(1, n_head, n_q, n_kv).copy()))          # in place
    assert np.all(np.isnan(got[0, :, 1]))


@pytest.mark.parametrize("max_bias", [0.0, 8.0])
def test_soft_max_sparse_rows_bits(ctx, rng, monkeypatch, max_bias):
    """Rows whose mask hides most cells (sequences interleaved in a shared cache) take the sparse path:
    same bits, also with inf/NaN scores (masked or not), a +inf or NaN mask entry and an in-place dst."""
    n_kv, n_q, n_head = 256, 8, 3
    a, m = ctx.new_tensor(F32, (n_kv, n_q, n_head)), ctx.new_tensor(F32, (n_kv, n_q))
    x = randn(rng, n_head, n_q, n_kv, scale=6.0)
    mask = np.full((n_q, n_kv), -np.inf, np.float32)
    for i in range(n_q):
        mask[i, i % 16::16] = 0                                # 1 cell in 16 (sparse: under 1 in 8)
    mask[3, 3] = -2.0
    x[0, 1, 0] = np.inf                                       # masked cell, non-finite score: dense path
    x[1, 2, 2] = np.nan                                       # unmasked NaN
    mask[4, 4] = np.nan
    mask[5, 5] = np.inf
    out = ops.soft_max_ext(ctx, a, m, 0.125, max_bias)
    g = Graph()
    g.build_forward_expand(out)
    res = []
    with np.errstate(all="ignore"):
        for use in (True, False):
            res.append(ReferenceExecutor(ComputeOptions(numba=use)).compute(g, {a: x, m: mask})[out])
    nan = np.isnan(res[1])                    # NaN rows: the same NaNs (payloads may differ)
    assert np.array_equal(np.isnan(res[0]), nan) and nan[0, 0, 1].all() and nan[0, 1, 2].all()
    assert_same_bits(np.where(nan, 0, res[0]), np.where(nan, 0, res[1]))
    xf, mf = np.nan_to_num(x, posinf=9.0), mask.copy()        # in place (dst = x), finite scores
    mf[4, 4] = mf[5, 5] = 0
    kernel_both(out, lambda: (lambda y: (y, [y, mf.reshape(1, 1, n_q, n_kv)]))(
        xf.reshape(1, n_head, n_q, n_kv).copy()))


# -- rope --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [ops.ROPE_TYPE_NORM, ops.ROPE_TYPE_NEOX])
@pytest.mark.parametrize("n_dims", [64, 48])
@pytest.mark.parametrize("with_ff", [False, True], ids=["", "freq_factors"])
def test_rope_bits(ctx, rng, monkeypatch, mode, n_dims, with_ff):
    a, pos = ctx.new_tensor(F32, (64, 3, 7)), ctx.new_tensor(I32, (7,))
    x = randn(rng, 7, 3, 64, scale=2.0)
    p = np.array([0, 1, 5, 31, 700, 4000, 30000], np.int32)
    ff_t = ctx.new_tensor(F32, (n_dims // 2,)) if with_ff else None     # llama3 rope scaling's divisors
    f = rng.uniform(1, 8, n_dims // 2).astype(np.float32)
    out = ops.rope_ext(ctx, a, pos, ff_t, n_dims, mode, 4096, freq_base=500000.0)
    run_both(out, {a: x, pos: p} | ({ff_t: f} if with_ff else {}))
    srcs = (lambda y: [y, p, f] if with_ff else [y, p])
    kernel_both(out, lambda: (lambda y: (y, srcs(y)))(x.reshape(1, 7, 3, 64).copy()))  # in place


# -- set_rows ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F16, F32])
@pytest.mark.parametrize("itype", [I64, I32])
def test_set_rows_bits(ctx, rng, monkeypatch, dtype, itype):
    a, b, c = ctx.new_tensor(dtype, (13, 10, 2)), ctx.new_tensor(F32, (13, 4, 2)), ctx.new_tensor(itype, (4,))
    xa = randn(rng, 2, 10, 13).astype(np.float16 if dtype == F16 else np.float32)
    xb = randn(rng, 2, 4, 13)
    xb[0, 0, :6] = [7e4, -1e9, 2 ** -25, 3 * 2 ** -26, np.nan, -np.inf]
    idx = np.array([7, 2, 7, 0], np.int64 if itype == I64 else np.int32)      # a repeated index: last wins
    with np.errstate(all="ignore"):
        run_both(ops.set_rows(ctx, a, b, c), {a: xa, b: xb, c: idx})
    # the V cache's shape: rows of one element at idx j * kv_size + cell
    v, vb, vc = ctx.new_tensor(F16, (1, 6 * 16)), ctx.new_tensor(F32, (1, 6)), ctx.new_tensor(I64, (6,))
    run_both(ops.set_rows(ctx, v, vb, vc),
             {v: np.zeros((96, 1), np.float16), vb: randn(rng, 6, 1), vc: np.arange(6) * 16 + 3})


@pytest.mark.parametrize("ne0", [1, 3, 64])
def test_set_rows_split_across_threads_same_bits(ctx, rng, monkeypatch, ne0):
    """From _SET_ROWS_PARALLEL rows set_rows splits by destination row across threads (a batch's
    transposed V writes): repeated indices still keep the last row, as on one thread and in numpy."""
    n_rows, nr = 300, fk._SET_ROWS_PARALLEL + 37
    idx = rng.integers(0, n_rows, nr)                       # many repeats
    a, b, c = ctx.new_tensor(F16, (ne0, n_rows)), ctx.new_tensor(F32, (ne0, nr)), ctx.new_tensor(I64, (nr,))
    inputs = {a: np.zeros((n_rows, ne0), np.float16), b: randn(rng, nr, ne0), c: idx}
    before = kt.get_threads()
    try:
        for n in (1, 2):
            kt.set_threads(n)
            res = run_both(ops.set_rows(ctx, a, b, c), inputs)
            last = {r: j for j, r in enumerate(idx)}
            want = np.asarray(inputs[b])[list(last.values())].astype(np.float16)
            assert_same_bits(res.reshape(n_rows, ne0)[list(last.keys())], want)
    finally:
        kt.set_threads(before)


# -- mul_mat -----------------------------------------------------------------------------------------
def _mm_per_slice(wtype, w, x, n11, use_numba):
    """weights_mul_mat per slice with vec_n = n11 (quants.mul_mat, or qkernels' twin), the reference the
    fast kernel must equal."""
    opts = ComputeOptions(numba=use_numba)
    A3, A2 = w.shape[:2]
    B3, B2 = x.shape[:2]
    out = np.empty(x.shape[:3] + (w.shape[2],), np.float32)
    for i3 in range(B3):
        for i2 in range(B2):
            wm = w[i3 // (B3 // A3), i2 // (B2 // A2)]
            if wtype == F16:
                wm = np.ascontiguousarray(wm).view(np.uint8)
            out[i3, i2] = cpu_ops.weights_mul_mat(wtype, wm, np.ascontiguousarray(x[i3, i2]), opts, vec_n=n11)
    return out


@pytest.mark.parametrize("wtype", [F16, F32])
@pytest.mark.parametrize("K,M,n11", [(64, 256, 1), (64, 256, 5), (256, 64, 1), (256, 64, 3), (40, 12, 1),
                                     (40, 12, 2), (7, 13, 1), (7, 13, 4), (96, 13, 2), (33, 8, 1), (0, 4, 2),
                                     (64, 20, 16), (72, 13, 17)])       # n11 >= 16: F16's blocked kernel
def test_mul_mat_float_bits(rng, monkeypatch, wtype, K, M, n11):
    """fkernels.mul_mat over all slices (GQA r2 = 3, r3 = 2) == quants.mul_mat per slice, numba and numpy."""
    w = randn(rng, 1, 2, M, K, scale=0.5)
    x = randn(rng, 2, 6, n11, K)
    if K:
        x[0, 0, 0, 0] = 1e-6                                  # f16 subnormal after rounding
        w[0, 0, 0, -1] = 3e-7
    wv = w.astype(np.float16) if wtype == F16 else w
    dst = np.empty((2, 6, n11, M), np.float32)
    fk.mul_mat(wv.view(np.uint16) if wtype == F16 else wv, x, dst, n11 >= 2 and K % 8 == 0 and M % 4 == 0,
               wtype == F16)
    for use in (True, False):
        assert_same_bits(dst, _mm_per_slice(wtype, wv, x, n11, use))


@pytest.mark.parametrize("r2,K", [(2, 64), (4, 64), (5, 96), (8, 40)])
def test_mul_mat_f16_query_head_groups(rng, monkeypatch, r2, K):
    """One query row per head: the heads of one KV head go through _vdot32xG in groups of up to 4
    (r2 = 5: 4 + 1; 8: 4 + 4); same bits as quants.mul_mat per slice."""
    w = randn(rng, 1, 2, 37, K, scale=0.5).astype(np.float16)
    x = randn(rng, 2, 2 * r2, 1, K)
    dst = np.empty((2, 2 * r2, 1, 37), np.float32)
    fk.mul_mat(w.view(np.uint16), x, dst, False, True)
    assert_same_bits(dst, _mm_per_slice(F16, w, x, 1, True))


@pytest.mark.parametrize("n11", [1, 3, 20])
@pytest.mark.parametrize("a2,b3", [(2, 2), (1, 1)])
def test_mul_mat_float_threads_same_bits(rng, n11, a2, b3):
    """mul_mat_threads splits F16 products across threads by runs of KV heads, or by query head where
    there are fewer KV heads than threads (a2 = b3 = 1: one stream of an MQA model): same bits as one
    thread."""
    w = randn(rng, 1, a2, 256, 64, scale=0.5).astype(np.float16).view(np.uint16)
    x = randn(rng, b3, 6, n11, 64)
    one, two = (np.empty((b3, 6, n11, 256), np.float32) for _ in range(2))
    tiny = n11 >= 2
    before = kt.get_threads()
    try:
        kt.set_threads(1)
        fk.mul_mat_threads(w, x, one, tiny, True)
        kt.set_threads(2)
        fk.mul_mat_threads(w, x, two, tiny, True)
    finally:
        kt.set_threads(before)
    assert_same_bits(one, two)
    fk.mul_mat(w, x, one, tiny, True)
    assert_same_bits(one, two)


# the attention products on KV-cache views: K [head_dim, n_kv, n_head_kv] rows of the cache, V^T rows of
# kv_size cells, Q permuted; n_kv padded over empty (zero) cells masked to -inf
@pytest.mark.parametrize("n_tok", [1, 4])
def test_attention_products_bits(ctx, monkeypatch, rng, n_tok):
    d, n_head, n_head_kv, kv_size, n_kv = 64, 6, 2, 512, 256
    kc = ctx.new_tensor(F16, (d * n_head_kv, kv_size))
    vc = ctx.new_tensor(F16, (kv_size, d * n_head_kv))                    # V^T: rows of kv_size cells
    q = ctx.new_tensor(F32, (d, n_head, n_tok))
    m = ctx.new_tensor(F32, (n_kv, n_tok))
    k = ops.view_3d(ctx, kc, d, n_kv, n_head_kv, kc.nb[1], d * 2, 0)
    v = ops.view_3d(ctx, vc, n_kv, d, n_head_kv, vc.nb[1], vc.nb[1] * d, 0)
    kq = ops.mul_mat(ctx, k, ops.permute(ctx, q, 0, 2, 1, 3))
    kq = ops.soft_max_ext(ctx, kq, m, 0.125, 0.0)
    kqv = ops.mul_mat(ctx, v, kq)
    out = ops.cont(ctx, ops.permute(ctx, kqv, 0, 2, 1, 3), (d * n_head, n_tok))
    used = 37
    xk = np.zeros((kv_size, d * n_head_kv), np.float16)
    xk[:used] = randn(rng, used, d * n_head_kv)
    xv = np.zeros((d * n_head_kv, kv_size), np.float16)
    xv[:, :used] = randn(rng, d * n_head_kv, used)
    mask = np.full((n_tok, n_kv), -np.inf, np.float32)
    mask[:, :used - n_tok + 1] = 0
    for i in range(n_tok):
        mask[i, used - n_tok + 1:used - n_tok + 1 + i] = 0
    run_both(out, {kc: xk, vc: xv, q: randn(rng, n_tok, n_head, d), m: mask})


def _bound_run(g, out, inputs):
    """Run g through the CPU backend's bound replay (cpu.compute_graph), every tensor in its own buffer."""
    tensors = _all_tensors(g)
    for t in tensors:
        if t.view_src is None:
            t.buffer, t.data = _HOST.alloc_buffer(max(nbytes(t), 1)), 0
    for t in tensors:
        if t.view_src is not None:
            t.buffer, t.data = t.view_src.buffer, t.view_src.data + t.view_offs
    for t, v in inputs.items():
        t.buffer.set_tensor(t, v)
    compute_graph(g)
    return tensor_array(out).copy()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n_tok,d", [(1, 64), (3, 64), (8, 64), (1, 80)])
def test_attention_chain_skips_masked_cells_exactly(ctx, monkeypatch, rng, n_tok, d, fused):
    """Bound into a graph, KQ skips the cells the soft_max masks and KQV the all-zero probability steps
    (fkernels.SKIP_KQ/KQV); the chain's bits equal the numpy kernels'. Two sequences' cells interleave,
    as in a server's shared cache, and the cache is zero past the used cells. d = 80: K's rows end
    in a partial 32-lane step (summed in double) after the compacted live cells. fused: the chain as
    one call (fusion.py, which always skips), else its products bound one by one."""
    n_head, n_head_kv, kv_size, n_kv, used = 6, 2, 512, 512, 301
    kc = ctx.new_tensor(F16, (d * n_head_kv, kv_size))
    vc = ctx.new_tensor(F16, (kv_size, d * n_head_kv))
    q = ctx.new_tensor(F32, (d, n_head, n_tok))
    m = ctx.new_tensor(F32, (n_kv, n_tok))
    k = ops.view_3d(ctx, kc, d, n_kv, n_head_kv, kc.nb[1], d * 2, 0)
    v = ops.view_3d(ctx, vc, n_kv, d, n_head_kv, vc.nb[1], vc.nb[1] * d, 0)
    kq = ops.soft_max_ext(ctx, ops.mul_mat(ctx, k, ops.permute(ctx, q, 0, 2, 1, 3)), m, 0.125, 0.0)
    out = ops.cont(ctx, ops.permute(ctx, ops.mul_mat(ctx, v, kq), 0, 2, 1, 3), (d * n_head, n_tok))
    xk = np.zeros((kv_size, d * n_head_kv), np.float16)
    xk[:used] = randn(rng, used, d * n_head_kv)
    xv = np.zeros((d * n_head_kv, kv_size), np.float16)
    xv[:, :used] = randn(rng, d * n_head_kv, used)
    mask = np.full((n_tok, n_kv), -np.inf, np.float32)
    for i in range(n_tok):                       # sequence 0 owns the even cells, up to its position
        mask[i, 0:used - n_tok + 1 + i:2] = 0
    inputs = {kc: xk, vc: xv, q: randn(rng, n_tok, n_head, d), m: mask}
    g = Graph()
    g.build_forward_expand(out)
    want = ReferenceExecutor(ComputeOptions(numba=False)).compute(g, inputs)[out]
    skips = []
    if fused:
        real = fk.bind_attention
        monkeypatch.setattr(fk, "bind_attention", lambda *a: skips.append("chain") or real(*a))
    else:
        from ggml_dist.backends.cpu import fusion
        monkeypatch.setattr(fusion, "_attention", lambda *a: None)
        real = fk.bind_mul_mat
        monkeypatch.setattr(fk, "bind_mul_mat", lambda *a: skips.append(a[6]) or real(*a))
    assert_same_bits(_bound_run(g, out, inputs), want)
    assert sorted(skips) == (["chain"] if fused else [fk.SKIP_KQ, fk.SKIP_KQV])


# exact=True keeps the numpy float32 path (no fast kernel)
def test_mul_mat_exact_keeps_numpy(ctx, rng, monkeypatch):
    a, b = ctx.new_tensor(F16, (64, 8, 2)), ctx.new_tensor(F32, (64, 3, 4))
    got = run_both(ops.mul_mat(ctx, a, b),
                   {a: randn(rng, 2, 8, 64).astype(np.float16), b: randn(rng, 4, 3, 64)},
                   ComputeOptions(exact=True))
    assert got.shape == (1, 4, 3, 8)


def test_fast_path_is_taken():
    assert cpu_ops._fk(ComputeOptions(numba=True)) is fk
    assert cpu_ops._fk(ComputeOptions(numba=False)) is None


# -- row ops split across threads ------------------------------------------------------------------------
@pytest.mark.parametrize("n_chunks", [2, 3, 7])
def test_row_ops_split_across_threads_same_bits(rng, n_chunks):
    """soft_max, swiglu, rope and the norms split by rows (fkernels._rows_threads): every split gives the one-thread
    bits, with rows of one KV stream's mask, in-place soft_max included."""
    x = randn(rng, 8, 9, 1, 256, scale=4.0)
    mask = np.full((8, 1, 1, 256), -np.inf, np.float32)
    for s in range(8):
        mask[s, ..., :20 + 30 * s] = 0                           # a dense, a truncated and a sparse row
    sl = np.ones(9, np.float32)
    one, par = np.empty_like(x), np.empty_like(x)
    fk._soft_max_serial(x, np.float32(0.125), mask, sl, True, one)
    fk._soft_max_par(x, np.float32(0.125), mask, sl, True, par, n_chunks)
    assert_same_bits(one, par)
    y = x.copy()
    fk._soft_max_par(y, np.float32(0.125), mask, sl, True, y, n_chunks)
    assert_same_bits(one, y)
    g, u = randn(rng, 1, 2, 8, 1536), randn(rng, 1, 2, 8, 1536)
    one, par = np.empty_like(g), np.empty_like(g)
    fk._swiglu_serial(g, u, one)
    fk._swiglu_par(g, u, par, n_chunks)
    assert_same_bits(one, par)
    q = randn(rng, 1, 8, 9, 64)
    cos, sin = (rng.random((8, 32)).astype(np.float32) for _ in range(2))
    one, par = np.empty_like(q), np.empty_like(q)
    fk._rope_serial(q, cos, sin, 64, True, one)
    fk._rope_par(q, cos, sin, 64, True, par, n_chunks)
    assert_same_bits(one, par)
    x, r, w = randn(rng, 1, 3, 5, 640, scale=3.0), randn(rng, 1, 3, 5, 640), randn(rng, 1, 1, 1, 640)
    for fused in (False, True):
        one, par = np.empty_like(x), np.empty_like(x)
        fk.rms_norm(x, np.float32(1e-6), w, fused, one)
        fk._rms_norm_par(x, np.float32(1e-6), w, fused, par, n_chunks)
        assert_same_bits(one, par)
    s_one, s_par, one, par = (np.empty_like(x) for _ in range(4))
    fk.add_rms_norm(x, r, s_one, np.float32(1e-6), w, one)
    fk._add_rms_norm_par(x, r, s_par, np.float32(1e-6), w, par, n_chunks)
    assert_same_bits(one, par)
    assert_same_bits(s_one, s_par)
    fk._add_rms_norm_par(x, r, x, np.float32(1e-6), w, par, n_chunks)       # the sum over its input
    assert_same_bits(one, par)
    assert_same_bits(s_one, x)


# -- the bound replay's binders (cpu_ops._BINDERS) ---------------------------------------------------
def _one_op(ctx, rng, name):
    """(node, inputs) of one op in the shapes a decode step gives it."""
    x, y = ctx.new_tensor(F32, (64, 5, 3)), ctx.new_tensor(F32, (64, 1, 1))
    xv, yv = randn(rng, 3, 5, 64), randn(rng, 1, 1, 64)
    if name in ("add", "mul"):
        return (ops.add if name == "add" else ops.mul)(ctx, x, y), {x: xv, y: yv}
    if name == "rms_norm":
        return ops.rms_norm(ctx, x, 1e-5), {x: xv}
    if name == "swiglu":
        u = ctx.new_tensor(F32, (64, 5, 3))
        return ops.swiglu(ctx, x, u), {x: xv, u: randn(rng, 3, 5, 64)}
    if name == "soft_max":
        m = ctx.new_tensor(F32, (64, 5))
        mask = np.where(rng.random((5, 64)) < 0.3, -np.inf, 0).astype(np.float32)
        return ops.soft_max_ext(ctx, x, m, 0.125, 0.0), {x: xv, m: mask}
    if name == "set_rows":
        cache, idx = ctx.new_tensor(F16, (64, 10)), ctx.new_tensor(I64, (5,))
        b = ctx.new_tensor(F32, (64, 5))
        return ops.set_rows(ctx, cache, b, idx), {cache: np.zeros((10, 64), np.float16),
                                                   b: randn(rng, 5, 64), idx: np.array([3, 0, 9, 4, 1])}
    if name == "rope":
        pos = ctx.new_tensor(I32, (3,))
        out = ops.rope_ext(ctx, x, pos, None, 64, ops.ROPE_TYPE_NEOX, 4096, freq_base=10000.0)
        return out, {x: xv, pos: np.array([7, 8, 9], np.int32)}
    if name == "geglu":
        u = ctx.new_tensor(F32, (64, 5, 3))
        xg = randn(rng, 3, 5, 64, scale=6.0)
        xg[0, 0, :4] = [-10.0, 10.0, -9.999, np.nan]
        return ops.glu(ctx, x, u, GLUOp.GEGLU), {x: xg, u: randn(rng, 3, 5, 64)}
    if name == "scale":
        return ops.scale(ctx, x, 0.125), {x: xv}
    if name == "get_rows":
        from ggml_dist.backends.cpu import quants
        table, idx = ctx.new_tensor(GGMLType.Q8_0, (64, 10)), ctx.new_tensor(I32, (3,))
        return ops.get_rows(ctx, table, idx), {table: quants.quantize(GGMLType.Q8_0, randn(rng, 10, 64)),
                                               idx: np.array([7, 0, 7], np.int32)}
    assert name == "cont"
    return ops.cont(ctx, ops.permute(ctx, x, 0, 2, 1, 3)), {x: xv}


@pytest.mark.parametrize("name", ["add", "mul", "rms_norm", "swiglu", "soft_max", "set_rows", "rope", "cont",
                                  "get_rows", "geglu", "scale"])
def test_binders_take_their_path_with_the_reference_bits(ctx, rng, name):
    out, inputs = _one_op(ctx, rng, name)
    g = Graph()
    g.build_forward_expand(out)
    want = ReferenceExecutor(ComputeOptions(numba=False)).compute(g, inputs)[out]
    assert_same_bits(_bound_run(g, out, inputs), want)
    srcs = [tensor_array(s) if s is not None else None for s in out.src]
    binding = cpu_ops.Binding(cpu_ops.resolve(ComputeOptions()))
    assert cpu_ops._BINDERS[out.op](out, tensor_array(out), srcs, binding) is not None, "the binder declined"


@pytest.mark.parametrize("ext_factor,freq_scale,ff", [(0.0, 1.0, False), (1.0, 0.25, False), (0.0, 1.0, True),
                                                     (0.5, 0.125, True)])
def test_rope_cache_compiled_cos_sin_are_libm_s(rng, ext_factor, freq_scale, ff):
    """rope_cache through fkernels.rope_cache (one compiled call: the theta product, frequency factors,
    YaRN's ramp, numba's math.cos of a float32 = libm's cosf) equals the numpy reference with the ctypes
    libm calls bit for bit, positions far and near, YaRN and frequency factors included."""
    from ggml_dist.backends.cpu import rope
    if not fk.LIBM_COS_SIN or rope._COSF is None:
        pytest.skip("numba takes SVML's cos/sin here, or no libm loads")
    pos = np.concatenate([np.arange(0, 40), rng.integers(0, 1 << 17, 200)]).astype(np.int32)
    factors = rng.uniform(1, 40, 64).astype(np.float32) if ff else None
    args = (pos, 128, 500000.0, freq_scale, ext_factor, 1.0 + ext_factor / 3, (3.0, 40.7), factors)
    for a, b in zip(rope.rope_cache(*args), rope.rope_cache(*args, fk=fk)):
        assert_same_bits(b, a)


@pytest.mark.parametrize("contiguous", [True, False])
def test_row_ops_take_their_contiguous_arrays_as_one_block(rng, contiguous):
    """bind_add_rms_norm and bind_swiglu pass C-contiguous arrays as one entry.shape_block (the
    kernel rebuilds them as C arrays), other layouts as arrays; the bits are the kernels' either way."""
    n, width = 3, 64
    full = randn(rng, 1, 1, n, 2 * width)
    x = full[..., :width] if not contiguous else np.ascontiguousarray(full[..., :width])
    r, w = randn(rng, 1, 1, n, width), randn(rng, 1, 1, 1, width)
    s, got = np.empty_like(r), np.empty_like(r)
    call = fk.bind_add_rms_norm(x, r, s, np.float32(1e-6), w, got)
    assert (getattr(call, "keep_alive", None) is not None) == contiguous
    call()
    s_want, want = np.empty_like(r), np.empty_like(r)
    fk.add_rms_norm(np.ascontiguousarray(x), r, s_want, np.float32(1e-6), w, want)
    assert_same_bits(s, s_want)
    assert_same_bits(got, want)
    out, out_want = np.empty_like(r), np.empty_like(r)
    call = fk.bind_swiglu(x, r, out)
    assert (getattr(call, "keep_alive", None) is not None) == contiguous
    call()
    fk._swiglu_serial(np.ascontiguousarray(x), r, out_want)
    assert_same_bits(out, out_want)


def test_the_f16_gelu_table_holds_every_entry_of_the_f32_one():
    """The compiled GEGLU reads ggml's f16 table (numerics.gelu_table_f16) where the reference reads the
    f32 one: each entry, widened by the kernels' own conversion, is the f32 entry (NaNs included)."""
    from numba import njit

    from ggml_dist.backends.cpu import numerics as nm

    @njit
    def widen(h):
        out = np.empty(h.shape[0], np.float32)
        for i in range(h.shape[0]):
            out[i] = fk._half(h[i])
        return out
    t16 = nm.gelu_table_f16()
    assert t16.dtype == np.uint16 and t16.nbytes == 1 << 17
    assert np.array_equal(widen(t16).view(np.uint32), nm.gelu_table().view(np.uint32))

"""Tests for ggml_dist.backends.cpu.kpack: Q4_K/Q5_K/Q6_K weights packed once give exactly
quants.mul_mat(order="ggml")'s bits (the oracle-checked numpy emulation, which qkernels.mul_mat_q equals)
for decode and prompt token counts, repacked Q4_K (M % 8 == 0) and not, partial row groups, 1 and 2
threads, both int8 kernel kinds; the CPU backend's MUL_MAT on a model weight takes the packed form."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.base import BufferUsage
from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.cpu.backend import CPUDevice, compute_graph
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType as T

from .test_qpack import assert_products_are_separate
from .test_quants import random_rows

kpack = pytest.importorskip("ggml_dist.backends.cpu.kpack")
qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")

F32 = np.float32
TYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
_D = {T.Q4_K: 0, T.Q5_K: 0, T.Q6_K: 208}            # byte offset of a superblock's f16 d
_BS = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}
KERNELS = ([kpack.Kernels.VNNI] if kpack._vnni_ok() else []) + ([kpack.Kernels.AVX2] if kpack._avx2_ok() else [])
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no AVX2 or AVX-512 VNNI on this CPU")


def weights(t, M, K, seed):
    """random_rows plus zero superblocks and extreme f16 scales (65504, a subnormal)."""
    w = random_rows(t, M, K, seed=seed).reshape(M, K // 256, _BS[t])
    w[::5, 0] = 0                                            # whole zero superblocks
    o = _D[t]
    w[1::7, -1, o:o + 2] = (0xFF, 0x7B)                      # d = 65504
    w[2::7, 0, o:o + 2] = (0x01, 0x00)                       # d = 2^-24 (subnormal)
    if t != T.Q6_K:
        w[3::7, -1, 2:4] = (0xFF, 0x7B)                      # dmin = 65504
    return w.reshape(M, -1)


def activations(N, K, seed):
    x = (np.random.default_rng(seed).standard_normal((N, K)) * 3).astype(F32)
    x[0, :256] = 0                                           # an all-zero superblock: d = 0
    if N > 1:
        x[1, 5] = 300.0                                      # an outlier
    if N > 2:
        x[2, 256:] *= F32(1e-30)                             # tiny scales
    if N > 3:
        x[3, :256] *= F32(1e20)                              # huge scales
    return x


def oracle(t, w, x):
    return Q.mul_mat(t, w, x, order="ggml")                  # repacked Q4_K iff M % 8 == 0


@needs_kernels
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("M,K", [(8, 256), (37, 768), (136, 512)])
def test_bit_identical_every_token_count(t, M, K, kernels):
    # M = 8, 136: Q4_K repacked (gemv chain; gemm for the first N - N % 4 rows from N = 4); 37: vec_dot
    # lanes (and the tiled kernel from 8 rows on); 37, 136: partial row groups
    w = weights(t, M, K, seed=M)
    pw = kpack.PackedKWeight(t, w, kernels=kernels)
    assert pw.repacked == (t == T.Q4_K and M % 8 == 0)
    xs = activations(13, K, seed=int(t))
    for N in (1, 2, 3, 4, 5, 7, 8, 13):
        got = pw.mul_mat(xs[:N])
        ref = oracle(t, w, xs[:N])
        assert got is not None and got.shape == (N, M) and got.dtype == F32
        np.testing.assert_array_equal(got, ref, err_msg=f"{t.name} M={M} N={N} {kernels}")


@needs_kernels
@pytest.mark.parametrize("t", TYPES)
def test_equals_qkernels_with_vec_n(t):
    """vec_n (the per-slice row count) picks the tiled order as in qkernels.mul_mat_q."""
    K, M = 512, 44                                           # not a multiple of 8: Q4_K not repacked
    w = weights(t, M, K, seed=3)
    x = activations(9, K, seed=4)
    pw = kpack.PackedKWeight(t, w, kernels=KERNELS[0])
    for N, vec_n in ((9, 3), (8, 8), (3, None), (2, 8)):
        ref = qk.mul_mat_q(t, w, x[:N], order="ggml", repacked=False, vec_n=vec_n)
        np.testing.assert_array_equal(pw.mul_mat(x[:N], vec_n=vec_n), ref)


@needs_kernels
@pytest.mark.parametrize("t", TYPES)
def test_threads_do_not_change_bits(t):
    """192 rows: 3 groups over 2 threads, so the tokens are split too (odd counts: a lone last token)."""
    K, M = 1536, 192
    w = weights(t, M, K, seed=7)
    pw = kpack.PackedKWeight(t, w, kernels=KERNELS[0])
    x = activations(9, K, seed=8)
    before = kt.get_threads()
    try:
        kt.set_threads(1)
        one = [pw.mul_mat(x[:n]) for n in (1, 3, 4, 9)]
        kt.set_threads(min(2, kt.numba.config.NUMBA_NUM_THREADS))
        two = [pw.mul_mat(x[:n]) for n in (1, 3, 4, 9)]
    finally:
        kt.set_threads(before)
    for n, a, b in zip((1, 3, 4, 9), one, two):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, oracle(t, w, x[:n]))


@pytest.mark.parametrize("scale", [1e-40, 1e-6, 1.0, 3e4, 1e37])
def test_activation_quantization_matches_quants(scale):
    """_prep's codes and d equal quants.quantize_q8_K's; the pair words hold its bsums."""
    x = (np.random.default_rng(5).standard_normal((3, 512)) * scale).astype(F32)
    x[0, :256] = 0
    x[1, 300] = 1e-45
    x[2, 7] = -2 * np.abs(x[2, :256]).max()                  # a negative largest value
    N, K = x.shape
    Yb, dy = np.zeros((N, K), np.int8), np.zeros((N, 2), F32)
    sp, bp = np.zeros((N, 8), np.int32), np.zeros((N, 16), np.int32)
    assert kpack._prep(x, Yb, dy, sp, bp)
    codes, d, bsums = Q.quantize_q8_K(x)
    finite = d != 0
    np.testing.assert_array_equal(dy, d)
    np.testing.assert_array_equal(Yb.reshape(N, 2, 256)[finite], codes[finite])
    pairs = bp.view(np.int16).reshape(N, 2, 16)
    np.testing.assert_array_equal(pairs[finite], bsums[finite])
    s = bsums.astype(np.int32).reshape(N, 2, 8, 2).sum(-1)
    np.testing.assert_array_equal(sp.view(np.int16).reshape(N, 2, 8)[finite], s[finite])


@needs_kernels
def test_non_finite_activations_are_given_back():
    w = weights(T.Q4_K, 16, 256, seed=1)
    x = np.ones((2, 256), F32)
    x[1, 3] = np.inf
    assert kpack.PackedKWeight(T.Q4_K, w, kernels=KERNELS[0]).mul_mat(x) is None


@needs_kernels
@pytest.mark.parametrize("kernels", KERNELS)
def test_q6_lanes_past_2_24_are_exact(kernels):
    """sc = 127, codes 63 everywhere; lane 0 of a token with +1 on its elements and -1 on the rest of the
    first 32 is -44.9M, past 2^24 (f32(lane) would round): the reference's fma takes it exactly."""
    w6 = np.zeros((8, 210), np.uint8)
    w6[:, :192] = 0xFF
    w6[:, 192:208] = 127
    w6[:, 208:210] = (0x00, 0x3C)                            # d = 1
    x6 = np.zeros((2, 256), F32)
    x6[:, :32] = -1
    x6[:, [32 * v + i for v in range(8) for i in range(4)]] = 1
    x6[1] *= F32(1.37)
    pw = kpack.PackedKWeight(T.Q6_K, w6, kernels=kernels)
    for N in (1, 2):
        np.testing.assert_array_equal(pw.mul_mat(x6[:N]), oracle(T.Q6_K, w6, x6[:N]))


@needs_kernels
def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="cannot pack Q4_0"):
        kpack.PackedKWeight(T.Q4_0, np.zeros((8, 18), np.uint8))
    with pytest.raises(ValueError, match="whole 144-byte superblocks"):
        kpack.PackedKWeight(T.Q4_K, np.zeros((8, 150), np.uint8))
    with pytest.raises(ValueError, match="rows of 256"):
        kpack.PackedKWeight(T.Q6_K, np.zeros((8, 210), np.uint8)).mul_mat(np.zeros((1, 512), F32))


class _WeightBuffer:
    """A host buffer marked as holding weights, recording release_pages calls (as test_qpack's)."""

    def __init__(self, data: np.ndarray) -> None:
        self.base = data
        self.usage = BufferUsage.WEIGHTS
        self.released: list[tuple[int, int]] = []

    def release_pages(self, offset: int, size: int) -> None:
        self.released.append((offset, size))


def _matmul_graph(wtype, w_bytes, M, K, x):
    ctx = Context(1 << 20, no_alloc=True)
    wt = ctx.new_tensor(wtype, (K, M))
    xt = ctx.new_tensor(T.F32, (K, x.shape[0]))
    out = ops.mul_mat(ctx, wt, xt)
    g = Graph()
    g.build_forward_expand(out)
    wbuf = _WeightBuffer(w_bytes.reshape(-1))
    wt.buffer, wt.data = wbuf, 0
    buf = CPUDevice().get_buffer_type().alloc_buffer(x.nbytes + 4 * M * x.shape[0] + 64)
    xt.buffer, xt.data = buf, 0
    out.buffer, out.data = buf, x.nbytes + (-x.nbytes) % 32
    buf.set_tensor(xt, x)
    return g, wt, out, buf, wbuf


@needs_kernels
@pytest.mark.parametrize("t", [T.Q4_K, T.Q6_K])
def test_cpu_backend_packs_model_weights_once(t):
    """MUL_MAT on a model weight: packed at its first use, kept in the tensor's extra, the oracle's bits
    (a prompt of 9 rows: Q4_K's gemm and gemv rows, Q6_K's tiled order; then one row)."""
    M, K = 24, 512
    w = weights(t, M, K, seed=3)
    x = activations(9, K, seed=4)
    g, wt, out, buf, wbuf = _matmul_graph(t, w, M, K, x)
    compute_graph(g)
    np.testing.assert_array_equal(buf.get_tensor(out).reshape(-1, M), oracle(t, w, x))
    pw = wt.extra
    assert isinstance(pw, kpack.PackedKWeight) and pw.M == M and pw.K == K
    assert wbuf.released == [(0, w.nbytes)]
    compute_graph(g)
    assert wt.extra is pw
    g1, _, out1, buf1, _ = _matmul_graph(t, w, M, K, x[1:2])
    compute_graph(g1)
    np.testing.assert_array_equal(buf1.get_tensor(out1).reshape(-1, M), oracle(t, w, x[1:2]))


@needs_kernels
@pytest.mark.parametrize("t", TYPES)
def test_bound_product_is_mul_mat(t):
    K, M = 512, 72
    w = weights(t, M, K, seed=21)
    pw = kpack.PackedKWeight(t, w, kernels=KERNELS[0])
    for N in (1, 5):
        x = activations(N, K, seed=22 + N)
        out = np.empty((N, M), F32)
        call = pw.bind(x, out)
        assert call() and np.array_equal(out, pw.mul_mat(x))
        x[0, 5] = np.nan
        assert not call() and pw.mul_mat(x) is None


@needs_kernels
@pytest.mark.parametrize("t", TYPES)
def test_products_of_one_activation_are_the_separate_products(t):
    """kpack.bind_products: each weight's mul_mat bits, 1 and 2 threads, 1 to 3 weights (repacked Q4_K
    and not), decode and prompt token counts; a non-finite x gives them back."""
    K = 512
    Ms = (136, 64, 72) if t == T.Q4_K else (136, 37, 64)        # Q4_K: all repacked (M % 8 == 0)
    pws = [kpack.PackedKWeight(t, weights(t, M, K, seed=60 + M), kernels=KERNELS[-1]) for M in Ms]
    assert_products_are_separate(kpack.bind_products, pws, (1, 5), lambda N: activations(N, K, seed=70 + N))


@needs_kernels
def test_k_products_that_cannot_share_a_call_are_an_error():
    K = 256
    a = kpack.PackedKWeight(T.Q4_K, weights(T.Q4_K, 64, K, seed=1), kernels=KERNELS[-1])
    b = kpack.PackedKWeight(T.Q6_K, weights(T.Q6_K, 64, K, seed=2), kernels=KERNELS[-1])
    c = kpack.PackedKWeight(T.Q4_K, weights(T.Q4_K, 37, K, seed=3), kernels=KERNELS[-1])   # not repacked
    x = activations(2, K, seed=4)
    assert a.shares_call(a) and not a.shares_call(b) and not a.shares_call(c)
    with pytest.raises(ValueError, match="one type and layout"):
        kpack.bind_products([a, b], x, [np.empty((2, 64), F32)] * 2)
    with pytest.raises(ValueError, match="x must be f32"):
        kpack.bind_products([a], x[:, :128], [np.empty((2, 64), F32)])

"""Tests for ggml_dist.backends.cpu.qpack: weights repacked once into row groups give exactly
quants.mul_mat(order="ggml")'s bits (numpy path, the oracle-checked emulation) for every token count, row
count and thread count; the packed copy is made once per weight, kept in the tensor's extra, and used by the
CPU backend's MUL_MAT on model weights. Q5_0/Q5_1 run the int8 kernels (their nibbles and a plane of 5th
bits); with the float kernels they keep the file's rows and take qkernels' product, the same bits."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.base import BufferUsage
from ggml_dist.backends.cpu.backend import CPUDevice, compute_graph
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType as T
from ggml_dist.core import ops

from .test_quants import random_rows

qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")
qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")

F32 = np.float32
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1]
Q5 = [T.Q5_0, T.Q5_1]
# both packed layouts: the float kernels' everywhere, the int8 (vnni.py) one where the CPU has VNNI
LAYOUTS = [False] + ([True] if qpack.vnni.AVAILABLE else [])
# every kind of kernels this host runs (Q5's int8 path is tested here with whichever it has; test_avx2
# forces the AVX2 one on a VNNI host)
KERNELS = ["float"] + (["avx2"] if qpack.avx2.AVAILABLE else []) + (["vnni"] if qpack.vnni.AVAILABLE else [])


def oracle(t, w, x):
    """quants.mul_mat, the numpy reference (ggml's AVX2 orders; repacked Q4_0 iff M % 8 == 0)."""
    return Q.mul_mat(t, w, x, order="ggml")


def activations(N, K, seed):
    x = (np.random.default_rng(seed).standard_normal((N, K)) * 3).astype(F32)
    x[0, :32] = 0                         # an all-zero block: d = 0
    if N > 1:
        x[1, 5] = 300.0                   # an outlier block
    return x


@pytest.mark.parametrize("vnni_layout", LAYOUTS)
@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("M", [8, 37, 136, 150])
def test_bit_identical_every_token_count(t, M, vnni_layout, monkeypatch):
    # M = 37, 150: partial last groups and (Q4_0) the 8-lane vec_dot order; 8, 136: Q4_0 repacked chain
    K = 256
    w = random_rows(t, M, K, seed=M)
    w[::3, :Q.TYPE_TRAITS[t].type_size] = 0        # zero blocks (d = 0)
    if t == T.Q8_0:
        w[1::3, 2:34:5] = 0x80                     # code -128 (outside quantize's range, valid in a file)
    pw = qpack.PackedWeight(t, w, vnni_layout=vnni_layout)
    assert pw.vnni == vnni_layout
    assert pw.chain == (t == T.Q4_0 and M % 8 == 0)
    xs = activations(21, K, seed=int(t))
    for N in (1, 2, 3, 4, 5, 8, 13, 21):           # decode kernel below MIN_TOKENS, tiled from it on
        got = pw.mul_mat(xs[:N])
        ref = oracle(t, w, xs[:N])
        assert got.shape == (N, M) and got.dtype == F32
        assert np.array_equal(got, ref), f"{t.name} M={M} N={N}: max |diff| {np.abs(got - ref).max()}"


@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from(TYPES), M=st.integers(1, 40), nb=st.integers(1, 6), N=st.integers(1, 12),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]), vnni_layout=st.sampled_from(LAYOUTS))
def test_bit_identical_random_shapes(t, M, nb, N, seed, scale, vnni_layout):
    K = 32 * nb
    w = random_rows(t, M, K, seed=seed)
    x = (np.random.default_rng(seed + 1).standard_normal((N, K)) * scale).astype(F32)
    ref = Q.mul_mat(t, w, x, order="ggml")
    assert np.array_equal(qpack.PackedWeight(t, w, vnni_layout=vnni_layout).mul_mat(x), ref)


@pytest.mark.parametrize("M", [96, 192])
@pytest.mark.parametrize("vnni_layout", LAYOUTS)
@pytest.mark.parametrize("t", TYPES)
def test_threads_do_not_change_bits(t, vnni_layout, M):
    """M = 192: 3 groups of 64 rows over 2 threads, so the vnni kernels split the tokens too, in slices of
    whole token pairs (odd counts leave a lone token in the last slice)."""
    K = 512
    w = random_rows(t, M, K, seed=7)
    pw = qpack.PackedWeight(t, w, vnni_layout=vnni_layout)
    x = activations(40, K, seed=8)
    before = kt.get_threads()
    try:
        kt.set_threads(1)
        one = [pw.mul_mat(x[:n]) for n in (1, 3, 8, 13, 40)]
        kt.set_threads(min(2, kt.numba.config.NUMBA_NUM_THREADS))
        two = [pw.mul_mat(x[:n]) for n in (1, 3, 8, 13, 40)]
    finally:
        kt.set_threads(before)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("q8_1", [False, True])
@pytest.mark.parametrize("scale", [1e-40, 1e-6, 1.0, 3e4])
def test_activation_quantization_matches_quants(q8_1, scale):
    """_prep's codes and scales equal quants.quantize_q8_0/_q8_1's (x86 activation quantizers, numpy),
    subnormal blocks included."""
    x = (np.random.default_rng(5).standard_normal((3, 128)) * scale).astype(F32)
    x[0, :32] = 0
    x[1, 40] = 1e-45
    N, K = x.shape
    Y, Yb = np.zeros((N, K), F32), np.zeros((N, K), np.int8)
    dy, sy, ys = (np.zeros((N, 4), F32) for _ in range(3))
    assert qpack._prep(x, q8_1, Y, Yb, dy, sy, ys)
    if q8_1:
        codes, d, sd = Q.quantize_q8_1(x)
        np.testing.assert_array_equal(sy, sd)
    else:
        codes, d = Q.quantize_q8_0(x)
    np.testing.assert_array_equal(dy, d)
    np.testing.assert_array_equal(Yb, codes.reshape(N, K))
    np.testing.assert_array_equal(Y, codes.reshape(N, K))
    np.testing.assert_array_equal(ys, codes.sum(-1))


def test_non_finite_activations_defer_to_the_generic_path():
    w = random_rows(T.Q4_1, 8, 64, seed=1)
    x = np.ones((2, 64), F32)
    x[1, 3] = np.inf
    assert qpack.PackedWeight(T.Q4_1, w).mul_mat(x) is None


def test_vnni_layout_needs_the_instructions(monkeypatch):
    monkeypatch.setattr(qpack.vnni, "AVAILABLE", False)
    w = random_rows(T.Q4_0, 8, 64, seed=1)
    assert not qpack.PackedWeight(T.Q4_0, w).vnni                   # the default follows the host
    with pytest.raises(ValueError, match="VNNI"):
        qpack.PackedWeight(T.Q4_0, w, vnni_layout=True)


def test_bad_input_is_an_error():
    with pytest.raises(ValueError, match="cannot pack Q6_K"):
        qpack.PackedWeight(T.Q6_K, np.zeros((8, 210), np.uint8))
    with pytest.raises(ValueError, match="whole 18-byte blocks"):
        qpack.PackedWeight(T.Q4_0, np.zeros((8, 20), np.uint8))
    pw = qpack.PackedWeight(T.Q8_0, np.zeros((8, 34), np.uint8))
    with pytest.raises(ValueError, match="rows of 32"):
        pw.mul_mat(np.zeros((1, 64), F32))


class _WeightBuffer:
    """A host buffer marked as holding weights, recording release_pages calls."""

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


@pytest.mark.parametrize("t", TYPES)
def test_cpu_backend_packs_model_weights_once(t, monkeypatch):
    M, K = 24, 128
    w = random_rows(t, M, K, seed=3)
    x = activations(5, K, seed=4)
    g, wt, out, buf, wbuf = _matmul_graph(t, w, M, K, x)
    for N in (5, 1):
        compute_graph(g)
        got = buf.get_tensor(out)
        np.testing.assert_array_equal(got.reshape(-1, M), oracle(t, w, x))
    pw = wt.extra
    assert isinstance(pw, qpack.PackedWeight) and pw.M == M and pw.K == K
    assert wbuf.released == [(0, w.nbytes)]             # the mapping's pages are handed back once
    compute_graph(g)
    assert wt.extra is pw                               # reused, not packed again
    wt.data = 0
    wt.buffer = _WeightBuffer(np.ascontiguousarray(w[::-1]).reshape(-1))   # rebound: packed again
    assert qpack.packed(t, wt.buffer.base.reshape(M, -1), wt) is not pw


def test_mapped_buffer_release_pages_keeps_the_bytes(tmp_path):
    # dropping a mapping's resident pages is invisible to readers: the bytes fault back in from the file
    from ggml_dist.model.weights import MappedBuffer
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 100, dtype=np.uint8)
    path = tmp_path / "w.bin"
    data.tofile(path)
    buf = MappedBuffer(str(path))
    assert int(buf.base.astype(np.int64).sum()) == int(data.astype(np.int64).sum())   # pages resident
    buf.release_pages(10, 2 * 4096 + 50)        # only whole pages inside the range are dropped
    buf.release_pages(0, 0)
    np.testing.assert_array_equal(np.asarray(buf.base), data)


@pytest.mark.parametrize("vnni_layout", LAYOUTS)
@pytest.mark.parametrize("t", TYPES)
def test_bound_product_is_mul_mat(t, vnni_layout):
    """PackedWeight.bind (the replayed step's call: kernel and arguments chosen once) writes mul_mat's
    values at 1 and 2 threads, and answers False for a non-finite activation, as mul_mat answers None."""
    K, M = 256, 192
    w = random_rows(t, M, K, seed=21)
    pw = qpack.PackedWeight(t, w, vnni_layout=vnni_layout)
    before = kt.get_threads()
    try:
        for n_threads in sorted({1, min(2, kt.numba.config.NUMBA_NUM_THREADS)}):
            kt.set_threads(n_threads)
            for N in (1, 3, 8):
                x = activations(N, K, seed=22 + N)
                out = np.empty((N, M), F32)
                call = pw.bind(x, out)
                assert call() and np.array_equal(out, pw.mul_mat(x))
                x[0, 5] = np.nan
                assert not call() and pw.mul_mat(x) is None
    finally:
        kt.set_threads(before)


def _q5_weights(t, M, K, seed):
    """Random Q5 rows with zero blocks (d = 0, every 5th bit clear) and blocks whose 5th bits are all set
    or alternate, the nibbles random."""
    w = random_rows(t, M, K, seed=seed)
    bs, oh = Q.TYPE_TRAITS[t].type_size, (2 if t == T.Q5_0 else 4)
    blocks = w.reshape(M, K // 32, bs)
    blocks[::4, 0] = 0                                  # a whole zero block
    blocks[1::4, 1, oh:oh + 4] = 0xFF
    blocks[2::4, -1, oh:oh + 4] = 0x55
    return w


@pytest.mark.parametrize("t", Q5)
def test_q5_fifth_bit_plane(t):
    """The int8 layout keeps Q5 at the file's size: each block's nibbles (Q4's order), then 4R bytes
    where bit i of byte 4r + k is row r's 5th bit of element 4i + k (ggml lane i)."""
    M, K = 64, 96
    w = _q5_weights(t, M, K, seed=3)
    pw = qpack.PackedWeight(t, w, kernels=KERNELS[-1])
    if pw.kernels is qpack.Kernels.FLOAT:
        assert pw.raw is w
        return
    nb = K // 32
    assert pw.qs.nbytes + pw.d.nbytes + (pw.m.nbytes if t == T.Q5_1 else 0) == w.nbytes
    oh = 2 if t == T.Q5_0 else 4
    qh = np.ascontiguousarray(w.reshape(M, nb, -1)[..., oh:oh + 4]).view("<u4")[..., 0]     # [r, b]
    plane = pw.qs.reshape(nb, 20 * qpack.R)[:, 16 * qpack.R:].reshape(nb, M, 4)            # [b, r, k]
    for i in range(8):
        for k in range(4):
            np.testing.assert_array_equal((plane[..., k] >> i) & 1, ((qh >> (4 * i + k)) & 1).T)


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("t", Q5)
def test_q5_every_token_count(t, kernels):
    """Q5 against the oracle for decode (1-3 tokens) and prompt-sized token counts, M not a multiple of
    64 (a partial last group), at 1 and 2 threads (M = 200: 4 groups, then a token split too at N=5)."""
    M, K = 200, 256
    w = _q5_weights(t, M, K, seed=int(t))
    pw = qpack.PackedWeight(t, w, kernels=kernels)
    assert (pw.raw is not None) == (kernels == "float")
    xs = activations(128, K, seed=5)
    before = kt.get_threads()
    try:
        for n_threads in sorted({1, min(2, kt.numba.config.NUMBA_NUM_THREADS)}):
            kt.set_threads(n_threads)
            for N in (1, 2, 3, 5, 8, 9, 33, 128):
                got, ref = pw.mul_mat(xs[:N]), oracle(t, w, xs[:N])
                assert np.array_equal(got, ref), \
                    f"{t.name} {kernels} N={N} threads={n_threads}: {np.sum(got != ref)} differ"
    finally:
        kt.set_threads(before)


@pytest.mark.parametrize("t", Q5)
def test_q5_without_int8_kernels_keeps_the_file_rows(t, monkeypatch):
    """With the float kernels (a CPU without AVX2) a Q5 weight is not repacked: the CPU backend's MUL_MAT
    still takes the packed path, whose product is qkernels' (the same bits), and the mapping's pages stay."""
    monkeypatch.setattr(qpack, "default_kernels", lambda: qpack.Kernels.FLOAT)
    M, K = 24, 128
    w = _q5_weights(t, M, K, seed=9)
    x = activations(5, K, seed=4)
    g, wt, out, buf, wbuf = _matmul_graph(t, w, M, K, x)
    compute_graph(g)
    np.testing.assert_array_equal(buf.get_tensor(out).reshape(-1, M), oracle(t, w, x))
    assert isinstance(wt.extra, qpack.PackedWeight) and wt.extra.raw is not None
    assert wbuf.released == []


def test_cpu_backend_packs_what_qpack_packs():
    from ggml_dist.backends.cpu import ops as cpu_ops
    assert cpu_ops._PACKABLE == qpack.PACKABLE


INT8 = [k for k in KERNELS if k != "float"]


@pytest.mark.skipif(not INT8, reason="no AVX2 or AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("kernels", INT8)
@pytest.mark.parametrize("t", TYPES)
def test_products_of_one_activation_are_the_separate_products(t, kernels):
    """bind_products (a layer's Q, K, V in one call: x quantized once, the weights' groups shared among
    the threads) writes each weight's mul_mat bits, at 1 and 2 threads, for 1, 2 and 3 weights of
    different row counts; a non-finite x gives them back (False, the fallback called)."""
    K = 256
    Ms = (136, 64, 72) if t == T.Q4_0 else (136, 37, 64)        # Q4_0: all chains (M % 8 == 0), one kind
    pws = [qpack.PackedWeight(t, random_rows(t, M, K, seed=40 + M), kernels=kernels) for M in Ms]
    assert_products_are_separate(qpack.bind_products, pws, (1, 3, 8), lambda N: activations(N, K, seed=50 + N))


def assert_products_are_separate(bind_products, pws, Ns, activations):
    """bind_products(pws[:n_w], x, outs, fallback) for 1..3 weights, N tokens of activations(N), at 1
    and 2 threads: each out is its weight's mul_mat, and a non-finite x gives them back."""
    before = kt.get_threads()
    try:
        for n_threads in sorted({1, min(2, kt.numba.config.NUMBA_NUM_THREADS)}):
            kt.set_threads(n_threads)
            for n_w in (1, 2, 3):
                for N in Ns:
                    x = activations(N)
                    outs = [np.full((N, p.M), np.nan, F32) for p in pws[:n_w]]
                    given_back = []
                    call = bind_products(pws[:n_w], x, outs, fallback=lambda: given_back.append(1))
                    assert call() and not given_back
                    for p, o in zip(pws, outs):
                        assert np.array_equal(o, p.mul_mat(x))
                    x[-1, 7] = np.inf
                    assert not call() and given_back == [1]
    finally:
        kt.set_threads(before)


@pytest.mark.skipif(not INT8, reason="no AVX2 or AVX-512 VNNI on this CPU")
def test_products_that_cannot_share_a_call_are_an_error():
    K = 64
    q4 = qpack.PackedWeight(T.Q4_1, random_rows(T.Q4_1, 64, K, seed=1), kernels=INT8[0])
    q8 = qpack.PackedWeight(T.Q8_0, random_rows(T.Q8_0, 64, K, seed=2), kernels=INT8[0])
    fl = qpack.PackedWeight(T.Q4_1, random_rows(T.Q4_1, 64, K, seed=3), kernels="float")
    x = activations(2, K, seed=4)
    assert q4.shares_call(q4) and not q4.shares_call(q8) and not q4.shares_call(fl)
    with pytest.raises(ValueError, match="one int8 layout and kind"):
        qpack.bind_products([q4, q8], x, [np.empty((2, 64), F32)] * 2)
    with pytest.raises(ValueError, match="one int8 layout and kind"):
        qpack.bind_products([q4] * (qpack.MULTI + 1), x, [np.empty((2, 64), F32)] * (qpack.MULTI + 1))
    with pytest.raises(ValueError, match=r"out must be f32 \[2, 64\]"):
        qpack.bind_products([q4, q4], x, [np.empty((2, 64), F32), np.empty((2, 32), F32)])
    with pytest.raises(ValueError, match="x must be f32"):
        qpack.bind_products([q4], x[:, :32], [np.empty((2, 64), F32)])

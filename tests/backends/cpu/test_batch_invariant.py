"""ComputeOptions.batch_invariant: a MUL_MAT row's bits, and an attention query's, do not depend on the
rows computed beside it, for every weight type, kernel kind (VNNI, AVX2, float), packed model weights
and plain tensors, 1 and 2 threads; and a row among others gets the bits ggml gives it alone. Without
the option ggml's own rule holds, and these tests pin down its exception exactly: the products whose
batched kernel reduces in another order (EXCEPTION below) may differ from the row alone, every other
row is bit-identical to it."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_dist.backends.base import BufferUsage, tensor_array
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.cpu.backend import CPUDevice, compute_graph
from ggml_dist.backends.cpu.ops import ComputeOptions, resolve
from ggml_dist.backends.cpu.reference import _HOST, _all_tensors
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import nbytes
from ggml_dist.core.types import GGMLType as T

from .test_quants import random_rows

qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")

F32 = np.float32
QUANT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
TYPES = [*QUANT, T.F16, T.F32, T.BF16]
KERNELS = ["float"] + (["avx2"] if qpack.avx2.AVAILABLE else []) + (["vnni"] if qpack.vnni.AVAILABLE else [])
THREADS = [n for n in (1, 2) if n <= kt._numba_num_threads()]


def exception_rows(t: T, M: int, K: int, N: int) -> range:
    """The rows of an N-row product that ggml's default numerics compute in an order of their batch's,
    not of a row alone (ggml-numerics.md §1.5-1.6): F16/F32/BF16 from 2 rows (tinyBLAS, where K % 8 ==
    0 and M % 4 == 0; the attention's products are these), the K-quants from 8 rows (the tiled kernel),
    repacked Q4_K (M % 8 == 0) from 4 rows, in groups of 4 (the gemm). Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
    (vec_dot and tinyBLAS_Q0 share their lanes, repacked Q4_0's gemv and gemm their chain): none."""
    if t in (T.F16, T.F32, T.BF16):
        return range(N) if N >= 2 and K % 8 == 0 and M % 4 == 0 else range(0)
    if t == T.Q4_K and M % 8 == 0:
        return range(N - N % 4) if N >= 4 else range(0)
    if t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        return range(N) if N >= 8 else range(0)
    return range(0)


class _Host:
    """A host buffer over an array; WEIGHTS usage makes the CPU backend take the packed products."""

    def __init__(self, data: np.ndarray, usage: BufferUsage) -> None:
        self.base, self.usage = data, usage

    def release_pages(self, offset: int, size: int) -> None:
        pass


def _weights(t: T, M: int, K: int, seed: int) -> np.ndarray:
    """M rows of K elements of type t as bytes [M, row bytes]."""
    rng = np.random.default_rng(seed)
    if t in QUANT:
        return random_rows(t, M, K, seed)
    x = (rng.standard_normal((M, K)) * rng.uniform(0.01, 3, (M, 1))).astype(F32)
    if t == T.F16:
        return x.astype(np.float16).view(np.uint8)
    if t == T.BF16:
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return x.view(np.uint8)


class Products:
    """W [M, K] times N activation rows and times one row, two graphs over the same weight tensor."""

    def __init__(self, t: T, w: np.ndarray, M: int, K: int, N: int, packed: bool) -> None:
        ctx = Context(1 << 20, no_alloc=True)
        self.wt = ctx.new_tensor(t, (K, M))
        self.wt.buffer, self.wt.data = _Host(np.ascontiguousarray(w).reshape(-1),
                                             BufferUsage.WEIGHTS if packed else BufferUsage.ANY), 0
        self.graphs = {}
        for n in {N, 1}:
            x = ctx.new_tensor(T.F32, (K, n))
            out = ops.mul_mat(ctx, self.wt, x)
            g = Graph()
            g.build_forward_expand(out)
            buf = CPUDevice().get_buffer_type().alloc_buffer(4 * n * (K + M) + 64)
            x.buffer, x.data = buf, 0
            out.buffer, out.data = buf, 4 * n * K + (-4 * n * K) % 32
            self.graphs[n] = (g, x, out)

    def run(self, x: np.ndarray, opts: ComputeOptions) -> np.ndarray:
        g, xt, out = self.graphs[x.shape[0]]
        xt.buffer.set_tensor(xt, x)
        compute_graph(g, opts)
        return tensor_array(out).reshape(x.shape[0], -1).copy()


def _activations(N: int, K: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((N, K)) * rng.uniform(0.1, 4, (N, 1))).astype(F32)
    x[rng.integers(N), :32] = 0                     # an all-zero block
    return x


@pytest.fixture
def threads():
    before = kt.get_threads()
    yield
    kt.set_threads(before)


def _opts(kernels: str, batch_invariant: bool) -> ComputeOptions:
    return resolve(ComputeOptions(kernels=kernels, batch_invariant=batch_invariant))


# any weight type, row count, partial row group (M % 64, M % 8), packed or not, any kernels and threads:
# in the mode every row of N is the row alone; without it only EXCEPTION's rows may differ
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.sampled_from(TYPES), M=st.sampled_from([8, 36, 64, 72, 136]), K=st.sampled_from([256, 512]),
       N=st.integers(2, 17), packed=st.booleans(), kernels=st.sampled_from(KERNELS),
       n_threads=st.sampled_from(THREADS), seed=st.integers(0, 2 ** 16))
def test_a_row_s_product_does_not_depend_on_the_rows_beside_it(threads, t, M, K, N, packed, kernels, n_threads,
                                                               seed):
    kt.set_threads(n_threads)
    w, x = _weights(t, M, K, seed), _activations(N, K, seed + 1)
    p = Products(t, w, M, K, N, packed)
    for bi in (True, False):
        opts = _opts(kernels, bi)
        rows = p.run(x, opts)
        alone = np.stack([p.run(x[i:i + 1], opts)[0] for i in range(N)])
        if bi:
            np.testing.assert_array_equal(rows.view(np.uint32), alone.view(np.uint32))
            # ... and a row alone has the default numerics' bits: the mode changes no one-row product
            np.testing.assert_array_equal(alone.view(np.uint32),
                                          np.stack([p.run(x[i:i + 1], _opts(kernels, False))[0]
                                                    for i in range(N)]).view(np.uint32))
        else:
            same = [i for i in range(N) if i not in exception_rows(t, M, K, N)]
            np.testing.assert_array_equal(rows[same].view(np.uint32), alone[same].view(np.uint32))


# the exception is real: each type that has one gives some row other bits among others than alone
@pytest.mark.parametrize("t,M,N", [(T.F16, 64, 2), (T.F32, 64, 2), (T.BF16, 64, 2), (T.Q4_K, 64, 4),
                                   (T.Q4_K, 36, 8), (T.Q5_K, 64, 8), (T.Q6_K, 64, 8), (T.Q2_K, 64, 8),
                                   (T.Q3_K, 64, 8)])
def test_without_the_mode_the_batched_orders_change_bits(t, M, N):
    K = 512
    w, x = _weights(t, M, K, 7), _activations(N, K, 8)
    p = Products(t, w, M, K, N, packed=True)
    opts = resolve(ComputeOptions())
    rows = p.run(x, opts)
    alone = np.stack([p.run(x[i:i + 1], opts)[0] for i in range(N)])
    assert (rows.view(np.uint32) != alone.view(np.uint32)).any()
    assert len(exception_rows(t, M, K, N)) > 0


# the numpy reference kernels (GGML_DIST_NO_NUMBA, and a cold kernel cache's first minutes) follow the
# mode too, with the compiled kernels' bits
@pytest.mark.parametrize("t", [T.F16, T.Q4_K, T.Q6_K, T.Q2_K])
def test_the_numpy_kernels_follow_the_mode(t):
    M, K, N = 64, 256, 9
    w, x = _weights(t, M, K, 3), _activations(N, K, 4)
    p = Products(t, w, M, K, N, packed=False)
    ref = ComputeOptions(numba=False, batch_invariant=True)
    rows = p.run(x, ref)
    np.testing.assert_array_equal(rows.view(np.uint32), p.run(x, resolve(replace(ref, numba=True))).view(np.uint32))
    for i in range(N):
        np.testing.assert_array_equal(rows[i].view(np.uint32), p.run(x[i:i + 1], ref)[0].view(np.uint32))


# -- attention -------------------------------------------------------------------------------------
class Attention:
    """A layer's KQ -> soft_max -> KQV over f16 K/V cache views (test_fusion's shapes), for n_tok query
    rows and for one: the fused chain of the bound replay."""

    def __init__(self, n_tok: int, n_head: int, n_head_kv: int, n_kv: int, d: int = 64, kv_size: int = 512):
        self.graphs = {}
        for n, nkv in ((n_tok, n_kv), (1, 256)):
            ctx = Context(1 << 24)
            kc = ctx.new_tensor(T.F16, (d * n_head_kv, kv_size))
            vc = ctx.new_tensor(T.F16, (kv_size, d * n_head_kv))
            q = ctx.new_tensor(T.F32, (d, n_head, n))
            m = ctx.new_tensor(T.F32, (nkv, n))
            k = ops.view_3d(ctx, kc, d, nkv, n_head_kv, kc.nb[1], d * 2, 0)
            v = ops.view_3d(ctx, vc, nkv, d, n_head_kv, vc.nb[1], vc.nb[1] * d, 0)
            kq = ops.mul_mat(ctx, k, ops.permute(ctx, q, 0, 2, 1, 3))
            sm = ops.soft_max_ext(ctx, kq, m, 0.125, 0.0)
            kqv = ops.mul_mat(ctx, v, sm)
            out = ops.cont(ctx, ops.permute(ctx, kqv, 0, 2, 1, 3), (d * n_head, n))
            g = Graph()
            g.build_forward_expand(out)
            _allocate(g)
            self.graphs[n] = (g, (kc, vc, q, m), out)

    def run(self, kv: tuple[np.ndarray, np.ndarray], q: np.ndarray, mask: np.ndarray,
            opts: ComputeOptions) -> np.ndarray:
        g, (kc, vc, qt, mt), out = self.graphs[q.shape[0]]
        for t, val in ((kc, kv[0]), (vc, kv[1]), (qt, q), (mt, mask[:, :mt.ne[0]])):
            t.buffer.set_tensor(t, np.ascontiguousarray(val))
        compute_graph(g, opts)
        return tensor_array(out).reshape(q.shape[0], -1).copy()


def _allocate(g: Graph) -> None:
    """Every tensor of g in a host buffer of its own, views over their sources (test_fast_ops')."""
    tensors = _all_tensors(g)
    for t in tensors:
        if t.view_src is None:
            t.buffer, t.data = _HOST.alloc_buffer(max(nbytes(t), 1)), 0
    for t in tensors:
        if t.view_src is not None:
            t.buffer, t.data = t.view_src.buffer, t.view_src.data + t.view_offs


def _attention_case(rng, n_tok, n_head, n_head_kv, used, n_kv, d=64, kv_size=512):
    """K/V cells 0..used-1 filled (the rest zero, as a cleared cache), n_tok queries at the last
    positions with the causal mask over n_kv cells."""
    k = np.zeros((kv_size, d * n_head_kv), np.float16)
    k[:used] = rng.standard_normal((used, d * n_head_kv))
    v = np.zeros((d * n_head_kv, kv_size), np.float16)
    v[:, :used] = rng.standard_normal((d * n_head_kv, used))
    q = (rng.standard_normal((n_tok, n_head, d)) * 2).astype(F32)
    mask = np.full((n_tok, n_kv), -np.inf, F32)
    for i in range(n_tok):
        mask[i, :used - n_tok + 1 + i] = 0
    return (k, v), q, mask


# queries of one sequence (a prompt chunk) with GQA, any context length, a padded n_kv (another
# stream's length) and 1 or 2 threads: in the mode each query's output is the query alone's; without
# it that holds for one query only (tinyBLAS from 2: the exception)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_tok=st.integers(1, 9), heads=st.sampled_from([(4, 4), (6, 2), (9, 3), (3, 1)]),
       used=st.integers(9, 250), n_kv=st.sampled_from([256, 512]), n_threads=st.sampled_from(THREADS),
       seed=st.integers(0, 2 ** 16))
def test_an_attention_query_does_not_depend_on_the_queries_beside_it(threads, n_tok, heads, used, n_kv,
                                                                    n_threads, seed):
    kt.set_threads(n_threads)
    n_head, n_head_kv = heads
    a = Attention(n_tok, n_head, n_head_kv, n_kv)
    kv, q, mask = _attention_case(np.random.default_rng(seed), n_tok, n_head, n_head_kv, used, n_kv)
    for bi in (True, False):
        opts = resolve(ComputeOptions(batch_invariant=bi))
        rows = a.run(kv, q, mask, opts)
        alone = np.stack([a.run(kv, q[i:i + 1], mask[i:i + 1], opts)[0] for i in range(n_tok)])
        if bi or n_tok == 1:
            np.testing.assert_array_equal(rows.view(np.uint32), alone.view(np.uint32))


# the attention's exception is real: 2+ queries of a sequence (a prompt) take tinyBLAS and other bits
def test_without_the_mode_a_prompt_s_attention_changes_bits():
    a = Attention(8, 9, 3, 256)
    kv, q, mask = _attention_case(np.random.default_rng(1), 8, 9, 3, 120, 256)
    opts = resolve(ComputeOptions())
    rows = a.run(kv, q, mask, opts)
    alone = np.stack([a.run(kv, q[i:i + 1], mask[i:i + 1], opts)[0] for i in range(8)])
    assert (rows.view(np.uint32) != alone.view(np.uint32)).any()


# the mode does not make attention independent of where a sequence's cells are: it reduces over the
# cells in cell order (vec_dot's 32 lanes by cell index, the soft_max's sum by 8-cell chunks), so keys
# interleaved with another sequence's cells (a unified KV cache) give other bits; moved by a multiple of
# 32 cells they give the same
def test_an_attention_query_s_bits_follow_its_cells():
    d, n_head, n_head_kv, used = 64, 6, 2, 40
    a = Attention(1, n_head, n_head_kv, 256)
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((used, d * n_head_kv)).astype(np.float16)
    vals = rng.standard_normal((d * n_head_kv, used)).astype(np.float16)
    q = (rng.standard_normal((1, n_head, d)) * 2).astype(F32)
    opts = resolve(ComputeOptions(batch_invariant=True))

    def at(cells: np.ndarray) -> np.ndarray:
        k, v = np.zeros((512, d * n_head_kv), np.float16), np.zeros((d * n_head_kv, 512), np.float16)
        k[cells], v[:, cells] = keys, vals
        mask = np.full((1, 256), -np.inf, F32)
        mask[0, cells] = 0
        return a.run((k, v), q, mask, opts)
    alone = at(np.arange(used))
    assert np.array_equal(at(np.arange(used) + 64).view(np.uint32), alone.view(np.uint32))
    assert not np.array_equal(at(2 * np.arange(used) + 1).view(np.uint32), alone.view(np.uint32))


# exact keeps float32 BLAS products, whose rounding follows the shape: refused in the mode
def test_the_mode_refuses_exact():
    with pytest.raises(ValueError, match="batch_invariant"):
        ComputeOptions(exact=True, batch_invariant=True)

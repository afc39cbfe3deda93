"""tests/ggml_oracle.py, llama.cpp's own ggml through ctypes, checked against what we already know: float
products within rounding, the dense quant types bit for bit with quants.mul_mat(order="ggml") (which
matches llama.cpp), the repack buffer really taking the repack kernels, MUL_MAT_ID against MUL_MAT, and the
small ops against numpy. Skipped where llama-cpp-python is not installed (CI's `.[test]`)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import quants as Q
from ggml_dist.core.types import GGMLType as T
from tests import ggml_oracle as O

REASON = O.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

F32 = np.float32


def rng(seed):
    return np.random.default_rng(seed)


def test_f32_mul_mat_is_a_float_product():
    # F32 x F32 (vec_dot for 1 row, tinyBLAS for 3): numpy's product within f32 rounding
    w = rng(0).standard_normal((16, 96)).astype(F32)
    for N in (1, 3):
        x = rng(N).standard_normal((N, 96)).astype(F32)
        out = O.mul_mat(T.F32, w, x)
        assert out.shape == (N, 16) and out.dtype == F32
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=0, atol=1e-4)


@pytest.mark.parametrize("t", [T.Q8_0, T.Q4_1, T.Q5_0, T.Q6_K])
def test_dense_quant_types_are_ours_bit_for_bit(t):
    # our order="ggml" emulation (vec_dot for 1 row, tinyBLAS_Q0 / vec_dot / the tiled kernel for more) is
    # llama.cpp's: an oracle that passes this runs the real kernels on the bytes we gave it
    K, M = 512, 12                           # M % 8 != 0: nothing repacks
    w = Q.quantize(t, rng(1).standard_normal((M, K)).astype(F32)) if t != T.Q6_K else \
        Q.quantize(t, (rng(1).standard_normal((M, K)) * 0.1).astype(F32))
    for N in (1, 3, 9):
        x = (rng(N).standard_normal((N, K)) * 2).astype(F32)
        np.testing.assert_array_equal(O.mul_mat(t, w, x), Q.mul_mat(t, w, x, order="ggml"))


def test_repack_buffer_runs_the_repack_kernels():
    # Q4_0 with 16 rows in CPU_REPACK: the gemm/gemv chain (quants' repacked=True), which differs from the
    # plain buffer's vec_dot lanes on most outputs; the buffer is named as llama.cpp names it
    K, M, N = 1024, 16, 6
    w = Q.quantize(T.Q4_0, rng(2).standard_normal((M, K)).astype(F32))
    x = rng(3).standard_normal((N, K)).astype(F32)
    plain, rep = O.mul_mat(T.Q4_0, w, x), O.mul_mat(T.Q4_0, w, x, repack=True)
    np.testing.assert_array_equal(plain, Q.mul_mat(T.Q4_0, w, x, repacked=False))
    np.testing.assert_array_equal(rep, Q.mul_mat(T.Q4_0, w, x, repacked=True))
    assert (plain != rep).mean() > 0.3
    with O.Graph() as g:
        wt = g.tensor(T.Q4_0, (K, M), w, repack=True)
        g.compute(g.op("mul_mat", wt, g.array(x)))
        assert g.buffer_name(wt) == "CPU_REPACK"
    with pytest.raises(ValueError, match="does not repack"):
        O.mul_mat(T.Q4_0, w[:12], x, repack=True)         # ne[1] % 8 != 0: ggml would have no traits


def test_threads_do_not_change_bits():
    # K is never split across threads, in either buffer
    K, M, N = 512, 64, 5
    w = Q.quantize(T.Q4_0, rng(4).standard_normal((M, K)).astype(F32))
    x = rng(5).standard_normal((N, K)).astype(F32)
    for repack in (False, True):
        np.testing.assert_array_equal(O.mul_mat(T.Q4_0, w, x, repack=repack),
                                      O.mul_mat(T.Q4_0, w, x, repack=repack, n_threads=2))


@pytest.mark.parametrize("repack", [False, True])
def test_mul_mat_id_is_mul_mat_per_chosen_expert(repack):
    # MUL_MAT_ID rows = MUL_MAT of the chosen expert with that one row (plain: vec_dot either way;
    # repacked: MUL_MAT_ID always takes gemv, a 1-row MUL_MAT does too)
    n_expert, n_used, n_tok, K, M = 4, 2, 3, 256, 16
    w = Q.quantize(T.Q4_0, rng(6).standard_normal((n_expert * M, K)).astype(F32)).reshape(n_expert, M, -1)
    x = rng(7).standard_normal((n_tok, 1, K)).astype(F32)
    ids = np.array([[0, 3], [2, 1], [3, 0]], np.int32)
    out = O.mul_mat_id(T.Q4_0, w, x, ids, repack=repack)
    assert out.shape == (n_tok, n_used, M)
    for t in range(n_tok):
        for i in range(n_used):
            np.testing.assert_array_equal(out[t, i], O.mul_mat(T.Q4_0, w[ids[t, i]], x[t], repack=repack)[0])


def test_quantize_and_get_rows_are_ggml_base():
    # ggml_quantize_chunk = gguf's (= ggml's _ref) quantizer; GET_ROWS = dequantize_row
    x = rng(8).standard_normal((4, 256)).astype(F32)
    for t in (T.Q4_0, T.Q8_0):
        b = O.quantize(t, x)
        np.testing.assert_array_equal(b, Q.quantize(t, x))
        np.testing.assert_array_equal(O.dequantize(t, b, 256), Q.dequantize(t, b, 256))


def test_small_ops():
    # the builders table: unary, binary with broadcast, scalar parameters, a view result (argsort_top_k)
    x = rng(9).standard_normal((3, 40)).astype(F32)
    y = rng(10).standard_normal((1, 40)).astype(F32)
    np.testing.assert_array_equal(O.run("add", x, y), x + y)
    np.testing.assert_array_equal(O.run("scale", x, 0.5), x * F32(0.5))
    np.testing.assert_array_equal(O.run("clamp", x, -0.5, 0.25), np.clip(x, F32(-0.5), F32(0.25)))
    np.testing.assert_allclose(O.run("sum_rows", x)[:, 0], x.sum(axis=1), rtol=1e-6)
    np.testing.assert_array_equal(O.run("argsort", x, 1), np.argsort(-x, axis=1, kind="stable"))
    top = O.run("argsort_top_k", x, 4)
    assert top.shape == (3, 4) and top.dtype == np.int32
    np.testing.assert_array_equal(top, np.argsort(-x, axis=1, kind="stable")[:, :4])
    sm = O.run("soft_max_ext", x, None, 0.5, 0.0)
    e = np.exp(0.5 * x.astype(np.float64) - (0.5 * x).max(axis=1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(axis=1, keepdims=True), rtol=1e-5)
    with O.Graph() as g:                     # soft_max with sinks: an extra logit per head in the sum
        t = g.op("soft_max_ext", g.array(x), None, 1.0, 0.0)
        g.soft_max_add_sinks(t, g.array(np.zeros(1, F32)))
        sk = g.compute(t)
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(sk, e / (e.sum(axis=1, keepdims=True) + np.exp(-x.max(axis=1, keepdims=True))),
                               rtol=1e-5)

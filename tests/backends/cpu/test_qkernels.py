"""Tests for ggml_dist.backends.cpu.qkernels: the numba kernels give the same bits as the numpy reference
quants.mul_mat, order="fast" and order="ggml", for every covered type (and cpu_ops.weights_mul_mat
dispatches to them)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu.ops import ComputeOptions, weights_mul_mat
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.core.types import GGMLType as T

from .test_quants import random_rows

qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")

F32 = np.float32
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16]


def weights(t, M, K, seed):
    if t == T.F16:
        return Q.quantize(T.F16, np.random.default_rng(seed).standard_normal((M, K)).astype(F32))
    w = random_rows(t, M, K, seed=seed)
    # zero blocks: an all-zero first block (d = 0, codes 0) in every third row
    w[::3, :Q.TYPE_TRAITS[t].type_size] = 0
    return w


@pytest.mark.parametrize("t", TYPES)
def test_covered_types_bit_identical(t):
    # every covered type, N in {1, 2, 7, 64}, odd M, zero weight and activation blocks: np.array_equal
    K, M = 512, 37
    w = weights(t, M, K, seed=int(t) + 3)
    xs = (np.random.default_rng(int(t)).standard_normal((64, K)) * 3).astype(F32)
    xs[0, :256] = 0                      # zero activation blocks (Q8_0 d = 0, Q8_K d = 0)
    xs[5, 100] = 40.0                    # one outlier: large isum, amax on an exact tie path
    for N in (1, 2, 7, 64):
        x = xs[:N]
        got = qk.mul_mat_q(t, w, x)
        ref = Q.mul_mat(t, w, x, order="fast")
        assert got.shape == (N, M) and got.dtype == F32
        assert np.array_equal(got, ref), f"{t.name} N={N}: max |diff| {np.abs(got - ref).max()}"
        # the CPU backend's entry point dispatches to the kernels
        np.testing.assert_array_equal(weights_mul_mat(t, w, x, ComputeOptions(numba=True, order="fast")), ref)


@pytest.mark.parametrize("t", TYPES)
def test_ggml_order_bit_identical(t):
    # order="ggml" (AVX2 lane orders; repacked Q4_0/Q4_K chains at M = 64; F16 vec_dot for N = 1 or
    # M = 37, tinyBLAS for N >= 2 and M = 64): numba == numpy for N in {1, 2, 7, 64}, zero blocks
    K = 544 if t == T.F16 else 512          # F16: a K % 32 tail (vec_dot) with K % 8 == 0 (tinyBLAS)
    xs = (np.random.default_rng(int(t) + 1).standard_normal((64, K)) * 3).astype(F32)
    xs[0, :256] = 0
    xs[5, 100] = 40.0
    for M in (37, 64):
        w = weights(t, M, K, seed=int(t) + M)
        for rp in ((None, False) if t in (T.Q4_0, T.Q4_K) and M == 64 else (None,)):
            for N in (1, 2, 7, 64):
                x = xs[:N]
                ref = Q.mul_mat(t, w, x, order="ggml", repacked=rp)
                rk = M % 8 == 0 if rp is None else rp
                got = qk.mul_mat_q(t, w, x, order="ggml", repacked=rk)
                assert got.shape == (N, M) and got.dtype == F32
                assert np.array_equal(got, ref), \
                    f"{t.name} M={M} N={N} repacked={rp}: max |diff| {np.abs(got - ref).max()}"
                if rp is None:
                    np.testing.assert_array_equal(weights_mul_mat(t, w, x, ComputeOptions(numba=True)), ref)


def test_ggml_order_is_not_fast():
    # the two orders really differ (guards against a dispatch that silently ignores `order`)
    K, M = 2048, 64
    w = weights(T.Q4_1, M, K, seed=11)
    x = np.random.default_rng(12).standard_normal((3, K)).astype(F32)
    assert not np.array_equal(Q.mul_mat(T.Q4_1, w, x, order="ggml"), Q.mul_mat(T.Q4_1, w, x, order="fast"))
    assert not np.array_equal(weights_mul_mat(T.Q4_1, w, x, ComputeOptions(numba=True, order="ggml")),
                              weights_mul_mat(T.Q4_1, w, x, ComputeOptions(numba=True, order="fast")))


@pytest.mark.parametrize("t", [T.Q4_0, T.Q6_K])
def test_readonly_strided(t):
    # mapped (read-only) weights, a strided weight view
    K, M = 256, 9
    w = weights(t, M, K, seed=5)
    x = np.random.default_rng(6).standard_normal((3, K)).astype(F32)
    for order in ("fast", "ggml"):
        ref = Q.mul_mat(t, w, x, order=order)
        ro = w.copy()
        ro.flags.writeable = False
        np.testing.assert_array_equal(qk.mul_mat_q(t, ro, x, order=order), ref)
        big = np.zeros((M, 2, w.shape[1] + 3), np.uint8)
        big[:, 0, 3:] = w
        np.testing.assert_array_equal(qk.mul_mat_q(t, big[:, 0, 3:], x, order=order), ref)


def test_threads_do_not_change_results(monkeypatch):
    # K is never split, so 1 thread and all threads give the same bits
    K, M = 1024, 41
    w = weights(T.Q4_K, M, K, seed=8)
    x = np.random.default_rng(9).standard_normal((5, K)).astype(F32)
    n0 = kt.get_threads()
    try:
        kt.set_threads(1)
        one = qk.mul_mat_q(T.Q4_K, w, x)
        one_g = qk.mul_mat_q(T.Q4_K, w, x, order="ggml")
    finally:
        kt.set_threads(n0)
    np.testing.assert_array_equal(qk.mul_mat_q(T.Q4_K, w, x), one)
    np.testing.assert_array_equal(qk.mul_mat_q(T.Q4_K, w, x, order="ggml"), one_g)
    with pytest.raises(ValueError):
        kt.set_threads(0)


def test_not_covered_and_bad_rows():
    # F32/BF16 stay on numpy (mul_mat_q says so); a wrong row length is an error, not garbage
    x = np.ones((1, 64), F32)
    assert qk.mul_mat_q(T.F32, np.ones((2, 64), F32), x) is None
    with pytest.raises(ValueError):
        qk.mul_mat_q(T.Q4_0, np.zeros((2, 30), np.uint8), x)
    with pytest.raises(ValueError):
        qk.mul_mat_q(T.Q4_0, np.zeros((2, 36), np.uint8), x, order="bad")


def test_prep_q8_g_matches_numpy_quantizers():
    # the one-call activation quantization of the N = 1.. ggml path: same codes (in the yr layout) and
    # f16-rounded scales as quants.quantize_q8_0 / _q8_1, including tiny (subnormal f16) and huge scales
    rng = np.random.default_rng(7)
    for K, N in ((64, 1), (576, 3)):
        for scale in (1.0, 1e-6, 3e-3, 1e4, 1e7):
            x = (rng.standard_normal((N, K)) * scale).astype(F32)
            x[0, :32] = 0
            yr = np.empty((N, qk._R * K), np.int8)
            dy = np.empty((N, K // 32), F32)
            sy = np.empty_like(dy)
            for q81 in (False, True):
                assert qk._prep_q8_g(x, q81, qk._F16_LUT, yr, dy, sy)
                with np.errstate(over="ignore"):
                    if q81:
                        qy, d, s = Q.quantize_q8_1(x)
                    else:
                        qy, d = Q.quantize_q8_0(x)
                        s = d
                yg = qy.reshape(N, K // 32, 8, 4)[:, :, qk._PI].transpose(0, 1, 3, 2)[:, :, :, None, :]
                yr2 = np.broadcast_to(yg, (N, K // 32, 4, qk._R, 8)).reshape(N, qk._R * K)
                assert np.array_equal(yr, yr2)
                assert np.array_equal(dy.view(np.uint32), d.view(np.uint32))
                assert np.array_equal(sy.view(np.uint32), s.view(np.uint32))
    x = np.ones((1, 64), F32)
    x[0, 3] = np.nan                                    # non-finite: the caller takes the numpy path
    assert not qk._prep_q8_g(x, True, qk._F16_LUT, np.empty((1, qk._R * 64), np.int8),
                             np.empty((1, 2), F32), np.empty((1, 2), F32))


def test_f16_round_matches_numpy():
    # float32 -> float16 (nearest even) -> float32 for normals, subnormals, ties and overflow
    from numba import njit

    @njit
    def many(v, lut, out):
        for i in range(v.shape[0]):
            out[i] = qk._f16_round(v[i], lut)
    rng = np.random.default_rng(3)
    bits = np.concatenate([rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
                           np.arange(0x33000000 - 5000, 0x48000000 + 5000, 4099, dtype=np.uint32),
                           (np.arange(0, 2 ** 19, 7, dtype=np.uint32) << 13) | np.uint32(0x1000)])
    v = bits.view(F32)
    v = v[np.isfinite(v)]
    out = np.empty_like(v)
    many(v, qk._F16_LUT, out)
    with np.errstate(over="ignore"):
        ref = v.astype(np.float16).astype(F32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_serial_and_parallel_launch_same_bits():
    # small products run on the calling thread, large ones in parallel: the same bits
    rng = np.random.default_rng(11)
    for t in (T.Q4_1, T.Q8_0, T.Q4_K, T.F16):
        w = weights(t, 64, 512, seed=5)
        x = (rng.standard_normal((3, 512)) * 2).astype(F32)
        old = qk._SERIAL_WORK
        try:
            qk._SERIAL_WORK = 0
            par = qk.mul_mat_q(t, w, x, order="ggml")
            qk._SERIAL_WORK = 1 << 40
            ser = qk.mul_mat_q(t, w, x, order="ggml")
        finally:
            qk._SERIAL_WORK = old
        assert np.array_equal(par, ser), t.name


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_get_rows_kernel_dequantizes_rows_as_quants_does(t):
    """qkernels.bind_get_rows: the rows ids of a table, in quants.dequantize's bits (ggml's
    dequantize_row_*), repeated ids and the table's last row included."""
    K, rows = 96, 40
    table = random_rows(t, rows, K, seed=21)
    ids = np.array([3, 0, 39, 3, 17], np.int32)
    out = np.full((len(ids), K), np.nan, np.float32)
    call = qk.bind_get_rows(t, table, ids, out)
    assert call is not None
    call()
    want = Q.dequantize(t, table[ids], K)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    for bad in (rows, -1):                  # a row id outside the table: an error, not a read past it
        ids[1] = bad
        with pytest.raises(IndexError, match="outside the table"):
            call()


def test_get_rows_kernel_declines_what_it_does_not_cover():
    table = random_rows(T.Q4_K, 4, 256, seed=1)
    assert qk.bind_get_rows(T.Q4_K, table, np.zeros(1, np.int32), np.zeros((1, 256), np.float32)) is None
    table = random_rows(T.Q8_0, 4, 64, seed=1)
    assert qk.bind_get_rows(T.Q8_0, table, np.zeros(1, np.int64), np.zeros((1, 64), np.float32)) is None

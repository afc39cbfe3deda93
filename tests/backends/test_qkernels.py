"""Tests for ggml_dist.backends.qkernels: the numba kernels give the same bits as the numpy "fast" path
of quants.mul_mat for every covered type (and quants.mul_mat dispatches to them)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends import quants as Q
from ggml_dist.core.types import GGMLType as T

from .test_quants import random_rows

qk = pytest.importorskip("ggml_dist.backends.qkernels")

F32 = np.float32
TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.F16]


def numpy_fast(t, w, x, monkeypatch):
    monkeypatch.setattr(Q, "USE_NUMBA", False)
    try:
        return Q.mul_mat(t, w, x, order="fast")
    finally:
        monkeypatch.setattr(Q, "USE_NUMBA", True)


def weights(t, M, K, seed):
    if t == T.F16:
        return Q.quantize(T.F16, np.random.default_rng(seed).standard_normal((M, K)).astype(F32))
    w = random_rows(t, M, K, seed=seed)
    # zero blocks: an all-zero first block (d = 0, codes 0) in every third row
    w[::3, :Q.TYPE_TRAITS[t].type_size] = 0
    return w


@pytest.mark.parametrize("t", TYPES)
def test_covered_types_bit_identical(t, monkeypatch):
    # every covered type, N in {1, 2, 7, 64}, odd M, zero weight and activation blocks: np.array_equal
    K, M = 512, 37
    w = weights(t, M, K, seed=int(t) + 3)
    xs = (np.random.default_rng(int(t)).standard_normal((64, K)) * 3).astype(F32)
    xs[0, :256] = 0                      # zero activation blocks (Q8_0 d = 0, Q8_K d = 0)
    xs[5, 100] = 40.0                    # one outlier: large isum, amax on an exact tie path
    for N in (1, 2, 7, 64):
        x = xs[:N]
        got = qk.mul_mat_q(t, w, x)
        ref = numpy_fast(t, w, x, monkeypatch)
        assert got.shape == (N, M) and got.dtype == F32
        assert np.array_equal(got, ref), f"{t.name} N={N}: max |diff| {np.abs(got - ref).max()}"
        # the public entry point dispatches to the kernels
        np.testing.assert_array_equal(Q.mul_mat(t, w, x), ref)


@pytest.mark.parametrize("t", [T.Q4_0, T.Q6_K])
def test_readonly_strided_and_1d(t, monkeypatch):
    # mapped (read-only) weights, a strided weight view, a 1-d activation
    K, M = 256, 9
    w = weights(t, M, K, seed=5)
    x = np.random.default_rng(6).standard_normal((3, K)).astype(F32)
    ref = numpy_fast(t, w, x, monkeypatch)
    ro = w.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(Q.mul_mat(t, ro, x), ref)
    big = np.zeros((M, 2, w.shape[1] + 3), np.uint8)
    big[:, 0, 3:] = w
    np.testing.assert_array_equal(Q.mul_mat(t, big[:, 0, 3:], x), ref)
    np.testing.assert_array_equal(Q.mul_mat(t, w, x[1]), ref[1])


def test_threads_do_not_change_results(monkeypatch):
    # K is never split, so 1 thread and all threads give the same bits
    K, M = 1024, 41
    w = weights(T.Q4_K, M, K, seed=8)
    x = np.random.default_rng(9).standard_normal((5, K)).astype(F32)
    n0 = qk.get_threads()
    try:
        qk.set_threads(1)
        one = qk.mul_mat_q(T.Q4_K, w, x)
    finally:
        qk.set_threads(n0)
    np.testing.assert_array_equal(qk.mul_mat_q(T.Q4_K, w, x), one)
    with pytest.raises(ValueError):
        qk.set_threads(0)


def test_not_covered_and_bad_rows():
    # F32/BF16 stay on numpy (mul_mat_q says so); a wrong row length is an error, not garbage
    x = np.ones((1, 64), F32)
    assert qk.mul_mat_q(T.F32, np.ones((2, 64), F32), x) is None
    with pytest.raises(ValueError):
        qk.mul_mat_q(T.Q4_0, np.zeros((2, 30), np.uint8), x)

"""Tests for ggml_dist.backends.cpu.avx2: the AVX2 int8 kernels (vpmaddubsw + vpmaddwd) read a packed Q4_0,
Q4_1, Q8_0, Q5_0 or Q5_1 weight with exactly quants.mul_mat(order="ggml")'s bits (numpy path) for every row, token
and block count, zero blocks, outliers and the codes nearest int16 saturation included; qpack chooses
them where AVX2 is there and VNNI is not, or with GGML_DIST_FORCE_AVX2=1. Where the CPU lacks AVX2
everything here but the choice of kernels is skipped."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.core.types import GGMLType as T

from .test_quants import random_rows

qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")
qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")
avx2 = qpack.avx2

F32 = np.float32
TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1]
AVX2 = qpack.Kernels.AVX2
needs_avx2 = pytest.mark.skipif(not avx2.AVAILABLE, reason="the CPU lacks AVX2/FMA/F16C (or GGML_DIST_NO_AVX2)")


def oracle(t, w, x):
    """quants.mul_mat, the numpy reference (ggml's AVX2 orders; repacked Q4_0 iff M % 8 == 0)."""
    return Q.mul_mat(t, w, x, order="ggml")


def weights(t, M, K, seed):
    w = random_rows(t, M, K, seed=seed)
    bs = Q.TYPE_TRAITS[t].type_size
    w[::3, :bs] = 0                                    # zero blocks (d = 0) in every third row
    if t == T.Q8_0:
        w[1::3, 2:34:5] = 0x80                         # code -128 (outside quantize's range, valid in a file)
    if t in (T.Q5_0, T.Q5_1):                          # the last block's 5th bits all set (its qh)
        oh = 2 if t == T.Q5_0 else 4
        w[1::3, oh - bs:oh - bs + 4] = 0xFF
    return w


def activations(N, K, seed):
    x = (np.random.default_rng(seed).standard_normal((N, K)) * 3).astype(F32)
    x[0, :32] = 0                                      # an all-zero block: d = 0
    x[N // 2, 5 % K] = 300.0                           # an outlier block
    return x


def check(t, w, x, pw=None):
    pw = pw or qpack.PackedWeight(t, w, kernels=AVX2)
    got, ref = pw.mul_mat(x), oracle(t, w, x)
    assert got.shape == ref.shape and got.dtype == F32
    assert np.array_equal(got, ref), \
        f"{t.name} M={w.shape[0]} N={x.shape[0]}: {np.sum(got != ref)} differ, max |diff| {np.abs(got - ref).max()}"


@needs_avx2
@pytest.mark.parametrize("K", [32, 96, 512])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 8, 64, 136])
@pytest.mark.parametrize("t", TYPES)
def test_bit_identical_every_shape(t, M, K):
    # M = 8, 64, 136: Q4_0 as the repacked chain; 1-7: the 8-lane order, a group that is mostly padding
    # (Q5 takes the lanes order at every M: each M is another count of padding rows in its one group)
    w = weights(t, M, K, seed=M + K)
    pw = qpack.PackedWeight(t, w, kernels=AVX2)
    assert pw.kernels is AVX2 and not pw.vnni and pw.chain == (t == T.Q4_0 and M % 8 == 0)
    xs = activations(64, K, seed=int(t) + K)
    for N in (1, 2, 3, 4, 7, 8, 64):
        check(t, w, xs[:N], pw)


@needs_avx2
@pytest.mark.parametrize("t", TYPES)
def test_codes_at_the_int16_limits(t):
    # the largest pair sums vpmaddubsw can see: every weight code at its extreme (Q8_0: -128, so |x| =
    # 128; Q4: nibble 15, the chain summing a block's 8 pairs per int16; Q5: 31, every 5th bit set)
    # against codes of +-127 with the same sign pattern (Q8_0 pairs 2 * 128 * 127 = 32512), and the
    # opposite one
    M, K = 16, 256
    bs = Q.TYPE_TRAITS[t].type_size
    has_m = t in (T.Q4_1, T.Q5_1)
    w = np.zeros((M, K // 32, bs), np.uint8)
    w[..., :2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)      # d = 0.5 (Q4_1, Q5_1: m = 0.5 too)
    if has_m:
        w[..., 2:4] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    codes = slice(4, None) if has_m else slice(2, None)                  # Q5: qh and the nibbles
    w[..., codes] = 0x80 if t == T.Q8_0 else 0xFF
    w = w.reshape(M, -1)
    x = np.full((4, K), 2.0, F32)
    x[1] = -2.0
    x[2, ::2] = -2.0                                   # alternating signs: pairs cancel
    x[3] = np.where(np.arange(K) % 64 < 32, 1e3, -1e-3)
    check(t, w, x)


@needs_avx2
@pytest.mark.parametrize("M", [96, 192])
@pytest.mark.parametrize("t", TYPES)
def test_threads_do_not_change_bits(t, M):
    """M = 192: 3 groups over 2 threads, so the tokens are split too, in slices of whole token pairs."""
    K = 512
    w = weights(t, M, K, seed=7)
    pw = qpack.PackedWeight(t, w, kernels=AVX2)
    x = activations(40, K, seed=8)
    before = kt.get_threads()
    try:
        kt.set_threads(1)
        one = [pw.mul_mat(x[:n]) for n in (1, 3, 8, 13, 40)]
        kt.set_threads(min(2, kt.numba.config.NUMBA_NUM_THREADS))
        two = [pw.mul_mat(x[:n]) for n in (1, 3, 8, 13, 40)]
    finally:
        kt.set_threads(before)
    for n, a, b in zip((1, 3, 8, 13, 40), one, two):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, oracle(t, w, x[:n]))


@needs_avx2
@settings(max_examples=25, deadline=None)
@given(t=st.sampled_from(TYPES), M=st.integers(1, 80), nb=st.integers(1, 6), N=st.integers(1, 12),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_bit_identical_random_shapes(t, M, nb, N, seed, scale):
    K = 32 * nb
    w = random_rows(t, M, K, seed=seed)
    x = (np.random.default_rng(seed + 1).standard_normal((N, K)) * scale).astype(F32)
    check(t, w, x)


@settings(max_examples=60, deadline=None)
@given(scale=st.sampled_from([1e-45, 1e-40, 3.7e-37, 1e-30, 1e-3, 1.0, 1e30, 3.4e38]),
       seed=st.integers(0, 2**16), tie=st.booleans())
def test_activation_codes_never_minus_128(scale, seed, tie):
    """vpsignb's -(-128) would wrap: _prep's codes stay in [-127, 127] wherever the block scale is not 0
    (-amax itself maps to -127; a block with id = inf has d = 0, see avx2.py)."""
    r = np.random.default_rng(seed)
    x = (r.uniform(-1, 1, (2, 256)) * scale).astype(F32)                 # finite up to FLT_MAX
    if tie:                                             # a block's amax on a negative element, repeated
        x[:, 32:64] = -np.abs(x[:, 32:64]).max(axis=1, keepdims=True)
    N, K = x.shape
    Y, Yb = np.zeros((N, K), F32), np.zeros((N, K), np.int8)
    dy, sy, ys = (np.zeros((N, K // 32), F32) for _ in range(3))
    assert qpack._prep(x, False, Y, Yb, dy, sy, ys)
    live = np.repeat(dy != 0, 32, axis=1)
    assert Yb[live].min(initial=0) >= -127


def test_default_kernels_follow_the_host(monkeypatch):
    # VNNI first, else AVX2, else the float kernels; FORCED picks AVX2 over VNNI
    for has_vnni, has_avx2, forced, want in [(True, True, False, "VNNI"), (True, True, True, "AVX2"),
                                             (False, True, False, "AVX2"), (False, False, False, "FLOAT"),
                                             (True, False, False, "VNNI")]:
        monkeypatch.setattr(qpack.vnni, "AVAILABLE", has_vnni)
        monkeypatch.setattr(avx2, "AVAILABLE", has_avx2)
        monkeypatch.setattr(avx2, "FORCED", forced)
        assert qpack.default_kernels() is qpack.Kernels[want], (has_vnni, has_avx2, forced)
    w = random_rows(T.Q4_0, 8, 64, seed=1)
    monkeypatch.setattr(qpack.vnni, "AVAILABLE", False)
    monkeypatch.setattr(avx2, "AVAILABLE", True)
    assert qpack.PackedWeight(T.Q4_0, w).kernels is AVX2                # packing follows the choice
    monkeypatch.setattr(avx2, "AVAILABLE", False)
    assert qpack.PackedWeight(T.Q4_0, w).kernels is qpack.Kernels.FLOAT
    with pytest.raises(ValueError, match="AVX2"):
        qpack.PackedWeight(T.Q4_0, w, kernels="avx2")
    with pytest.raises(ValueError, match="not both"):
        qpack.PackedWeight(T.Q4_0, w, vnni_layout=False, kernels="float")


@pytest.mark.skipif(not avx2._host_has_avx2(), reason="the CPU lacks AVX2/FMA/F16C")
@pytest.mark.parametrize("env, want", [({"GGML_DIST_FORCE_AVX2": "1"}, "AVX2"),
                                       ({"GGML_DIST_NO_VNNI": "1"}, "AVX2"),
                                       ({"GGML_DIST_NO_VNNI": "1", "GGML_DIST_NO_AVX2": "1"}, "FLOAT"),
                                       ({"GGML_DIST_FORCE_AVX2": "1", "GGML_DIST_NO_AVX2": "1"}, "host")])
def test_environment_switches(env, want):
    # read once, at import: a fresh interpreter with the switches set ("host": VNNI where the CPU has it)
    clean = {k: v for k, v in os.environ.items() if k not in
             ("GGML_DIST_FORCE_AVX2", "GGML_DIST_NO_VNNI", "GGML_DIST_NO_AVX2")}
    code = "from ggml_dist.backends.cpu import qpack; print(qpack.default_kernels().name)"
    got = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == (("VNNI" if qpack.vnni._host_has_vnni() else "FLOAT") if want == "host" else want)


@needs_avx2
def test_q8_0_layout_keeps_the_codes():
    # avx2's Q8_0 codes are the file's int8 codes, in vnni's byte order (vnni stores them + 128)
    w = random_rows(T.Q8_0, 64, 128, seed=2)
    a = qpack.PackedWeight(T.Q8_0, w, kernels=AVX2)
    assert a.qs.dtype == np.uint8 and a.qs.nbytes == 64 * 4 * 32
    if qpack.vnni.AVAILABLE:
        v = qpack.PackedWeight(T.Q8_0, w, kernels="vnni")
        np.testing.assert_array_equal(a.qs ^ np.uint8(0x80), v.qs)
        np.testing.assert_array_equal(a.d, v.d)

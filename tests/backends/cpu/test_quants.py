"""Tests for ggml_dist.backends.cpu.quants: formats vs gguf.quants, §1.2 activation quantizers vs scalar
references, mul_mat vs slow references built from ggml-numerics.md §1.4."""
from __future__ import annotations

import math

import gguf.quants as gq
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType as G
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from ggml_dist.backends.cpu import quants as Q
from ggml_dist.core.types import GGMLType as T, row_size

F32 = np.float32
BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
GGUF_QUANT = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
K_TYPES = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def rng(seed=0):
    return np.random.default_rng(seed)


def random_rows(t, M, K, seed=0):
    """Random but finite blocks: quantized random data with random bytes in the code fields."""
    r = rng(seed)
    x = (r.standard_normal((M, K)) * r.uniform(0.01, 3, (M, 1))).astype(F32)
    b = Q.quantize(t, x)
    if t in GGUF_QUANT or t in K_TYPES:
        # randomize everything except the f16/f32 scale fields, which keep finite sane values
        nb = b.shape[1] // Q.TYPE_TRAITS[t].type_size
        bb = b.reshape(M, nb, -1)
        keep = {T.Q4_0: [0, 1], T.Q4_1: [0, 1, 2, 3], T.Q5_0: [0, 1], T.Q5_1: [0, 1, 2, 3], T.Q8_0: [0, 1],
                T.Q2_K: [80, 81, 82, 83], T.Q3_K: [108, 109], T.Q4_K: [0, 1, 2, 3], T.Q5_K: [0, 1, 2, 3],
                T.Q6_K: [208, 209], T.MXFP4: [0]}[t]
        mask = np.ones(bb.shape[-1], bool)
        mask[keep] = False
        bb[..., mask] = r.integers(0, 256, (M, nb, int(mask.sum())), dtype=np.uint8)
        b = bb.reshape(M, -1)
    return b


# ------------------------------------------------------------------------------------------------
# formats
@pytest.mark.parametrize("t", [*BLOCK_TYPES, T.MXFP4, T.F16, T.BF16])
def test_dequantize_random_bytes_matches_gguf(t):
    K = 512
    b = rng(1).integers(0, 256, (16, row_size(t, K)), dtype=np.uint8)
    ours = Q.dequantize(t, b, K)
    ref = gq.dequantize(b, G(int(t))).astype(F32)
    assert ours.dtype == F32 and ours.shape == (16, K)
    assert np.array_equal(ours, ref, equal_nan=True)
    fin = np.isfinite(ref)
    assert np.array_equal(ours[fin].view(np.uint32), ref[fin].view(np.uint32))


@pytest.mark.parametrize("t", GGUF_QUANT)
def test_quantize_roundtrip_gguf(t):
    x = (rng(2).standard_normal((3, 4, 256)) * 2).astype(F32)
    x[0, 0, :32] = 0                       # an all-zero block
    b = Q.quantize(t, x)
    assert b.dtype == np.uint8 and b.shape == (3, 4, row_size(t, 256))
    ref_b = gq.quantize(x.reshape(-1, 256), G(int(t))).reshape(b.shape)
    assert np.array_equal(b, ref_b)
    ours = Q.dequantize(t, b, 256)
    assert ours.shape == x.shape
    assert np.array_equal(ours, gq.dequantize(b.reshape(-1, b.shape[-1]), G(int(t))).reshape(x.shape))


@pytest.mark.parametrize("t", K_TYPES)
def test_kquant_quantize_valid(t):
    x = rng(3).standard_normal((5, 512)).astype(F32)
    x[1, :256] = 0
    b = Q.quantize(t, x)
    y = Q.dequantize(t, b, 512)
    assert np.array_equal(y, gq.dequantize(b, G(int(t))))
    rel = {T.Q2_K: 0.45, T.Q3_K: 0.25, T.Q4_K: 0.12, T.Q5_K: 0.06, T.Q6_K: 0.03}[t]
    assert np.sqrt(((x - y) ** 2).mean()) < rel
    assert np.all(y[1, :256] == 0)


def test_q8_K_format_roundtrip():
    x = rng(4).standard_normal((2, 512)).astype(F32)
    b = Q.quantize(T.Q8_K, x)
    assert b.shape == (2, 584)
    qs, d, bs = Q.quantize_q8_K(x)
    np.testing.assert_array_equal(Q.dequantize(T.Q8_K, b, 512), (qs.astype(F32) * d[..., None]).reshape(2, 512))
    np.testing.assert_array_equal(Q._dec_q8_K(b.reshape(2, 2, 292))[2], bs)


def test_f16_bf16_quantize():
    x = np.array([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 65504, 70000, 1e-6, 1e-8, np.inf, -np.inf, np.nan,
                  3.14159, -2.5e38, 1.00390625, 1.01171875], F32)
    b16 = Q.quantize(T.F16, x)
    assert np.array_equal(b16.view(np.float16), x.astype(np.float16), equal_nan=True)
    bb = Q.quantize(T.BF16, x)
    ref = gq.quantize(x, G.BF16)
    assert np.array_equal(bb, np.ascontiguousarray(ref).view(np.uint8).reshape(bb.shape))
    u = bb.view(np.uint16)
    assert u[3] == 0x3F80 and u[4] == 0x3F82   # ties to even: 1+2^-8 -> 1.0 ; 1+3*2^-8 -> 1+2^-6
    assert u[11] & 0x7FC0 == 0x7FC0            # NaN quiet
    assert np.array_equal(Q.dequantize(T.BF16, bb, len(x)), (u.astype(np.uint32) << 16).view(F32), equal_nan=True)


def test_dequantize_strided_and_leading_axes():
    t = T.Q4_K
    b = random_rows(t, 24, 512, seed=5)
    big = np.zeros((24, 2, b.shape[1] + 7), np.uint8)
    big[:, 1, 3:3 + b.shape[1]] = b
    view = big[::2, 1, 3:3 + b.shape[1]]
    assert not view.flags.c_contiguous
    ref = Q.dequantize(t, b, 512)
    np.testing.assert_array_equal(Q.dequantize(t, view, 512), ref[::2])
    np.testing.assert_array_equal(Q.dequantize(t, b.reshape(2, 3, 4, -1), 512), ref.reshape(2, 3, 4, 512))


# ------------------------------------------------------------------------------------------------
# activation quantizers vs scalar references (§1.2)
def ref_q8_0(x):
    x = np.asarray(x, F32).reshape(-1, 32)
    qs, ds, ss = [], [], []
    for blk in x:
        amax = F32(0)
        for v in blk:
            amax = max(amax, abs(v))
        d = F32(amax / F32(127))
        id_ = F32(F32(127) / amax) if amax != 0 else F32(0)
        q = [int(np.rint(F32(v * id_))) for v in blk]
        qs.append(q)
        ds.append(float(np.float16(d)))
        ss.append(float(np.float16(F32(d * F32(sum(q))))))
    return np.array(qs), np.array(ds, F32), np.array(ss, F32)


def ref_q8_K(x):
    x = np.asarray(x, F32).reshape(-1, 256)
    qs, ds, bsums = [], [], []
    for blk in x:
        amax, mx = F32(0), F32(0)
        for v in blk:
            if abs(v) > amax:
                amax, mx = abs(v), v
        if amax == 0:
            qs.append([0] * 256)
            ds.append(0.0)
            bsums.append([0] * 16)
            continue
        iscale = F32(F32(-127) / mx)
        q = [min(127, int(np.rint(F32(iscale * v)))) for v in blk]
        qs.append(q)
        ds.append(F32(F32(1) / iscale))
        bsums.append([sum(q[16 * j:16 * j + 16]) for j in range(16)])
    return np.array(qs), np.array(ds, F32), np.array(bsums)


def special_rows(bs):
    r = rng(6)
    rows = [np.zeros(bs, F32),
            (r.standard_normal(bs) * 10).astype(F32),
            np.concatenate([[127.0], (np.arange(bs - 1) % 9 - 4) + 0.5]).astype(F32),   # exact ties
            np.concatenate([[-127.0], (np.arange(bs - 1) % 9 - 4) + 0.5]).astype(F32),
            np.full(bs, -3.0, F32), np.full(bs, 2.0, F32),
            (r.standard_normal(bs) * 1e-30).astype(F32)]
    rows[1][5] = -rows[1][5] if rows[1][5] else 1.0
    r2 = r.standard_normal(bs).astype(F32)
    r2[7] = 4.0
    r2[3] = -4.0   # |max| tie: first one wins (index 3, negative)
    rows.append(r2)
    return np.stack(rows)


finite32 = hnp.arrays(F32, st.integers(1, 3).map(lambda n: (n * 256,)),
                      elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)
                      .map(lambda v: v if abs(v) > 1e-30 else 0.0))   # 127/amax must stay finite


def check_q8(x):
    qs, d = Q.quantize_q8_0(x)
    q1, d1, s1 = Q.quantize_q8_1(x)
    rq, rd, rs = ref_q8_0(x)
    np.testing.assert_array_equal(qs.reshape(-1, 32), rq)
    np.testing.assert_array_equal(d.reshape(-1), rd)
    np.testing.assert_array_equal(q1.reshape(-1, 32), rq)
    np.testing.assert_array_equal(d1.reshape(-1), rd)
    np.testing.assert_array_equal(s1.reshape(-1), rs)
    kq, kd, kb = Q.quantize_q8_K(x)
    rkq, rkd, rkb = ref_q8_K(x)
    np.testing.assert_array_equal(kq.reshape(-1, 256), rkq)
    np.testing.assert_array_equal(kd.reshape(-1), rkd)
    np.testing.assert_array_equal(kb.reshape(-1, 16), rkb)


def test_activation_quantizers_special():
    x = special_rows(256)
    check_q8(x)
    qs, d = Q.quantize_q8_0(x[2])
    assert qs.dtype == np.int8 and d.dtype == F32 and qs.shape == (8, 32)
    assert list(qs[0, 1:6]) == [-4, -2, -2, 0, 0]          # ties to even (id = 1)
    kq, kd, kb = Q.quantize_q8_K(x)
    assert kd[0, 0] == 0 and np.all(kq[0] == 0)
    assert kd[7, 0] > 0                                       # sign of the first largest |x| (-4) kept


@settings(max_examples=25, deadline=None)
@given(finite32)
def test_activation_quantizers_hypothesis(x):
    check_q8(x[None])


# ------------------------------------------------------------------------------------------------
# mul_mat reference (§1.4), slow, float64 on exact integers
def scalar_decode(t, blk):
    """One block -> dict of codes and scales, straight from the C layouts (independent of Q._dec_*)."""
    f16 = lambda o: float(np.frombuffer(bytes(blk[o:o + 2]), np.float16)[0])
    blk = [int(v) for v in blk]
    if t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        d = f16(0)
        m = f16(2) if t in (T.Q4_1, T.Q5_1) else 0.0
        if t == T.Q8_0:
            return dict(d=d, q=list(np.frombuffer(bytes(blk[2:34]), np.int8).astype(int)))
        off = {T.Q4_0: 2, T.Q4_1: 4, T.Q5_0: 6, T.Q5_1: 8}[t]
        qh = int.from_bytes(bytes(blk[off - 4:off]), "little") if t in (T.Q5_0, T.Q5_1) else 0
        q = [0] * 32
        for j in range(16):
            q[j] = blk[off + j] & 15
            q[j + 16] = blk[off + j] >> 4
        for e in range(32):
            q[e] += 16 * ((qh >> e) & 1) if t in (T.Q5_0, T.Q5_1) else 0
        if t == T.Q4_0:
            q = [v - 8 for v in q]
        if t == T.Q5_0:
            q = [v - 16 for v in q]
        return dict(d=d, m=m, q=q)
    if t in (T.Q4_K, T.Q5_K):
        d, dmin = f16(0), f16(2)
        s = blk[4:16]
        sc, mn = [], []
        for j in range(8):
            if j < 4:
                sc.append(s[j] & 63); mn.append(s[j + 4] & 63)
            else:
                sc.append((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)); mn.append((s[j + 4] >> 4) | ((s[j] >> 6) << 4))
        qs = blk[16:144] if t == T.Q4_K else blk[48:176]
        q = [0] * 256
        for c in range(4):
            for l in range(32):
                q[64 * c + l] = qs[32 * c + l] & 15
                q[64 * c + 32 + l] = qs[32 * c + l] >> 4
                if t == T.Q5_K:
                    q[64 * c + l] += 16 * ((blk[16 + l] >> (2 * c)) & 1)
                    q[64 * c + 32 + l] += 16 * ((blk[16 + l] >> (2 * c + 1)) & 1)
        return dict(d=d, dmin=dmin, sc=sc, m=mn, q=q)
    if t == T.Q6_K:
        ql, qh = blk[0:128], blk[128:192]
        sc = list(np.frombuffer(bytes(blk[192:208]), np.int8).astype(int))
        q = [0] * 256
        for h in range(2):
            for l in range(32):
                a, b_, c = ql[64 * h + l], ql[64 * h + l + 32], qh[32 * h + l]
                q[128 * h + l] = (a & 15) | ((c & 3) << 4)
                q[128 * h + l + 32] = (b_ & 15) | (((c >> 2) & 3) << 4)
                q[128 * h + l + 64] = (a >> 4) | (((c >> 4) & 3) << 4)
                q[128 * h + l + 96] = (b_ >> 4) | (((c >> 6) & 3) << 4)
        return dict(d=f16(208), sc=sc, q=q)
    if t == T.Q2_K:
        q = [0] * 256
        for h in range(2):
            for j in range(4):
                for l in range(32):
                    q[128 * h + 32 * j + l] = (blk[16 + 32 * h + l] >> (2 * j)) & 3
        return dict(d=f16(80), dmin=f16(82), sc=[v & 15 for v in blk[:16]], m=[v >> 4 for v in blk[:16]], q=q)
    if t == T.Q3_K:
        s = blk[96:108]
        sc = []
        for i in range(16):
            lo = (s[i] & 15) if i < 8 else (s[i - 8] >> 4)
            hi = (s[8 + i % 4] >> (2 * (i // 4))) & 3
            sc.append((lo | (hi << 4)) - 32)
        q = [0] * 256
        for h in range(2):
            for j in range(4):
                for l in range(32):
                    v = (blk[32 + 32 * h + l] >> (2 * j)) & 3
                    hb = (blk[l] >> (4 * h + j)) & 1
                    q[128 * h + 32 * j + l] = v - (0 if hb else 4)
        return dict(d=f16(108), sc=sc, q=q)
    raise AssertionError(t)


def ref_dot(t, wrow, xrow):
    """float64 value of the §1.4 formula (exact integer sums, f32 scale products), plus sum|w||x|."""
    K = len(xrow)
    bs = Q.TYPE_TRAITS[t].type_size
    blocks = [wrow[i * bs:(i + 1) * bs] for i in range(len(wrow) // bs)]
    total = 0.0
    if t in (T.Q4_0, T.Q5_0, T.Q8_0, T.Q4_1, T.Q5_1):
        qy, dy, sy = ref_q8_0(xrow)
        for b, blk in enumerate(blocks):
            c = scalar_decode(t, blk)
            isum = sum(int(a) * int(v) for a, v in zip(c["q"], qy[b]))
            total += float(F32(c["d"] * dy[b])) * isum
            if t in (T.Q4_1, T.Q5_1):
                total += c["m"] * float(sy[b])
        return total
    qy, dy, bsums = ref_q8_K(xrow)
    for b, blk in enumerate(blocks):
        c = scalar_decode(t, blk)
        y = qy[b]
        if t in (T.Q4_K, T.Q5_K):
            d = float(F32(F32(dy[b]) * F32(c["d"])))
            dm = float(F32(F32(dy[b]) * F32(c["dmin"])))
            isum = sum(c["sc"][j] * sum(c["q"][32 * j + i] * int(y[32 * j + i]) for i in range(32)) for j in range(8))
            msum = sum(c["m"][j] * (int(bsums[b][2 * j]) + int(bsums[b][2 * j + 1])) for j in range(8))
            total += d * isum - dm * msum
        elif t == T.Q6_K:
            d = float(F32(F32(dy[b]) * F32(c["d"])))
            isum = sum(c["sc"][e // 16] * c["q"][e] * int(y[e]) for e in range(256))
            isum -= 32 * sum(c["sc"][j] * int(bsums[b][j]) for j in range(16))
            total += d * isum
        elif t == T.Q2_K:
            d = float(F32(F32(dy[b]) * F32(c["d"])))
            dm = float(F32(F32(dy[b]) * F32(c["dmin"])))
            isum = sum(c["sc"][e // 16] * c["q"][e] * int(y[e]) for e in range(256))
            msum = sum(c["m"][j] * int(bsums[b][j]) for j in range(16))
            total += d * isum - dm * msum
        elif t == T.Q3_K:
            d = float(F32(F32(dy[b]) * F32(c["d"])))
            total += d * sum(c["sc"][e // 16] * c["q"][e] * int(y[e]) for e in range(256))
    return total


@pytest.mark.parametrize("t", BLOCK_TYPES)
@pytest.mark.parametrize("M,N", [(8, 1), (6, 3)])
@pytest.mark.parametrize("order", ["ggml", "fast"])
def test_mul_mat_quant_vs_reference(t, M, N, order):
    K = 512
    w = random_rows(t, M, K, seed=7 + M)
    x = (rng(8 + N).standard_normal((N, K)) * 2).astype(F32)
    x[0, :32] = 0
    out = Q.mul_mat(t, w, x, order=order)
    assert out.shape == (N, M) and out.dtype == F32
    wd = gq.dequantize(w, G(int(t))).astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T + 1e-30
    ref = np.array([[ref_dot(t, w[m], x[n]) for m in range(M)] for n in range(N)])
    assert np.all(np.abs(out - ref) / scale < 1e-5)
    if t in (T.Q4_0, T.Q4_K):
        alt = Q.mul_mat(t, w, x, repacked=not (M % 8 == 0), order=order)
        assert np.all(np.abs(alt - ref) / scale < 1e-5)
    # activation quantization is small relative to the exact product
    assert np.all(np.abs(out - x.astype(np.float64) @ wd.T) / scale < 3e-2)


@pytest.mark.parametrize("t", [*BLOCK_TYPES, T.MXFP4, T.F16, T.BF16, T.F32])
def test_mul_mat_exact(t):
    K, M, N = 256, 20, 3
    x = rng(9).standard_normal((N, K)).astype(F32)
    if t == T.F32:
        w = rng(10).standard_normal((M, K)).astype(F32)
        wd = w.astype(np.float64)
    else:
        w = random_rows(t, M, K, seed=10) if t in BLOCK_TYPES or t == T.MXFP4 else \
            Q.quantize(t, rng(10).standard_normal((M, K)).astype(F32))
        wd = Q.dequantize(t, w, K).astype(np.float64)
    out = Q.mul_mat(t, w, x, exact=True)
    ref = x.astype(np.float64) @ wd.T
    scale = np.abs(x).astype(np.float64) @ np.abs(wd).T
    assert np.all(np.abs(out - ref) / scale < 1e-5)


@pytest.mark.parametrize("t", [T.F32, T.F16, T.BF16])
@pytest.mark.parametrize("M,N,K", [(8, 1, 96), (8, 4, 96), (6, 4, 100), (5, 2, 40)])
@pytest.mark.parametrize("order", ["ggml", "fast"])
def test_mul_mat_float(t, M, N, K, order):
    r = rng(11)
    wf = r.standard_normal((M, K)).astype(F32)
    x = r.standard_normal((N, K)).astype(F32)
    w = wf if t == T.F32 else Q.quantize(t, wf)
    wd = Q.dequantize(t, w, K).astype(np.float64)
    xd = Q.dequantize(t, Q.quantize(t, x), K).astype(np.float64)   # X converted to the vec_dot type
    out = Q.mul_mat(t, w, x, order=order)
    ref = xd @ wd.T
    scale = np.abs(xd) @ np.abs(wd).T
    assert np.all(np.abs(out - ref) / scale < 1e-6)
    if t == T.F16:   # float16 arrays are accepted as well
        np.testing.assert_array_equal(Q.mul_mat(t, w.view(np.float16), x, order=order), out)


def test_mul_mat_f16_vec_dot_order():
    """n = 1, K = 64: 4x8 lanes, fold a0+a2, a1+a3, a0+a1, HB -- emulate with numpy scalars."""
    r = rng(12)
    K = 64
    w = r.standard_normal((3, K)).astype(np.float16)
    x = r.standard_normal((1, K)).astype(F32)
    xh = x.astype(np.float16).astype(F32)
    out = Q.mul_mat(T.F16, w.view(np.uint8), x, order="ggml")
    for m in range(3):
        acc = np.zeros(32, F32)
        for i in range(K):
            acc[i % 32] = F32(np.float64(w[m, i]) * np.float64(xh[0, i]) + np.float64(acc[i % 32]))
        a = acc.reshape(4, 8)
        a0 = (a[0] + a[2]) + (a[1] + a[3])
        hb = ((a0[0] + a0[4]) + (a0[1] + a0[5])) + ((a0[2] + a0[6]) + (a0[3] + a0[7]))
        assert out[0, m] == hb


def test_mul_mat_q4_0_lane_order_bitexact():
    """Scalar emulation of the AVX2 vec_dot (8 lanes, fma, HA) and of the repacked chain."""
    K, M, N = 128, 8, 2
    w = random_rows(T.Q4_0, M, K, seed=13)
    x = rng(14).standard_normal((N, K)).astype(F32)
    qy, dy = Q.quantize_q8_0(x)
    vec = Q.mul_mat(T.Q4_0, w, x, repacked=False, order="ggml")
    rep = Q.mul_mat(T.Q4_0, w, x, repacked=True, order="ggml")
    np.testing.assert_array_equal(Q.mul_mat(T.Q4_0, w, x, order="fast"), rep)
    for m in range(M):
        for n in range(N):
            acc = [F32(0)] * 8
            chain = F32(0)
            for b in range(K // 32):
                c = scalar_decode(T.Q4_0, w[m, 18 * b:18 * b + 18])
                d = F32(F32(c["d"]) * dy[n, b])
                for k in range(8):
                    lane = sum(c["q"][4 * k + i] * int(qy[n, b, 4 * k + i]) for i in range(4))
                    acc[k] = F32(float(d) * lane + float(acc[k]))
                isum = sum(c["q"][e] * int(qy[n, b, e]) for e in range(32))
                chain = F32(float(isum) * float(d) + float(chain))
            ha = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
            assert vec[n, m] == ha
            assert rep[n, m] == chain


@pytest.mark.parametrize("order", ["ggml", "fast"])
def test_mul_mat_strided_and_chunked(monkeypatch, order):
    def mm(*args, **kw):
        return Q.mul_mat(*args, order=order, **kw)
    t, K, M, N = T.Q4_1, 256, 40, 3
    w = random_rows(t, M, K, seed=15)
    x = rng(16).standard_normal((N, K)).astype(F32)
    ref = mm(t, w, x)
    big = np.zeros((M, 2, w.shape[1] + 5), np.uint8)
    big[:, 0, 5:] = w
    xb = np.zeros((N, 2 * K), F32)
    xb[:, ::2] = x
    np.testing.assert_array_equal(mm(t, big[:, 0, 5:], xb[:, ::2]), ref)
    np.testing.assert_array_equal(mm(t, w, x[0]), ref[0])
    monkeypatch.setattr(Q, "_CHUNK_BYTES", 1)      # forces 8-row chunks
    np.testing.assert_array_equal(mm(t, w, x), ref)
    np.testing.assert_array_equal(mm(t, w, x, exact=True), mm(t, w, x, exact=True))
    wk = random_rows(T.Q6_K, M, K, seed=17)
    a = mm(T.Q6_K, wk, x)
    monkeypatch.setattr(Q, "_CHUNK_BYTES", 48 << 20)
    np.testing.assert_array_equal(mm(T.Q6_K, wk, x), a)


def test_vec_dot_type_table():
    assert Q.VEC_DOT_TYPE[T.Q4_1] == T.Q8_1 and Q.VEC_DOT_TYPE[T.Q5_0] == T.Q8_0
    assert Q.VEC_DOT_TYPE[T.Q6_K] == T.Q8_K and Q.VEC_DOT_TYPE[T.F16] == T.F16
    assert all(Q.VEC_DOT_TYPE[t] == T.Q8_K for t in K_TYPES)


def tiled_dot(t, wrow, xrow):
    """The tiled K-quant kernel's value (llama.cpp 0.3.36 tiled_run_microtile_avx2), scalar, from
    scalar_decode: per superblock r = f32(d*f32(isum)), r = fnmadd(dmin, f32(msum), r), acc = fma(r, dy)."""
    bs = Q.TYPE_TRAITS[t].type_size
    qy, dy, bsums = ref_q8_K(xrow)
    acc = F32(0)
    for b in range(len(wrow) // bs):
        c = scalar_decode(t, wrow[b * bs:(b + 1) * bs])
        y = [int(v) for v in qy[b]]
        if t in (T.Q4_K, T.Q5_K):
            isum = sum(c["sc"][e // 32] * c["q"][e] * y[e] for e in range(256))
            msum = sum(c["m"][j] * (int(bsums[b][2 * j]) + int(bsums[b][2 * j + 1])) for j in range(8))
        else:
            isum = sum(c["sc"][e // 16] * c["q"][e] * y[e] for e in range(256))
            msum = sum(c["m"][j] * int(bsums[b][j]) for j in range(16)) if t == T.Q2_K else None
            if t == T.Q6_K:
                isum -= 32 * sum(c["sc"][j] * int(bsums[b][j]) for j in range(16))
        r = F32(F32(c["d"]) * F32(isum))
        if msum is not None:           # one rounding of r - dmin*msum (the product is exact in double)
            r = F32(float(r) - float(F32(c["dmin"])) * float(F32(msum)))
        acc = F32(float(r) * float(F32(dy[b])) + float(acc))
    return acc


@pytest.mark.parametrize("t", K_TYPES)
def test_mul_mat_tiled_kquants(t):
    # from 8 rows of X on, a K-quant weight outside the repack buffer takes ggml's tiled kernel (bit for
    # bit the scalar formula); 7 rows still take vec_dot, and so does a slice of 7 rows stacked to 14
    K, M = 512, 6
    w = random_rows(t, M, K, seed=30 + int(t))
    x = (rng(31).standard_normal((8, K)) * 2).astype(F32)
    x[3, :256] = 0
    assert Q.takes_tiled(t, False, 8, "ggml") and not Q.takes_tiled(t, False, 7, "ggml")
    assert not Q.takes_tiled(t, True, 8, "ggml") and not Q.takes_tiled(t, False, 8, "fast")
    for numba in (False, True):       # the reference, then its compiled twin
        def mm(w, x, vec_n=None, numba=numba):
            if numba:
                return pytest.importorskip("ggml_dist.backends.cpu.qkernels").mul_mat_q(
                    t, w, x, order="ggml", repacked=False, vec_n=vec_n)
            return Q.mul_mat(t, w, x, order="ggml", repacked=False, vec_n=vec_n)
        out = mm(w, x)
        ref = np.array([[tiled_dot(t, w[m], x[n]) for m in range(M)] for n in range(8)], F32)
        np.testing.assert_array_equal(out, ref)
        vec = mm(w, x[:7])
        np.testing.assert_array_equal(vec, np.concatenate([mm(w, x[i:i + 1]) for i in range(7)]))
        stacked = mm(w, np.concatenate([x[:7], x[:7]]), vec_n=7)
        np.testing.assert_array_equal(stacked, np.concatenate([vec, vec]))
    if t in (T.Q4_K, T.Q5_K, T.Q6_K):          # the vec_dot lanes really are another order
        assert not np.array_equal(out, Q.mul_mat(t, w, x, order="ggml", repacked=False, vec_n=1))

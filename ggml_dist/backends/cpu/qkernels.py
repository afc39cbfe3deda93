"""numba MUL_MAT kernels on quantized weights, bit-identical to quants.mul_mat(order="fast") and, through
``_mm_g`` / ``_mm_f16`` modes 1-2, to quants.mul_mat(order="ggml") (the x86 AVX2 lane orders, see the
"order=ggml" section below; repacked Q4_0/Q4_K/MXFP4 and Q2_K/Q3_K have the "fast" numerics in both orders).
MXFP4 has a kernel of its own (``_mm_mxfp4``, its section below) on _mm_g's layout.

The weights stay in their GGUF blocks: each kernel decodes a group of ``_R`` weight rows at a time into a
small int8 scratch (codes) plus per-block scales, then dots those rows with every activation row.
Activations arrive already quantized by quants.quantize_q8_0 / _q8_1 / _q8_K (int8 codes, f32 scales),
so the numerics are the numpy "fast" order exactly (ggml-numerics.md §1.4; quants module docstring):
* Q4_0/Q5_0/Q8_0: ``acc = f32(f64(f32(isum_b)) * f64(f32(dx*dy)) + f64(acc))`` over blocks; Q4_1/Q5_1 add
  the sequential f32 sum of ``mx*sy`` at the end.
* Q4_K/Q5_K: the same chain over superblocks with ``isum = sum_j sc_j*isum_j`` and ``d = f32(dy*dx)``,
  a second chain for ``minsum`` with ``dm = f32(dy*dmin)``; result ``acc - accm``.
* Q6_K: one chain with the (exact) integer superblock sum not rounded to f32 first.
* Q2_K/Q3_K: per superblock ``f32(f32(d*isum) - f32(dm*msum))`` summed in f32 (Q3_K without the min).
* tiled (K-quants, order="ggml", quants.takes_tiled): ``r = f32(d*f32(isum))``, ``fnmadd(dmin, f32(msum), r)``
  where the type has mins, one chain ``acc = fma(r, dy, acc)`` (``_group``'s ``tiled``).
* F16: X rounded to f16; one float64 sum per output, rounded once (numpy: float64 BLAS). The float64 sum of
  f16 x f16 products is exact for any realistic data, so its order does not matter.
Integers are exact (int64 lanes), so only the float steps above fix the result.

Decode (N = 1) and prefill (N >= 2) share one loop nest: decoding a row group once and reusing each
activation load for ``_R`` rows is what makes N = 1 memory-bound rather than decode-bound.

Decode-sized calls: for Q4_0..Q8_0 in the "ggml" order the activation quantization and the ``yr`` layout
run in one numba call (``_prep_q8_g``, same bits as quants.quantize_q8_0/_q8_1); products of at most
``_SERIAL_WORK`` multiply-adds run on the calling thread (``*_serial``: the same row-group bodies without a
parallel launch, which costs more than such a product).

API: ``mul_mat_q(wtype, w, x, order="fast", repacked=False, vec_n=None) -> f32 [N, M]`` (None when the
type is not covered; ``vec_n`` as in quants.mul_mat), ``COVERED``. Threads: threads.py.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ...core.types import GGMLType, row_size
from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from . import quants as Q
from .blocks import BLOCKS, GGUF_KINDS, REPACK_TYPES
from .entry import bound
from .threads import get_threads, launch

T = GGMLType
F32 = np.float32
F64 = np.float64

_R = 4        # weight rows per pass: each activation load is reused _R times
# multiply-adds (N*M*K) below which a kernel runs on the calling thread: a parallel launch costs more
_SERIAL_WORK = 1 << 17

# kind codes passed to the kernels (one generic kernel per block size, branches per row, not per element):
# blocks.py's gguf_kind, 0..9 = Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K
_KIND = {t: k for k, t in enumerate(GGUF_KINDS)}
COVERED = frozenset(_KIND) | {T.F16, T.MXFP4}
# the block layouts as module constants, which numba compiles as literals: block bytes per kind, and the
# codes' offset for kinds 0..6 (Q5: of the nibbles; the 32-bit qh sits just before them)
_BS = tuple(BLOCKS[t].nbytes for t in GGUF_KINDS)
_OQ = tuple(BLOCKS[t].off("qs") for t in GGUF_KINDS[:7])
_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0 = (BLOCKS[t] for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0))
_OM = _Q4_1.off("m")                    # Q4_1/Q5_1's m
assert _Q5_1.off("m") == _OM
_K_SC, _K_DMIN, _Q5K_QH = BLOCKS[T.Q4_K].off("scales"), BLOCKS[T.Q4_K].off("dmin"), BLOCKS[T.Q5_K].off("qh")
assert (BLOCKS[T.Q5_K].off("scales"), BLOCKS[T.Q5_K].off("dmin")) == (_K_SC, _K_DMIN)
_Q6_QH, _Q6_SC, _Q6_D = (BLOCKS[T.Q6_K].off(f) for f in ("qh", "scales", "d"))
_Q2_QS, _Q2_D, _Q2_DMIN = (BLOCKS[T.Q2_K].off(f) for f in ("qs", "d", "dmin"))
_Q3_QS, _Q3_SC, _Q3_D = (BLOCKS[T.Q3_K].off(f) for f in ("qs", "scales", "d"))
_Q4_0_BS, _Q4_1_BS, _Q5_0_BS, _Q5_1_BS, _Q8_0_BS = (f.nbytes for f in (_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0))
_Q4_0_QS, _Q4_1_QS, _Q5_0_QS, _Q5_1_QS, _Q8_0_QS = (f.off("qs") for f in (_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0))
_MXFP4_BS, _MXFP4_QS = BLOCKS[T.MXFP4].nbytes, BLOCKS[T.MXFP4].off("qs")
assert BLOCKS[T.MXFP4].off("e") == 0

# f16 bits -> f32 value (exact); numba has no float16 on the CPU
_F16_LUT = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
# E8M0 byte -> 2^(e-128) (GGML_E8M0_TO_FP32_HALF, MXFP4's scale)
_E8M0_HALF = Q.e8m0_to_fp32_half(np.arange(256))


# ------------------------------------------------------------------------------------------------
# row decoders: one weight row -> 8-code words and per-block scales.
# Codes are written as uint64 words of 8 int8 codes (SWAR unpacking, no per-byte loop). Word layout
# cw[jw * ns + s] = codes of elements 8*jw .. 8*jw+7 of sub-block s (W words per sub-block, ns sub-blocks
# per row), so the dot below runs over long unit-stride lanes with no horizontal sums but one per 8 codes.
_U = np.uint64
_M1 = _U(0x0101010101010101)
_M2 = _U(0x0303030303030303)
_M4 = _U(0x0F0F0F0F0F0F0F0F)
_MH = _U(0x8080808080808080)
_M32 = _U(0x2020202020202020)
_S4 = _U(4)

# byte x -> word with 0x10 in byte k iff bit k of x (Q5_0/Q5_1 5th bits)
_SPREAD = np.array([sum(((x >> k) & 1) << (8 * k + 4) for k in range(8)) for x in range(256)], np.uint64)


@njit(cache=True)
def _f16(lut, row, o):
    return lut[np.int64(row[o]) | (np.int64(row[o + 1]) << 8)]


@njit(cache=True)
def _u64(row, o):
    """8 bytes at row[o:] as a little-endian word (one unaligned load)."""
    q = row[o:o + 8]
    return (_U(q[0]) | (_U(q[1]) << _U(8)) | (_U(q[2]) << _U(16)) | (_U(q[3]) << _U(24))
            | (_U(q[4]) << _U(32)) | (_U(q[5]) << _U(40)) | (_U(q[6]) << _U(48)) | (_U(q[7]) << _U(56)))


@njit(cache=True, inline="always")
def _k_words(row, o, oq, c, i, q5):
    """Q4_K/Q5_K superblock at byte o (codes at o + oq): word i of 32-byte chunk c as the 8 low-nibble codes
    (sub-block 2c) and the 8 high-nibble codes (sub-block 2c+1), with Q5_K's 5th bits when q5."""
    u = _u64(row, o + oq + 32 * c + 8 * i)
    lo4 = u & _M4
    hi4 = (u >> _S4) & _M4
    if q5:
        h = _u64(row, o + _Q5K_QH + 8 * i)
        lo4 |= ((h >> _U(2 * c)) & _M1) << _S4
        hi4 |= ((h >> _U(2 * c + 1)) & _M1) << _S4
    return lo4, hi4


@njit(cache=True)
def _dec_row(kind, row, lut, sp, cw, ns, d1, d2, sc, mn):
    """kind 0..4: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (W = 4, ns = nb; Q4_0/Q5_0 codes NOT centred: the kernel
    subtracts bias*ysum); 5, 6: Q4_K, Q5_K (W = 4, 8 sub-blocks of 32); 7, 8, 9: Q6_K, Q2_K, Q3_K (W = 2,
    16 sub-blocks of 16). d1 = d per block, d2 = m (Q4_1/Q5_1) or dmin; sc, mn per sub-block."""
    nb = d1.shape[0]
    if kind <= 4:
        bs = _BS[kind]
        for b in range(nb):
            o = b * bs
            d1[b] = _f16(lut, row, o)
            if kind == 4:
                for i in range(4):
                    cw[i * ns + b] = _u64(row, o + _Q8_0_QS + 8 * i)
                continue
            if kind == 1 or kind == 3:
                d2[b] = _f16(lut, row, o + _OM)
            oq = _OQ[kind]
            u0 = _u64(row, oq + o)
            u1 = _u64(row, oq + o + 8)
            w0 = u0 & _M4
            w1 = u1 & _M4
            w2 = (u0 >> _S4) & _M4
            w3 = (u1 >> _S4) & _M4
            if kind >= 2:
                oh = o + oq - 4
                w0 |= sp[row[oh]]
                w1 |= sp[row[oh + 1]]
                w2 |= sp[row[oh + 2]]
                w3 |= sp[row[oh + 3]]
            cw[b] = w0
            cw[ns + b] = w1
            cw[2 * ns + b] = w2
            cw[3 * ns + b] = w3
    elif kind <= 6:                                     # Q4_K (144 B) / Q5_K (176 B)
        bs = _BS[kind]
        oq = _OQ[kind]
        for b in range(nb):
            o = b * bs
            d1[b] = _f16(lut, row, o)
            d2[b] = _f16(lut, row, o + _K_DMIN)
            for j in range(4):                          # get_scale_min_k4
                lo = np.int64(row[o + _K_SC + j])
                mid = np.int64(row[o + _K_SC + 4 + j])
                hi = np.int64(row[o + _K_SC + 8 + j])
                sc[b * 8 + j] = lo & 63
                mn[b * 8 + j] = mid & 63
                sc[b * 8 + 4 + j] = (hi & 15) | ((lo >> 6) << 4)
                mn[b * 8 + 4 + j] = (hi >> 4) | ((mid >> 6) << 4)
            for c in range(4):                          # 32-byte chunk c: sub-blocks 2c (low), 2c+1 (high)
                s0 = b * 8 + 2 * c
                for i in range(4):
                    cw[i * ns + s0], cw[i * ns + s0 + 1] = _k_words(row, o, oq, c, i, kind == 6)
    else:                                               # 16 sub-blocks of 16: element 128h + 32g + 8i + k
        for b in range(nb):
            if kind == 7:                               # Q6_K: ql[128], qh[64], sc[16], d
                o = b * _BS[7]
                d1[b] = _f16(lut, row, o + _Q6_D)
                for s in range(16):
                    sc[b * 16 + s] = np.int8(row[o + _Q6_SC + s])
            elif kind == 8:                             # Q2_K: scales[16], qs[64], d, dmin
                o = b * _BS[8]
                d1[b] = _f16(lut, row, o + _Q2_D)
                d2[b] = _f16(lut, row, o + _Q2_DMIN)
                for s in range(16):
                    v = np.int64(row[o + s])
                    sc[b * 16 + s] = v & 15
                    mn[b * 16 + s] = v >> 4
            else:                                       # Q3_K: hmask[32], qs[64], scales[12], d
                o = b * _BS[9]
                d1[b] = _f16(lut, row, o + _Q3_D)
                for j in range(8):
                    v = np.int64(row[o + _Q3_SC + j])
                    sc[b * 16 + j] = v & 15
                    sc[b * 16 + 8 + j] = v >> 4
                for k in range(4):
                    v = np.int64(row[o + _Q3_SC + 8 + k])
                    for g in range(4):
                        sc[b * 16 + 4 * g + k] = (sc[b * 16 + 4 * g + k] | (((v >> (2 * g)) & 3) << 4)) - 32
            for h in range(2):
                for g in range(4):
                    for i in range(4):
                        if kind == 7:
                            lw = _u64(row, o + 64 * h + 32 * (g & 1) + 8 * i)
                            hw = _u64(row, o + _Q6_QH + 32 * h + 8 * i)
                            q = ((lw >> _U(4 * (g >> 1))) & _M4) | (((hw >> _U(2 * g)) & _M2) << _S4)
                            q = ((q | _MH) - _M32) ^ _MH              # bytewise q - 32
                        elif kind == 8:
                            q = (_u64(row, o + _Q2_QS + 32 * h + 8 * i) >> _U(2 * g)) & _M2
                        else:
                            lo = (_u64(row, o + _Q3_QS + 32 * h + 8 * i) >> _U(2 * g)) & _M2
                            hb = (_u64(row, o + 8 * i) >> _U(4 * h + g)) & _M1
                            q = ((lo | _MH) - ((hb ^ _M1) << _U(2))) ^ _MH   # bytewise lo - 4*(1-hb)
                        cw[(i & 1) * ns + b * 16 + 8 * h + 2 * g + (i >> 1)] = q


# ------------------------------------------------------------------------------------------------
# kernels
@njit(cache=True)
def _vdot(c8, y8, W, ns, part, isub):
    """isub[s] = sum of c8*y8 over sub-block s, both in the word layout (int8 [W * ns * 8])."""
    L = ns * 8
    c = c8[0:L]
    y = y8[0:L]
    for i in range(L):
        part[i] = np.int32(c[i]) * np.int32(y[i])
    for jw in range(1, W):
        c = c8[jw * L:(jw + 1) * L]
        y = y8[jw * L:(jw + 1) * L]
        for i in range(L):
            part[i] += np.int32(c[i]) * np.int32(y[i])
    for s in range(ns):
        p = part[8 * s:8 * s + 8]
        isub[s] = ((np.int64(p[0]) + p[1]) + (np.int64(p[2]) + p[3])) + \
            ((np.int64(p[4]) + p[5]) + (np.int64(p[6]) + p[7]))


@njit(parallel=True, cache=True, fastmath=False)
def _mm_q(kind, w, yw, dy, sy, ysum, bsums, lut, sp, out, n_chunks, n_gemm, tiled):
    """w uint8 [M, row_bytes]; yw int8 [N, K] (word layout); dy f32 [N, nb]; sy f32 [N, nb] (Q8_1 s);
    ysum int64 [N, nb] (Q8_0 block sums); bsums int64 [N, nb*16] (Q8_K); out f32 [N, M].
    n_gemm: activation rows 0 .. n_gemm-1 take repacked Q4_K's gemm order (4 fma steps per superblock).
    tiled: the K-quants' tiled kernel order (quants.takes_tiled)."""
    M = w.shape[0]
    N, K = yw.shape
    W = 2 if kind >= 7 else 4
    ns = K // (8 * W)
    nb = K // 32 if kind <= 4 else K // 256
    nsub = ns // nb
    bias = 8 if kind == 0 else (16 if kind == 2 else 0)
    n_groups = (M + _R - 1) // _R
    n_chunks = min(n_groups, n_chunks)                           # scratch allocated once per chunk
    for ch in prange(n_chunks):
        cw = np.empty((_R, W * ns), np.uint64)
        d1 = np.zeros((_R, nb), F32)
        d2 = np.zeros((_R, nb), F32)
        sc = np.zeros((_R, ns), np.int64)
        mn = np.zeros((_R, ns), np.int64)
        part32 = np.empty(ns * 8, np.int32)
        isub = np.empty((_R, ns), np.int64)
        acc = np.empty(_R, F32)
        accm = np.empty(_R, F32)
        for g in range(ch * n_groups // n_chunks, (ch + 1) * n_groups // n_chunks):
            _group(kind, w, yw, dy, sy, ysum, bsums, lut, sp, out, g * _R, min(_R, M - g * _R), N, W, ns, nb,
                   nsub, bias, cw, d1, d2, sc, mn, part32, isub, acc, accm, n_gemm, tiled)


@njit(cache=True)
def _group(kind, w, yw, dy, sy, ysum, bsums, lut, sp, out, r0, nr, N, W, ns, nb, nsub, bias,
           cw, d1, d2, sc, mn, part32, isub, acc, accm, n_gemm, tiled):
    """Rows r0 .. r0+nr-1: decode once, then every activation row."""
    for r in range(nr):
        _dec_row(kind, w[r0 + r], lut, sp, cw[r], ns, d1[r], d2[r], sc[r], mn[r])
    for n in range(N):
        yn = yw[n]
        for r in range(nr):
            _vdot(cw[r].view(np.int8), yn, W, ns, part32, isub[r])
        for r in range(nr):
            acc[r] = 0
            accm[r] = 0
        for b in range(nb):
            ddy = dy[n, b]
            for r in range(nr):
                if kind <= 4:
                    isum = isub[r, b] - bias * ysum[n, b]
                    d = d1[r, b] * ddy                                # f32(dx*dy), exact
                    acc[r] = F32(F64(F32(isum)) * F64(d) + F64(acc[r]))
                    continue
                if kind == 5 and n < n_gemm:                          # ggml_gemm_q4_K_8x8_q8_K: one
                    dm = ddy * d2[r, b]                               # fma per 64 values (2 sub-blocks)
                    d = ddy * d1[r, b]
                    for q in range(4):
                        j0 = b * nsub + 2 * q
                        isum = sc[r, j0] * isub[r, j0] + sc[r, j0 + 1] * isub[r, j0 + 1]
                        k0 = b * 16 + 4 * q
                        m = mn[r, b * 8 + 2 * q] * (bsums[n, k0] + bsums[n, k0 + 1]) + \
                            mn[r, b * 8 + 2 * q + 1] * (bsums[n, k0 + 2] + bsums[n, k0 + 3])
                        acc[r] = F32(F64(F32(isum)) * F64(d) + F64(acc[r]))
                        accm[r] = F32(F64(F32(m)) * F64(dm) + F64(accm[r]))
                    continue
                isum = 0
                for j in range(nsub):
                    isum += sc[r, b * nsub + j] * isub[r, b * nsub + j]
                if tiled:                     # f32(d*f32(isum)), fnmadd(dmin, f32(minsum)), fma(., dy)
                    res = F32(d1[r, b] * F32(isum))
                    if kind == 5 or kind == 6 or kind == 8:
                        m = 0
                        if kind == 8:
                            for j in range(16):
                                m += mn[r, b * 16 + j] * bsums[n, b * 16 + j]
                        else:
                            for j in range(8):
                                m += mn[r, b * 8 + j] * (bsums[n, b * 16 + 2 * j] + bsums[n, b * 16 + 2 * j + 1])
                        res = F32(F64(res) - F64(d2[r, b]) * F64(F32(m)))
                    acc[r] = F32(F64(res) * F64(ddy) + F64(acc[r]))
                    continue
                d = ddy * d1[r, b]                                    # f32(dy*dx), rounds
                if kind <= 6:                                         # Q4_K, Q5_K
                    m = 0
                    for j in range(8):
                        m += mn[r, b * 8 + j] * (bsums[n, b * 16 + 2 * j] + bsums[n, b * 16 + 2 * j + 1])
                    dm = ddy * d2[r, b]
                    acc[r] = F32(F64(F32(isum)) * F64(d) + F64(acc[r]))
                    accm[r] = F32(F64(F32(m)) * F64(dm) + F64(accm[r]))
                elif kind == 7:                                       # Q6_K: isum not rounded
                    acc[r] = F32(F64(isum) * F64(d) + F64(acc[r]))
                elif kind == 8:                                       # Q2_K
                    m = 0
                    for j in range(16):
                        m += mn[r, b * 16 + j] * bsums[n, b * 16 + j]
                    dm = ddy * d2[r, b]
                    term = d * F32(isum) - dm * F32(m)
                    acc[r] = term if b == 0 else acc[r] + term
                else:                                                 # Q3_K
                    term = d * F32(isum)
                    acc[r] = term if b == 0 else acc[r] + term
        if kind == 1 or kind == 3:                                    # + sequential f32 sum of m*s
            for r in range(nr):
                summs = d2[r, 0] * sy[n, 0]
                for b in range(1, nb):
                    summs += d2[r, b] * sy[n, b]
                acc[r] += summs
        for r in range(nr):
            out[n, r0 + r] = acc[r] - accm[r] if kind == 5 or kind == 6 else acc[r]


@njit(parallel=True, cache=True, fastmath=False)
def _mm_f16(w, y, lut, out, mode):
    """w uint16 [M, K] (f16 bits); y f64 [N, K] (values already rounded to f16); out f32 [N, M].
    mode 0: "fast" (one float64 sum, rounded once); 1: ggml_vec_dot_f16 (4 x 8 f32 lanes over 32-element
    steps, fold, HB; tail summed in double); 2: tinyBLAS (one 8-lane f32 accumulator, HA)."""
    n_groups = (w.shape[0] + _R - 1) // _R
    n_chunks = min(n_groups, 64)
    for ch in prange(n_chunks):
        _mm_f16_rows(w, y, lut, out, mode, ch * n_groups // n_chunks, (ch + 1) * n_groups // n_chunks)


@njit(cache=True, fastmath=False)
def _mm_f16_serial(w, y, lut, out, mode):
    """_mm_f16 on the calling thread (no parallel launch: small matrices)."""
    _mm_f16_rows(w, y, lut, out, mode, np.int64(0), (w.shape[0] + _R - 1) // _R)


@njit(cache=True, fastmath=False)
def _mm_f16_rows(w, y, lut, out, mode, g_lo, g_hi):
    """_mm_f16 for the row groups g_lo .. g_hi - 1."""
    M, K = w.shape
    N = y.shape[0]
    K8 = K - K % 8
    K32 = K - K % 32
    for g in range(g_lo, g_hi):
        r0 = g * _R
        nr = min(_R, M - r0)
        wf = np.empty((_R, K), F64)
        a = np.empty(8, F64)
        acc = np.empty(32, F32)
        for r in range(nr):
            wr = w[r0 + r]
            for k in range(K):
                wf[r, k] = lut[wr[k]]
        for n in range(N):
            yn = y[n]
            for r in range(nr):
                wr = wf[r]
                if mode == 0:
                    for l in range(8):
                        a[l] = 0.0
                    for k in range(0, K8, 8):      # 8 independent partial sums (exact, see docstring)
                        for l in range(8):
                            a[l] += wr[k + l] * yn[k + l]
                    s = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
                    for k in range(K8, K):
                        s += wr[k] * yn[k]
                    out[n, r0 + r] = F32(s)
                elif mode == 2:
                    for l in range(8):
                        acc[l] = 0
                    for k in range(0, K8, 8):
                        for l in range(8):
                            acc[l] = F32(wr[k + l] * yn[k + l] + F64(acc[l]))
                    out[n, r0 + r] = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + \
                        ((acc[1] + acc[5]) + (acc[3] + acc[7]))
                else:
                    for l in range(32):
                        acc[l] = 0
                    for k in range(0, K32, 32):
                        for l in range(32):
                            acc[l] = F32(wr[k + l] * yn[k + l] + F64(acc[l]))
                    for l in range(8):
                        acc[l] = (acc[l] + acc[16 + l]) + (acc[8 + l] + acc[24 + l])
                    res = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
                    if K32 < K:
                        sd = F64(res)
                        for k in range(K32, K):
                            sd += F64(F32(wr[k] * yn[k]))
                        res = F32(sd)
                    out[n, r0 + r] = res




# ------------------------------------------------------------------------------------------------
# order="ggml": the AVX2 lane orders of quants.mul_mat(order="ggml") (ggml-numerics.md §1.5)
# A group of _R = 4 weight rows is decoded into one int8 scratch in which each 32-element group (Q4_0..Q8_0
# block, Q4_K/Q5_K sub-block, Q6_K 32-vector) g of row r is 4 words of 8 codes: byte p of word i holds
# element 4*_PI[p] + i (ggml lane _PI[p] = 2*(p & 3) + (p >> 2)), at c[128g + 32i + 8r + p]. So the 32
# accumulators "lane _PI[p] of row r" (position 8r + p) of one group are four unit-stride 32-wide int8
# products, and the per-block fma runs over 32 independent lanes (one row's 8-lane chain alone is
# latency-bound). _PI makes the layout a plain 4x4 byte transpose of the natural-order code words (_put4).
# Activations are permuted the same way and repeated for the _R rows.
_PI = np.array([0, 2, 4, 6, 1, 3, 5, 7], np.int64)
_MB = _U(0x00FF00FF00FF00FF)
_MW = _U(0x0000FFFF0000FFFF)
_M8 = _U(0x0808080808080808)
_M16 = _U(0x1010101010101010)


@njit(cache=True)
def _put4(cw, o, n0, n1, n2, n3):
    """Natural code words n0..n3 (byte t of nq = element 8q + t of a 32-group) -> cw[o + 4i], i = 0..3,
    byte p of word i = element 4*_PI[p] + i (two 4x4 byte transposes side by side)."""
    t = ((n0 >> _U(8)) ^ n1) & _MB
    n1 ^= t
    n0 ^= t << _U(8)
    t = ((n2 >> _U(8)) ^ n3) & _MB
    n3 ^= t
    n2 ^= t << _U(8)
    t = ((n0 >> _U(16)) ^ n2) & _MW
    n2 ^= t
    n0 ^= t << _U(16)
    t = ((n1 >> _U(16)) ^ n3) & _MW
    n3 ^= t
    n1 ^= t << _U(16)
    cw[o] = n0
    cw[o + 4] = n1
    cw[o + 8] = n2
    cw[o + 12] = n3


@njit(cache=True)
def _dec_row_g32(kind, row, lut, sp, r, cw, dw, d2):
    """_dec_row_g for kinds 0..4 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): one loop per type with its block layout
    as constants (the generic loop with the layout in variables ran ~3x slower)."""
    nb = d2.shape[0]
    if kind == 0:
        _dec_blocks_g32(row, lut, sp, r, cw, dw, d2, nb, _Q4_0_BS, _Q4_0_QS, False, False, _M8)
    elif kind == 1:
        _dec_blocks_g32(row, lut, sp, r, cw, dw, d2, nb, _Q4_1_BS, _Q4_1_QS, True, False, _U(0))
    elif kind == 2:
        _dec_blocks_g32(row, lut, sp, r, cw, dw, d2, nb, _Q5_0_BS, _Q5_0_QS, False, True, _M16)
    elif kind == 3:
        _dec_blocks_g32(row, lut, sp, r, cw, dw, d2, nb, _Q5_1_BS, _Q5_1_QS, True, True, _U(0))
    else:
        for b in range(nb):
            o = b * _Q8_0_BS
            d = _f16(lut, row, o)
            for p in range(8):
                dw[32 * b + 8 * r + p] = d
            oq = o + _Q8_0_QS
            _put4(cw, 16 * b + r, _u64(row, oq), _u64(row, oq + 8), _u64(row, oq + 16), _u64(row, oq + 24))


@njit(cache=True, inline="always")
def _dec_blocks_g32(row, lut, sp, r, cw, dw, d2, nb, bs, oq, has_m, has_h, center):
    """Blocks of a Q4_0/Q4_1/Q5_0/Q5_1 row (bs bytes, codes at oq, m at 2 if has_m, 5th bits at oq - 4 if
    has_h, codes minus `center` bytewise) -> the _dec_row_g layout."""
    for b in range(nb):
        o = b * bs
        d = _f16(lut, row, o)
        for p in range(8):
            dw[32 * b + 8 * r + p] = d
        if has_m:
            d2[b] = _f16(lut, row, o + _OM)
        u0 = _u64(row, oq + o)
        u1 = _u64(row, oq + o + 8)
        w0 = u0 & _M4
        w1 = u1 & _M4
        w2 = (u0 >> _S4) & _M4
        w3 = (u1 >> _S4) & _M4
        if has_h:
            oh = o + oq - 4
            w0 |= sp[row[oh]]
            w1 |= sp[row[oh + 1]]
            w2 |= sp[row[oh + 2]]
            w3 |= sp[row[oh + 3]]
        if center != _U(0):                             # bytewise q - 8 / q - 16
            w0 = ((w0 | _MH) - center) ^ _MH
            w1 = ((w1 | _MH) - center) ^ _MH
            w2 = ((w2 | _MH) - center) ^ _MH
            w3 = ((w3 | _MH) - center) ^ _MH
        _put4(cw, 16 * b + r, w0, w1, w2, w3)


@njit(cache=True)
def _dec_row_g(kind, row, lut, sp, r, cw, dw, d2, scw, mn):
    """Row r of a group -> cw (uint64 view of the code scratch; Q4_0/Q5_0/Q8_0 signed, others unsigned),
    dw[32b + 8r + p] = d of block b, d2[b] = m (Q4_1/Q5_1) or dmin (Q4_K/Q5_K); scw[32g + 8r + p] = scale
    of position p of 32-group g (K-quants); mn = Q4_K/Q5_K mins (8 per superblock) or Q6_K scales (16)."""
    nb = d2.shape[0]
    if kind <= 4:
        _dec_row_g32(kind, row, lut, sp, r, cw, dw, d2)
    elif kind <= 6:                                     # Q4_K (144 B) / Q5_K (176 B)
        bs = _BS[kind]
        oq = _OQ[kind]
        for b in range(nb):
            o = b * bs
            d = _f16(lut, row, o)
            for p in range(8):
                dw[32 * b + 8 * r + p] = d
            d2[b] = _f16(lut, row, o + _K_DMIN)
            for j in range(4):                          # get_scale_min_k4
                lo = np.int64(row[o + _K_SC + j])
                mid = np.int64(row[o + _K_SC + 4 + j])
                hi = np.int64(row[o + _K_SC + 8 + j])
                s0 = lo & 63
                s1 = (hi & 15) | ((lo >> 6) << 4)
                for p in range(8):
                    scw[32 * (8 * b + j) + 8 * r + p] = s0
                    scw[32 * (8 * b + 4 + j) + 8 * r + p] = s1
                mn[b * 8 + j] = mid & 63
                mn[b * 8 + 4 + j] = (hi >> 4) | ((mid >> 6) << 4)
            for ch in range(4):                         # 32-byte chunk: low nibbles sub 2ch, high 2ch+1
                lw0, hw0 = _k_words(row, o, oq, ch, 0, kind == 6)
                lw1, hw1 = _k_words(row, o, oq, ch, 1, kind == 6)
                lw2, hw2 = _k_words(row, o, oq, ch, 2, kind == 6)
                lw3, hw3 = _k_words(row, o, oq, ch, 3, kind == 6)
                g = 8 * b + 2 * ch
                _put4(cw, 16 * g + r, lw0, lw1, lw2, lw3)
                _put4(cw, 16 * (g + 1) + r, hw0, hw1, hw2, hw3)
    else:                                               # Q6_K: ql[128], qh[64], sc[16], d; unsigned 0..63
        for b in range(nb):
            o = b * 210
            d = _f16(lut, row, o + 208)
            for p in range(8):
                dw[32 * b + 8 * r + p] = d
            for s in range(16):
                mn[b * 16 + s] = np.int8(row[o + 192 + s])
            for v in range(8):                          # 32-vector v: lanes 0-3 sub-block 2v, 4-7 2v+1
                for p in range(8):
                    scw[32 * (8 * b + v) + 8 * r + p] = mn[b * 16 + 2 * v + ((p >> 1) & 1)]
            for h in range(2):
                for g in range(4):                      # 32-vector 4h + g: elements 128h + 32g + 8i + t
                    n0 = _U(0)
                    n1 = _U(0)
                    n2 = _U(0)
                    n3 = _U(0)
                    for i in range(4):
                        lw = _u64(row, o + 64 * h + 32 * (g & 1) + 8 * i)
                        hw = _u64(row, o + 128 + 32 * h + 8 * i)
                        q = ((lw >> _U(4 * (g >> 1))) & _M4) | (((hw >> _U(2 * g)) & _M2) << _S4)
                        if i == 0:
                            n0 = q
                        elif i == 1:
                            n1 = q
                        elif i == 2:
                            n2 = q
                        else:
                            n3 = q
                    _put4(cw, 16 * (8 * b + 4 * h + g) + r, n0, n1, n2, n3)


@njit(parallel=True, cache=True, fastmath=False)
def _mm_g(kind, w, yr, dy, sy, bsums, lut, sp, out, n_chunks):
    """order="ggml" for kinds 0..7 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K; not repacked).
    w uint8 [M, row_bytes]; yr int8 [N, _R*K] (layout above); dy f32 [N, nb]; sy f32 [N, nb] (Q8_1 s);
    bsums int32 [N, nb*16] (Q8_K); out f32 [N, M]."""
    n_groups = (w.shape[0] + _R - 1) // _R
    n_chunks = min(n_groups, n_chunks)
    for ch in prange(n_chunks):
        _mm_g_rows(kind, w, yr, dy, sy, bsums, lut, sp, out, ch * n_groups // n_chunks,
                   (ch + 1) * n_groups // n_chunks)


@njit(cache=True, fastmath=False)
def _mm_g_serial(kind, w, yr, dy, sy, bsums, lut, sp, out):
    """_mm_g on the calling thread (no parallel launch: small matrices)."""
    _mm_g_rows(kind, w, yr, dy, sy, bsums, lut, sp, out, np.int64(0), (w.shape[0] + _R - 1) // _R)


@njit(cache=True, fastmath=False)
def _mm_g_rows(kind, w, yr, dy, sy, bsums, lut, sp, out, g_lo, g_hi):
    """_mm_g for the row groups g_lo .. g_hi - 1 (rows _R*g ..)."""
    M = w.shape[0]
    N = yr.shape[0]
    K = yr.shape[1] // _R
    nb = K // 32 if kind <= 4 else K // 256
    ng = K // 32
    if True:
        cw = np.zeros(_R * K // 8, np.uint64)
        c = cw.view(np.int8)
        dw = np.zeros(nb * 32, F32)
        d2 = np.zeros((_R, nb), F32)
        scw = np.zeros(ng * 32 if kind >= 5 else 1, np.int32)
        mn = np.zeros((_R, nb * 16), np.int32)
        acc = np.empty(32, F32)
        accm = np.empty(16, F32)
        lane = np.empty(32, np.int32)
        for g in range(g_lo, g_hi):
            r0 = g * _R
            nr = min(_R, M - r0)
            if nr < _R:                                  # padding rows: zero codes and scales
                cw[:] = 0
                dw[:] = 0
                d2[:] = 0
                scw[:] = 0
                mn[:] = 0
            for r in range(nr):
                if kind <= 4:
                    _dec_row_g32(kind, w[r0 + r], lut, sp, r, cw, dw, d2[r])
                else:
                    _dec_row_g(kind, w[r0 + r], lut, sp, r, cw, dw, d2[r], scw, mn[r])
            for n in range(N):
                yn = yr[n]
                acc[:] = 0
                accm[:] = 0
                if kind <= 4:
                    for b in range(nb):
                        ddy = dy[n, b]
                        cb = c[128 * b:128 * b + 128]
                        yb = yn[128 * b:128 * b + 128]
                        db = dw[32 * b:32 * b + 32]
                        for j in range(32):
                            l = (np.int32(cb[j]) * np.int32(yb[j]) + np.int32(cb[32 + j]) * np.int32(yb[32 + j])
                                 + np.int32(cb[64 + j]) * np.int32(yb[64 + j])
                                 + np.int32(cb[96 + j]) * np.int32(yb[96 + j]))
                            acc[j] = F32(F64(db[j] * ddy) * F64(l) + F64(acc[j]))   # f32(dx*dy) exact
                else:
                    for b in range(nb):
                        ddy = dy[n, b]
                        lane[:] = 0
                        for s in range(8):
                            o = 128 * (8 * b + s)
                            cb = c[o:o + 128]
                            yb = yn[o:o + 128]
                            sb = scw[32 * (8 * b + s):32 * (8 * b + s) + 32]
                            for j in range(32):
                                lane[j] += sb[j] * (np.int32(cb[j]) * np.int32(yb[j])
                                                    + np.int32(cb[32 + j]) * np.int32(yb[32 + j])
                                                    + np.int32(cb[64 + j]) * np.int32(yb[64 + j])
                                                    + np.int32(cb[96 + j]) * np.int32(yb[96 + j]))
                        bn = bsums[n, 16 * b:16 * b + 16]
                        if kind == 7:                   # Q6_K: - 32*(sc_2k*bsum_2k + sc_2k+1*bsum_2k+1)
                            for r in range(_R):
                                mr = mn[r, 16 * b:16 * b + 16]
                                for p in range(8):
                                    k = 2 * (p & 3) + (p >> 2)          # lane _PI[p]
                                    lane[8 * r + p] -= 32 * (mr[2 * k] * bn[2 * k] + mr[2 * k + 1] * bn[2 * k + 1])
                        else:                           # Q4_K mins: 4 lanes per row, fma(-dm, ...);
                            for r in range(_R):         # Q5_K's: one scalar, fma(-dm, f32(sum of the 8), .)
                                dm = F64(-(ddy * d2[r, b]))
                                mr = mn[r, 8 * b:8 * b + 8]
                                tot = 0
                                for i in range(4):
                                    ml = (mr[2 * i] * (bn[4 * i] + bn[4 * i + 1])
                                          + mr[2 * i + 1] * (bn[4 * i + 2] + bn[4 * i + 3]))
                                    if kind == 5:
                                        accm[4 * r + i] = F32(dm * F64(ml) + F64(accm[4 * r + i]))
                                    tot += ml
                                if kind == 6:
                                    accm[4 * r] = F32(dm * F64(tot) + F64(accm[4 * r]))
                        db = dw[32 * b:32 * b + 32]
                        for j in range(32):
                            acc[j] = F32(F64(ddy * db[j]) * F64(lane[j]) + F64(acc[j]))   # f32(dy*dx)
                for r in range(nr):
                    a = acc[8 * r:8 * r + 8]                # HA over lanes; lane _PI[p] sits at p
                    res = ((a[0] + a[2]) + (a[1] + a[3])) + ((a[4] + a[6]) + (a[5] + a[7]))
                    if kind == 1 or kind == 3:                            # + sequential f32 sum of m*s
                        summs = d2[r, 0] * sy[n, 0]
                        for b in range(1, nb):
                            summs += d2[r, b] * sy[n, b]
                        res = res + summs
                    elif kind == 5:
                        m = accm[4 * r:4 * r + 4]
                        res = res + ((m[0] + m[2]) + (m[1] + m[3]))
                    elif kind == 6:
                        res = res + accm[4 * r]
                    out[n, r0 + r] = res


# ------------------------------------------------------------------------------------------------
# MXFP4 (quants module docstring): the _mm_g layout (4 rows, 32 lanes per block, yr from _prep_q8_g), the
# codes turned into their kvalues_mxfp4 bytes while decoding. chain=False: ggml_vec_dot_mxfp4_q8_0's two
# 8-lane accumulators (even / odd blocks), HA of their sum, a scalar fma for an odd last block;
# chain=True: the repack kernels' (and "fast"'s) one fma per block, acc = fma(f32(isum), f32(e*dy), acc).
_M7 = _U(0x0707070707070707)


@njit(cache=True, inline="always")
def _mxfp4_values(c):
    """8 codes (one per byte, 0..15) -> their kvalues_mxfp4 as int8 bytes, bytewise with no carries:
    magnitude index m = c & 7 gives m for m < 4, else m + (0, 1, 2, 5)[m & 3] (4, 6, 8, 12); bit 3 negates."""
    m = c & _M7
    t = c & _M2
    extra = t + ((t & (t >> _U(1)) & _M1) << _U(1))              # m & 3 -> 0, 1, 2, 5
    mag = m + (extra & (((c >> _U(2)) & _M1) * _U(0xFF)))        # m >= 4 only
    neg = (_MH - mag) ^ _MH                                      # bytewise -mag (0x80 - mag never borrows)
    s = ((c >> _U(3)) & _M1) * _U(0xFF)
    return (mag & ~s) | (neg & s)


@njit(cache=True)
def _dec_row_mxfp4(row, r, cw, ds):
    """One MXFP4 row as row r of the _mm_g layout: its values (int8) in cw (uint64 view), ds[_R*b + r] =
    2^(e-128) of block b (one scale per block and row: _mm_g's 8 copies per lane cost a third of the decode)."""
    for b in range(ds.shape[0] // _R):
        o = b * _MXFP4_BS
        ds[_R * b + r] = _E8M0_HALF[row[o]]
        u0 = _u64(row, o + _MXFP4_QS)
        u1 = _u64(row, o + _MXFP4_QS + 8)
        _put4(cw, 16 * b + r, _mxfp4_values(u0 & _M4), _mxfp4_values(u1 & _M4),
              _mxfp4_values((u0 >> _S4) & _M4), _mxfp4_values((u1 >> _S4) & _M4))


@njit(parallel=True, cache=True, fastmath=False)
def _mm_mxfp4(w, yr, dy, out, chain, n_chunks):
    """MXFP4 weights w uint8 [M, row_bytes] times yr int8 [N, _R*K] (_prep_q8_g's layout), dy f32 [N, K/32]
    -> out f32 [N, M]; chain: the repacked order, else vec_dot's."""
    n_groups = (w.shape[0] + _R - 1) // _R
    n_chunks = min(n_groups, n_chunks)
    for ch in prange(n_chunks):
        _mm_mxfp4_rows(w, yr, dy, out, chain, ch * n_groups // n_chunks, (ch + 1) * n_groups // n_chunks)


@njit(cache=True, fastmath=False)
def _mm_mxfp4_serial(w, yr, dy, out, chain):
    """_mm_mxfp4 on the calling thread (no parallel launch: small matrices)."""
    _mm_mxfp4_rows(w, yr, dy, out, chain, np.int64(0), (w.shape[0] + _R - 1) // _R)


@njit(cache=True, fastmath=False)
def _mm_mxfp4_rows(w, yr, dy, out, chain, g_lo, g_hi):
    """_mm_mxfp4 for the row groups g_lo .. g_hi - 1 (rows _R*g ..)."""
    M = w.shape[0]
    N = yr.shape[0]
    nb = yr.shape[1] // (_R * 32)
    n_pairs = nb // 2                                    # vec_dot's 2-block loop; an odd last block is its tail
    cw = np.zeros(_R * nb * 4, np.uint64)
    c = cw.view(np.int8)
    ds = np.zeros(nb * _R, F32)
    acc = np.empty(64, F32)                              # [2][32]: even, odd blocks (chain: acc[0:_R])
    tail_i = np.zeros(_R, F64)                           # vec_dot's odd last block: isum, f32(e*dy)
    tail_d = np.zeros(_R, F64)
    lane = np.empty(32, np.int32)
    dd = np.empty(32, F32)                               # f32(e*dy) per lane (the fma loop vectorizes)
    for g in range(g_lo, g_hi):
        r0 = g * _R
        nr = min(_R, M - r0)
        if nr < _R:                                      # padding rows: zero values and scales
            cw[:] = 0
            ds[:] = 0
        for r in range(nr):
            _dec_row_mxfp4(w[r0 + r], r, cw, ds)
        for n in range(N):
            yn = yr[n]
            acc[:] = 0
            for b in range(nb):
                ddy = dy[n, b]
                cb = c[128 * b:128 * b + 128]
                yb = yn[128 * b:128 * b + 128]
                for j in range(32):
                    lane[j] = (np.int32(cb[j]) * np.int32(yb[j]) + np.int32(cb[32 + j]) * np.int32(yb[32 + j])
                               + np.int32(cb[64 + j]) * np.int32(yb[64 + j])
                               + np.int32(cb[96 + j]) * np.int32(yb[96 + j]))
                if chain or b == 2 * n_pairs:            # one fma per row: the chain, or vec_dot's tail block
                    for r in range(nr):
                        isum = 0
                        for p in range(8):
                            isum += lane[8 * r + p]
                        d = F64(ds[_R * b + r] * ddy)                             # f32(e*dy)
                        if chain:
                            acc[r] = F32(F64(isum) * d + F64(acc[r]))
                        else:
                            tail_i[r] = isum
                            tail_d[r] = d
                    continue
                for r in range(_R):
                    d = ds[_R * b + r] * ddy
                    for p in range(8):
                        dd[8 * r + p] = d
                a = acc[32 * (b & 1):32 * (b & 1) + 32]
                for j in range(32):
                    a[j] = F32(F64(dd[j]) * F64(lane[j]) + F64(a[j]))
            for r in range(nr):
                if chain:
                    out[n, r0 + r] = acc[r]
                    continue
                a = acc[8 * r:8 * r + 8]                 # even blocks' lanes; lane _PI[p] sits at p
                e = acc[32 + 8 * r:32 + 8 * r + 8]       # odd blocks'
                res = (((a[0] + e[0]) + (a[2] + e[2])) + ((a[1] + e[1]) + (a[3] + e[3]))) + \
                    (((a[4] + e[4]) + (a[6] + e[6])) + ((a[5] + e[5]) + (a[7] + e[7])))
                if nb % 2:
                    res = F32(tail_d[r] * tail_i[r] + F64(res))
                out[n, r0 + r] = res


# ------------------------------------------------------------------------------------------------
# activation quantization for _mm_g in one call (quants.quantize_q8_0 / _q8_1 + the yr layout)
@njit(cache=True)
def _f16_round(v, lut):
    """float32 -> nearest-even float16 -> float32 (numpy's npy_floatbits_to_halfbits, finite v)."""
    a = np.empty(1, F32)
    a[0] = v
    f = np.int64(a.view(np.uint32)[0])
    f_exp = f & 0x7F800000
    h_sgn = (f >> 16) & 0x8000
    if f_exp >= 0x47800000:                             # overflow (inputs are finite)
        return lut[h_sgn + 0x7C00]
    if f_exp <= 0x38000000:                             # subnormal or zero half
        if f_exp < 0x33000000:
            return lut[h_sgn]
        e = f_exp >> 23
        f_sig = (0x00800000 + (f & 0x007FFFFF)) >> (113 - e)
        if (f_sig & 0x3FFF) != 0x1000 or (f & 0x7FF) != 0:
            f_sig += 0x1000
        return lut[h_sgn + (f_sig >> 13)]
    h_exp = (f_exp - 0x38000000) >> 13
    f_sig = f & 0x007FFFFF
    if (f_sig & 0x3FFF) != 0x1000:
        f_sig += 0x1000
    return lut[h_sgn + (((f_sig >> 13) + h_exp) & 0xFFFF)]


@njit(cache=True, inline="always")
def q8_block(xb, q, q8_1, lut):
    """One block of 32 values with quants.quantize_q8_0's (q8_1=False) or quantize_q8_1's float steps: the
    codes into q; returns (finite, d, s, sum of codes), d and s as f16 values (s = d for Q8_0). finite is
    False, and nothing else meaningful, if the block holds a non-finite value."""
    amax = F32(0)
    for j in range(32):
        v = xb[j]
        if not np.isfinite(v):
            return False, F32(0), F32(0), 0
        av = abs(v)
        if av > amax:
            amax = av
    d = amax / F32(127)
    idv = F32(127) / amax if amax != 0 else F32(0)
    isum = 0
    for j in range(32):
        qj = np.int8(np.rint(xb[j] * idv))
        q[j] = qj
        isum += int(qj)
    d16 = _f16_round(d, lut)
    return True, d16, (_f16_round(d * F32(isum), lut) if q8_1 else d16), isum


@njit(cache=True)
def _prep_q8_g(x, q8_1, lut, yr, dy, sy):
    """x f32 [N, K] -> yr int8 [N, _R*K] (the _mm_g layout), dy, sy f32 [N, K/32]: quants.quantize_q8_0
    (q8_1=False; sy = dy) or quantize_q8_1, the same float steps. Returns False (nothing to trust) if x
    has a non-finite value, where the caller takes the numpy path."""
    N, K = x.shape
    nb = K // 32
    q = np.empty(32, np.int8)
    for n in range(N):
        for b in range(nb):
            ok, dy[n, b], sy[n, b], _ = q8_block(x[n, 32 * b:32 * b + 32], q, q8_1, lut)
            if not ok:
                return False
            o = 128 * b
            for i in range(4):
                for p in range(8):
                    c = q[4 * ((2 * p) % 8 + p // 4) + i]          # element 4*_PI[p] + i
                    for r in range(_R):
                        yr[n, o + 32 * i + 8 * r + p] = c
    return True


# ------------------------------------------------------------------------------------------------
# entry point
_NO_BSUMS = np.zeros((1, 1), np.int32)        # bsums for kinds 0..4 (not read)


# ------------------------------------------------------------------------------------------------
# GET_ROWS of a legacy-quantized table (a step's token embeddings): ggml's dequantize_row_* per row
ROW_KINDS = {t: _KIND[t] for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)}


@njit(cache=True)
def _dequant_rows(kind, table, ids, lut, out):
    """out[r] = dequantize_row(table[ids[r]]) for kinds 0..4 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), in ggml's
    float operations: x * d, plus m for Q4_1/Q5_1 (two roundings: ggml's C contracts nothing)."""
    bs = _BS[kind]
    for r in range(ids.shape[0]):
        if not 0 <= ids[r] < table.shape[0]:            # ggml_get_rows asserts it; unchecked, a crash
            raise IndexError("GET_ROWS: a row id outside the table")
        row, y = table[ids[r]], out[r]
        for b in range(y.shape[0] // 32):
            o, y0 = b * bs, 32 * b
            d = _f16(lut, row, o)
            if kind == 4:
                for j in range(32):
                    y[y0 + j] = F32(np.int8(row[o + _Q8_0_QS + j])) * d
                continue
            oq = _OQ[kind]
            qh = np.int64(0)
            if kind >= 2:
                qh = (np.int64(row[oq + o - 4]) | (np.int64(row[oq + o - 3]) << 8) | (np.int64(row[oq + o - 2]) << 16)
                      | (np.int64(row[oq + o - 1]) << 24))
            for j in range(16):
                q = np.int64(row[o + oq + j])
                x0, x1 = q & 15, q >> 4
                if kind >= 2:                           # the 5th bits: qh bit j, bit j + 16
                    x0 |= ((qh >> j) << 4) & 16
                    x1 |= (qh >> (j + 12)) & 16
                if kind == 0 or kind == 2:
                    c = 8 if kind == 0 else 16
                    y[y0 + j] = F32(x0 - c) * d
                    y[y0 + j + 16] = F32(x1 - c) * d
                else:
                    m = _f16(lut, row, o + _OM)
                    y[y0 + j] = F32(x0) * d + m
                    y[y0 + j + 16] = F32(x1) * d + m


def bind_get_rows(type: GGMLType, table: np.ndarray, ids: np.ndarray, out: np.ndarray):
    """GET_ROWS of rows ids (int32 [n]) of table (uint8 [rows, row bytes]) of a legacy quant type into out
    (f32 [n, ne0]) as one bound kernel call (entry.py), or None for another type or layout. The table is
    not copied: quants.dequantize reads a row through ~12 numpy calls (~60 us in a decode step, where the
    step's weights have evicted them; this ~5)."""
    kind = ROW_KINDS.get(type)
    if kind is None or table.dtype != np.uint8 or table.ndim != 2 or out.ndim != 2 or out.dtype != F32 \
            or ids.ndim != 1 or ids.dtype != np.int32 or out.shape[1] % 32 or not out.flags.c_contiguous \
            or table.shape[1] != row_size(type, out.shape[1]) or ids.shape[0] != out.shape[0]:
        return None
    return bound(_dequant_rows, kind, table, ids, _F16_LUT, out)


def _readonly(a: np.ndarray) -> np.ndarray:
    """One numba specialization for mapped (read-only) and owned weights alike."""
    a = np.ascontiguousarray(a)
    v = a.view(np.ndarray)
    v.flags.writeable = False
    return v


def _n_gemm(wtype: GGMLType, repacked: bool, N: int, vec_n: int | None) -> int:
    """Rows of X that repacked Q4_K multiplies in ggml_gemm_q4_K_8x8_q8_K (quants.gemm_rows: groups of 4
    when N > 3 and vec_n, where given, > 3; the rest take ggml_gemv_q4_K_8x8_q8_K, one fma per superblock)."""
    return Q.gemm_rows(N, vec_n) if repacked and wtype == T.Q4_K else 0


def _yr_layout(qy: np.ndarray) -> np.ndarray:
    """Q8 codes int8 [N, ...] (any blocks, K per row) -> the _mm_g activation layout int8 [N, _R*K] (as
    _prep_q8_g writes it): yr[n, 128g + 32i + 8r + p] = element 32g + 4*_PI[p] + i, for each of the _R rows r."""
    N = qy.shape[0]
    nb = qy[0].size // 32
    yg = qy.reshape(N, nb, 8, 4)[:, :, _PI].transpose(0, 1, 3, 2)[:, :, :, None, :]
    return np.ascontiguousarray(np.broadcast_to(yg, (N, nb, 4, _R, 8))).reshape(N, _R * 32 * nb)


def _mul_mat_mxfp4(w: np.ndarray, x: np.ndarray, chain: bool, serial: bool, out: np.ndarray) -> np.ndarray:
    """MXFP4 by _mm_mxfp4: X quantized to Q8_0 by _prep_q8_g (quants.quantize_q8_0 where x has a
    non-finite value); chain: the repacked (and "fast") order, else vec_dot's."""
    N, K = x.shape
    wr = _readonly(w).reshape(w.shape[0], -1)
    yr = np.empty((N, _R * K), np.int8)
    dy = np.empty((N, K // 32), F32)
    if not _prep_q8_g(np.ascontiguousarray(x, F32), False, _F16_LUT, yr, dy, np.empty_like(dy)):
        qy, dy = Q.quantize_q8_0(x)
        yr = _yr_layout(qy)
    if serial:
        _mm_mxfp4_serial(wr, yr, dy, out, chain)
        return out
    with launch() as nt:
        _mm_mxfp4(wr, yr, dy, out, chain, 16 * nt)
    return out


def mul_mat_q(wtype: GGMLType, w: np.ndarray, x: np.ndarray, order: str = "fast",
              repacked: bool = False, vec_n: int | None = None) -> np.ndarray | None:
    """quants.mul_mat(order=order, repacked=repacked) for covered types: w uint8 [M, row_bytes] (F16: uint8
    or float16 [M, K]); x f32 [N, K]. Returns f32 [N, M], or None if wtype is not covered.
    order="ggml" with repacked Q4_0/Q4_K/MXFP4, and Q2_K/Q3_K, have the "fast" numerics (quants docstring)."""
    wtype = GGMLType(wtype)
    N, K = x.shape
    M = w.shape[0]
    if wtype not in COVERED:
        return None
    if order not in ("fast", "ggml"):
        raise ValueError(f"order must be 'ggml' or 'fast', not {order!r}")
    nbytes = w.shape[1] * w.itemsize if w.ndim == 2 else -1
    if nbytes != row_size(wtype, K):
        raise ValueError(f"{wtype.name} rows of {K} elements need {row_size(wtype, K)} B, got w {w.shape} "
                         f"{w.dtype}")
    out = np.empty((N, M), F32)
    serial = get_threads() == 1 or N * M * K <= _SERIAL_WORK
    if wtype == T.F16:
        w16 = _readonly(w).view(np.uint16).reshape(M, K)
        y = np.ascontiguousarray(x.astype(np.float16).astype(F64))
        vn = N if vec_n is None else vec_n            # rows that pick vec_dot (1) or tinyBLAS (>= 2)
        mode = 0 if order == "fast" else (2 if vn >= 2 and K % 8 == 0 and M % 4 == 0 else 1)
        if serial:
            _mm_f16_serial(w16, y, _F16_LUT, out, mode)
            return out
        with launch():
            _mm_f16(w16, y, _F16_LUT, out, mode)
        return out
    repacked = repacked and wtype in REPACK_TYPES               # the only types x86 repacks
    if wtype == T.MXFP4:
        return _mul_mat_mxfp4(w, x, order == "fast" or repacked, serial, out)
    kind = _KIND[wtype]
    tiled = Q.takes_tiled(wtype, repacked, N if vec_n is None else vec_n, order)
    ggml = order == "ggml" and kind <= 7 and not (repacked and wtype in (T.Q4_0, T.Q4_K)) and not tiled
    wr = _readonly(w).reshape(M, -1)
    if ggml and kind <= 4 and x.dtype == F32:
        # one numba call for quantize_q8_0/_q8_1 and the yr layout below (same bits)
        xc = np.ascontiguousarray(x)
        yr = np.empty((N, _R * K), np.int8)
        dy = np.empty((N, K // 32), F32)
        sy = np.empty((N, K // 32), F32)
        if _prep_q8_g(xc, kind == 1 or kind == 3, _F16_LUT, yr, dy, sy):
            if serial:
                _mm_g_serial(kind, wr, yr, dy, sy, _NO_BSUMS, _F16_LUT, _SPREAD, out)
                return out
            with launch() as nt:
                _mm_g(kind, wr, yr, dy, sy, _NO_BSUMS, _F16_LUT, _SPREAD, out, 16 * nt)
            return out
    if kind <= 4:
        if kind in (1, 3):
            qy, dy, sy = Q.quantize_q8_1(x)
        else:
            qy, dy = Q.quantize_q8_0(x)
            sy = dy
        ysum = qy.sum(axis=-1, dtype=np.int64)
        bsums = np.zeros((N, 1), np.int32 if ggml else np.int64)     # one _mm_g / _mm_q specialization
    else:
        qy, dy, bs = Q.quantize_q8_K(x)
        sy = dy
        ysum = np.zeros((N, 1), np.int64)
        bsums = bs.reshape(N, -1).astype(np.int32 if ggml else np.int64)
    dy = np.ascontiguousarray(dy, F32)
    sy = np.ascontiguousarray(sy, F32)
    if ggml:
        yr = _yr_layout(qy)
        if serial:
            _mm_g_serial(kind, wr, yr, dy, sy, bsums, _F16_LUT, _SPREAD, out)
            return out
        with launch() as nt:
            _mm_g(kind, wr, yr, dy, sy, bsums, _F16_LUT, _SPREAD, out, 16 * nt)
        return out
    W = 2 if kind >= 7 else 4
    yw = np.ascontiguousarray(qy.reshape(N, K // (8 * W), W, 8).transpose(0, 2, 1, 3)).reshape(N, K)
    with launch() as nt:
        _mm_q(kind, wr, yw, dy, sy, ysum, bsums, _F16_LUT, _SPREAD, out, 16 * nt, _n_gemm(wtype, repacked, N, vec_n),
              tiled)
    return out

"""ggml block formats and the CPU MUL_MAT numerics, in vectorized numpy (ggml-numerics.md §1).

API
* ``dequantize(type, blocks, ne0)``: uint8 rows -> float32 rows (ggml ``dequantize_row_*``, §1.3).
* ``quantize(type, x)``: float32 rows -> uint8 rows (weights; Q4_0..Q8_0 and MXFP4 via gguf.quants, which
  is bit-exact with ggml's ``quantize_row_*_ref``; K-quants with simple quantizers of our own, see
  ``quantize``).
* ``quantize_q8_0 / quantize_q8_1 / quantize_q8_K``: activation quantization, exactly as §1.2 (x86).
* ``VEC_DOT_TYPE``: what X is converted to before a matmul with a weight of a given type.
* ``mul_mat(wtype, w, x, exact=False, repacked=None, order="ggml")``: dst[n, m] = W[m] . X[n] -> [N, M],
  as ggml's CPU backend.

This is the reference: it imports no numba. qkernels.py, fkernels.py and qpack.py are its compiled twins
(the same bits); ops.py chooses between them per op (``ComputeOptions.numba``).

``mul_mat(exact=False)`` has two accumulation orders (``order=``, default "ggml", the one that runs).
Both quantize X exactly as ggml and compute the integer block sums exactly; they differ only at ULP level.
* "fast": one fma chain per output over blocks, ``acc = fma(f32(isum_b), f32(dx*dy), acc)`` (= the repacked
  Q4_0 kernel's order; Q4_1/Q5_1 add the sequential f32 sum of ``m*s`` at the end; Q4_K/Q5_K two chains
  ``acc - accm`` as repacked Q4_K; Q6_K one chain); F32/F16/BF16: float64 BLAS of the converted values,
  rounded once (ggml's f32 lane sums differ at ULP level).
* "ggml" (bit-faithful emulation of the x86 AVX2 build, ~5-10x slower for many rows of X):
Accumulation orders used by ``order="ggml"`` (§1.5):
* Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 (vec_dot and tinyBLAS_Q0): 8 f32 lanes, lane k of a block = exact integer
  sum over its elements 4k..4k+3; ``acc_k = fma(f32(dx*dy), lane_k, acc_k)`` over blocks; ``HA``;
  Q4_1/Q5_1 then add the sequential f32 sum of ``m*s``.
* Repacked Q4_0 and MXFP4 (``repacked``): one chain ``acc = fma(f32(isum_b), f32(dx*dy), acc)``.
* Q4_K/Q5_K: 8 scale-weighted int lanes, ``acc = fma(d, lane, acc)``; Q4_K's mins in 4 lanes with
  ``fma(-dm, ...)``, result ``HA(acc) + ((m0+m2)+(m1+m3))``; Q5_K's in one scalar, ``summs = fma(-dm,
  f32(sum_j m_j*s_j), summs)`` per superblock, result ``HA(acc) + summs``. Repacked Q4_K: two chains,
  ``acc - accm``.
* Q6_K: 8 lanes (``sc*q6*qy`` minus ``32*sc*bsum``), ``acc = fma(d, lane, acc)``, ``HA``.
* Q2_K/Q3_K: NOT the AVX2 order: per superblock the exact integer sums, then
  ``sumf = f32(sumf + f32(f32(d*isum) - f32(dm*msum)))`` (Q3_K without the min term).
* F32/F16/BF16: n == 1 (or K % 8 or M % 4 non-zero): ``ggml_vec_dot_f16``'s 4x8 lanes, fold, ``HB``, tail in
  double (f16/bf16) or float (f32); n >= 2: tinyBLAS' single 8-lane accumulator and ``HA``.
  (BF16 uses the F16 structure; ggml's AVX2 bf16 dot may associate differently: ULP-level.)
fma is emulated in float64 (exact product, one double rounding of the add: vanishingly rare).
* MXFP4 (gpt-oss's experts; ggml-common.h block_mxfp4: an E8M0 byte ``e``, 16 bytes of 4-bit codes, byte j
  low nibble -> element j, high -> element j+16). Value = ``kvalues_mxfp4[code] * 2^(e-128)`` (the E2M1
  values doubled, so the scale is ``GGML_E8M0_TO_FP32_HALF(e)``: 2^(e-128), the f32 subnormals
  2^-128 / 2^-127 for e = 0 / 1); every product is exact in f32 (or +-inf, e >= 254), so decode never
  rounds. X is converted to Q8_0; ``d = f32(dy * 2^(e-128))`` (exact unless it leaves f32's normal range)
  and the integer block sums are exact; the float steps are:
  - not repacked (``ggml_vec_dot_mxfp4_q8_0``, arch/x86/quants.c): lanes as Q4_0 (lane k = elements
    4k..4k+3), but TWO 8-lane accumulators, even blocks ``acc1 = fma(d, lane, acc1)`` and odd blocks
    ``acc2``; result ``HA(acc1 + acc2)`` (lane-wise add first), then, when the block count is odd, the last
    block in scalar C: ``sumf = fma(d, f32(isum), sumf)`` (GCC contracts ``sumf += d*(sumi1+sumi2)``:
    checked against the oracle). llama.cpp takes this path for every row count: MXFP4 is neither a
    llamafile (tinyBLAS) nor a tiled-kernel type, and MUL_MAT_ID outside the repack buffer is vec_dot too.
  - repacked (``repacked``; ggml's rule: ``blocks.ggml_repacks``, ne[1] % 8 == 0 on AVX2;
    ``ggml_gemv_mxfp4_8x8_q8_0`` and ``ggml_gemm_mxfp4_8x8_q8_0``, the q4_b32 8x8 LUT kernels of
    arch/x86/repack.cpp): one chain ``acc = fma(f32(isum_b), f32(e_half*dy), acc)``, the "fast" order.
    gemm (MUL_MAT, 4 rows of X at a time) and gemv (the rest, and MUL_MAT_ID always) have that same
    formula, so unlike Q4_K a row's bits do not depend on how many rows came with it.
  ``quantize`` is gguf.quants' MXFP4, bit-exact with ggml's quantize_row_mxfp4_ref (checked against the
  oracle: e = floor(log2(amax)) - 2 + 127, each code the first of the 16 with the least |v*d - x|).
* Tiled K-quants (``takes_tiled``: Q2_K..Q6_K not repacked, n >= 8 rows of X; llama.cpp 0.3.36's
  ``ggml_compute_forward_mul_mat_tiled``, AVX2 microtile, §1.6): per superblock the exact integer sums, then
  ``r = f32(d*f32(isum))``, ``r = fnmadd(dmin, f32(minsum), r)`` where the type has mins, and one chain
  ``acc = fma(r, dy, acc)``. This is the one K-quant order in which Q2_K/Q3_K are exact too.
"""
from __future__ import annotations

import numpy as np

from ...core.types import TYPE_TRAITS, GGMLType, row_size
from .blocks import BLOCKS, REPACK_TYPES, VEC_DOT_TYPE, assemble, ggml_repacks

F32 = np.float32
F64 = np.float64
QK = 32
QK_K = 256
T = GGMLType

# VEC_DOT_TYPE (what X is converted to per weight type) is blocks.py's, imported above.
# the block layouts (blocks.py): F["qs"] is the slice of a block's codes
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (BLOCKS[t] for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0))
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K = (BLOCKS[t] for t in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K))
MXFP4 = BLOCKS[T.MXFP4]

# ggml-common.h kvalues_mxfp4: the E2M1 values doubled (code bit 3 is the sign; 8 is -0 = 0)
KVALUES_MXFP4 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)

# temporaries budget for mul_mat row chunks (bytes)
_CHUNK_BYTES = 48 << 20


# ------------------------------------------------------------------------------------------------
# byte helpers (all work on any strides)
def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) little-endian f16 -> float32 (exact)."""
    u = b[..., 0].astype(np.uint16) | (b[..., 1].astype(np.uint16) << 8)
    return u.view(np.float16).astype(F32)


def _f32(b: np.ndarray) -> np.ndarray:
    u = (b[..., 0].astype(np.uint32) | (b[..., 1].astype(np.uint32) << 8)
         | (b[..., 2].astype(np.uint32) << 16) | (b[..., 3].astype(np.uint32) << 24))
    return u.view(F32)


def _blocks(type: GGMLType, rows: np.ndarray, ne0: int) -> np.ndarray:
    """[..., row_bytes] uint8 -> [..., nb, type_size]."""
    tt = TYPE_TRAITS[type]
    rb = row_size(type, ne0)
    rows = np.asarray(rows)
    if rows.dtype != np.uint8:
        rows = np.ascontiguousarray(rows).view(np.uint8)
    if rows.shape[-1] != rb:
        raise ValueError(f"{tt.name} row of {ne0} elements needs {rb} bytes, got {rows.shape[-1]}")
    return rows.reshape(*rows.shape[:-1], ne0 // tt.blck_size, tt.type_size)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 nibbles: byte j low -> element j, high -> element j+16."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits32(qh: np.ndarray) -> np.ndarray:
    """4 bytes (little-endian u32) -> 32 bits (element e = bit e)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


# ------------------------------------------------------------------------------------------------
# decoders: blocks [..., nb, bs] -> integer codes and float32 scales
def _dec_q4_0(b):
    return _f16(b[..., Q4_0["d"]]), _nibbles32(b[..., Q4_0["qs"]]).astype(np.int8) - np.int8(8)


def _dec_q4_1(b):
    return _f16(b[..., Q4_1["d"]]), _f16(b[..., Q4_1["m"]]), _nibbles32(b[..., Q4_1["qs"]])


def _dec_q5_0(b):
    q = _nibbles32(b[..., Q5_0["qs"]]) | (_bits32(b[..., Q5_0["qh"]]) << 4)
    return _f16(b[..., Q5_0["d"]]), q.astype(np.int8) - np.int8(16)


def _dec_q5_1(b):
    q = _nibbles32(b[..., Q5_1["qs"]]) | (_bits32(b[..., Q5_1["qh"]]) << 4)
    return _f16(b[..., Q5_1["d"]]), _f16(b[..., Q5_1["m"]]), q


def _dec_q8_0(b):
    return _f16(b[..., Q8_0["d"]]), b[..., Q8_0["qs"]].view(np.int8) if b.strides[-1] == 1 else \
        np.ascontiguousarray(b[..., Q8_0["qs"]]).view(np.int8)


def _i8(b):
    return np.ascontiguousarray(b).view(np.int8)


def _scale_min_k4(s: np.ndarray):
    """12 scale bytes -> (sc [..., 8], m [..., 8]) 6-bit (get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, m


def _dec_q4_K(b):
    """-> d, dmin [..., nb]; sc, m [..., nb, 8]; q [..., nb, 8, 32] (0..15), element 32j+l."""
    sc, m = _scale_min_k4(b[..., Q4_K["scales"]])
    qs = b[..., Q4_K["qs"]].reshape(*b.shape[:-1], 4, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F
    return _f16(b[..., Q4_K["d"]]), _f16(b[..., Q4_K["dmin"]]), sc, m, q.reshape(*b.shape[:-1], 8, 32)


def _dec_q5_K(b):
    sc, m = _scale_min_k4(b[..., Q5_K["scales"]])
    qs = b[..., Q5_K["qs"]].reshape(*b.shape[:-1], 4, 1, 32)
    ql = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*b.shape[:-1], 8, 32)
    qh = b[..., Q5_K["qh"]].reshape(*b.shape[:-1], 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
    q = ql | ((qh & 1) << 4)
    return _f16(b[..., Q5_K["d"]]), _f16(b[..., Q5_K["dmin"]]), sc, m, q


def _dec_q6_K(b):
    """-> d [..., nb]; sc int8 [..., nb, 16]; q [..., nb, 256] unsigned 0..63 (element order)."""
    lead = b.shape[:-1]
    ql = b[..., Q6_K["ql"]].reshape(*lead, 2, 1, 64)       # half, (lo/hi nibble), l'
    qh = b[..., Q6_K["qh"]].reshape(*lead, 2, 1, 32)       # half, shift, l
    lo = ((ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F)   # [.., 2, 2(nib), 64]
    # element 64*nib + l' of the half: nibble nib of ql[l']; 2 high bits from qh[l' % 32] at 2*(2*nib + l'//32)
    hi = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3   # [.., 2, 4, 32] for e//32 = 0..3
    q = lo.reshape(*lead, 2, 4, 32) | (hi << 4)
    return _f16(b[..., Q6_K["d"]]), _i8(b[..., Q6_K["scales"]]), q.reshape(*lead, 256)


def _dec_q2_K(b):
    """-> d, dmin; sc, m [..., nb, 16] (4-bit); q [..., nb, 16, 16] (0..3)."""
    lead = b.shape[:-1]
    s = b[..., Q2_K["scales"]]
    qs = b[..., Q2_K["qs"]].reshape(*lead, 2, 1, 32)
    q = (qs >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3     # [.., 2, 4, 32]
    return _f16(b[..., Q2_K["d"]]), _f16(b[..., Q2_K["dmin"]]), s & 0x0F, s >> 4, q.reshape(*lead, 16, 16)


def _dec_q3_K(b):
    """-> d; sc int [..., nb, 16] (-32..31); q [..., nb, 16, 16] (-4..3)."""
    lead = b.shape[:-1]
    hm = b[..., Q3_K["hmask"]]
    qs = b[..., Q3_K["qs"]].reshape(*lead, 2, 1, 32)
    s = b[..., Q3_K["scales"]]
    lo, hi = s[..., 0:8], s[..., 8:12]
    sc_lo = np.concatenate([lo & 0x0F, lo >> 4], axis=-1)                    # 16
    sc_hi = np.concatenate([(hi >> sh) & 3 for sh in (0, 2, 4, 6)], axis=-1)  # 16
    sc = (sc_lo | (sc_hi << 4)).astype(np.int16) - 32
    ql = ((qs >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(*lead, 8, 32)
    h = (hm.reshape(*lead, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
    q = ql.astype(np.int8) - ((h ^ 1) << 2).astype(np.int8)
    return _f16(b[..., Q3_K["d"]]), sc, q.reshape(*lead, 16, 16)


def e8m0_to_fp32_half(e: np.ndarray) -> np.ndarray:
    """GGML_E8M0_TO_FP32_HALF: E8M0 byte e -> 2^(e-128) as float32, from its bits (e < 2: the subnormals
    2^-128, 2^-127; e = 255 gives 2^127, not NaN, as ggml's)."""
    e = np.asarray(e).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(F32)


def _dec_mxfp4(b):
    """-> d = 2^(e-128) f32 [..., nb]; q int8 [..., nb, 32] (kvalues_mxfp4 of the codes, element order)."""
    return e8m0_to_fp32_half(b[..., MXFP4.off("e")]), KVALUES_MXFP4[_nibbles32(b[..., MXFP4["qs"]])]


def _dec_q8_K(b):
    bs = b[..., Q8_K["bsums"]]
    bsums = (bs[..., 0::2].astype(np.uint16) | (bs[..., 1::2].astype(np.uint16) << 8)).view(np.int16)
    return _f32(b[..., Q8_K["d"]]), _i8(b[..., Q8_K["qs"]]), bsums


# ------------------------------------------------------------------------------------------------
def dequantize(type: GGMLType, blocks: np.ndarray, ne0: int) -> np.ndarray:
    """ggml dequantize_row_* for rows of ``ne0`` elements: uint8 [..., row_bytes] -> float32 [..., ne0]."""
    type = GGMLType(type)
    blocks = np.asarray(blocks)
    lead = blocks.shape[:-1]
    if type == T.F32:
        if blocks.dtype == F32:
            return blocks
        return np.ascontiguousarray(_blocks(type, blocks, ne0)).view(F32).reshape(*lead, ne0)
    if type == T.F16:
        if blocks.dtype == np.float16:
            return blocks.astype(F32)
        b = _blocks(type, blocks, ne0)
        return _f16(b).reshape(*lead, ne0)
    if type == T.BF16:
        if blocks.dtype == np.uint16:
            return (blocks.astype(np.uint32) << 16).view(F32)
        b = _blocks(type, blocks, ne0)
        u = (b[..., 0].astype(np.uint32) << 16) | (b[..., 1].astype(np.uint32) << 24)
        return u.view(F32).reshape(*lead, ne0)
    b = _blocks(type, blocks, ne0)
    if type == T.Q4_0:
        d, q = _dec_q4_0(b)
        y = q.astype(F32) * d[..., None]
    elif type == T.Q4_1:
        d, m, q = _dec_q4_1(b)
        y = q.astype(F32) * d[..., None] + m[..., None]
    elif type == T.Q5_0:
        d, q = _dec_q5_0(b)
        y = q.astype(F32) * d[..., None]
    elif type == T.Q5_1:
        d, m, q = _dec_q5_1(b)
        y = q.astype(F32) * d[..., None] + m[..., None]
    elif type == T.Q8_0:
        d, q = _dec_q8_0(b)
        y = q.astype(F32) * d[..., None]
    elif type in (T.Q4_K, T.Q5_K):
        d, dmin, sc, m, q = (_dec_q4_K if type == T.Q4_K else _dec_q5_K)(b)
        dl = (d[..., None] * sc.astype(F32))[..., None]
        ml = (dmin[..., None] * m.astype(F32))[..., None]
        y = dl * q.astype(F32) - ml
    elif type == T.Q6_K:
        d, sc, q = _dec_q6_K(b)
        dl = (d[..., None] * sc.astype(F32))[..., None]                      # [.., nb, 16, 1]
        y = dl * (q.astype(F32) - F32(32)).reshape(*q.shape[:-1], 16, 16)
    elif type == T.Q2_K:
        d, dmin, sc, m, q = _dec_q2_K(b)
        dl = (d[..., None] * sc.astype(F32))[..., None]
        ml = (dmin[..., None] * m.astype(F32))[..., None]
        y = dl * q.astype(F32) - ml
    elif type == T.Q3_K:
        d, sc, q = _dec_q3_K(b)
        y = (d[..., None] * sc.astype(F32))[..., None] * q.astype(F32)
    elif type == T.Q8_K:
        d, q, _ = _dec_q8_K(b)
        y = q.astype(F32) * d[..., None]
    elif type == T.MXFP4:
        d, q = _dec_mxfp4(b)
        with np.errstate(over="ignore"):                # e >= 254: +-inf, as ggml's float multiply
            y = q.astype(F32) * d[..., None]
    else:
        raise NotImplementedError(f"dequantize: type {type.name} not supported")
    return np.asarray(y, F32).reshape(*lead, ne0)


# ------------------------------------------------------------------------------------------------
# activation quantization (§1.2)
def _split(x: np.ndarray, bs: int) -> np.ndarray:
    x = np.asarray(x, F32)
    if x.shape[-1] % bs:
        raise ValueError(f"row length {x.shape[-1]} is not a multiple of {bs}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // bs, bs)


def _q8_0_core(x):
    xb = _split(x, QK)
    amax = np.abs(xb).max(axis=-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        id_ = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint(xb * id_[..., None]).astype(np.int8)
    return q, d


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x86 quantize_row_q8_0: -> (qs int8 [..., nb, 32], d float32 [..., nb] already rounded to f16)."""
    q, d = _q8_0_core(x)
    return q, d.astype(np.float16).astype(F32)


def quantize_q8_1(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x86 quantize_row_q8_1: -> (qs, d, s) with d, s f16-rounded; s = f16(f32(d * sum(q)))."""
    q, d = _q8_0_core(x)
    isum = q.sum(axis=-1, dtype=np.int32).astype(F32)
    s = (d * isum).astype(F32)
    return q, d.astype(np.float16).astype(F32), s.astype(np.float16).astype(F32)


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_K_ref: -> (qs int8 [..., nb, 256], d float32 [..., nb], bsums int16 [..., nb, 16])."""
    xb = _split(x, QK_K)
    ax = np.abs(xb)
    imax = ax.argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xb, imax, axis=-1)[..., 0]
    zero = mx == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
        v = np.rint(xb * iscale[..., None])
        q = np.minimum(v, F32(127)).astype(np.int8)
        d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)
    bsums = q.reshape(*q.shape[:-1], 16, 16).sum(axis=-1, dtype=np.int32).astype(np.int16)
    return q, d, bsums


# ------------------------------------------------------------------------------------------------
# weight quantization
def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    n = np.ascontiguousarray(x, F32).view(np.uint32)
    nan = (n & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = ((n.astype(np.uint64) + (np.uint64(0x7FFF) + ((n >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(nan, ((n >> 16) | 64).astype(np.uint16), r)


def _u8(a: np.ndarray, lead: tuple) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(*lead, -1)


def _pack_f16(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)[..., None]).view(np.uint8)


def _quant_k_scales(vals: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Positive per-sub-block values [..., n] -> (super-scale f32 (f16-rounded), 'bits'-bit codes)."""
    mx = vals.max(axis=-1)
    top = (1 << bits) - 1
    dd = (mx / top).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(dd[..., None] > 0, np.rint(vals / dd[..., None]), 0)
    return dd, np.clip(c, 0, top).astype(np.uint8)


def _quantize_kq_min(type, xb):
    """Simple (not ggml's make_qkx2) asymmetric quantizer for Q4_K/Q5_K/Q2_K blocks [..., nb, 256]."""
    nsub, sbs, qbits, sbits = {T.Q4_K: (8, 32, 4, 6), T.Q5_K: (8, 32, 5, 6), T.Q2_K: (16, 16, 2, 4)}[type]
    qmax = (1 << qbits) - 1
    xs = xb.reshape(*xb.shape[:-1], nsub, sbs)
    mn = np.minimum(xs.min(axis=-1), 0)
    mx = xs.max(axis=-1)
    scale = (mx - mn) / qmax
    d, sc = _quant_k_scales(scale, sbits)
    dmin, mc = _quant_k_scales(-mn, sbits)
    dl = (d[..., None] * sc)[..., None].astype(F32)
    ml = (dmin[..., None] * mc)[..., None].astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl > 0, np.rint((xs + ml) / dl), 0)
    q = np.clip(q, 0, qmax).astype(np.uint8)
    lead = xb.shape[:-1]
    if type == T.Q2_K:
        qq = q.reshape(*lead, 2, 4, 32)
        qs = qq[..., 0, :] | (qq[..., 1, :] << 2) | (qq[..., 2, :] << 4) | (qq[..., 3, :] << 6)
        return np.concatenate(assemble(T.Q2_K, scales=sc | (mc << 4), qs=qs.reshape(*lead, 64), d=_pack_f16(d),
                                       dmin=_pack_f16(dmin)), -1)
    s = np.concatenate([(sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6),
                        (mc[..., 0:4] & 63) | ((mc[..., 4:8] >> 4) << 6),
                        (sc[..., 4:8] & 15) | ((mc[..., 4:8] & 15) << 4)], axis=-1)
    qq = q.reshape(*lead, 4, 2, 32)
    qs = ((qq[..., 0, :] & 15) | ((qq[..., 1, :] & 15) << 4)).reshape(*lead, 128)
    parts = {"d": _pack_f16(d), "dmin": _pack_f16(dmin), "scales": s, "qs": qs}
    if type == T.Q5_K:
        hb = (q >> 4).reshape(*lead, 8, 32)       # bit j of qh[l] = high bit of element 32j+l
        qh = np.zeros((*lead, 32), np.uint8)
        for j in range(8):
            qh |= hb[..., j, :] << j
        parts["qh"] = qh
    return np.concatenate(assemble(type, **parts), axis=-1)


def _quantize_q6_K(xb):
    lead = xb.shape[:-1]
    xs = xb.reshape(*lead, 16, 16)
    imax = np.abs(xs).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xs, imax, axis=-1)[..., 0]
    scale = (mx / F32(-32)).astype(F32)
    amx = np.abs(scale).max(axis=-1)
    d = (amx / F32(127)).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] > 0, np.rint(scale / d[..., None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    dl = (d[..., None] * sc.astype(F32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl != 0, np.rint(xs / dl), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(*lead, 2, 4, 32)   # half, e//32, l
    ql = np.concatenate([(q[..., 0, :] & 15) | ((q[..., 2, :] & 15) << 4),
                         (q[..., 1, :] & 15) | ((q[..., 3, :] & 15) << 4)], axis=-1)    # [.., 2, 64]
    qh = (q[..., 0, :] >> 4) | ((q[..., 1, :] >> 4) << 2) | ((q[..., 2, :] >> 4) << 4) | ((q[..., 3, :] >> 4) << 6)
    return np.concatenate(assemble(T.Q6_K, ql=ql.reshape(*lead, 128), qh=qh.reshape(*lead, 64),
                                   scales=sc.view(np.uint8), d=_pack_f16(d)), -1)


def _quantize_q3_K(xb):
    lead = xb.shape[:-1]
    xs = xb.reshape(*lead, 16, 16)
    imax = np.abs(xs).argmax(axis=-1)[..., None]
    mx = np.take_along_axis(xs, imax, axis=-1)[..., 0]
    scale = (mx / F32(-4)).astype(F32)
    imx = np.abs(scale).argmax(axis=-1)[..., None]
    smax = np.take_along_axis(scale, imx, axis=-1)[..., 0]
    d = (smax / F32(-32)).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[..., None] != 0, np.rint(scale / d[..., None]), 0)
    sc = np.clip(sc, -32, 31).astype(np.int16)
    dl = (d[..., None] * sc.astype(F32))[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(dl != 0, np.rint(xs / dl), 0)
    q = (np.clip(q, -4, 3) + 4).astype(np.uint8).reshape(*lead, 2, 4, 32)     # half, j, l
    qs = q[..., 0, :] & 3 | ((q[..., 1, :] & 3) << 2) | ((q[..., 2, :] & 3) << 4) | ((q[..., 3, :] & 3) << 6)
    hb = (q >> 2).reshape(*lead, 8, 32)
    hm = np.zeros((*lead, 32), np.uint8)
    for j in range(8):
        hm |= hb[..., j, :] << j
    s6 = (sc + 32).astype(np.uint8)
    lo, hi = s6 & 15, s6 >> 4
    sbytes = np.concatenate([lo[..., 0:8] | (lo[..., 8:16] << 4),
                             hi[..., 0:4] | (hi[..., 4:8] << 2) | (hi[..., 8:12] << 4) | (hi[..., 12:16] << 6)], -1)
    return np.concatenate(assemble(T.Q3_K, hmask=hm, qs=qs.reshape(*lead, 64), scales=sbytes, d=_pack_f16(d)), -1)


def quantize(type: GGMLType, x: np.ndarray) -> np.ndarray:
    """float32 [..., ne0] -> uint8 [..., row_bytes].

    F32/F16 (RNE)/BF16 (ggml_compute_fp32_to_bf16: RNE, NaN quieted) directly; Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and
    MXFP4 via gguf.quants (ggml's ``quantize_row_*_ref``); Q8_K as the activation quantizer. Q2_K..Q6_K use simple
    quantizers of our own: valid blocks with reasonable error, but NOT bit-identical to llama-quantize.
    """
    type = GGMLType(type)
    x = np.asarray(x, F32)
    lead = x.shape[:-1]
    ne0 = x.shape[-1]
    row_size(type, ne0)
    if type == T.F32:
        return _u8(x, lead)
    if type == T.F16:
        return _u8(x.astype(np.float16), lead)
    if type == T.BF16:
        return _u8(_f32_to_bf16_bits(x), lead)
    if type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4):
        import gguf.quants as gq
        from gguf.constants import GGMLQuantizationType
        out = gq.quantize(np.ascontiguousarray(x.reshape(-1, ne0)), GGMLQuantizationType(int(type)))
        return out.reshape(*lead, -1)
    if type == T.Q8_K:
        q, d, bsums = quantize_q8_K(x)
        return np.concatenate(assemble(T.Q8_K, d=_u8(d[..., None], q.shape[:-1]), qs=q.view(np.uint8),
                                       bsums=_u8(bsums, q.shape[:-1])), axis=-1).reshape(*lead, -1)
    xb = _split(x, QK_K)
    if type in (T.Q4_K, T.Q5_K, T.Q2_K):
        out = _quantize_kq_min(type, xb)
    elif type == T.Q6_K:
        out = _quantize_q6_K(xb)
    elif type == T.Q3_K:
        out = _quantize_q3_K(xb)
    else:
        raise NotImplementedError(f"quantize: type {type.name} not supported")
    return np.ascontiguousarray(out).reshape(*lead, -1)


# ------------------------------------------------------------------------------------------------
# float helpers
def _fma(a, b, c) -> np.ndarray:
    return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


def _ha(l) -> np.ndarray:
    """((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), l: [8, ...] float32."""
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))


def _hb(l) -> np.ndarray:
    return ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))


def _chain(d: np.ndarray, lanes: np.ndarray) -> np.ndarray:
    """acc = fma(d[b], lanes[b], acc) for b in order (float32 result); d, lanes: [nb, ...] broadcastable."""
    nb = lanes.shape[0]
    shape = np.broadcast_shapes(d.shape[1:], lanes.shape[1:])
    tmp = np.empty(shape, F64)
    acc = np.zeros(shape, F32)
    d = d.astype(F64, copy=False)
    lanes = lanes.astype(F64, copy=False)
    for b in range(nb):
        np.multiply(d[b], lanes[b], out=tmp)
        np.add(tmp, acc, out=tmp)
        np.copyto(acc, tmp, casting="unsafe")
    return acc


# ------------------------------------------------------------------------------------------------
# mul_mat
def _lanes32(qx: np.ndarray, qy: np.ndarray, nlane: int = 8, dtype=F32) -> np.ndarray:
    """qx [M, nb, E] and qy [N, nb, E] (E = nlane*g) -> lanes [nb, nlane, M, N]:
    lane k = sum over elements k*g .. k*g+g-1 of qx*qy (exact integer sums in float)."""
    M, nb, E = qx.shape
    N = qy.shape[0]
    g = E // nlane
    a = qx.astype(dtype).reshape(M, nb, nlane, g).transpose(1, 2, 0, 3)      # [nb, 8, M, g]
    if N == 1:
        yb = qy[0].astype(dtype).reshape(nb, nlane, 1, g)
        return np.einsum("bkmg,bkg->bkm", a, yb[:, :, 0, :], optimize=False)[..., None]
    b = qy.astype(dtype).reshape(N, nb, nlane, g).transpose(1, 2, 3, 0)      # [nb, 8, g, N]
    return np.matmul(a, b)


def _isum(qx: np.ndarray, qy: np.ndarray, dtype=F32) -> np.ndarray:
    """qx [M, nb, E], qy [N, nb, E] -> [nb, M, N] exact integer block sums."""
    a = qx.astype(dtype).transpose(1, 0, 2)
    b = qy.astype(dtype).transpose(1, 2, 0)
    return np.matmul(a, b)


# ggml_tiled_matmul_supported / ggml_tiled_min_batch (llama.cpp 0.3.36, ggml-cpu/tiled/tiled.cpp): the
# K-quant weights that are not in the repack buffer, from 8 rows of X on (src1->ne[1], one slice's rows)
TILED_TYPES = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
TILED_MIN_ROWS = 8


def takes_tiled(wtype: GGMLType, repacked: bool, n_rows: int, order: str) -> bool:
    """Whether ggml computes this MUL_MAT with the tiled K-quant kernel (order="ggml" only)."""
    return order == "ggml" and wtype in TILED_TYPES and not repacked and n_rows >= TILED_MIN_ROWS


def gemm_rows(N: int, vec_n: int | None = None) -> int:
    """The rows of X (0 .. the result - 1) that repacked Q4_K multiplies in ggml_gemm_q4_K_8x8_q8_K, in
    groups of 4 where the slice has more than 3 rows (vec_n, else N); the rest, and every row where
    vec_n < 4, take ggml_gemv_q4_K_8x8_q8_K."""
    return N - N % 4 if (N if vec_n is None else vec_n) > 3 and N > 3 else 0


def _kq_sums(wtype, b, qy, bsums):
    """Per superblock, exactly: d [M, nb], isum [nb, M, N] (with Q6_K's -32 and Q3_K's signed codes),
    and for the types with mins dmin [M, nb] and minsum [nb, M, N] (else None, None); float64 ints."""
    M, nb = b.shape[:2]
    if wtype in (T.Q4_K, T.Q5_K):
        dx, dmin, sc, m, qx = (_dec_q4_K if wtype == T.Q4_K else _dec_q5_K)(b)
        isum = _isum((qx.astype(F64) * sc[..., None]).reshape(M, nb, 256), qy, dtype=F64)
        s = bsums[..., 0::2].astype(F64) + bsums[..., 1::2]                      # [N, nb, 8]
        return dx, isum, dmin, np.matmul(m.transpose(1, 0, 2).astype(F64), s.transpose(1, 2, 0))
    if wtype == T.Q6_K:
        dx, sc, q6 = _dec_q6_K(b)
        isum = _isum(q6.astype(F64) * np.repeat(sc.astype(F64), 16, axis=-1), qy, dtype=F64)
        isum -= 32 * np.matmul(sc.transpose(1, 0, 2).astype(F64), bsums.transpose(1, 2, 0).astype(F64))
        return dx, isum, None, None
    if wtype == T.Q2_K:
        dx, dmin, sc, m, qx = _dec_q2_K(b)
        isum = _isum((qx.astype(F64) * sc[..., None]).reshape(M, nb, 256), qy, dtype=F64)
        return dx, isum, dmin, np.matmul(m.transpose(1, 0, 2).astype(F64), bsums.transpose(1, 2, 0).astype(F64))
    dx, sc, qx = _dec_q3_K(b)
    return dx, _isum((qx.astype(F64) * sc[..., None]).reshape(M, nb, 256), qy, dtype=F64), None, None


def _mm_kq_tiled(wtype, b, xq):
    """The tiled K-quant kernel's float steps (tiled_run_microtile_avx2): per superblock
    r = f32(d*f32(isum)), minus dmin*f32(minsum) in one fnmadd, then acc = fma(r, dy, acc) in order."""
    qy, dy, bsums = xq
    dx, isum, dmin, msum = _kq_sums(wtype, b, qy, bsums)
    r = dx.T.astype(F32)[:, :, None] * isum.astype(F32)                         # one f32 rounding
    if dmin is not None:
        r = (r.astype(F64) - dmin.T.astype(F64)[:, :, None] * msum.astype(F32)).astype(F32)
    return _chain(r, dy.T[:, None, :])


def _mm_q32(wtype, b, xq, repacked, order):
    """Block-32 weight types. b: [M, nb, bs] blocks; xq: quantized activations."""
    if wtype in (T.Q4_1, T.Q5_1):
        dx, mx, qx = (_dec_q4_1 if wtype == T.Q4_1 else _dec_q5_1)(b)
        qy, dy, sy = xq
    else:
        dx, qx = {T.Q4_0: _dec_q4_0, T.Q5_0: _dec_q5_0, T.Q8_0: _dec_q8_0}[wtype](b)
        qy, dy = xq
    d = (dx.T[:, :, None] * dy.T[:, None, :]).astype(F32)                  # [nb, M, N] f32(dx*dy) exact
    if repacked or order == "fast":
        isum = _isum(qx, qy)                                                # [nb, M, N]
        acc = _chain(isum, d)
        if wtype in (T.Q4_1, T.Q5_1):
            ms = mx.T[:, :, None] * sy.T[:, None, :]
            summs = ms[0].copy()
            for i in range(1, ms.shape[0]):
                summs += ms[i]
            acc += summs
        return acc
    lanes = _lanes32(qx, qy, dtype=F64)                                     # [nb, 8, M, N]
    acc = _chain(d[:, None], lanes)                                         # [8, M, N]
    r = _ha(acc)
    if wtype in (T.Q4_1, T.Q5_1):
        ms = mx.T[:, :, None] * sy.T[:, None, :]                            # [nb, M, N] exact
        summs = ms[0].copy()
        for i in range(1, ms.shape[0]):
            summs += ms[i]
        r = r + summs
    return r


def _mm_mxfp4(b, xq, repacked, order):
    """MXFP4 (module docstring). b: [M, nb, 17] blocks; xq: Q8_0 activations (qs, d)."""
    dx, qx = _dec_mxfp4(b)                                                  # [M, nb], [M, nb, 32]
    qy, dy = xq
    d = (dx.T[:, :, None] * dy.T[:, None, :]).astype(F32)                  # [nb, M, N] f32(e_half*dy)
    if repacked or order == "fast":                                         # the gemv/gemm chain
        return _chain(_isum(qx, qy), d)
    nb = d.shape[0]
    lanes = _lanes32(qx, qy, dtype=F64)                                     # [nb, 8, M, N]
    h = nb - nb % 2                                                         # blocks in pairs
    r = _ha(_chain(d[0:h:2, None], lanes[0:h:2]) + _chain(d[1:h:2, None], lanes[1:h:2]))
    if nb % 2:                                                              # the scalar tail block
        r = _fma(d[-1], lanes[-1].sum(axis=0), r)
    return r


def _mm_kq(wtype, b, xq, repacked, order, vec_n=None):
    qy, dy, bsums = xq                                                      # [N, nb, 256], [N, nb], [N, nb, 16]
    M, nb = b.shape[:2]
    N = qy.shape[0]
    if wtype in (T.Q4_K, T.Q5_K):
        dx, dmin, sc, m, qx = (_dec_q4_K if wtype == T.Q4_K else _dec_q5_K)(b)   # qx [M, nb, 8, 32]
        d = (dy.T[:, None, :] * dx.T[:, :, None]).astype(F32)                   # [nb, M, N]
        dm = (dy.T[:, None, :] * dmin.T[:, :, None]).astype(F32)
        s = (bsums[..., 0::2].astype(np.int32) + bsums[..., 1::2])               # [N, nb, 8] sub-block sums
        if repacked or order == "fast":
            xs = (qx.astype(F32) * sc[..., None].astype(F32)).reshape(M, nb, 256)
            # exact in f64, then f32(isum) as ggml converts it (f32 sums can pass 2^24 here)
            isum = _isum(xs, qy, dtype=F64).astype(F32)                         # [nb, M, N]
            minsum = np.matmul(m.transpose(1, 0, 2).astype(F32), s.transpose(1, 2, 0).astype(F32))
            acc = _chain(isum, d)
            accm = _chain(minsum, dm)
            ng = gemm_rows(N, vec_n) if repacked and wtype == T.Q4_K else 0
            if ng:                  # ggml_gemm_q4_K_8x8_q8_K: one fma per 64 values (2 sub-blocks)
                xs4 = xs.reshape(M, nb * 4, 64)
                qy4 = qy[:ng].reshape(ng, nb * 4, 64)
                isum4 = _isum(xs4, qy4, dtype=F64).astype(F32)                 # [nb*4, M, ng]
                m4 = m.reshape(M, nb * 4, 2).transpose(1, 0, 2).astype(F32)
                s4 = s[:ng].reshape(ng, nb * 4, 2).transpose(1, 2, 0).astype(F32)
                min4 = np.matmul(m4, s4)
                acc[:, :ng] = _chain(isum4, np.repeat(d[:, :, :ng], 4, axis=0))
                accm[:, :ng] = _chain(min4, np.repeat(dm[:, :, :ng], 4, axis=0))
            return (acc - accm).astype(F32)
        # lanes: lane k = sum_j sc_j * sum_{i<4} qx[j, 4k+i] qy[j, 4k+i]
        xs = (qx.astype(F32) * sc[..., None].astype(F32)).reshape(M, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)
        ys = qy.reshape(N, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)
        lanes = _lanes32(xs.reshape(M, nb, 256), ys.reshape(N, nb, 256), dtype=F64)   # [nb, 8, M, N]
        acc = _chain(d[:, None], lanes)
        ml = m.reshape(M, nb, 4, 2).astype(np.int32)
        sl = s.reshape(N, nb, 4, 2)
        mlanes = (np.matmul(ml[..., 0].transpose(1, 2, 0)[..., None].astype(F32),
                            sl[..., 0].transpose(1, 2, 0)[:, :, None, :].astype(F32))
                  + np.matmul(ml[..., 1].transpose(1, 2, 0)[..., None].astype(F32),
                              sl[..., 1].transpose(1, 2, 0)[:, :, None, :].astype(F32)))   # [nb, 4, M, N]
        if wtype == T.Q5_K:         # one scalar: summs = fma(dmin, f32(sum of the 8 sub-blocks' m*s), summs)
            return _ha(acc) + _chain(-dm, mlanes.astype(F64).sum(axis=1).astype(F32))
        accm = _chain(-dm[:, None], mlanes)
        return _ha(acc) + ((accm[0] + accm[2]) + (accm[1] + accm[3]))
    if wtype == T.Q6_K:
        dx, sc, q6 = _dec_q6_K(b)                                              # q6 [M, nb, 256]
        d = (dy.T[:, None, :] * dx.T[:, :, None]).astype(F32)
        scl = np.repeat(sc.astype(F64), 16, axis=-1)                           # [M, nb, 256]
        if order == "fast":
            isum = _isum(q6.astype(F64) * scl, qy, dtype=F64)
            isum -= 32 * np.matmul(sc.transpose(1, 0, 2).astype(F64), bsums.transpose(1, 2, 0).astype(F64))
            return _chain(isum, d)
        xs = (q6.astype(F64) * scl).reshape(M, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)
        ys = qy.reshape(N, nb, 8, 8, 4).transpose(0, 1, 3, 2, 4)
        lanes = _lanes32(xs.reshape(M, nb, 256), ys.reshape(N, nb, 256), dtype=F64)
        scp = sc.reshape(M, nb, 8, 2).astype(F64)
        bsp = bsums.reshape(N, nb, 8, 2).astype(F64)
        corr = (np.matmul(scp[..., 0].transpose(1, 2, 0)[..., None], bsp[..., 0].transpose(1, 2, 0)[:, :, None, :])
                + np.matmul(scp[..., 1].transpose(1, 2, 0)[..., None], bsp[..., 1].transpose(1, 2, 0)[:, :, None, :]))
        lanes = lanes - 32 * corr
        acc = _chain(d[:, None], lanes)
        return _ha(acc)
    if wtype == T.Q2_K:
        dx, dmin, sc, m, qx = _dec_q2_K(b)                                     # qx [M, nb, 16, 16]
        d = (dy.T[:, None, :] * dx.T[:, :, None]).astype(F32)
        dm = (dy.T[:, None, :] * dmin.T[:, :, None]).astype(F32)
        xs = (qx.astype(F32) * sc[..., None].astype(F32)).reshape(M, nb, 256)
        isum = _isum(xs, qy)
        msum = np.matmul(m.transpose(1, 0, 2).astype(F32), bsums.transpose(1, 2, 0).astype(F32))
        terms = (d * isum).astype(F32) - (dm * msum).astype(F32)
    elif wtype == T.Q3_K:
        dx, sc, qx = _dec_q3_K(b)
        d = (dy.T[:, None, :] * dx.T[:, :, None]).astype(F32)
        xs = (qx.astype(F32) * sc[..., None].astype(F32)).reshape(M, nb, 256)
        terms = (d * _isum(xs, qy)).astype(F32)
    else:
        raise NotImplementedError(f"mul_mat: weight type {wtype.name} not supported")
    acc = terms[0].copy()
    for i in range(1, nb):
        acc += terms[i]
    return acc


def _mm_float(wtype, wf: np.ndarray, y: np.ndarray, order: str, tiny: bool | None = None) -> np.ndarray:
    """wf [M, K], y [N, K] float32 (already in the vec_dot type's values). `tiny`: whether the whole
    matrix takes tinyBLAS (decided on the full M, not on this row chunk)."""
    M, K = wf.shape
    N = y.shape[0]
    if order == "fast":
        return (wf.astype(F64) @ y.T.astype(F64)).astype(F32)
    if tiny is None:
        tiny = N >= 2 and K % 8 == 0 and M % 4 == 0
    if tiny:
        # tinyBLAS: one 8-lane accumulator, lane i gets elements = i (mod 8); HA
        w8 = wf.reshape(M, K // 8, 8).transpose(1, 2, 0)[..., None].astype(F64)   # [K/8, 8, M, 1]
        y8 = y.reshape(N, K // 8, 8).transpose(1, 2, 0)[:, :, None, :]            # [K/8, 8, 1, N]
        acc = np.zeros((8, M, N), F32)
        for s in range(K // 8):
            acc = (w8[s] * y8[s] + acc).astype(F32)
        return _ha(acc)
    # ggml_vec_dot_f16/f32: 4 accumulators x 8 lanes over 32-element steps, fold, HB; tail
    np_ = K - K % 32
    if np_:
        w32 = wf[:, :np_].reshape(M, np_ // 32, 32).transpose(1, 2, 0)[..., None].astype(F64)
        y32 = y[:, :np_].reshape(N, np_ // 32, 32).transpose(1, 2, 0)[:, :, None, :]
        acc = np.zeros((32, M, N), F32)
        for s in range(np_ // 32):
            acc = (w32[s] * y32[s] + acc).astype(F32)
        a = acc.reshape(4, 8, M, N)
        a0 = a[0] + a[2]
        a1 = a[1] + a[3]
        r = _hb(a0 + a1)
    else:
        r = np.zeros((M, N), F32)
    if np_ < K:
        if wtype == T.F32:
            for i in range(np_, K):
                r = (r + (wf[:, i, None] * y[None, :, i]).astype(F32)).astype(F32)
        else:
            rd = r.astype(F64)
            for i in range(np_, K):
                rd = rd + (wf[:, i, None] * y[None, :, i]).astype(F32)
            r = rd.astype(F32)
    return r


def _chunk_rows(M: int, per_row: int) -> int:
    return int(max(8, min(4096, _CHUNK_BYTES // max(per_row, 1))))


def mul_mat(wtype: GGMLType, w: np.ndarray, x: np.ndarray, exact: bool = False,
            repacked: bool | None = None, order: str = "ggml", vec_n: int | None = None) -> np.ndarray:
    """ggml CPU MUL_MAT: dst[n, m] = dot(W[m], X[n]) -> float32 [N, M].

    w: uint8 [M, row_bytes] (block types, F16, BF16; f16/uint16 arrays are accepted too) or float32 [M, K]
    for F32. x: float32 [N, K].
    exact=False: X is converted to VEC_DOT_TYPE[wtype] and the dot products follow ggml's float steps
    (see the module docstring for the accumulation orders). exact=True: W is dequantized (row chunks) and
    multiplied by the unquantized X in float32.
    repacked: emulate the CPU_REPACK kernels (Q4_0, Q4_K, MXFP4 only: blocks.REPACK_TYPES). None = ggml's
    rule on x86 AVX2 (blocks.ggml_repacks): repacked iff wtype is one of those and M % 8 == 0; pass False for
    tensors that are not in the repack buffer (e.g. a tied token embedding used as output head).
    order: "ggml" = the AVX2 accumulation orders of the module docstring (bit-faithful, costs one float64
    pass per block over 8 lanes x M x N); "fast" = one fma chain per output over blocks (the repacked
    kernels' order, ULP-level off the vec_dot order) and, for F32/F16/BF16, a float64 BLAS product
    rounded once.
    vec_n: the row count of X that picks the F32/F16/BF16 order="ggml" path (vec_dot for 1, tinyBLAS for
    >= 2), the tiled K-quant path (``takes_tiled``) and repacked Q4_K's gemm (``gemm_rows``); None = N.
    Lets a caller stack the rows of several ggml slices (each output depends only on its own row pair in
    every path) and keep each slice's order; vec_n = 1 gives every row the order of a row alone
    (ComputeOptions.batch_invariant).
    """
    wtype = GGMLType(wtype)
    x = np.asarray(x, F32)
    squeeze = x.ndim == 1
    if squeeze:
        x = x[None]
    N, K = x.shape
    w = np.asarray(w)
    M = w.shape[0]
    if wtype == T.F32 and w.dtype != F32:
        w = np.ascontiguousarray(w).view(F32).reshape(M, K)
    elif (wtype == T.F16 and w.dtype == np.float16) or (wtype == T.BF16 and w.dtype == np.uint16):
        w = (w if w.strides[-1] == 2 else np.ascontiguousarray(w)).view(np.uint8)
    out = np.empty((N, M), F32)
    if M == 0 or N == 0:
        return out[0] if squeeze else out

    if exact:
        step = _chunk_rows(M, K * 4 * 2)
        for m0 in range(0, M, step):
            wc = dequantize(wtype, w[m0:m0 + step], K)
            out[:, m0:m0 + step] = x @ wc.T
        return out[0] if squeeze else out

    if order not in ("ggml", "fast"):
        raise ValueError(f"order must be 'ggml' or 'fast', not {order!r}")
    vt = VEC_DOT_TYPE.get(wtype)
    if vt is None:
        raise NotImplementedError(f"mul_mat: weight type {wtype.name} not supported")
    if repacked is None:
        repacked = ggml_repacks(wtype, M)
    repacked = bool(repacked) and wtype in REPACK_TYPES

    if wtype in (T.F32, T.F16, T.BF16):
        if wtype == T.F32:
            y = x
        elif wtype == T.F16:
            y = x.astype(np.float16).astype(F32)
        else:
            y = dequantize(T.BF16, quantize(T.BF16, x), K)
        tiny = (N if vec_n is None else vec_n) >= 2 and K % 8 == 0 and M % 4 == 0
        per_row = (8 * N * 8 + 32) if tiny else (32 * N * 8 + 32 * 8)
        step = _chunk_rows(M, per_row + K * 8)
        for m0 in range(0, M, step):
            wc = w[m0:m0 + step] if wtype == T.F32 else dequantize(wtype, w[m0:m0 + step], K)
            out[:, m0:m0 + step] = _mm_float(wtype, wc, y, order, tiny).T
        return out[0] if squeeze else out

    xq: tuple[np.ndarray, ...]     # (qs, d) for Q8_0; (qs, d, s) for Q8_1; (qs, d, bsums) for Q8_K
    if vt == T.Q8_0:
        xq = quantize_q8_0(x)
    elif vt == T.Q8_1:
        xq = quantize_q8_1(x)
    else:
        xq = quantize_q8_K(x)
    nb = K // TYPE_TRAITS[wtype].blck_size
    lanes_per_row = nb * max(N, 1) * (8 * 8 + 4 * 8 + 16)
    step = _chunk_rows(M, lanes_per_row + K * 8)
    tiled = takes_tiled(wtype, repacked, N if vec_n is None else vec_n, order)
    for m0 in range(0, M, step):
        b = _blocks(wtype, w[m0:m0 + step], K)
        if tiled:
            out[:, m0:m0 + step] = _mm_kq_tiled(wtype, b, xq).T
        elif wtype == T.MXFP4:
            out[:, m0:m0 + step] = _mm_mxfp4(b, xq, repacked, order).T
        elif vt in (T.Q8_0, T.Q8_1):
            out[:, m0:m0 + step] = _mm_q32(wtype, b, xq, repacked, order).T
        else:
            out[:, m0:m0 + step] = _mm_kq(wtype, b, xq, repacked, order, vec_n).T
    return out[0] if squeeze else out

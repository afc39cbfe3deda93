"""numba kernels for the CPU backend's float ops: one call per op, bit-identical to ops.py's numpy paths.

ops.py runs these when numba is on (ComputeOptions.numba) and an op's operands fit (f32 activations, f16 or
f32 weights and caches); everything else, and GGML_DIST_NO_NUMBA=1, takes the numpy kernels, which stay the
reference. Each kernel works on the 4-d strided views ops.py receives (numpy order, ne reversed), so a
decode step pays one dispatch per op instead of a chain of numpy temporaries. Each reads a whole row (or
element pair) before writing it, so dst may alias src0 as gallocr's in-place reuse allows.

Kernels release the GIL (nogil=True): a server's event loop keeps streaming while a step computes.

Float steps follow ggml-numerics.md exactly as the numpy paths emulate them: ``fma(a, b, c)`` is
``f32(f64(a) * f64(b) + f64(c))`` (numerics.fma32), or a true fma (_fma) where that gives the same bits
(vexp's, checked on all 2^32 inputs); sums ggml keeps in double (ggml_float) are sequential float64 sums.
fastmath stays off (LLVM then neither contracts nor reorders), and error_model="numpy" gives IEEE division
(1/0 = inf) instead of Python's ZeroDivisionError.

Kernels, each mirroring a ggml CPU function:
* ``mul_mat``: ggml_compute_forward_mul_mat for F16/F32 weights (attention KQ and KQV), every slice and
  GQA broadcast in one call: ggml_vec_dot_f16/_f32 for one activation row, tinyBLAS for more.
* ``rms_norm``: ggml_compute_forward_rms_norm_f32, optionally followed by the MUL by a weight row.
* ``soft_max``: ggml_compute_forward_soft_max_f32 (scale, mask with ALiBi slope, ggml_vec_soft_max_f32).
* ``swiglu``: ggml_vec_swiglu_f32.
* ``rope``: the rotation of ggml_compute_forward_rope_flt (cos/sin come from rope.py's cache).
* ``set_rows``: ggml_compute_forward_set_rows into F32 or F16 (ggml_cpu_fp32_to_fp16).
The vexp kernels (softmax, swiglu) cover rows whose length is a multiple of 8; ops.py keeps the numpy
path for the rest, whose tail uses numpy's float32 exp, which numba cannot reproduce.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Concatenate, ParamSpec, cast

import numba
import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.arrayobj import make_array

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from .entry import (
    F32P,
    F32V4,
    I64V4,
    U16V4,
    Lazy,
    Split,
    address,
    array4,
    array4c,
    at,
    bound,
    keep_alive,
    shape_block,
    view_block,
)
from .numerics import _C_LN2_HI, _C_LN2_LO, _C_LOG2E, _C_P0, _C_P1, _C_P2, _C_P3, _C_P4, _C_SHIFT
from .threads import get_threads, launch

F32 = np.float32
F64 = np.float64
_U64 = np.uint64
_I64 = np.int64      # _I64(c) passed to another kernel: an int64, where c would be a Literal and compile
                     # an overload of the callee of its own
_TWO112 = F64(2.0 ** 112)

_P = ParamSpec("_P")


def _intrinsic(defn: Callable[Concatenate[Any, _P], object]) -> Callable[_P, Any]:
    """numba.extending.intrinsic, typed as nopython code calls the result: without defn's first argument,
    the typing context, which numba supplies (numba's stub keeps it, and types the call Never, since
    calling an intrinsic from Python raises)."""
    return cast("Callable[_P, Any]", intrinsic(defn))


# ------------------------------------------------------------------------------------------------
# scalar helpers: bit casts, f16 <-> f32, vexp
@_intrinsic
def _bits(typingctx, x):
    """float32 -> its uint32 bit pattern (an LLVM bitcast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@_intrinsic
def _float(typingctx, u):
    """uint32 bit pattern -> float32."""
    if u != types.uint32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@_intrinsic
def _data_ptr(typingctx, arr):
    """An array's data pointer (its first element), typed as a pointer to its dtype."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        return make_array(sig.args[0])(context, builder, value=args[0]).data
    return types.CPointer(arr.dtype)(arr), codegen


@njit(cache=True, inline="always")
def _rows_view(a):
    """(flat, s3, s2, s1) for a 4-d array whose rows are contiguous (last stride = itemsize, the others
    >= 0): flat is a C-contiguous 1-D view from a's first element over its whole span, and row
    (i3, i2, i1) is flat[i3*s3 + i2*s2 + i1*s1:][:ne0], a unit-stride slice numba can vectorise."""
    it = a.itemsize
    span = 1
    for d in range(4):
        if a.shape[d] == 0:
            span = 0
        elif span > 0:
            span += (a.shape[d] - 1) * (a.strides[d] // it)
    flat = carray(_data_ptr(a), (span,))
    return flat, a.strides[0] // it, a.strides[1] // it, a.strides[2] // it


@njit(cache=True, inline="always")
def f16_bits(v):
    """float32 -> float16 bits, round to nearest even: numpy's astype(float16) (npy_floatbits_to_halfbits,
    NaN payloads included); for finite values and inf also ggml_cpu_fp32_to_fp16."""
    f = _U64(_bits(v))
    h_sgn = (f & _U64(0x80000000)) >> _U64(16)
    f_exp = f & _U64(0x7F800000)
    if f_exp >= _U64(0x47800000):                       # overflow, inf, nan
        f_sig = f & _U64(0x007FFFFF)
        if f_exp == _U64(0x7F800000) and f_sig != _U64(0):
            ret = _U64(0x7C00) + (f_sig >> _U64(13))
            if ret == _U64(0x7C00):
                ret += _U64(1)
            return np.uint16(h_sgn + ret)
        return np.uint16(h_sgn + _U64(0x7C00))
    if f_exp <= _U64(0x38000000):                       # subnormal half or signed zero
        if f_exp < _U64(0x33000000):
            return np.uint16(h_sgn)
        e = f_exp >> _U64(23)
        f_sig = (_U64(0x00800000) + (f & _U64(0x007FFFFF))) >> (_U64(113) - e)
        if (f_sig & _U64(0x3FFF)) != _U64(0x1000) or (f & _U64(0x7FF)) != _U64(0):
            f_sig += _U64(0x1000)
        return np.uint16(h_sgn + (f_sig >> _U64(13)))
    h_exp = (f_exp - _U64(0x38000000)) >> _U64(13)
    f_sig = f & _U64(0x007FFFFF)
    if (f_sig & _U64(0x3FFF)) != _U64(0x1000):
        f_sig += _U64(0x1000)
    return np.uint16(h_sgn + (((f_sig >> _U64(13)) + h_exp) & _U64(0xFFFF)))


@njit(cache=True, inline="always")
def f16_value(h):
    """float16 bits -> float64 value (exact, like ggml_cpu_fp16_to_fp32). Branch-free but for inf/nan:
    the bits shifted into a float32 are the value times 2^-112 (subnormal halves become subnormal floats,
    widened exactly), so one exact multiply by 2^112 finishes it."""
    u = _U64(h)
    em = u & _U64(0x7FFF)
    b = ((u & _U64(0x8000)) << _U64(16)) | (em << _U64(13))
    if em >= _U64(0x7C00):
        return F64(_float(np.uint32(b | _U64(0x7F800000))))
    return F64(_float(np.uint32(b))) * _TWO112


@njit(cache=True, inline="always")
def vexp(x):
    """ggml_v_expf for one float32 lane with ggml's true fmas (_fma: llvm.fma.f32, one rounding): these
    give numerics.vexp's bits (fma emulated in float64) on every non-NaN float32 (all 2^32 checked,
    each fma alone and all together). A NaN x gives x quieted with its sign flipped, as vexp's
    steps do (-n carries it); set explicitly, as the NaN an fma passes on depends on the instruction
    form LLVM picks. Branch-free, so loops calling it vectorise: both outcomes of |n| > 126 are computed
    and one is selected. The lanes that are not selected must not make subnormals or underflow (each
    costs a microcode assist): s1*s1 (+0 for n <= 0, else +inf) is selected, not multiplied, and the
    |n| > 126 path takes s2 = 1 in the other lanes."""
    z = _fma(x, _C_LOG2E, _C_SHIFT)
    n = z - _C_SHIFT
    b = _fma(-n, _C_LN2_LO, _fma(-n, _C_LN2_HI, x))
    e = np.uint32(_bits(z) << np.uint32(23))
    k = _float(np.uint32(e + np.uint32(0x3F800000)))
    u = b * b
    j = _fma(_fma(_fma(_C_P0, b, _C_P1), u, _fma(_C_P2, b, _C_P3)), u, _C_P4 * b)
    an = abs(n)
    neg = n <= 0
    g = np.uint32(0x82000000) * np.uint32(neg)          # |n| > 126: 2^n applied in two factors
    s1 = _float(np.uint32(g + np.uint32(0x7F000000)))
    s2 = _float(np.uint32(e - g)) if an > 126 else F32(1)
    big = (F32(0) if neg else F32(np.inf)) if an > 192 else _fma(s2, j, s2) * s1
    r = big if an > 126 else _fma(j, k, k)
    nan = _float(np.uint32((_bits(x) | np.uint32(0x00400000)) ^ np.uint32(0x80000000)))
    return r if x == x else nan


@njit(cache=True, inline="always")
def _ha(a0, a1, a2, a3, a4, a5, a6, a7):
    """HA horizontal sum of 8 float32 lanes: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    return ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))


# ------------------------------------------------------------------------------------------------
# MUL_MAT, F16 / F32 weights (F16: _mm_h_rows below)
# F32 weights: a block of _RB weight rows is widened once and reused by every activation row of the slices that share
# it. Layout per accumulation step s (nl ggml lanes): lane j = r * nl + l is lane l of row r, so a step is one
# unit-stride loop over _RB * nl lanes: wt[s, j] = W[m0 + r, s * nl + l] and, per activation row,
# yr[s, j] = Y[s * nl + l] (the row repeated for each of the _RB weight rows).
_RB = 8       # weight rows per block
_NB = 16      # activation rows per chunk (bounds the activation scratch)


@_intrinsic
def _half(typingctx, h):
    """float16 bits -> float32 value (LLVM fpext: exact, vectorised to vcvtph2ps)."""
    if h != types.uint16:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@_intrinsic
def _round_half(typingctx, v):
    """float32 -> nearest-even float16 -> float32 (LLVM fptrunc/fpext: vcvtps2ph, vcvtph2ps). Equals
    numpy's astype(float16) on every non-NaN input; a NaN stays a NaN (payload as the hardware sets it)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@_intrinsic
def _fma(typingctx, a, b, c):
    """float32 fused multiply-add, one rounding (llvm.fma.f32)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, sig, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f], ir.FunctionType(f, [f, f, f]))
        return builder.call(fn, args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@njit(cache=True, inline="always")
def _mac(w, y, acc):
    """One lane update fma(w, y, acc) of the F32-weight kernel with the numpy reference's bits: w, y are
    float64 lanes holding f32 values, whose 48-bit product is exact; f32(f64 sum) as the reference rounds
    (f64 double rounding can differ from a one-rounding fma here)."""
    return F32(w * y + F64(acc))


# Attention products skip what cannot change the result, as ggml's flash attention does (it skips cells
# whose mask is -inf): SKIP_KQ leaves out KQ's cells that the soft_max's mask sets to -inf (any finite KQ
# value gives -inf there; 0 is written), SKIP_KQV leaves out the leading and trailing lane steps whose
# probabilities are all 0 (fma(v, 0, acc) = acc; acc starts at +0 and never becomes -0). Both are exact
# when the cached K and V are finite; ops.py binds them only to the KQ -> SOFT_MAX -> KQV chain.
SKIP_NONE, SKIP_KQ, SKIP_KQV = 0, 1, 2
_NO_MASK = np.zeros((1, 1, 1, 1), F32)
_NO_ROPE = np.zeros((1, 1), F32)
_NO_ROWS = (_NO_ROPE, _NO_ROPE, 0, False, _NO_ROPE, _NO_ROPE, 0, False, False)   # bind_attention without rows
_ATTN_VIEWS, _ROW_VIEWS, _AUX_VIEWS = 9, 10, 5     # bind_attention's block: its views, the rows', the rest


def mul_mat_threads(w, x, dst, tiny: bool, half: bool, mask=None, skip: int = SKIP_NONE) -> None:
    """mul_mat, with F16 products split by activation slice (query head) across the kernels' threads (threads.py) when
    there are several and the product is big enough to pay for a launch. mask/skip: see _mm_h_rows."""
    B3, B2, M = x.shape[0], x.shape[1], w.shape[2]
    mask = _NO_MASK if mask is None else mask
    if half and B3 * B2 > 1 and get_threads() > 1 and x.size * M >= _PARALLEL_WORK:
        with launch():
            _mm_h_rows_par(w, x, dst, tiny, mask, skip, get_threads())
        return
    mul_mat(w, x, dst, tiny, half, mask, skip)


_PARALLEL_WORK = 1 << 16                # multiply-adds (attention products are cheap to launch)


def bind_mul_mat(w, x, dst, tiny: bool, half: bool, mask=None, skip: int = SKIP_NONE) -> Callable[[], None]:
    """mul_mat_threads for arrays fixed from now on (a replayed step's), through entry points
    (entry.py): the kernel itself where the product is too small ever to split across threads."""
    mask = _NO_MASK if mask is None else mask
    if not half:
        return partial(mul_mat, w, x, dst, tiny, half, mask, skip)
    n = x.shape[0] * x.shape[1]
    return bind_split(n > 1 and x.size * w.shape[2] >= _PARALLEL_WORK, (_mm_h_rows, w, x, dst, tiny, 0, n, mask, skip),
                      (_mm_h_rows_par, w, x, dst, tiny, mask, skip), any_layout=True)


def bind_split(splits: bool, serial: tuple, parallel: tuple, most: int = 1 << 30,
               any_layout: bool = False) -> Callable[[], None]:
    """A bound op (entry.py) that may split across threads: serial = (kernel, *args) called as it is,
    parallel = (kernel, *args) given a thread count last. Where the op is too small ever to split, the
    serial kernel's entry itself; else an entry.Split, each entry resolved at its first call (a serial twin
    that a run at 2 threads never calls is never compiled)."""
    if not splits:
        return bound(*serial, any_layout=any_layout)
    return Split(Lazy(*serial, any_layout=any_layout), Lazy(*parallel, any_layout=any_layout), most)


def mul_mat(w, x, dst, tiny, half, mask=None, skip=SKIP_NONE):
    """dst[i3, i2, n, m] = W[i3 // r3, i2 // r2, m, :] . X[i3, i2, n, :] (ggml_compute_forward_mul_mat).

    w: [A3, A2, M, K] uint16 (f16 bits; half=True) or float32 (half=False); x: float32 [B3, B2, N, K];
    both with contiguous rows (last stride = itemsize) and no negative stride; dst: float32 [B3, B2, N, M].
    half: X is rounded to f16 first (F16's vec_dot_type) and the vec_dot tail is summed in double
    (ggml_vec_dot_f16), else X is kept and the tail summed in float (ggml_vec_dot_f32).
    tiny=False: ggml_vec_dot_f16/_f32, 4 x 8 lanes (element k -> lane k mod 32) over 32-element steps,
    fold a0+a2, a1+a3, a0+a1, then HB; tiny=True: tinyBLAS, 8 lanes (k mod 8), HA (needs K % 8 == 0).
    Lane updates are fma(w, x, acc) (see _mac), quants._mm_float's step. mask/skip (F16 only): the
    attention products' skipped cells, see _mm_h_rows."""
    if half:
        _mm_h_rows(w, x, dst, tiny, 0, x.shape[0] * x.shape[1], _NO_MASK if mask is None else mask, skip)
    else:
        rows = (x.shape[0] // w.shape[0]) * (x.shape[1] // w.shape[1]) * min(x.shape[2], _NB)
        K = w.shape[3]
        _mm(w, x, dst, tiny, np.empty(K * _RB, F64), np.empty((rows, K * _RB), F64))


def bind_attention(kw, q, kq, mask, tiny_kq, scale, slopes, sm, vw, tiny_kqv, kqv, cont, one_loop=False,
                   rows=None):
    """The attention chain KQ = K.Q (cells the mask hides skipped) -> SOFT_MAX(KQ * scale + mask) ->
    KQV = V.softmax [-> CONT of KQV permuted] as one call, for arrays fixed from now on: per slice
    (query head), _mm_h_rows, _soft_max_rows and _mm_h_rows again, so the same bits as the three
    bound calls, and every tensor written as they write it. Threads take runs of whole KV heads, as
    _mm_h_rows_par splits the products: each runs KQ and the soft_max of its heads, then (all threads
    past the first loop) KQV of its heads; the CONT copy comes after them all. cont: KQV's CONT
    destination seen in KQV's index order (or None). The caller checks that kq and sm overlap neither
    each other (but sm on kq exactly: an in-place soft_max) nor q, mask or K, and kqv neither sm nor V
    (the allocator may put KQV over Q, dead once KQ has read it), and cont not kqv: a thread's writes
    must not land where another thread still reads. one_loop: the caller has checked that no thread's
    writes land where another thread reads at any time (KQV over nothing but its own heads' Q, the
    scores over nothing V), so each thread runs its heads' KQ, soft_max and KQV in one loop: one
    launch, not two (~5 us each). rows: cache_rows_args of the layer's new cache rows (F16 caches),
    which the call then writes first, on the calling thread, as bind_cache_rows's call would just
    before it (one call a layer fewer in a decode step). Every array travels in one view_block (entry.py)
    passed by its address: the attention's 9 views (F16 bits of K and V, F32 others; a mask of another
    type: None, the chain's ops then bound one by one), the rows' 10 (zeros without rows), then the ALiBi
    slopes and the rows' cos and sin of K and Q as 4-d views (_aux)."""
    has_cont = cont is not None
    cont = kqv if cont is None else cont
    views = (kw, q, kq, mask, sm, vw, kqv, cont, _NO_MASK)          # _attention_start
    dtypes = (np.uint16, F32, F32, F32, F32, np.uint16, F32, F32, F32)
    if any(v.dtype != t for v, t in zip(views, dtypes)):
        return None
    if rows is not None and rows[1][4] != np.uint16:
        return None
    rviews, rtypes, rope = rows if rows is not None else ((), (), _NO_ROWS)
    cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q = rope
    aux = tuple(a.reshape(1, 1, 1, -1) if a.ndim == 1 else a[None, None] for a in (slopes, cos, sin, cq, sq))
    if any(a.dtype != F32 for a in aux):
        return None
    block = np.zeros(9 * (_ATTN_VIEWS + _ROW_VIEWS + _AUX_VIEWS), np.int64)
    block[:9 * (_ATTN_VIEWS + len(rviews))] = view_block((*views, *rviews), (*dtypes, *rtypes))
    block[9 * (_ATTN_VIEWS + _ROW_VIEWS):] = view_block(aux, (F32,) * _AUX_VIEWS)
    args = (address(block), tiny_kq, float(scale), tiny_kqv, has_cont, (n_dims, neox, nq, neoxq, has_q),
            rows is not None)
    return keep_alive(bind_split(q.shape[0] * q.shape[1] > 1 and q.size * kw.shape[2] >= _PARALLEL_WORK,
                                 (_attention_serial, *args),
                                 (_attention_par1 if one_loop else _attention_par, *args)), (*views, *rviews, *aux))


@njit(cache=True, inline="always")
def _attention_start(addr, scale64, rope, has_rows):
    """An attention call's first steps: the layer's new cache rows written (_new_rows), then its views
    (kw, q, kq, mask, sm, vw, kqv, cont, nomask), its f32 scale and its slopes."""
    block = at(addr, 9 * (_ATTN_VIEWS + _ROW_VIEWS + _AUX_VIEWS))
    _new_rows(block, rope, has_rows)
    views = (array4(U16V4, block, 0), array4(F32V4, block, 1), array4(F32V4, block, 2), array4(F32V4, block, 3),
             array4(F32V4, block, 4), array4(U16V4, block, 5), array4(F32V4, block, 6), array4(F32V4, block, 7),
             array4(F32V4, block, 8))
    return views, F32(scale64), _aux(block, 0)[0, 0, 0]


@njit(cache=True, inline="always")
def _aux(block, i):
    """bind_attention's aux view i (0: the slopes, 1-4: cos and sin of K and Q) as the 1-d or 2-d array
    it was."""
    return array4(F32V4, block, _ATTN_VIEWS + _ROW_VIEWS + i)


@njit(cache=True, inline="always")
def _new_rows(block, rope, has_rows):
    """bind_attention's rows: the views past the attention's 9 are _cache_rows's, rope its other
    scalar arguments (F16 caches). A call of _cache_rows_f16 (not inlined), so the three attention
    entries share its one compiled copy."""
    if has_rows:
        n_dims, neox, nq, neoxq, has_q = rope
        _cache_rows_f16(block[9 * _ATTN_VIEWS:], _aux(block, 1)[0, 0], _aux(block, 2)[0, 0], n_dims, neox,
                        _aux(block, 3)[0, 0], _aux(block, 4)[0, 0], nq, neoxq, has_q)


@njit(cache=True, nogil=True, error_model="numpy")
def _attention_serial(addr, tiny_kq, scale64, tiny_kqv, has_cont, rope, has_rows):
    (kw, q, kq, mask, sm, vw, kqv, cont, nomask), scale, slopes = _attention_start(addr, scale64, rope, has_rows)
    n = _I64(q.shape[0] * q.shape[1])
    _scores_part(kw, q, kq, mask, tiny_kq, scale, slopes, sm, _I64(0), n)
    _mm_h_rows(vw, sm, kqv, tiny_kqv, _I64(0), n, nomask, _I64(SKIP_KQV))
    if has_cont:
        _copy4(kqv, cont)


@njit(cache=True, nogil=True, error_model="numpy")
def _scores_part(kw, q, kq, mask, tiny_kq, scale, slopes, sm, u0, u1):
    """_scores as a function of its own (not inlined), called by the three attention entries: one
    compiled copy for them all, and a parallel loop whose body is two calls, which numba compiles in a
    fraction of the time of the inlined chain (cold, SmolLM2, the project's busy 2-vCPU VM: the three
    entries 74 s of CPU before, 45 s after; model/warmup.py's MEASURED_COSTS). The same operations in
    the same order, so the same bits; the call per thread's chunk costs nothing measurable
    (benchmarks/decode_step.py, alternating runs: the attention 31-36 us a call at 1 thread and 26-30 at
    2, the step 5.0-5.8 ms and 3.6-3.9 ms, before and after)."""
    _scores(kw, q, kq, mask, tiny_kq, scale, slopes, sm, u0, u1)


@njit(cache=True, inline="always")
def _head_runs(q, kw, n_chunks):
    """(r2, n, n_chunks): the attention's slices in n units of r2 (whole KV heads, as _mm_h_rows_par
    splits them), over at most n_chunks threads."""
    r2 = q.shape[1] // kw.shape[1]
    if q.shape[0] * q.shape[1] // r2 < n_chunks:
        r2 = 1
    n = q.shape[0] * q.shape[1] // r2
    return r2, n, min(n, n_chunks)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _attention_par1(addr, tiny_kq, scale64, tiny_kqv, has_cont, rope, has_rows, n_chunks):
    """_attention_par in one parallel loop (bind_attention's one_loop)."""
    (kw, q, kq, mask, sm, vw, kqv, cont, nomask), scale, slopes = _attention_start(addr, scale64, rope, has_rows)
    r2, n, n_chunks = _head_runs(q, kw, n_chunks)
    for c in prange(n_chunks):
        u0, u1 = _I64(r2 * (c * n // n_chunks)), _I64(r2 * ((c + 1) * n // n_chunks))
        _scores_part(kw, q, kq, mask, tiny_kq, scale, slopes, sm, u0, u1)
        _mm_h_rows(vw, sm, kqv, tiny_kqv, u0, u1, nomask, _I64(SKIP_KQV))
    if has_cont:
        _copy4(kqv, cont)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _attention_par(addr, tiny_kq, scale64, tiny_kqv, has_cont, rope, has_rows, n_chunks):
    (kw, q, kq, mask, sm, vw, kqv, cont, nomask), scale, slopes = _attention_start(addr, scale64, rope, has_rows)
    r2, n, n_chunks = _head_runs(q, kw, n_chunks)
    for c in prange(n_chunks):
        _scores_part(kw, q, kq, mask, tiny_kq, scale, slopes, sm, _I64(r2 * (c * n // n_chunks)),
                     _I64(r2 * ((c + 1) * n // n_chunks)))
    for c in prange(n_chunks):
        _mm_h_rows(vw, sm, kqv, tiny_kqv, _I64(r2 * (c * n // n_chunks)), _I64(r2 * ((c + 1) * n // n_chunks)),
                   nomask, _I64(SKIP_KQV))
    if has_cont:
        _copy4(kqv, cont)


@njit(cache=True, inline="always")
def _copy4(src, dst):
    for i3 in range(src.shape[0]):
        for i2 in range(src.shape[1]):
            for i1 in range(src.shape[2]):
                for i0 in range(src.shape[3]):
                    dst[i3, i2, i1, i0] = src[i3, i2, i1, i0]


@njit(cache=True, inline="always")
def _scores(kw, q, kq, mask, tiny_kq, scale, slopes, sm, u0, u1):
    """Slices u0 .. u1-1 (u = i3 * B2 + i2) of KQ, then their soft_max rows."""
    _mm_h_rows(kw, q, kq, tiny_kq, _I64(u0), u1, mask, _I64(SKIP_KQ))
    _soft_max_rows(kq, scale, mask, slopes, True, sm, u0 * kq.shape[2], u1 * kq.shape[2])


# F16 weights (the KV cache): one dot product per (activation row, weight row), each in a _vdot32xG/_vdot8
# intrinsic that keeps ggml's lane chains in LLVM vector registers (numba would neither vectorise nor keep
# in registers chains this short), so no weight block is widened or transposed first; tinyBLAS rows go 8
# at a time (_vdot8xR), and vec_dot rows against the query heads of their KV head (_vdot32xG), to hide
# the fma latency of one chain.
def _lane_chains(context, builder, sig, args, nl, rows):
    """LLVM IR: the lane chains of `rows` weight rows against one activation row over `steps` whole
    steps of nl lanes (lane = element mod nl, in nl // 8 groups of 8 f32), as <8 x float> values.
    args (w, wo, ws, y, yo, steps, ...): weight row i (f16 bits) at w[wo + i*ws], activations at y[yo]."""
    v8, h8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.HalfType(), 8)
    w, wo, ws, y, yo, steps = args[:6]
    wbase = context.make_array(sig.args[0])(context, builder, w).data
    wps = [builder.bitcast(builder.gep(wbase, [builder.add(wo, builder.mul(ws, ir.Constant(ws.type, i)))]),
                           h8.as_pointer()) for i in range(rows)]
    yp = builder.bitcast(builder.gep(context.make_array(sig.args[3])(context, builder, y).data, [yo]),
                         v8.as_pointer())
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]), "llvm.fma.v8f32")
    ng = nl // 8
    zero = ir.Constant(v8, None)
    accs = [[cgutils.alloca_once_value(builder, zero) for _ in range(ng)] for _ in range(rows)]
    with cgutils.for_range(builder, steps) as loop:
        base = builder.mul(loop.index, ir.Constant(loop.index.type, ng))
        for j in range(ng):
            o = builder.add(base, ir.Constant(base.type, j))
            yv = builder.load(builder.gep(yp, [o]), align=4)
            for wp, acc in zip(wps, accs):
                wv = builder.fpext(builder.load(builder.gep(wp, [o]), align=2), v8)
                builder.store(builder.call(fma, [wv, yv, builder.load(acc[j])]), acc[j])
    return [[builder.load(a) for a in acc] for acc in accs]


def _reduce_lanes(builder, a):
    """ggml's reduction of one row's lane vectors: 4 groups (vec_dot_f16): GGML_F32x8_REDUCE (a0 += a2,
    a1 += a3, a0 += a1) then HB; 1 group (tinyBLAS): HA."""
    s = builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3])) if len(a) == 4 else a[0]
    lane = [builder.extract_element(s, ir.Constant(ir.IntType(32), i)) for i in range(8)]
    t = [builder.fadd(lane[i], lane[i + 4]) for i in range(4)]
    if len(a) == 4:
        return builder.fadd(builder.fadd(t[0], t[1]), builder.fadd(t[2], t[3]))         # HB
    return builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))             # HA


def _vdot_typer(w, wo, ws, y, yo, steps, *out):
    if w == types.Array(types.uint16, 1, "C") and y == types.Array(types.float32, 1, "C") \
            and all(isinstance(v, types.Integer) for v in (wo, ws, yo, steps, *out[1:])) \
            and (not out or out[0] == types.Array(types.float32, 1, "C")):
        res = types.void if out else types.float32
        ip = types.intp
        return res(w, ip, ip, y, ip, ip, *out[:1], *(ip,) * len(out[1:]))
    return None


def _vdot_intrinsic(nl: int, name: str, doc: str):
    """An intrinsic (w, wo, ws, y, yo, steps) -> float32: one weight row w[wo:] (f16 bits; ws unused)
    against y[yo:] over whole steps of nl lanes, reduced as ggml does (see _reduce_lanes)."""
    def vdot(typingctx, w, wo, ws, y, yo, steps):
        def codegen(context, builder, sig, args):
            return _reduce_lanes(builder, _lane_chains(context, builder, sig, args, nl, 1)[0])
        sig = _vdot_typer(w, wo, ws, y, yo, steps)
        return (sig, codegen) if sig is not None else None
    vdot.__name__, vdot.__doc__ = name, doc
    return _intrinsic(vdot)


_vdot8 = _vdot_intrinsic(8, "_vdot8", "tinyBLAS's 8 lanes and HA")


def _vdot32xG_intrinsic(G: int):
    """ggml_vec_dot_f16's lane chains (4 x 8 lanes) and fold (a0 + a2) + (a1 + a3) of one weight row
    w[wo:] against G activation rows y[yo + j*ys:], the folded 8 lanes stored at out[8 * (oo + j*os):]:
    the row's f16 codes are widened once for all G (the query heads of one KV head under GQA), and the
    G chains are independent. The last step, HB over the 8 lanes, is left to _hb_rows, which does it
    for many rows at once (per row, in scalars, it cost more than a short row's chains)."""
    def vdot(typingctx, w, wo, ys, y, yo, steps, out, oo, os_):
        def codegen(context, builder, sig, args):
            v8, h8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.HalfType(), 8)
            w_, wo_, ys_, y_, yo_, steps_, out_, oo_, os__ = args
            i64 = ir.IntType(64)

            def c(i):
                return ir.Constant(i64, i)

            wp = builder.bitcast(builder.gep(context.make_array(sig.args[0])(context, builder, w_).data,
                                             [wo_]), h8.as_pointer())
            ybase = context.make_array(sig.args[3])(context, builder, y_).data
            yps = [builder.bitcast(builder.gep(ybase, [builder.add(yo_, builder.mul(ys_, c(j)))]),
                                   v8.as_pointer()) for j in range(G)]
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8, v8]),
                                                 "llvm.fma.v8f32")
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8, None)) for _ in range(4)]
                    for _ in range(G)]
            with cgutils.for_range(builder, steps_) as loop:
                base = builder.mul(loop.index, c(4))
                for k in range(4):
                    o = builder.add(base, c(k))
                    wv = builder.fpext(builder.load(builder.gep(wp, [o]), align=2), v8)
                    for yp, acc in zip(yps, accs):
                        yv = builder.load(builder.gep(yp, [o]), align=4)
                        builder.store(builder.call(fma, [wv, yv, builder.load(acc[k])]), acc[k])
            op = builder.bitcast(context.make_array(sig.args[6])(context, builder, out_).data,
                                 v8.as_pointer())
            for j, acc in enumerate(accs):
                a = [builder.load(x) for x in acc]
                folded = builder.fadd(builder.fadd(a[0], a[2]), builder.fadd(a[1], a[3]))
                builder.store(folded, builder.gep(op, [builder.add(oo_, builder.mul(os__, c(j)))]), align=4)
            return context.get_dummy_value()
        ints = (wo, ys, yo, steps, oo, os_)
        if not (w == types.Array(types.uint16, 1, "C") and y == types.Array(types.float32, 1, "C")
                and out == types.Array(types.float32, 1, "C")
                and all(isinstance(v, types.Integer) for v in ints)):
            return None
        ip = types.intp
        return types.void(w, ip, ip, y, ip, ip, out, ip, ip), codegen
    vdot.__name__ = f"_vdot32x{G}"
    return _intrinsic(vdot)


@njit(cache=True, inline="always")
def _hb_rows(lanes, res, n):
    """res[r] = HB of the folded lanes[8r:8r+8] for r < n: ((l0+l4) + (l1+l5)) + ((l2+l6) + (l3+l7)),
    as _reduce_lanes does for one row; a loop over rows, so it vectorises across them."""
    for r in range(n):
        o = 8 * r
        res[r] = (((lanes[o] + lanes[o + 4]) + (lanes[o + 1] + lanes[o + 5]))
                  + ((lanes[o + 2] + lanes[o + 6]) + (lanes[o + 3] + lanes[o + 7])))


_vdot32x1, _vdot32x2, _vdot32x3, _vdot32x4 = (_vdot32xG_intrinsic(g) for g in (1, 2, 3, 4))
_HEADS = 4           # most query heads per _vdot32xG call


_ROWS8 = 8           # weight rows per _vdot8xR call


@_intrinsic
def _vdot8xR(typingctx, w, wo, ws, y, yo, steps, out, oo):
    """tinyBLAS's 8-lane dot (HA) of _ROWS8 weight rows w[wo + i*ws:] against y[yo:], into out[oo + i]:
    independent chains, so the latency of one row's 8-lane fma chain is hidden."""
    def codegen(context, builder, sig, args):
        res = [_reduce_lanes(builder, a) for a in _lane_chains(context, builder, sig, args, 8, _ROWS8)]
        op = builder.gep(context.make_array(sig.args[6])(context, builder, args[6]).data, [args[7]])
        for i, r in enumerate(res):
            builder.store(r, builder.gep(op, [ir.Constant(ir.IntType(64), i)]))
        return context.get_dummy_value()
    sig = _vdot_typer(w, wo, ws, y, yo, steps, out, oo)
    return (sig, codegen) if sig is not None else None


@njit(cache=True, nogil=True, error_model="numpy")
def _mm_h_rows(w, x, dst, tiny, u0, u1, mask, skip):
    """Activation slices u0 .. u1-1 (u = i3 * B2 + i2), each against its weight slice, row by row.
    skip = SKIP_KQ: mask [m3, m2, m1, M] is the soft_max's (row n of slice (i3, i2) at
    [i3 % m3, i2 % m2, n]). Without tinyBLAS, up to _HEADS consecutive slices that share a weight slice
    (GQA's query heads of one KV head) go together when the mask is the same for all heads."""
    if tiny:                                                    # one loop nest specialized per path
        _h_rows(w, x, dst, True, u0, u1, mask, skip)
    else:
        _h_rows(w, x, dst, False, u0, u1, mask, skip)


@njit(cache=True, inline="always")
def _scratch4(n0, n1, n2, n3):
    """Four f32 scratch arrays of n0..n3 floats in one allocation, each at a multiple of 16 floats (64
    bytes) from its start: a chunk of the attention allocated its scratch array by array, ~30 times a
    call, each a malloc and a free."""
    a0, a1, a2 = (n0 + 15) // 16 * 16, (n1 + 15) // 16 * 16, (n2 + 15) // 16 * 16
    buf = np.empty(a0 + a1 + a2 + n3, F32)
    return buf[:n0], buf[a0:a0 + n1], buf[a0 + a1:a0 + a1 + n2], buf[a0 + a1 + a2:a0 + a1 + a2 + n3]


@njit(cache=True, inline="always")
def _h_rows(w, x, dst, tiny, u0, u1, mask, skip):
    A2, M, K = w.shape[1], w.shape[2], w.shape[3]
    B2, N = x.shape[1], x.shape[2]
    r2, r3 = B2 // A2, x.shape[0] // w.shape[0]
    nl = 8 if tiny else 32
    ks = K - K % nl
    Y, res, lanes, full = _scratch4(_HEADS * K, _HEADS * M, 8 * _HEADS * M, _HEADS * M)
    live = np.empty(M, np.int64)
    wf, w3, w2, w1 = _rows_view(w)
    xf, x3, x2, x1 = _rows_view(x)
    df, d3, d2, d1 = _rows_view(dst)
    mf, m3, m2, m1 = _rows_view(mask)
    u = u0
    while u < u1:
        i3, i2 = u // B2, u % B2
        g = 1
        if not tiny and mask.shape[1] == 1:
            while g < _HEADS and u + g < u1 and i2 + g < B2 and (i2 + g) // r2 == i2 // r2:
                g += 1
        o = (i3 // r3) * w3 + (i2 // r2) * w2
        for n in range(N):
            for j in range(g):
                xr = xf[i3 * x3 + (i2 + j) * x2 + n * x1:][:K]
                for k in range(K):
                    Y[j * K + k] = _round_half(xr[k])
            s0, s1 = 0, ks // nl                                # the lane steps to run
            if skip == SKIP_KQV:                                # all-zero steps at either end skipped
                s0, s1 = _live_steps(Y, 1, K, s1, 8) if tiny else _live_steps(Y, g, K, s1, 32)
            mo = (i3 % mask.shape[0]) * m3 + (i2 % mask.shape[1]) * m2 + (n % mask.shape[2]) * m1
            mrow = mf[mo:mo + mask.shape[3]]
            out = res
            if tiny:
                _rows_tiny(wf, o, w1, Y, s0, s1, mrow, skip, res, M)
            else:
                out = _rows_vec(wf, o, w1, Y, s0, s1, mrow, skip, res, lanes, live, full, M, K, ks, g)
            for j in range(g):
                do = i3 * d3 + (i2 + j) * d2 + n * d1
                df[do:do + M] = out[j * M:(j + 1) * M]
        u += g


@njit(cache=True, inline="always")
def _rows_tiny(wf, o, w1, y, s0, s1, mrow, skip, res, M):
    """tinyBLAS (8 lanes, HA) of the M weight rows against y: _ROWS8 rows per call, then the rest."""
    mr = M - M % _ROWS8
    for m in range(0, mr, _ROWS8):
        if skip == SKIP_KQ and _all_masked(mrow, m, m + _ROWS8):
            res[m:m + _ROWS8] = 0
        else:
            _vdot8xR(wf, o + m * w1 + 8 * s0, w1, y, 8 * s0, s1 - s0, res, m)
    for m in range(mr, M):
        res[m] = _vdot8(wf, o + m * w1 + 8 * s0, 0, y, 8 * s0, s1 - s0)


@njit(cache=True, inline="always")
def _rows_vec(wf, o, w1, Y, s0, s1, mrow, skip, res, lanes, live, full, M, K, ks, g):
    """ggml_vec_dot_f16 of the M weight rows against the g activation rows Y[j*K:], each weight row
    widened once for all g; the products past the last whole 32-lane step summed in double. Returns the
    array holding row j's results at [j*M:(j+1)*M]: res, or with SKIP_KQ `full`, where the cells the
    mask hides are 0 and only the others (live, compacted first) were computed. lanes: scratch of
    8 * g * M floats for the folded lanes, which _hb_rows reduces all at once."""
    nl = M
    if skip == SKIP_KQ:
        nl = 0
        for m in range(M):                                      # branch-free compaction
            live[nl] = m
            nl += mrow[m] != -np.inf
    for k in range(nl):
        m = live[k] if skip == SKIP_KQ else k
        wo, yo = o + m * w1 + 32 * s0, 32 * s0
        if g == 1:
            _vdot32x1(wf, wo, K, Y, yo, s1 - s0, lanes, k, nl)
        elif g == 2:
            _vdot32x2(wf, wo, K, Y, yo, s1 - s0, lanes, k, nl)
        elif g == 3:
            _vdot32x3(wf, wo, K, Y, yo, s1 - s0, lanes, k, nl)
        else:
            _vdot32x4(wf, wo, K, Y, yo, s1 - s0, lanes, k, nl)
    _hb_rows(lanes, res, g * nl)                                # res[j*nl + k]
    if ks < K:
        for k in range(nl):
            m = live[k] if skip == SKIP_KQ else k
            for j in range(g):
                sd = F64(res[j * nl + k])
                for i in range(ks, K):
                    sd += F64(F32(_half(wf[o + m * w1 + i]) * Y[j * K + i]))
                res[j * nl + k] = F32(sd)
    if skip != SKIP_KQ:
        return res
    full[:g * M] = 0
    for j in range(g):
        for k in range(nl):
            full[j * M + live[k]] = res[j * nl + k]
    return full


@njit(cache=True, inline="always")
def _live_steps(Y, g, K, s1, nl):
    """(s0, s1): lane steps 0 .. s1-1 without the leading and trailing ones that are zero (+0 or -0) in
    all g rows Y[j*K:] (SKIP_KQV). One branch-free pass (it vectorises): the first and last nonzero
    element of the rows, over the steps' ks = s1 * nl elements."""
    ks = s1 * nl
    first, last = ks, 0
    for j in range(g):
        for k in range(ks):
            nz = (_bits(Y[j * K + k]) << np.uint32(1)) != np.uint32(0)
            first = min(first, k if nz else ks)
            last = max(last, k + 1 if nz else 0)
    if last == 0:
        return 0, 0
    return first // nl, -(-last // nl)


@njit(cache=True, inline="always")
def _all_masked(mrow, m0, m1):
    for m in range(m0, m1):  # noqa: SIM110  (numba compiles the loop; all() over a generator it does not)
        if mrow[m] != -np.inf:
            return False
    return True


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _mm_h_rows_par(w, x, dst, tiny, mask, skip, n_chunks):
    """_mm_h_rows with the activation slices (query heads) split across threads in n_chunks runs of
    whole KV heads, so each keeps its GQA groups and its scratch (a run per slice cost more than the
    second thread gave); by slice where there are fewer KV heads than chunks (one stream of an MQA
    model)."""
    r2 = x.shape[1] // w.shape[1]
    if x.shape[0] * x.shape[1] // r2 < n_chunks:
        r2 = 1
    n = x.shape[0] * x.shape[1] // r2                           # units of r2 slices
    n_chunks = min(n, n_chunks)
    for c in prange(n_chunks):
        _mm_h_rows(w, x, dst, tiny, r2 * (c * n // n_chunks), r2 * ((c + 1) * n // n_chunks), mask, skip)


@njit(cache=True, nogil=True, error_model="numpy")
def _mm(w, x, dst, tiny, wt, yr):
    """mul_mat of F32 weights with float64 scratch wt [K * _RB] and yr [r3 * r2 * _NB, K * _RB]."""
    A3, A2, M, K = w.shape
    B3, B2, N = x.shape[0], x.shape[1], x.shape[2]
    r2, r3 = B2 // A2, B3 // A3
    nl = 8 if tiny else 32
    ks = K - K % nl
    acc = np.empty(_RB * nl, F32)
    res = np.empty(_RB, F32)
    wf, w3, w2, w1 = _rows_view(w)
    xf, x3, x2, x1 = _rows_view(x)
    for a3 in range(A3):
        for a2 in range(A2):
            for n0 in range(0, N, _NB):
                nn = min(_NB, N - n0)
                j = 0
                for i3 in range(a3 * r3, a3 * r3 + r3):
                    for i2 in range(a2 * r2, a2 * r2 + r2):
                        for n in range(n0, n0 + nn):
                            o = i3 * x3 + i2 * x2 + n * x1
                            _load_row(xf[o:o + K], nl, yr[j])
                            j += 1
                for m0 in range(0, M, _RB):
                    nr = min(_RB, M - m0)
                    for r in range(_RB):
                        o = a3 * w3 + a2 * w2 + (m0 + r) * w1
                        _widen_row(wf[o:o + K] if r < nr else None, nl, r, wt)
                    j = 0
                    for i3 in range(a3 * r3, a3 * r3 + r3):
                        for i2 in range(a2 * r2, a2 * r2 + r2):
                            for n in range(n0, n0 + nn):
                                yj = yr[j]
                                j += 1
                                _dot_lanes(wt, yj, acc, ks * _RB)
                                if tiny:
                                    _ha_lanes(acc, res)
                                else:
                                    _fold_hb(acc, res)
                                    if ks < K:
                                        _tail(wt, yj, res, ks, K)
                                for r in range(nr):
                                    dst[i3, i2, n, m0 + r] = res[r]


# F32 weights of one slice (a MoE router, ffn_gate_inp [n_embd, n_expert]): each (activation row, weight
# row) straight from the arrays, lanes in registers, the same bits as _mm (its _mac steps, fold and tail)
# without the lane-layout copies; rows of W split across threads, each row read once for all of X's rows
@njit(cache=True, inline="always")
def _dot_f32(wr, xr, acc, nl):
    """_dot_lanes, _fold_hb / _ha_lanes and _tail of one row pair: nl = 32 (vec_dot) or 8 (tinyBLAS; K % 8
    == 0), a constant once inlined."""
    K = wr.shape[0]
    ks = K - K % nl
    for j in range(nl):
        acc[j] = 0
    for k0 in range(0, ks, nl):
        for j in range(nl):
            acc[j] = _mac(F64(wr[k0 + j]), F64(xr[k0 + j]), acc[j])
    if nl == 8:
        return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
    for j in range(8):
        acc[j] = (acc[j] + acc[16 + j]) + (acc[8 + j] + acc[24 + j])
    sf = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
    for k in range(ks, K):
        sf = F32(sf + F32(F64(wr[k]) * F64(xr[k])))
    return sf


@njit(cache=True, nogil=True, error_model="numpy")
def _mm_f32_rows(w, x, dst, tiny, m0, m1):
    """dst[n, m] = W[m] . X[n] for weight rows m0 .. m1-1 (w f32 [M, K], x f32 [N, K], dst f32 [N, M]; rows
    contiguous): mul_mat's F32 numerics (tiny: tinyBLAS's 8 lanes, else vec_dot_f32's 4 x 8)."""
    acc = np.empty(32, F32)
    for m in range(m0, m1):
        wr = w[m]
        for n in range(x.shape[0]):
            dst[n, m] = _dot_f32(wr, x[n], acc, 8) if tiny else _dot_f32(wr, x[n], acc, 32)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _mm_f32_par(w, x, dst, tiny, n_chunks):
    M = w.shape[0]
    n_chunks = min(M, n_chunks)
    for c in prange(n_chunks):
        _mm_f32_rows(w, x, dst, tiny, c * M // n_chunks, (c + 1) * M // n_chunks)


def bind_mul_mat_f32(w, x, dst, tiny: bool) -> Callable[[], None]:
    """mul_mat of one F32 weight slice w [M, K] by x [N, K] into dst [N, M] (2-D, rows contiguous) for
    arrays fixed from now on: _mm_f32_rows, its rows split across threads where the product is big
    enough to pay for a launch."""
    M = w.shape[0]
    return bind_split(x.shape[0] * M * w.shape[1] >= _PARALLEL_WORK and M > 1,
                      (_mm_f32_rows, w, x, dst, tiny, 0, M), (_mm_f32_par, w, x, dst, tiny))


@njit(cache=True, inline="always")
def _load_row(xr, nl, yj):
    """yj = the activation row xr in the lane layout: each step's nl elements once per weight row; the
    vec_dot tail element k at k * _RB."""
    K = xr.shape[0]
    ks = K - K % nl
    for k0 in range(0, ks, nl):
        xs = xr[k0:k0 + nl]
        for r in range(_RB):
            ys = yj[k0 * _RB + r * nl:k0 * _RB + (r + 1) * nl]
            for l in range(nl):
                ys[l] = xs[l]
    for k in range(ks, K):
        yj[k * _RB] = xr[k]


@njit(cache=True, inline="always")
def _widen_row(src, nl, r, wt):
    """Row r of the weight block in the lane layout: step k0's elements at lanes r * nl .. of the step,
    the vec_dot tail element k at k * _RB + r. src = None: zeros (a row past the matrix)."""
    K = wt.shape[0] // _RB
    ks = K - K % nl
    for k0 in range(0, ks, nl):
        ws = wt[k0 * _RB + r * nl:k0 * _RB + (r + 1) * nl]
        if src is None:
            ws[:] = 0
        else:
            ss = src[k0:k0 + nl]
            for l in range(nl):
                ws[l] = ss[l]
    for k in range(ks, K):
        wt[k * _RB + r] = 0 if src is None else src[k]


@njit(cache=True, inline="always")
def _dot_lanes(wt, yj, acc, n):
    """acc[j] = lane j's chain fma(w, y, acc) over the first n entries of wt and yj (whole steps)."""
    L = acc.shape[0]
    acc[:] = 0
    for s0 in range(0, n, L):
        ws = wt[s0:s0 + L]
        ys = yj[s0:s0 + L]
        for j in range(L):
            acc[j] = _mac(ws[j], ys[j], acc[j])


@njit(cache=True, inline="always")
def _ha_lanes(acc, res):
    """tinyBLAS's HA over each row's 8 lanes: ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))."""
    for r in range(_RB):
        a = acc[r * 8:(r + 1) * 8]
        res[r] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@njit(cache=True, inline="always")
def _fold_hb(acc, res):
    """ggml_vec_dot_f16's reduction of 4 accumulators x 8 lanes: a0 += a2, a1 += a3, a0 += a1, then
    HB = ((l0+l4)+(l1+l5)) + ((l2+l6)+(l3+l7))."""
    for r in range(_RB):
        a = acc[r * 32:(r + 1) * 32]
        for l in range(8):
            a[l] = (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l])
        res[r] = ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]))


@njit(cache=True, inline="always")
def _tail(wt, yj, res, ks, K):
    """The leftover K % 32 products (ggml_vec_dot_f32's), each rounded to f32 and summed in float."""
    for r in range(_RB):
        sf = res[r]
        for k in range(ks, K):
            sf = F32(sf + F32(wt[k * _RB + r] * yj[k * _RB]))
        res[r] = sf


# ------------------------------------------------------------------------------------------------
# row ops
@njit(cache=True, nogil=True, error_model="numpy")
def rms_norm(x, eps, wgt, fused, dst):
    """ggml_compute_forward_rms_norm_f32 per row: sum of double(f32(x*x)) in order; mean = f32(sum/n);
    scale = f32(1/sqrt(f32(mean + eps))); y = f32(x*scale). fused: then y = f32(y * wgt[...]) (the MUL
    by the norm weight, wgt broadcast over dst by index modulo its extent; ggml's fusion, same bits).
    The sequential double sum does not vectorise: a prompt's rows are split among the threads
    (bind_rms_norm), as ggml's are."""
    _rms_norm_rows(x, eps, wgt, fused, dst, 0, x.shape[0] * x.shape[1] * x.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _rms_norm_par(x, eps, wgt, fused, dst, n_chunks):
    n = x.shape[0] * x.shape[1] * x.shape[2]
    for c in prange(n_chunks):
        _rms_norm_rows(x, eps, wgt, fused, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _rms_norm_rows(x, eps, wgt, fused, dst, r0, r1):
    _ne3, ne2, ne1, _ne0 = x.shape
    for r in range(r0, r1):
        _rms_row(x, eps, wgt, fused, dst, r // (ne2 * ne1), r // ne1 % ne2, r % ne1)


@njit(cache=True, nogil=True, error_model="numpy")
def add_rms_norm(a, b, s, eps, wgt, dst):
    """ADD, RMS_NORM and the MUL by the norm weight as one call (a layer's residual add and the next
    norm): s = f32(a + b) (the sum's own tensor, which the residual stream reads again), then dst =
    rms_norm(s) fused with wgt, row by row. The same bits as the three kernels; s may alias a or b (a
    row reads only its own row, so rows split among threads too: bind_add_rms_norm)."""
    _add_rms_norm_rows(a, b, s, eps, wgt, dst, 0, s.shape[0] * s.shape[1] * s.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _add_rms_norm_par(a, b, s, eps, wgt, dst, n_chunks):
    n = s.shape[0] * s.shape[1] * s.shape[2]
    for c in prange(n_chunks):
        _add_rms_norm_rows(a, b, s, eps, wgt, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, nogil=True, error_model="numpy")
def _add_rms_norm_c(addr, eps64):
    """add_rms_norm of the C-contiguous arrays of a shape_block (entry.py) at addr: an int to unbox, not
    five arrays; eps64 the f32 eps widened (exactly)."""
    block, eps = at(addr, 5 * 5), F32(eps64)
    s = array4c(F32P, block, 2)
    _add_rms_norm_rows(array4c(F32P, block, 0), array4c(F32P, block, 1), s, eps, array4c(F32P, block, 3),
                       array4c(F32P, block, 4), 0, s.shape[0] * s.shape[1] * s.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _add_rms_norm_c_par(addr, eps64, n_chunks):
    block, eps = at(addr, 5 * 5), F32(eps64)
    a, b, s = array4c(F32P, block, 0), array4c(F32P, block, 1), array4c(F32P, block, 2)
    wgt, dst = array4c(F32P, block, 3), array4c(F32P, block, 4)
    n = s.shape[0] * s.shape[1] * s.shape[2]
    for c in prange(n_chunks):
        _add_rms_norm_rows(a, b, s, eps, wgt, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _add_rms_norm_rows(a, b, s, eps, wgt, dst, r0, r1):
    _ne3, ne2, ne1, ne0 = s.shape
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        ar, br, sr = a[i3, i2, i1], b[i3, i2, i1], s[i3, i2, i1]
        for i in range(ne0):
            sr[i] = ar[i] + br[i]
        _rms_row(s, eps, wgt, True, dst, i3, i2, i1)


@njit(cache=True, inline="always")
def _rms_row(x, eps, wgt, fused, dst, i3, i2, i1):
    ne0 = x.shape[3]
    w3, w2, w1, w0 = wgt.shape
    s = 0.0
    for i in range(ne0):
        v = x[i3, i2, i1, i]
        s += F64(v * v)
    mean = F32(s / ne0)
    scale = F32(1) / F32(np.sqrt(F32(mean + eps)))
    if fused:
        wr = wgt[i3 % w3, i2 % w2, i1 % w1]
        for i in range(ne0):
            dst[i3, i2, i1, i] = F32(x[i3, i2, i1, i] * scale) * wr[i % w0]
    else:
        for i in range(ne0):
            dst[i3, i2, i1, i] = x[i3, i2, i1, i] * scale


def soft_max(x, scale, mask, slopes, has_mask, dst):
    """ggml_compute_forward_soft_max_f32 (rows of a multiple of 8): w = f32(x*scale) [+ f32(slope*mask)];
    max as ggml's scalar loop finds it (_row_max); e = vexp(w - max) (masked -inf stays -inf, vexp(-inf)
    = +0); S = sequential double sum of the chunks' HA sums; p = f32(e * f32(1/S)). mask [m3, m2, m1, ne0]
    is read at (i3 % m3, i2 % m2, i1); slopes[i2] is the ALiBi slope of head i2 (1 without ALiBi).
    When x is finite and the slope positive, a -inf mask entry makes w = -inf and e = +0 whatever x is:
    such cells change neither the max nor the sum (+0 chunks), and their p is +0. So rows whose mask
    hides most cells (a server's interleaved sequences) take _soft_max_sparse, and the others run only
    up to their last whole 8-cell chunk holding an unmasked cell (_live_cells: a KV stream's cells past
    its sequence's end, up to n_kv's padding to 256). Same bits. Every pass but the sum vectorises: rows
    are read as slices of flat views (_rows_view), so x, mask and dst need contiguous rows (ops checks)."""
    _rows_threads(_soft_max_serial, _soft_max_par, x.shape[0] * x.shape[1] * x.shape[2], x.shape[3],
                  x, scale, mask, slopes, has_mask, dst)


@njit(cache=True, nogil=True, error_model="numpy")
def _soft_max_serial(x, scale, mask, slopes, has_mask, dst):
    _soft_max_rows(x, scale, mask, slopes, has_mask, dst, 0, x.shape[0] * x.shape[1] * x.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _soft_max_par(x, scale, mask, slopes, has_mask, dst, n_chunks):
    n = x.shape[0] * x.shape[1] * x.shape[2]
    for c in prange(n_chunks):
        _soft_max_rows(x, scale, mask, slopes, has_mask, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _soft_max_rows(x, scale, mask, slopes, has_mask, dst, r0, r1):
    """Rows r0 .. r1-1 of x (row r = (i3 * ne2 + i2) * ne1 + i1)."""
    _ne3, ne2, ne1, ne0 = x.shape
    xf, x3, x2, x1 = _rows_view(x)
    df, d3, d2, d1 = _rows_view(dst)
    mf, m3, m2, m1 = _rows_view(mask)
    w, wc, _, _ = _scratch4(ne0, ne0, 0, 0)
    idx = np.empty(ne0, np.int64)
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        sl = slopes[i2]
        xr = xf[i3 * x3 + i2 * x2 + i1 * x1:][:ne0]
        dr = df[i3 * d3 + i2 * d2 + i1 * d1:][:ne0]
        mo = (i3 % mask.shape[0]) * m3 + (i2 % mask.shape[1]) * m2 + (i1 % mask.shape[2]) * m1
        mr = mf[mo:][:mask.shape[3]]                            # (a dummy without a mask)
        n = ne0
        if has_mask and sl > 0:
            n, k = _live_cells(xr, mr)
            if n < 0:                                           # a non-finite x: the whole row
                n = ne0
            elif 8 * k < ne0:                                   # (all masked included)
                _soft_max_sparse(xr, scale, mr, sl, dr, wc, idx, k)
                continue
            else:
                dr[n:] = 0
                xr, mr, dr = xr[:n], mr[:n], dr[:n]
        wn = w[:n]
        for i in range(n):
            wn[i] = xr[i] * scale
        if has_mask:
            for i in range(n):
                wn[i] = wn[i] + sl * mr[i]
        _exp_shifted(wn, _row_max(wn))
        _normalize(wn, dr)


@njit(cache=True, inline="always")
def _row_max(w):
    """ggml's max loop (max = -inf; v > max or isnan(v): max = v, stopping at the first NaN). Without
    a NaN in w, as an integer max of order keys (vectorises; exact: a max does not round, and which of
    +0, -0 it keeps changes no vexp(v - max)); with one, that loop itself."""
    mk = _key(np.int32(_bits(F32(-np.inf))))
    nan = False
    for i in range(w.shape[0]):
        v = w[i]
        mk = max(mk, _key(np.int32(_bits(v))))
        nan |= v != v
    if not nan:
        return _float(np.uint32(_key(mk)))
    mx = F32(-np.inf)
    for i in range(w.shape[0]):
        v = w[i]
        if v > mx or np.isnan(v):
            mx = v
            if np.isnan(v):
                break
    return mx


@njit(cache=True, inline="always")
def _key(b):
    """A float32's bits as int32 <-> its order key (the map is its own inverse): the keys of non-NaN
    floats order as the floats do, -0 just below +0."""
    return np.int32(b ^ ((b >> 31) & 0x7FFFFFFF))


@njit(cache=True, inline="always")
def _exp_shifted(w, mx):
    """w = vexp(w - mx) in place, 0 where w = -inf (masked; also when mx = -inf, where w - mx is NaN)."""
    for i in range(w.shape[0]):
        v = w[i]
        e = vexp(F32(v - mx))
        w[i] = F32(0) if v == -np.inf else e


@njit(cache=True, inline="always")
def _live_cells(xr, mr):
    """(n, k) of a row in one vectorised pass: n = its cells up to the last 8-cell chunk with an
    unmasked cell, k = its unmasked cells; n = -1 when some x is not finite (-inf masking then does
    not decide a cell's value: the whole row is computed)."""
    last, k = 0, 0
    bad = False
    for i in range(xr.shape[0]):
        live = mr[i] != -np.inf
        k += live
        last = max(last, i + 1 if live else 0)
        bad |= (_bits(xr[i]) & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return (-1 if bad else -(-last // 8) * 8), k


@njit(cache=True, inline="always")
def _soft_max_sparse(xr, scale, mr, sl, dr, wc, idx, k):
    """soft_max of one row (finite x) over its k unmasked cells only (fewer than an eighth: below that
    the dense passes, which vectorise, cost more). Their indices are compacted (branch-free), in order,
    so the max is the same; w, max and vexp run on the contiguous wc, which is scattered into the
    zeroed row before the normalisation."""
    k = 0
    for i in range(xr.shape[0]):
        idx[k] = i
        k += mr[i] != -np.inf
    for j in range(k):
        wc[j] = F32(xr[idx[j]] * scale) + F32(sl * mr[idx[j]])
    wk = wc[:k]
    _exp_shifted(wk, _row_max(wk))
    dr[:] = 0
    for j in range(k):
        dr[idx[j]] = wk[j]
    _normalize(dr, dr)


@njit(cache=True, inline="always")
def _normalize(e, dr):
    """dr = f32(e * f32(1/S)), S the sequential double sum of the 8-element chunks' HA sums."""
    s = 0.0
    for c in range(0, e.shape[0], 8):
        s += F64(_ha(e[c], e[c + 1], e[c + 2], e[c + 3], e[c + 4], e[c + 5], e[c + 6], e[c + 7]))
    inv = F32(1.0 / s)
    for i in range(e.shape[0]):
        dr[i] = e[i] * inv


def swiglu(g, u, dst):
    """ggml_vec_swiglu_f32 on rows of a multiple of 8: f32(f32(g / f32(1 + vexp(-g))) * u). A row goes
    through the scratch s, so the loop vectorises even when dst aliases g or u (in place)."""
    _rows_threads(_swiglu_serial, _swiglu_par, dst.shape[0] * dst.shape[1] * dst.shape[2], dst.shape[3],
                  g, u, dst)


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_serial(g, u, dst):
    _swiglu_rows(g, u, dst, 0, dst.shape[0] * dst.shape[1] * dst.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _swiglu_par(g, u, dst, n_chunks):
    n = dst.shape[0] * dst.shape[1] * dst.shape[2]
    for c in prange(n_chunks):
        _swiglu_rows(g, u, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_c(addr):
    """_swiglu_serial of the C-contiguous arrays of a shape_block (entry.py) at addr."""
    block = at(addr, 5 * 3)
    dst = array4c(F32P, block, 2)
    _swiglu_rows(array4c(F32P, block, 0), array4c(F32P, block, 1), dst, 0, dst.shape[0] * dst.shape[1] * dst.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _swiglu_c_par(addr, n_chunks):
    block = at(addr, 5 * 3)
    g, u, dst = array4c(F32P, block, 0), array4c(F32P, block, 1), array4c(F32P, block, 2)
    n = dst.shape[0] * dst.shape[1] * dst.shape[2]
    for c in prange(n_chunks):
        _swiglu_rows(g, u, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _swiglu_rows(g, u, dst, r0, r1):
    _ne3, ne2, ne1, ne0 = dst.shape
    s = np.empty(ne0, F32)
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        gr, ur, dr = g[i3, i2, i1], u[i3, i2, i1], dst[i3, i2, i1]
        for i in range(ne0):
            gv = gr[i]
            s[i] = gv / (F32(1) + vexp(-gv)) * ur[i]
        for i in range(ne0):
            dr[i] = s[i]


# numba's math.cos/sin of a float32 are LLVM's cos/sin intrinsics, which become calls to the C library's
# cosf/sinf, the functions rope.py calls through ctypes as ggml does (checked equal bit for bit on 400k
# values); with SVML, numba could take its vector versions instead, so then rope.py keeps its own loop
LIBM_COS_SIN = not numba.config.USING_SVML                                      # type: ignore[attr-defined]


def bind_rope_cache(pos, *args) -> Callable[[], None]:
    """rope_cache(pos, *args), bound (entry.py): a replay's prologue fills its step's cos and sin."""
    return bound(rope_cache, pos, *args)


@njit(cache=True, nogil=True, error_model="numpy")
def rope_cache(pos, theta_scale, ff, freq_scale, ext_factor, corr0, corr_den, mscale, cos, sin):
    """rope.rope_cache's cos and sin [n_pos, n_dims/2] in one call, the reference's f32 operations in its
    order: theta_j = f32(theta_{j-1} * theta_scale) from the position, / ff[j] (ff empty: no freq
    factors), YaRN's ramp where ext_factor != 0 (corr0 and corr_den its f32 corr_dims[0] and
    max(0.001, corr_dims[1] - corr_dims[0])), then f32(cosf(theta)) * mscale (numba's math.cos of a
    float32 is libm's cosf, see LIBM_COS_SIN)."""
    one, zero = F32(1), F32(0)
    for i in range(pos.shape[0]):
        t = F32(pos[i])
        for j in range(cos.shape[1]):
            if j:
                t = t * theta_scale
            th = t / ff[j] if ff.shape[0] else t
            interp = freq_scale * th
            if ext_factor != zero:
                ramp = (one - min(one, max(zero, (F32(j) - corr0) / corr_den))) * ext_factor
                th = interp * (one - ramp) + th * ramp
            else:
                th = interp
            cos[i, j] = F32(math.cos(th)) * mscale
            sin[i, j] = F32(math.sin(th)) * mscale


def bind_geglu(g, u, table, dst) -> Callable[[], None]:
    """numerics.gelu(g) * u (ggml_vec_geglu_f32 with GGML_GELU_FP16), bound (bind_rows): 0 for g <= -10,
    g for g >= 10, else table[f16 bits of g] (numerics.gelu_table_f16: f16 bits [65536], as ggml keeps
    ggml_table_gelu_f16, 128 KB where an f32 table is 256 KB: a decode step finds it out of cache, and
    its 2048 lookups a row are as many misses); then f32(act * u)."""
    return bind_rows(_geglu_serial, _geglu_par, _n_rows(dst), dst.shape[3], g, u, table, dst)


@njit(cache=True, nogil=True, error_model="numpy")
def _geglu_serial(g, u, table, dst):
    _geglu_rows(g, u, table, dst, 0, dst.shape[0] * dst.shape[1] * dst.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _geglu_par(g, u, table, dst, n_chunks):
    n = dst.shape[0] * dst.shape[1] * dst.shape[2]
    for c in prange(n_chunks):
        _geglu_rows(g, u, table, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _geglu_rows(g, u, table, dst, r0, r1):
    _ne3, ne2, ne1, ne0 = dst.shape
    s = np.empty(ne0, F32)                  # (a row through the scratch: dst may alias g or u)
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        gr, ur, dr = g[i3, i2, i1], u[i3, i2, i1], dst[i3, i2, i1]
        for i in range(ne0):
            x = gr[i]
            if x <= F32(-10):
                a = F32(0)
            elif x >= F32(10):
                a = x
            else:
                a = _half(table[f16_bits(x)])
            s[i] = a * ur[i]
        for i in range(ne0):
            dr[i] = s[i]


def rope(x, cos, sin, n_dims, neox, dst):
    """The rotation of ggml_compute_forward_rope_flt: x, dst [ne3, n_tok, n_head, head_dim]; cos, sin
    [n_tok, n_dims/2]. Pair i is (2i, 2i+1) (NORM) or (i, i + n_dims/2) (NEOX):
    y0 = fma(x0, c, -f32(x1*s)), y1 = fma(x0, s, f32(x1*c)) (GCC's contraction); dims >= n_dims copied."""
    _rows_threads(_rope_serial, _rope_par, x.shape[0] * x.shape[1] * x.shape[2], x.shape[3],
                  x, cos, sin, n_dims, neox, dst)


@njit(cache=True, nogil=True, error_model="numpy")
def _rope_serial(x, cos, sin, n_dims, neox, dst):
    _rope_rows(x, cos, sin, n_dims, neox, dst, 0, x.shape[0] * x.shape[1] * x.shape[2])


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _rope_par(x, cos, sin, n_dims, neox, dst, n_chunks):
    n = x.shape[0] * x.shape[1] * x.shape[2]
    for c in prange(n_chunks):
        _rope_rows(x, cos, sin, n_dims, neox, dst, c * n // n_chunks, (c + 1) * n // n_chunks)


@njit(cache=True, inline="always")
def _rope_rows(x, cos, sin, n_dims, neox, dst, r0, r1):
    _ne3, ne2, ne1, ne0 = x.shape
    half = n_dims // 2
    for r in range(r0, r1):
        i3, i2, i1 = r // (ne2 * ne1), r // ne1 % ne2, r % ne1
        for i in range(half):
            j0 = i if neox else 2 * i
            j1 = i + half if neox else 2 * i + 1
            c, s = cos[i2, i], sin[i2, i]
            x0, x1 = x[i3, i2, i1, j0], x[i3, i2, i1, j1]
            y0 = F32(F64(x0) * F64(c) + F64(-F32(x1 * s)))
            y1 = F32(F64(x0) * F64(s) + F64(F32(x1 * c)))
            dst[i3, i2, i1, j0] = y0
            dst[i3, i2, i1, j1] = y1
        for i in range(n_dims, ne0):
            dst[i3, i2, i1, i] = x[i3, i2, i1, i]


# row elements from which a row op is split across threads: a numba parallel launch costs ~5 us here, so
# 8 rows of 1536 (swiglu, ~9 us) gained nothing, 72 soft_max rows of 256 (~20 us) a quarter
_ROW_PARALLEL_WORK = 1 << 14


def _rows_threads(serial, par, n_rows, row_len, *args) -> None:
    """A row op on one thread, or split by rows across the kernels' threads (threads.py) (as ggml splits every op's rows
    among its threads) when it has rows enough to pay for a launch."""
    nt = get_threads()
    if nt > 1 and n_rows > 1 and n_rows * row_len >= _ROW_PARALLEL_WORK:
        with launch():
            par(*args, min(nt, n_rows))
        return
    serial(*args)


def bind_rows(serial, par, n_rows: int, row_len: int, *args) -> Callable[[], None]:
    """_rows_threads for arrays fixed from now on, through entry points (entry.py): the serial kernel
    itself where the op is too small ever to split (most of a decode step's row ops)."""
    return bind_split(n_rows > 1 and n_rows * row_len >= _ROW_PARALLEL_WORK, (serial, *args), (par, *args),
                      n_rows)


def _n_rows(a) -> int:
    return a.shape[0] * a.shape[1] * a.shape[2]


def bind_soft_max(x, scale, mask, slopes, has_mask, dst) -> Callable[[], None]:
    """soft_max, bound (bind_rows)."""
    return bind_rows(_soft_max_serial, _soft_max_par, _n_rows(x), x.shape[3], x, scale, mask, slopes,
                     has_mask, dst)


def bind_rms_norm(x, eps, wgt, fused, dst) -> Callable[[], None]:
    """rms_norm, bound (bind_rows)."""
    return bind_rows(rms_norm, _rms_norm_par, _n_rows(x), x.shape[3], x, eps, wgt, fused, dst)


def bind_add_rms_norm(a, b, s, eps, wgt, dst) -> Callable[[], None]:
    """add_rms_norm, bound (bind_rows): its F32 arrays as one shape_block (entry.py) where all are
    C-contiguous (a decode step's 60 calls: each array unboxed costs ~0.5-1 us there, the step's weights
    having evicted its objects)."""
    arrays = (a, b, s, wgt, dst)
    block = shape_block(arrays) if all(x.dtype == F32 for x in arrays) else None
    if block is not None:
        return keep_alive(bind_rows(_add_rms_norm_c, _add_rms_norm_c_par, _n_rows(s), s.shape[3], address(block),
                                    float(eps)), arrays)
    return bind_rows(add_rms_norm, _add_rms_norm_par, _n_rows(s), s.shape[3], a, b, s, eps, wgt, dst)


def bind_swiglu(g, u, dst) -> Callable[[], None]:
    """swiglu, bound (bind_rows), as one shape_block where its F32 arrays are C-contiguous."""
    arrays = (g, u, dst)
    block = shape_block(arrays) if all(x.dtype == F32 for x in arrays) else None
    if block is not None:
        return keep_alive(bind_rows(_swiglu_c, _swiglu_c_par, _n_rows(dst), dst.shape[3], address(block)), arrays)
    return bind_rows(_swiglu_serial, _swiglu_par, _n_rows(dst), dst.shape[3], g, u, dst)


def bind_rope(x, cos, sin, n_dims, neox, dst) -> Callable[[], None]:
    """rope, bound (bind_rows); cos and sin are read when the call runs (a replay's prologue fills them)."""
    return bind_rows(_rope_serial, _rope_par, _n_rows(x), x.shape[3], x, cos, sin, n_dims, neox, dst)


def bind_set_rows(b, c, dst) -> Callable[[], None]:
    """set_rows, bound: one part on the calling thread below _SET_ROWS_PARALLEL rows."""
    return bind_split(_n_rows(b) >= _SET_ROWS_PARALLEL, (_set_rows_part, b, c, dst, 0, 1),
                      (_set_rows_par, b, c, dst), any_layout=True)


def rope_is_serial(x) -> bool:
    """Whether bind_rope's call never splits x's rows across threads (a decode step's)."""
    return not (_n_rows(x) > 1 and _n_rows(x) * x.shape[3] >= _ROW_PARALLEL_WORK)


def set_rows_is_serial(b) -> bool:
    """Whether bind_set_rows's call never splits b's rows across threads (a decode step's)."""
    return _n_rows(b) < _SET_ROWS_PARALLEL


def cache_rows_args(rope_k: tuple, store_k: tuple, store_v: tuple, rope_q: tuple | None) -> tuple | None:
    """(views, their dtypes, the other arguments) of _cache_rows for ROPE(K), SET_ROWS(K), SET_ROWS(V)
    [, ROPE(Q)] (bind_cache_rows), or None where they do not apply: I64 indices, and K and V caches of
    one type (F16 bits or F32)."""
    x, cos, sin, n_dims, neox, dst = rope_k
    (bk, ck, dk), (bv, cv, dv) = store_k, store_v
    xq, cq, sq, nq, neoxq, dq = rope_k if rope_q is None else rope_q
    if ck.dtype != np.int64 or cv.dtype != np.int64 or dk.dtype != dv.dtype or dk.dtype not in (np.uint16, F32):
        return None
    return ((x, dst, bk, ck, dk, bv, cv, dv, xq, dq),
            (F32, F32, F32, np.int64, dk.dtype, F32, np.int64, dv.dtype, F32, F32),
            (cos, sin, n_dims, neox, cq, sq, nq, neoxq, rope_q is not None))


def bind_cache_rows(rope_k: tuple, store_k: tuple, store_v: tuple, rope_q: tuple | None
                    ) -> Callable[[], None] | None:
    """ROPE(K), SET_ROWS(K), SET_ROWS(V) [, ROPE(Q)], a layer's new cache rows, as one call on the calling
    thread: rope_k, rope_q the arguments of bind_rope, store_k, store_v those of bind_set_rows, each op
    serial (rope_is_serial, set_rows_is_serial). The ops run in their order, as their own calls would.
    The 4-d arrays travel as one view_block (entry.py); None where cache_rows_args does not apply (each
    op then is a call of its own)."""
    rows = cache_rows_args(rope_k, store_k, store_v, rope_q)
    if rows is None:
        return None
    views, dtypes, rope = rows
    kernel = _cache_rows_f16 if dtypes[4] == np.uint16 else _cache_rows_f32
    return keep_alive(bound(kernel, view_block(views, dtypes), *rope), views)


@njit(cache=True, nogil=True)
def _cache_rows_f16(block, cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q):
    _cache_rows(block, cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q,
                array4(U16V4, block, 4), array4(U16V4, block, 7))


@njit(cache=True, nogil=True)
def _cache_rows_f32(block, cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q):
    _cache_rows(block, cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q,
                array4(F32V4, block, 4), array4(F32V4, block, 7))


@njit(cache=True, inline="always")
def _cache_rows(block, cos, sin, n_dims, neox, cq, sq, nq, neoxq, has_q, dk, dv):
    x, dst, bk, ck = array4(F32V4, block, 0), array4(F32V4, block, 1), array4(F32V4, block, 2), array4(I64V4, block, 3)
    bv, cv, xq, dq = array4(F32V4, block, 5), array4(I64V4, block, 6), array4(F32V4, block, 8), array4(F32V4, block, 9)
    _rope_rows(x, cos, sin, n_dims, neox, dst, 0, x.shape[0] * x.shape[1] * x.shape[2])
    _set_rows_part(bk, ck, dk, 0, 1)
    _set_rows_part(bv, cv, dv, 0, 1)
    if has_q:
        _rope_rows(xq, cq, sq, nq, neoxq, dq, 0, xq.shape[0] * xq.shape[1] * xq.shape[2])


def _encode(v, like):
    """A float32 value in dst's element type (typed by overload on `like`, a dst element)."""


@overload(_encode, inline="always")
def _encode_impl(v, like):
    if like == types.uint16:
        return lambda v, like: f16_bits(v)
    if like == types.float32:
        return lambda v, like: v
    return None


def set_rows(b, c, dst):
    """ggml_compute_forward_set_rows: dst[i3, i2, c[0, i3 % c1, i2 % c2, j]] = b[i3, i2, j] for each row
    j, converted to dst's type (uint16 = f16 bits, RNE; or float32). Rows are written in order, so a
    repeated index keeps the last row. Many rows (a batch's transposed V writes: one element per cache
    line, each a miss that waits on its line) are split across the kernels' threads (threads.py) by destination row,
    hashed from the row's first cache line: a row is always written by the same thread, so repeated
    indices keep their order, and no two threads write one line unless a row straddles lines."""
    nt = get_threads()
    if nt > 1 and b.shape[0] * b.shape[1] * b.shape[2] >= _SET_ROWS_PARALLEL:
        with launch():
            _set_rows_par(b, c, dst, nt)
        return
    _set_rows_part(b, c, dst, 0, 1)


_SET_ROWS_PARALLEL = 512                # rows from which set_rows splits across threads


@njit(parallel=True, cache=True, nogil=True)
def _set_rows_par(b, c, dst, n_parts):
    for part in prange(n_parts):
        _set_rows_part(b, c, dst, part, n_parts)


@njit(cache=True, inline="always")
def _line_hash(line):
    """Fibonacci hashing of a cache line number: neighbouring lines (a V column's cells, a K row's
    streams) spread evenly over the parts."""
    return ((np.uint64(line) * np.uint64(2654435761)) & np.uint64(0xFFFFFFFF)) >> np.uint64(16)


@njit(cache=True, nogil=True)
def _set_rows_part(b, c, dst, part, n_parts):
    """The rows of set_rows whose destination row hashes to `part` of n_parts (all of them for 1)."""
    ne3, ne2, nr, ne0 = b.shape
    c1, c2 = c.shape[1], c.shape[2]
    line_rows = max(1, 64 // (ne0 * dst.itemsize))             # rows per cache line
    for i3 in range(ne3):
        for i2 in range(ne2):
            idx = c[0, i3 % c1, i2 % c2]
            for j in range(nr):
                r = idx[j]
                if n_parts > 1 and _line_hash(r // line_rows) % n_parts != part:
                    continue
                row = dst[i3, i2, r]
                for i in range(ne0):
                    row[i] = _encode(b[i3, i2, j, i], row[0])

"""CPU kernels, one per op, on strided numpy views (ggml-cpu/ops.cpp, reference path).

Every kernel has the signature `kernel(t, dst, srcs, opts)`: `t` is the node (types and op_params), `dst`
and `srcs` are 4-d arrays in numpy order (ne reversed) bound to the tensors' bytes; quantized tensors are
uint8 arrays of rows of blocks. Kernels write into `dst` and allocate only temporaries. They follow ggml's
CPU numerics (ggml-numerics.md): float32 steps, sums in double where ggml uses ggml_float.

Ops that may run in place (gallocr's in-place set) must allow `dst` to alias `srcs[0]`: every kernel here
reads its sources completely before writing, or works row by row on the same row.

Fast paths: with numba on (ComputeOptions.numba; GGML_DIST_NO_NUMBA=1 turns it off) the common cases (f32 activations,
f16/f32 KV cache) run one fkernels call per op, with the same bits as the numpy code below, which stays the
reference and the fallback; F32 ADD/MUL with numpy-broadcastable operands are one ufunc into dst.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from types import ModuleType
from typing import Any, overload

import numpy as np

from ...core.tensor import GLUOp, Op, SortOrder, Tensor, TensorFlag, UnaryOp
from ...core.types import GGMLType, is_quantized
from ..base import BufferUsage
from . import gather, quants, recurrent, unary
from . import numerics as nm
from .blocks import KPACK_TYPES, QPACK_TYPES, ggml_repacks
from .rope import bind_rope, rope_forward

F32 = np.float32


# the compiled kernels (fkernels, qkernels, qpack) unless GGML_DIST_NO_NUMBA=1 (or numba is missing)
NUMBA_DEFAULT = os.environ.get("GGML_DIST_NO_NUMBA", "") not in ("1", "true", "yes")


@dataclass(frozen=True, slots=True)
class ComputeOptions:
    """How a CPU backend computes; fixed per backend, read by every kernel.

    exact: keep f32 activations in MUL_MAT instead of ggml's vec_dot_type conversion.
    numba: run the compiled twins of the numpy kernels (the same bits; False: the numpy reference only).
    order: MUL_MAT's accumulation order (quants module docstring): "ggml", the one llama.cpp's x86 build
    has, or "fast" (ULP-level off it; kept for the kernels' tests and studies).
    kernels: the kernels that read packed weights, qpack.Kernels' value ("vnni", "avx2", "float"; all
    give the same bits). None: the host's choice, made by resolve() when a CPU backend is created
    (qpack.default_kernels(), where GGML_DIST_FORCE_AVX2 / GGML_DIST_NO_VNNI / GGML_DIST_NO_AVX2 count).
    batch_invariant: every MUL_MAT computes each row of its activations in the order ggml gives a row
    alone (vec_n = 1, see row_count): the F16/F32/BF16 products (the attention's, on the KV cache) by
    vec_dot, never tinyBLAS; the K-quants by their vec_dot lanes, never the tiled kernel; repacked Q4_K
    by its gemv chain, never the gemm. A row's bits then do not depend on the rows beside it (the other
    sequences of a step, a prompt's other tokens, the ubatch size). The other types' batched kernels
    already reduce a row as their one-row kernel does (Q4_0..Q8_0 vec_dot and tinyBLAS_Q0, repacked
    Q4_0's gemv and gemm), so they do not change. Not with exact (its float32 BLAS rounds by shape)."""
    exact: bool = False
    numba: bool = NUMBA_DEFAULT
    order: str = "ggml"
    kernels: str | None = None
    batch_invariant: bool = False
    collective: Any = None     # the group its ALL_GATHER nodes exchange through (backends/collective.py)

    def __post_init__(self) -> None:
        if self.batch_invariant and self.exact:
            raise ValueError("batch_invariant needs ggml's numerics: exact's float32 BLAS products round "
                             "differently by shape")


Kernel = Callable[[Tensor, np.ndarray, list, ComputeOptions], None]

_COMPILED: dict[str, ModuleType | None] = {}      # fkernels / qkernels once imported; None without numba


def _compiled(name: str, opts: ComputeOptions) -> ModuleType | None:
    """The compiled-kernel module `name` when opts.numba, imported on first use, else None."""
    if not opts.numba:
        return None
    if name not in _COMPILED:
        try:
            _COMPILED[name] = importlib.import_module(f"{__package__}.{name}")
        except ImportError:
            _COMPILED[name] = None
    return _COMPILED[name]


def resolve(opts: ComputeOptions) -> ComputeOptions:
    """opts with the host's choices made, once per backend: the packed weights' kernels. Options that
    pack nothing (no numba, exact, order "fast") stay as they are."""
    if opts.kernels is not None or opts.exact or opts.order != "ggml":
        return opts
    qp = _compiled("qpack", opts)
    return opts if qp is None else replace(opts, kernels=qp.default_kernels().value)


def _fk(opts: ComputeOptions) -> ModuleType | None:
    return _compiled("fkernels", opts)


@overload
def row_count(opts: ComputeOptions, n: int) -> int: ...
@overload
def row_count(opts: ComputeOptions, n: None) -> int | None: ...


def row_count(opts: ComputeOptions, n: int | None) -> int | None:
    """The row count that picks a MUL_MAT's path (quants.mul_mat's vec_n: vec_dot or tinyBLAS, lanes or
    tiled, gemv or gemm) for n rows per slice (None: all of the call's): 1 under batch_invariant, where
    every row takes the path of a row alone."""
    return 1 if opts.batch_invariant else n


def weights_mul_mat(wtype: GGMLType, w: np.ndarray, x: np.ndarray, opts: ComputeOptions,
                    vec_n: int | None = None) -> np.ndarray:
    """quants.mul_mat (ggml's repack rule) in opts' order, by its compiled twin qkernels.mul_mat_q (the same
    bits) where opts.numba and the type is covered. w: uint8 rows of blocks (F16/BF16 raw rows, F32 as
    float32); x: f32 [N, K]."""
    vec_n = row_count(opts, vec_n)
    qk = None if opts.exact or x.shape[0] == 0 or w.shape[0] == 0 else _compiled("qkernels", opts)
    if qk is None or wtype not in qk.COVERED:
        return quants.mul_mat(wtype, w, x, exact=opts.exact, order=opts.order, vec_n=vec_n)
    repacked = ggml_repacks(wtype, w.shape[0])
    return qk.mul_mat_q(wtype, w, x, order=opts.order, repacked=repacked, vec_n=vec_n)


def _all_f32(t: Tensor, n_src: int) -> bool:
    """dst and the first n_src sources are F32."""
    return t.type == GGMLType.F32 and all(s is not None and s.type == GGMLType.F32 for s in t.src[:n_src])


_ONE4 = np.ones((1, 1, 1, 1), F32)     # placeholder weight / mask for kernels called without one


def to_f32(a: np.ndarray, type: GGMLType, ne0: int) -> np.ndarray:
    """Read any tensor's values as float32 (dequantizing block types, widening f16/bf16)."""
    if type == GGMLType.F32:
        return a
    if type == GGMLType.BF16:
        return (a.astype(np.uint32) << 16).view(F32)
    if is_quantized(type):
        return quants.dequantize(type, a, ne0)
    return a.astype(F32)


def convert(values: np.ndarray, type: GGMLType) -> np.ndarray:
    """float32 values as the bytes/dtype of `type` (f16: RNE; bf16 and block types: quants.quantize)."""
    if type == GGMLType.BF16:
        v = np.ascontiguousarray(values, F32)
        return quants.quantize(GGMLType.BF16, v).view(np.uint16).reshape(v.shape)
    if is_quantized(type):
        v = np.ascontiguousarray(values, F32)
        return quants.quantize(type, v)
    return values


def store(dst: np.ndarray, type: GGMLType, values: np.ndarray) -> None:
    """Write float32 values into the view dst, converting to dst's type as ggml does."""
    with np.errstate(over="ignore"):     # f16 overflow to inf is ggml's behaviour too
        np.copyto(dst, convert(values, type).reshape(dst.shape) if type == GGMLType.BF16 or is_quantized(type)
                  else values, casting="unsafe")


def _repeat(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml's broadcast: b's index is the destination index modulo b's extent."""
    if all(sb == sd or sb == 1 for sb, sd in zip(b.shape, shape)):
        return b
    return np.tile(b, tuple(sd // sb for sb, sd in zip(b.shape, shape)))


def _src(t: Tensor, srcs: list, i: int) -> np.ndarray:
    s = t.src[i]
    assert s is not None
    return to_f32(srcs[i], s.type, s.ne[0])


# -- element-wise ----------------------------------------------------------------------------------
def _ufunc_into(t, dst, srcs, ufunc) -> bool:
    """F32 a (op) b straight into dst when b broadcasts numpy-wise (each extent 1 or a's): the same f32
    operation without temporaries; numpy handles dst aliasing a or b."""
    if not _all_f32(t, 2) or not _broadcasts(srcs[1], srcs[0]):
        return False
    ufunc(srcs[0], srcs[1], out=dst)
    return True


def _broadcasts(b: np.ndarray, a: np.ndarray) -> bool:
    """b broadcasts to a numpy-wise: each extent 1 or a's."""
    return b.shape == a.shape or all(sb == sa or sb == 1 for sb, sa in zip(b.shape, a.shape))


def _add(t, dst, srcs, opts):
    if _ufunc_into(t, dst, srcs, np.add):
        return
    a, b = _src(t, srcs, 0), _src(t, srcs, 1)
    store(dst, t.type, (a + _repeat(b, a.shape)).astype(F32))


def _mul(t, dst, srcs, opts):
    if _ufunc_into(t, dst, srcs, np.multiply):
        return
    a, b = _src(t, srcs, 0), _src(t, srcs, 1)
    store(dst, t.type, (a * _repeat(b, a.shape)).astype(F32))


def _div(t, dst, srcs, opts):
    if _ufunc_into(t, dst, srcs, np.divide):
        return
    a, b = _src(t, srcs, 0), _src(t, srcs, 1)
    store(dst, t.type, (a / _repeat(b, a.shape)).astype(F32))


def _add_id(t, dst, srcs, opts):
    """ADD_ID: row (i1, i2) of a plus the bias row ids[i1, i2] of b (ggml_vec_add_f32: one f32 add)."""
    a, b, ids = srcs[0], srcs[1], srcs[2]             # [ne3, ne2, ne1, ne0], [.., n_as, ne0], [.., ne2, ne1]
    np.add(a, b[0, 0][ids[0, 0]][None], out=dst)


def _sum_rows(t, dst, srcs, opts):
    """SUM_ROWS: ggml_vec_sum_f32, a sequential sum in double, rounded to f32."""
    store(dst, t.type, _seq_sum(_src(t, srcs, 0).astype(np.float64)).astype(F32))


def _clamp(t, dst, srcs, opts):
    """CLAMP: MAX(MIN(x, max), min) element by element (in place: dst is a view of the source)."""
    lo, hi = F32(t.op_param(0)), F32(t.op_param(1))
    np.maximum(np.minimum(srcs[0], hi), lo, out=dst)


def _argsort(t, dst, srcs, opts):
    """ARGSORT per row. ggml's std::sort is not stable: ties may come out in another order (the model
    graphs' routers have none to speak of: test data keeps the k-th and (k+1)-th logits apart)."""
    x = srcs[0]
    desc = SortOrder(t.op_param(0)) == SortOrder.DESC
    dst[...] = np.argsort(-x if desc else x, axis=-1, kind="stable")


def _scale(t, dst, srcs, opts):
    s, b = F32(t.op_param(0, 1.0)), F32(t.op_param(1, 0.0))
    a = _src(t, srcs, 0)
    y = (a * s).astype(F32) if b == 0 else nm.fma32(a, s, b)
    store(dst, t.type, y)


def _rms_norm(t, dst, srcs, opts):
    fk = _fk(opts)
    if fk and _all_f32(t, 1):
        fk.rms_norm(srcs[0], F32(t.op_param(0)), _ONE4, False, dst)
        return
    x = _src(t, srcs, 0)
    sq = (x * x).astype(F32)
    mean = (_seq_sum(sq.astype(np.float64)) / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((mean + F32(t.op_param(0))).astype(F32))).astype(F32)
    store(dst, t.type, (x * scale).astype(F32))


def _norm(t, dst, srcs, opts):
    x = _src(t, srcs, 0)
    mean = (x.astype(np.float64).sum(axis=-1, keepdims=True) / x.shape[-1]).astype(F32)
    v = (x - mean).astype(F32)
    var = ((v * v).astype(F32).astype(np.float64).sum(axis=-1, keepdims=True) / x.shape[-1]).astype(F32)
    scale = (F32(1) / np.sqrt((var + F32(t.op_param(0))).astype(F32))).astype(F32)
    store(dst, t.type, (v * scale).astype(F32))


def _unary(t, dst, srcs, opts):
    x = _src(t, srcs, 0)
    if not unary.compiled(t, x, dst, opts):                 # ukernels' twin, else numerics' (the reference)
        store(dst, t.type, nm.UNARY[UnaryOp(t.op_param(0))](x))


def _glu(t, dst, srcs, opts):
    gop, swapped = GLUOp(t.op_param(0)), bool(t.op_param(1))
    split = len(t.src) > 1 and t.src[1] is not None
    fk = _fk(opts)
    if fk and gop == GLUOp.SWIGLU and _all_f32(t, 2 if split else 1) and dst.shape[-1] % 8 == 0:
        g, u = _glu_halves(srcs[0], srcs[1] if split else None, swapped)
        fk.swiglu(g, u, dst)
        return
    g, u = _glu_halves(_src(t, srcs, 0), _src(t, srcs, 1) if split else None, swapped)
    if gop == GLUOp.SWIGLU_OAI:
        store(dst, t.type, nm.swiglu_oai(g, u, t.op_param(2), t.op_param(3)))
        return
    if gop == GLUOp.SWIGLU:
        act = nm.silu(g)
    elif gop == GLUOp.GEGLU:
        act = nm.gelu(g)
    else:
        act = np.maximum(g, F32(0))
    store(dst, t.type, (act * u).astype(F32))


def _glu_halves(a: np.ndarray, b: np.ndarray | None, swapped: bool) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up): a and b, or the two halves of a's rows; swapped exchanges them."""
    if b is not None:
        g, u = a, b
    else:
        n = a.shape[-1] // 2
        g, u = a[..., :n], a[..., n:]
    return (u, g) if swapped else (g, u)


# -- matrix ----------------------------------------------------------------------------------------
def _mul_mat(t, dst, srcs, opts):
    """dst[i3, i2, j, i] = W[i3', i2', i, :] . X[i3, i2, j, :]; W broadcasts over dims 2, 3.

    The r2 slices of X that share one weight slice (GQA heads) go through one weights_mul_mat call with
    their rows stacked: every output element depends only on its own row pair in every path, and
    ``vec_n`` keeps the per-slice row count that picks ggml's F16/F32 order (vec_dot vs tinyBLAS).
    Not for exact=True (float32 BLAS) nor F32/BF16 weights in the "fast" order (float64 BLAS), whose
    rounding may depend on the shape."""
    a_t, b_t = t.src[0], t.src[1]
    assert a_t is not None and b_t is not None
    if _mul_mat_float(t, dst, srcs, opts):
        return
    w, x = srcs[0], srcs[1]
    r2, r3 = b_t.ne[2] // a_t.ne[2], b_t.ne[3] // a_t.ne[3]
    n11, K = b_t.ne[1], b_t.ne[0]
    if _mul_mat_packed(t, dst, srcs, opts):
        return
    stack = r2 > 1 and not opts.exact and n11 > 0 and \
        (opts.order == "ggml" or a_t.type not in (GGMLType.F32, GGMLType.BF16))
    g2 = r2 if stack else 1
    for i3 in range(b_t.ne[3]):
        for i2 in range(0, b_t.ne[2], g2):
            wm = w[i3 // r3, i2 // r2]
            if a_t.type in (GGMLType.F16, GGMLType.BF16):    # quants.mul_mat takes raw rows
                wm = (wm if wm.strides[-1] == 2 else np.ascontiguousarray(wm)).view(np.uint8)
            if g2 == 1:
                xm = to_f32(x[i3, i2], b_t.type, K)
                dst[i3, i2] = weights_mul_mat(a_t.type, wm, np.ascontiguousarray(xm, F32), opts)
                continue
            xm = np.ascontiguousarray(to_f32(x[i3, i2:i2 + g2], b_t.type, K), F32).reshape(g2 * n11, K)
            r = weights_mul_mat(a_t.type, wm, xm, opts, vec_n=n11)
            dst[i3, i2:i2 + g2] = r.reshape(g2, n11, r.shape[-1])


# the K-quants llama.cpp leaves in their blocks: its tiled kernel takes an expert's rows from 8 rows on
_TILED_TYPES = frozenset({GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K})


def mul_mat_id_vec_n(wtype: GGMLType, n_rows_w: int, n_rows: int) -> int:
    """The row count that picks an expert's product path in ggml's MUL_MAT_ID (quants.mul_mat's vec_n).
    A repacked weight's gemv (blocks.ggml_repacks: llama.cpp repacks 3-D experts too) takes one row at a
    time; an unrepacked K-quant's rows go to the tiled kernel together (from 8 on); every other type runs
    vec_dot per row (llamafile's tinyBLAS never takes MUL_MAT_ID), which is a row alone's order too."""
    return n_rows if wtype in _TILED_TYPES and not ggml_repacks(wtype, n_rows_w) else 1


def expert_rows(ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """ggml's row groups of a MUL_MAT_ID (matrix_rows): for each expert used, in ascending order, the
    (token, slot) pairs that chose it, token-major as ggml lists them. ids: [n_tokens, n_used]."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")             # token-major within an expert, like ggml's scan
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = [*starts.tolist(), len(order)]
    n_used = ids.shape[1]
    return [(int(e), order[bounds[k]:bounds[k + 1]] // n_used, order[bounds[k]:bounds[k + 1]] % n_used)
            for k, e in enumerate(experts.tolist())]


def _mul_mat_id(t, dst, srcs, opts):
    """MUL_MAT_ID: the rows of each expert's tokens through that expert's matrix, one expert at a time,
    by the MUL_MAT kernels (weights_mul_mat on the expert's view of the 3-D weight). dst[t, slot] =
    W[ids[t, slot]] . X[t, slot % n_b]; 0 where ids[t, slot] is -1 (another rank's expert: core/ops.py)."""
    a_t, b_t = t.src[0], t.src[1]
    assert a_t is not None and b_t is not None
    w, x, ids = srcs[0][0], srcs[1][0], srcs[2][0, 0]      # [n_as, M, row], [n_tok, n_b, K], [n_tok, n_used]
    n_b, K, M = b_t.ne[1], b_t.ne[0], a_t.ne[1]
    for e, tok, slot in expert_rows(ids):
        if not 0 <= e < a_t.ne[2]:
            if e != -1:
                raise IndexError(f"MUL_MAT_ID '{t.name}': expert id {e} outside 0..{a_t.ne[2] - 1}")
            dst[0, tok, slot] = 0
            continue
        wm = w[e]
        if a_t.type in (GGMLType.F16, GGMLType.BF16):
            wm = np.ascontiguousarray(wm).view(np.uint8)
        xm = np.ascontiguousarray(to_f32(x[tok, slot % n_b], b_t.type, K), F32)
        vec_n = mul_mat_id_vec_n(a_t.type, M, len(tok))
        dst[0, tok, slot] = weights_mul_mat(a_t.type, wm, xm, opts, vec_n=vec_n)


def packed_experts(t, dst, srcs, opts: ComputeOptions) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(packed experts, x [n_tok * n_b, K], ids [n_tok, n_used], out [n_tok * n_used, M], n_b) where
    MUL_MAT_ID node t runs as experts.py's packed call: a 3-D model weight of a type it packs with opts'
    kernels (experts.packable), f32 activations and output, contiguous arrays (ids: rows of any stride,
    the top-k view), opts taking the compiled ggml-order path; packed once (kept in t.extra). Else None."""
    a_t, b_t, i_t = t.src[0], t.src[1], t.src[2]
    if (opts.exact or not opts.numba or opts.order != "ggml" or opts.kernels == "float"
            or a_t.view_src is not None or a_t.ne[3] != 1 or a_t.buffer.usage != BufferUsage.WEIGHTS
            or b_t.type != GGMLType.F32 or t.type != GGMLType.F32 or i_t.type != GGMLType.I32
            or a_t.type not in _PACKABLE | _KPACKABLE):
        return None
    x, ids, out = srcs[1][0], srcs[2][0, 0], dst[0]         # [n_tok, n_b, K], [n_tok, n_used], [n_tok, n_used, M]
    if not (x.flags.c_contiguous and out.flags.c_contiguous and ids.strides[-1] == 4 and ids.strides[0] % 4 == 0
            and (ids.shape[0] <= 1 or ids.strides[0] >= 4 * ids.shape[1])):
        return None
    ex = _compiled("experts", opts)
    if ex is None or not ex.packable(a_t.type, a_t.ne[1], opts.kernels):
        return None
    pe = ex.packed(a_t.type, srcs[0][0], a_t, opts.kernels)
    n_tok, n_b, K = x.shape
    return pe, x.reshape(n_tok * n_b, K), ids, out.reshape(-1, out.shape[-1]), n_b


def bind_packed_experts(ts: list, dsts: list, srcss: list, opts: ComputeOptions) -> Bound | None:
    """The packed MUL_MAT_IDs of nodes ts (packed_experts; more than one: the same activations and ids,
    weights that share a call, fusion.py's gate and up) as one bound call; where the call gives them
    back (a non-finite activation, an id out of range) every node takes _mul_mat_id. None where the
    packed path cannot apply to them all."""
    parts = []
    for t, d, s in zip(ts, dsts, srcss):
        p = packed_experts(t, d, s, opts)
        if p is None:
            return None
        parts.append(p)
    fallbacks = [partial(_mul_mat_id, t, d, s, opts) for t, d, s in zip(ts, dsts, srcss)]

    def fallback() -> None:
        for f in fallbacks:
            f()
    _, x, ids, _, n_b = parts[0]
    ex = _compiled("experts", opts)
    assert ex is not None
    return ex.bind_experts([p[0] for p in parts], x, ids, [p[3] for p in parts], n_b,
                           tiled=not opts.batch_invariant, fallback=fallback)


def _bind_mul_mat_id(t, dst, srcs, b: Binding) -> Bound | None:
    return bind_packed_experts([t], [dst], [srcs], b.opts)


def _mul_mat_packed(t, dst, srcs, opts) -> bool:
    """MUL_MAT on a 2-D Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 model weight through its packed form (qpack.py: repacked once,
    ggml's "extra" buffer; the same bits as quants.mul_mat). False where that path does not apply."""
    a_t, b_t = t.src[0], t.src[1]
    if a_t.type in _KPACKABLE:
        return _mul_mat_kpacked(t, dst, srcs, opts)
    if (opts.exact or a_t.type not in _PACKABLE or not opts.numba or opts.order != "ggml"
            or a_t.view_src is not None or a_t.ne[2] != 1 or a_t.ne[3] != 1 or b_t.type != GGMLType.F32
            or a_t.buffer.usage != BufferUsage.WEIGHTS):
        return False
    from . import qpack
    return _packed_product(qpack, t, dst, srcs, opts)


def _packed_product(mod: ModuleType, t, dst, srcs, opts: ComputeOptions) -> bool:
    """dst = the product of t's weight packed by mod (qpack, kpack) for opts.kernels and its activations;
    False where the packed weight gives it back (a non-finite activation: the generic path gives ggml's
    values)."""
    a_t, x = t.src[0], srcs[1]
    pw = mod.packed(a_t.type, srcs[0][0, 0], a_t, opts.kernels)
    xm = x.reshape(-1, x.shape[-1]) if x.flags.c_contiguous else np.ascontiguousarray(x).reshape(-1, x.shape[-1])
    direct = dst.flags.c_contiguous
    r = pw.mul_mat(xm, dst.reshape(xm.shape[0], dst.shape[-1]) if direct else None, vec_n=row_count(opts, None))
    if r is None:
        return False
    if not direct:
        dst[...] = r.reshape(dst.shape)
    return True


_PACKABLE = QPACK_TYPES                 # qpack.PACKABLE (blocks.py: no numba import)


def _qpack(opts: ComputeOptions) -> ModuleType | None:
    """qpack, where opts take the compiled ggml-order path."""
    return None if opts.exact or opts.order != "ggml" else _compiled("qpack", opts)


def _bind_mul_mat_packed(t, dst, srcs, opts: ComputeOptions) -> Bound | None:
    """_mul_mat_packed with its static checks, views and packed weight resolved once: the replayed call
    is the packed product itself. None where the packed path cannot apply."""
    return bind_packed_products([t], [dst], [srcs], opts)


def packed_product(t, dst, srcs, opts: ComputeOptions) -> tuple[ModuleType, Any, np.ndarray, np.ndarray] | None:
    """(module, packed weight, x [N, K], out [N, M]) where MUL_MAT node t runs as a packed product of
    qpack (Q4_0/Q4_1/Q5_x/Q8_0) or kpack (K-quants): a 2-D model weight, f32 activations, contiguous
    arrays, opts taking the compiled ggml-order path. The weight is packed once (it stays in t.extra)
    with opts' kernels. None where the packed path cannot apply."""
    a_t, b_t = t.src[0], t.src[1]
    if not (srcs[1].flags.c_contiguous and dst.flags.c_contiguous):
        return None
    if a_t.type in _KPACKABLE:
        mod = _kpack(opts) if _kpack_applies(a_t, b_t) else None
    elif (a_t.type in _PACKABLE and a_t.view_src is None and a_t.ne[2] == 1 and a_t.ne[3] == 1
            and b_t.type == GGMLType.F32 and a_t.buffer.usage == BufferUsage.WEIGHTS):
        mod = _qpack(opts)
    else:
        mod = None
    if mod is None:
        return None
    xm = srcs[1].reshape(-1, srcs[1].shape[-1])
    out = dst.reshape(xm.shape[0], dst.shape[-1])          # N may be 0: a ubatch without outputs
    return mod, mod.packed(a_t.type, srcs[0][0, 0], a_t, opts.kernels), xm, out


def bind_packed_products(ts: list, dsts: list, srcss: list, opts: ComputeOptions) -> Bound | None:
    """The packed products of MUL_MAT nodes ts (packed_product) as one bound call: one node's pw.bind(),
    or the module's bind_products for nodes with the same activation whose weights share a call
    (fusion.py). Where the call gives the products back (a non-finite activation) every node takes the
    generic path. None where the packed path cannot apply to them all."""
    parts = []
    for t, d, s in zip(ts, dsts, srcss):
        p = packed_product(t, d, s, opts)
        if p is None:
            return None
        parts.append(p)
    fallbacks = [partial(_mul_mat, t, d, s, opts) for t, d, s in zip(ts, dsts, srcss)]
    mod, pw, xm, out = parts[0]
    vec_n = row_count(opts, None)
    if len(ts) == 1:
        return pw.bind(xm, out, vec_n=vec_n, fallback=fallbacks[0])

    def fallback() -> None:
        for f in fallbacks:
            f()
    return mod.bind_products([p[1] for p in parts], xm, [p[3] for p in parts], vec_n=vec_n, fallback=fallback)


# K-quant model weights: kpack.py (Q4_K, Q5_K, Q6_K packed once, int8 kernels; the same bits as qkernels)
_KPACKABLE = KPACK_TYPES                # kpack.PACKABLE (blocks.py: no numba import)


def _kpack_applies(a_t, b_t) -> bool:
    """The static conditions of the K-quant packed path: a 2-D model weight, f32 activations that are one
    slice (b's ne[2] = ne[3] = 1, so the row count is ggml's ne11, which picks the tiled order)."""
    return (a_t.view_src is None and a_t.ne[2] == 1 and a_t.ne[3] == 1 and b_t.type == GGMLType.F32
            and b_t.ne[2] == 1 and b_t.ne[3] == 1 and a_t.buffer.usage == BufferUsage.WEIGHTS)


def _kpack(opts: ComputeOptions) -> ModuleType | None:
    """kpack, where opts take the compiled ggml-order path with int8 kernels (opts.kernels, or where
    unresolved the host's: VNNI or AVX2)."""
    if opts.exact or opts.order != "ggml" or opts.kernels == "float":
        return None
    kp = _compiled("kpack", opts)
    return kp if kp is not None and (opts.kernels is not None or kp.available()) else None


def _mul_mat_kpacked(t, dst, srcs, opts) -> bool:
    """_mul_mat_packed for a K-quant weight; False where kpack does not apply (or gives the product back:
    a non-finite activation, a Q6_K lane past 2^24), and the generic path computes it."""
    a_t, b_t = t.src[0], t.src[1]
    kp = _kpack(opts) if _kpack_applies(a_t, b_t) else None
    return kp is not None and _packed_product(kp, t, dst, srcs, opts)


def _mul_mat_float(t, dst, srcs, opts, mask=None, skip: int = 0) -> bool:
    """F16/F32 weights (the attention products on the KV cache) in ggml's order: one fkernels.mul_mat
    call for all slices, bit-identical to quants.mul_mat(order="ggml", vec_n=ne11) per slice (vec_dot
    for one activation row, tinyBLAS for more when K % 8 == 0 and M % 4 == 0). mask/skip: the attention
    chain's skipped cells (fkernels.SKIP_*, bound by _bind_attention)."""
    a_t, b_t = t.src[0], t.src[1]
    fk = _fk(opts)
    if not fk or opts.exact or opts.order != "ggml" or a_t.type not in (GGMLType.F16, GGMLType.F32) \
            or b_t.type != GGMLType.F32 or t.type != GGMLType.F32:
        return False
    half = a_t.type == GGMLType.F16
    w = _unit_rows(srcs[0].view(np.uint16) if half else srcs[0])
    K, M, N = a_t.ne[0], a_t.ne[1], row_count(opts, b_t.ne[1])
    fk.mul_mat_threads(w, _unit_rows(srcs[1]), dst, N >= 2 and K % 8 == 0 and M % 4 == 0, half,
                       mask if half else None, skip if half else 0)
    return True


def _unit_rows(a: np.ndarray) -> np.ndarray:
    """a, or a contiguous copy if its rows are not contiguous (fkernels.mul_mat reads rows as slices)."""
    return a if _has_unit_rows(a) else np.ascontiguousarray(a)


def _has_unit_rows(*arrays: np.ndarray) -> bool:
    """Every array's rows are contiguous and no stride is negative: what fkernels' kernels that read
    rows as slices of a flat view (fkernels._rows_view) take."""
    return all(a.strides[-1] == a.itemsize and min(a.strides) >= 0 for a in arrays)


def _get_rows(t, dst, srcs, opts):
    a_t = t.src[0]
    assert a_t is not None
    a, ids = srcs[0], srcs[1]
    for i12 in range(ids.shape[1]):
        for i11 in range(ids.shape[2]):
            rows = a[min(i12, a.shape[0] - 1), i11, ids[0, i12, i11]]
            if a_t.type == GGMLType.I32:
                dst[i12, i11] = rows
            else:
                store(dst[i12, i11], t.type, to_f32(rows, a_t.type, a_t.ne[0]))


def _set_rows(t, dst, srcs, opts):
    b, c = srcs[0], srcs[1]
    b_t = t.src[0]
    assert b_t is not None
    fk = _fk(opts)
    if fk and b_t.type == GGMLType.F32 and t.type in (GGMLType.F32, GGMLType.F16):
        fk.set_rows(b, c, dst.view(np.uint16) if t.type == GGMLType.F16 else dst)
        return
    for i03 in range(b.shape[0]):
        for i02 in range(b.shape[1]):
            idx = c[0, i03 % c.shape[1], i02 % c.shape[2]]
            dst[i03, i02, idx] = convert(b[i03, i02], t.type)   # fancy index: assign, not a view


def _argmax(t, dst, srcs, opts):
    a = _src(t, srcs, 0)
    dst[0, 0, 0, :] = np.argmax(a[0, 0], axis=-1)


# -- attention -------------------------------------------------------------------------------------
def _seq_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis in element order (keepdims): ggml's running ggml_float sums. numpy's
    sum() is pairwise, whose last bits differ once the double sum is inexact."""
    if v.shape[-1] == 0:
        return np.zeros((*v.shape[:-1], 1), v.dtype)
    return np.cumsum(v, axis=-1)[..., -1:]


def softmax_rows(w: np.ndarray, sinks: np.ndarray | None = None) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 per row, after scale and mask: scalar max, vexp on chunks
    of 8, sequential sum of per-chunk HA sums and tail values in double, multiply by f32(1/S).
    sinks (broadcast to w's rows: one per head): the max takes the sink in, and expf(sink - max) joins
    the sum last, in double (gpt-oss's attention sinks)."""
    mx = w.max(axis=-1, keepdims=True)
    if sinks is not None:
        mx = np.maximum(mx, sinks[..., None])
    with np.errstate(invalid="ignore"):
        d = (w - mx).astype(F32)
    d = np.where(np.isneginf(w), F32(-np.inf), d)
    e = nm.exp_chunked(d)
    n8 = w.shape[-1] // 8 * 8
    chunks = e[..., :n8].reshape(*e.shape[:-1], n8 // 8, 8)
    terms = np.concatenate([nm.hsum_ha(chunks), e[..., n8:]], axis=-1).astype(np.float64)
    s = _seq_sum(terms)[..., 0]
    if sinks is not None:
        s = s + nm.expf((sinks[..., None] - mx).astype(F32))[..., 0].astype(np.float64)
    inv = (1.0 / s).astype(F32)
    return (e * inv[..., None]).astype(F32)


def _alibi_slopes(n_head: int, max_bias: float) -> np.ndarray:
    if max_bias <= 0:
        return np.ones(n_head, F32)
    n_head_log2 = 1 << int(np.floor(np.log2(n_head)))
    m0 = F32(2.0 ** (-max_bias / n_head_log2))
    m1 = F32(2.0 ** (-(max_bias / 2.0) / n_head_log2))
    h = np.arange(n_head)
    return np.where(h < n_head_log2, m0 ** (h + 1), m1 ** (2 * (h - n_head_log2) + 1)).astype(F32)


@lru_cache(maxsize=64)
def _alibi_slopes_cached(n_head: int, max_bias: float) -> np.ndarray:
    s = _alibi_slopes(n_head, max_bias)
    s.flags.writeable = False
    return s


def _soft_max(t, dst, srcs, opts):
    scale, max_bias = F32(t.op_param(0, 1.0)), float(t.op_param(1, 0.0))
    a_t = t.src[0]
    assert a_t is not None
    has_mask = len(t.src) > 1 and t.src[1] is not None
    sinks = srcs[2][0, 0, 0][None, :, None] if _has_sinks(t) else None     # [1, n_head, 1]
    fk = _fk(opts)
    if fk and sinks is None and _all_f32(t, 2 if has_mask else 1) and a_t.ne[0] % 8 == 0 and \
            _has_unit_rows(srcs[0], dst, *srcs[1:2 if has_mask else 1]):
        slopes = _alibi_slopes_cached(a_t.ne[2], max_bias)
        fk.soft_max(srcs[0], scale, srcs[1] if has_mask else _ONE4, slopes, has_mask, dst)
        return
    w = (_src(t, srcs, 0) * scale).astype(F32)                 # [ne3, ne2, ne1, ne0]
    if has_mask:
        m = _src(t, srcs, 1)[..., : w.shape[2], :]
        m = _repeat(m, (w.shape[0], w.shape[1], w.shape[2], w.shape[3]))
        slope = _alibi_slopes(a_t.ne[2], max_bias)[None, :, None, None]
        w = (w + (slope * m).astype(F32)).astype(F32)
    store(dst, t.type, softmax_rows(w, sinks))


def _has_sinks(t: Tensor) -> bool:
    """A SOFT_MAX with attention sinks (src[2], ggml_soft_max_add_sinks)."""
    return len(t.src) > 2 and t.src[2] is not None


def _flash_attn_ext(t, dst, srcs, opts):
    """FLASH_ATTN_EXT, one query row at a time in f32 with Q rounded to f16 (K's vec_dot type)."""
    q_t, k_t, v_t = t.src[0], t.src[1], t.src[2]
    assert q_t is not None and k_t is not None and v_t is not None
    scale, max_bias = F32(t.op_param(0, 1.0)), float(t.op_param(1, 0.0))
    softcap = F32(t.op_param(2, 0.0))
    q = _src(t, srcs, 0)                                        # [ne3, n_head, n_q, D]
    k = _src(t, srcs, 1)                                        # [ne3, n_head_kv, n_kv, D]
    v = _src(t, srcs, 2)                                        # [ne3, n_head_kv, n_kv, Dv]
    if k_t.type == GGMLType.F16:
        q = q.astype(np.float16).astype(F32)
    mask = _src(t, srcs, 3) if len(t.src) > 3 and t.src[3] is not None else None
    n_head, group = q.shape[1], q.shape[1] // k.shape[1]
    slopes = _alibi_slopes(n_head, max_bias)
    for i3 in range(q.shape[0]):
        for h in range(n_head):
            kh, vh = k[i3 % k.shape[0], h // group], v[i3 % v.shape[0], h // group]
            s = (q[i3, h] @ kh.T).astype(F32) * scale           # [n_q, n_kv]
            if softcap != 0:
                s = (softcap * np.tanh(s / softcap)).astype(F32)
            if mask is not None:
                s = (s + slopes[h] * mask[i3 % mask.shape[0], h % mask.shape[1], : s.shape[0]]).astype(F32)
            p = softmax_rows(s)
            dst[i3, :, h, :] = (p @ vh).astype(F32)


# -- copies ----------------------------------------------------------------------------------------
def _cpy(t, dst, srcs, opts):
    """CPY / CONT / DUP: copy element by element in row-major order, converting the type."""
    s_t = t.src[0]
    assert s_t is not None
    src = srcs[0]
    if s_t.type == t.type:             # ggml_compute_forward_dup_same_cont / dup_bytes: no conversion
        # block types: rows of blocks are bytes in element order, so the flat byte order is shared
        if src.shape == dst.shape:
            np.copyto(dst, src)
        elif dst.flags.c_contiguous and dst.size == src.size:
            np.copyto(dst.reshape(src.shape), src)          # a view of dst in src's logical shape
        else:
            np.copyto(dst, np.ascontiguousarray(src).reshape(dst.shape))
        return
    vals = to_f32(src, s_t.type, s_t.ne[0])
    if vals.shape != dst.shape and not is_quantized(t.type):
        vals = np.ascontiguousarray(vals).reshape(dst.shape)
    elif is_quantized(t.type):
        vals = np.ascontiguousarray(vals).reshape((*dst.shape[:-1], t.ne[0]))
    store(dst, t.type, vals)


def _concat(t, dst, srcs, opts):
    dim = int(t.op_param(0))
    a, b = srcs[0], srcs[1]
    dst[...] = np.concatenate([a, b], axis=3 - dim)


def _nop(t, dst, srcs, opts): ...        # views and leafs: nothing to compute


def _rope(t, dst, srcs, opts):
    rope_forward(t, dst, srcs, _fk(opts))


# -- bind time: an op's static checks, parameters and views resolved once; the replayed call is the
# kernel itself. Each binder returns None where its fast path does not apply (the generic kernel runs).
# A decode step makes ~650 calls, so a few us each are 10-20% of a small model's step.
Bound = Callable[[], None]


@dataclass
class Binding:
    """What binding a graph's nodes takes besides each node's arrays (cpu.BoundGraph makes one per
    graph): the backend's options, every tensor's readers in this graph (tensor -> nodes), the use
    counts of the whole graph it may be a split of (Graph.use_counts), a tensor's bound array, and the
    prologue: calls that run first in each replay, making a step's values that several nodes read (the
    rope's cos/sin of the step's positions), one per key of `shared`."""
    opts: ComputeOptions
    consumers: dict = field(default_factory=dict)
    use_counts: dict = field(default_factory=dict)
    array: Callable[[Tensor], np.ndarray] | None = None
    prologue: list[Bound] = field(default_factory=list)
    shared: dict = field(default_factory=dict)

    @property
    def fk(self) -> ModuleType | None:
        return _fk(self.opts)


def attention_product(t: Tensor, srcs: list, b: Binding) -> tuple[np.ndarray, np.ndarray, bool, int] | None:
    """(w, x, tiny, skip) of an F16 product of the attention chain KQ = K.Q -> SOFT_MAX(KQ, mask) ->
    KQV = V.softmax, which may skip the cells the mask hides (fkernels.SKIP_KQ / SKIP_KQV: ggml's flash
    attention skips them too; exact for finite K and V), where fkernels.mul_mat takes its arrays as
    they are; None otherwise. KQ must feed only that SOFT_MAX and not be a graph output."""
    a_t, b_t = t.src[0], t.src[1]
    assert a_t is not None and b_t is not None
    opts = b.opts
    if (a_t.type != GGMLType.F16 or b_t.type != GGMLType.F32 or t.type != GGMLType.F32 or b.array is None
            or b.fk is None or opts.exact or opts.order != "ggml"):
        return None
    if b_t.op == Op.SOFT_MAX and b_t.src[0] is not None and b_t.src[0].op == Op.MUL_MAT:
        skip = 2                                                # KQV: probabilities from the soft_max
    else:
        users = b.consumers.get(t, ())
        sm = users[0] if len(users) == 1 else None
        if (sm is None or sm.op != Op.SOFT_MAX or sm.src[0] is not t or len(sm.src) < 2 or sm.src[1] is None
                or sm.src[1].type != GGMLType.F32 or t.flags & TensorFlag.OUTPUT):
            return None
        skip = 1                                                # KQ: the soft_max's mask
    w, x = srcs[0].view(np.uint16), srcs[1]
    if _unit_rows(w) is not w or _unit_rows(x) is not x:       # _mul_mat_float would copy them
        return None
    tiny = row_count(opts, b_t.ne[1]) >= 2 and a_t.ne[0] % 8 == 0 and a_t.ne[1] % 4 == 0   # tinyBLAS
    return w, x, tiny, skip


def _bind_mul_mat_f32(t, dst, srcs, b: Binding) -> Bound | None:
    """An F32 weight of one slice (a MoE router) by F32 activations of one slice: _mul_mat_float's
    numerics as fkernels.bind_mul_mat_f32's bound call."""
    a_t, b_t = t.src[0], t.src[1]
    opts, fk = b.opts, b.fk
    if (fk is None or opts.exact or opts.order != "ggml" or a_t.type != GGMLType.F32 or b_t.type != GGMLType.F32
            or t.type != GGMLType.F32 or a_t.ne[2] != 1 or a_t.ne[3] != 1 or b_t.ne[2] != 1 or b_t.ne[3] != 1):
        return None
    w, x, out = srcs[0][0, 0], srcs[1][0, 0], dst[0, 0]
    if not _has_unit_rows(w, x, out) or np.may_share_memory(out, x) or np.may_share_memory(out, w):
        return None
    K, M = a_t.ne[0], a_t.ne[1]
    tiny = row_count(opts, b_t.ne[1]) >= 2 and K % 8 == 0 and M % 4 == 0
    return fk.bind_mul_mat_f32(w, x, out, tiny)


def _bind_attention(t, dst, srcs, b: Binding) -> Bound | None:
    """An attention product (attention_product) as fkernels' bound product."""
    p = attention_product(t, srcs, b)
    if p is None:
        return None
    w, x, tiny, skip = p
    fk, array = b.fk, b.array
    assert fk is not None and array is not None
    mask = array(b.consumers[t][0].src[1]) if skip == 1 else None      # KQ: the soft_max's mask
    if not _has_unit_rows(dst, *([] if mask is None else [mask])):
        return None
    return fk.bind_mul_mat(w, x, dst, tiny, True, mask, skip)


def _bind_ufunc(ufunc: np.ufunc) -> Callable[[Tensor, np.ndarray, list, Binding], Bound | None]:
    """ADD/MUL: _ufunc_into's case (F32, numpy-broadcastable) as the ufunc into dst, on 2-D views of
    contiguous arrays (numpy's call costs less with fewer dimensions) and with out positional."""
    def binder(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
        x, y = srcs[0], srcs[1]
        if not _all_f32(t, 2) or not _broadcasts(y, x):
            return None
        if x.shape == dst.shape and all(a.flags.c_contiguous for a in (x, y, dst)) and \
                (y.shape == x.shape or y.size == y.shape[-1] == x.shape[-1]):
            ne0 = x.shape[-1]
            x, y, dst = x.reshape(-1, ne0), y.reshape(-1, ne0), dst.reshape(-1, ne0)
        return partial(ufunc, x, y, dst)
    return binder


def _bind_rms_norm(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    fk = b.fk
    if fk is None or not _all_f32(t, 1):
        return None
    return fk.bind_rms_norm(srcs[0], F32(t.op_param(0)), _ONE4, False, dst)


def _bind_glu(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    split = len(t.src) > 1 and t.src[1] is not None
    fk, op = b.fk, GLUOp(t.op_param(0))
    if fk is None or op not in (GLUOp.SWIGLU, GLUOp.GEGLU) or not _all_f32(t, 2 if split else 1):
        return None
    g, u = _glu_halves(srcs[0], srcs[1] if split else None, bool(t.op_param(1)))
    if op == GLUOp.GEGLU:
        return fk.bind_geglu(g, u, nm.gelu_table_f16(), dst)
    return None if dst.shape[-1] % 8 else fk.bind_swiglu(g, u, dst)


def _bind_scale(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    """SCALE without a bias on F32: f32(x * s), numpy's multiply by an f32 scalar into dst."""
    if not _all_f32(t, 1) or F32(t.op_param(1, 0.0)) != 0:
        return None
    return partial(np.multiply, srcs[0], F32(t.op_param(0, 1.0)), dst)


def _bind_soft_max(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    a_t = t.src[0]
    assert a_t is not None
    has_mask = len(t.src) > 1 and t.src[1] is not None
    fk = b.fk
    if fk is None or _has_sinks(t) or not _all_f32(t, 2 if has_mask else 1) or a_t.ne[0] % 8 or \
            not _has_unit_rows(srcs[0], dst, *srcs[1:2 if has_mask else 1]):
        return None
    scale, slopes = F32(t.op_param(0, 1.0)), _alibi_slopes_cached(a_t.ne[2], float(t.op_param(1, 0.0)))
    return fk.bind_soft_max(srcs[0], scale, srcs[1] if has_mask else _ONE4, slopes, has_mask, dst)


def _bind_set_rows(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    fk, args = b.fk, set_rows_args(t, dst, srcs, b)
    return None if fk is None or args is None else fk.bind_set_rows(*args)


def set_rows_args(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> tuple | None:
    """The arguments (rows, indices, dst) of the fk set_rows kernels for a node (an F16 dst as its bits),
    or None where that path does not apply."""
    b_t = t.src[0]
    assert b_t is not None
    if b.fk is None or b_t.type != GGMLType.F32 or t.type not in (GGMLType.F32, GGMLType.F16):
        return None
    return srcs[0], srcs[1], dst.view(np.uint16) if t.type == GGMLType.F16 else dst


def _bind_rope(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    fk = b.fk
    return None if fk is None else bind_rope(t, dst, srcs, fk, b.prologue, b.shared)


def _bind_get_rows(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    """_get_rows of one 2-D table into F32 rows (a step's token embeddings): all rows in one
    dequantize call, a compiled one for the legacy quant types (qkernels.bind_get_rows)."""
    a_t = t.src[0]
    a, ids = srcs[0], srcs[1]
    if a_t is None or t.type != GGMLType.F32 or a.shape[:2] != (1, 1) or ids.shape[:3] != (1, 1, 1) \
            or a_t.type == GGMLType.I32:
        return None
    table, idx, out, typ, ne0 = a[0, 0], ids[0, 0, 0], dst[0, 0], a_t.type, a_t.ne[0]
    qk = _compiled("qkernels", b.opts)
    fast = None if qk is None else qk.bind_get_rows(typ, table, idx, out)
    if fast is not None:
        return fast

    def run() -> None:
        out[...] = to_f32(table[idx], typ, ne0)
    return run


def _bind_cpy(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound | None:
    """A copy without conversion (_cpy's first two cases): into dst, or a contiguous dst seen in the
    source's shape."""
    s_t, src = t.src[0], srcs[0]
    if s_t is None or s_t.type != t.type:
        return None
    if src.shape == dst.shape:
        return partial(np.copyto, dst, src)
    if dst.flags.c_contiguous and dst.size == src.size:
        return partial(np.copyto, dst.reshape(src.shape), src)
    return None


_BINDERS: dict[Op, Callable[[Tensor, np.ndarray, list, Binding], Bound | None]] = {
    Op.ADD: _bind_ufunc(np.add), Op.MUL: _bind_ufunc(np.multiply), Op.RMS_NORM: _bind_rms_norm,
    Op.GLU: _bind_glu, Op.SOFT_MAX: _bind_soft_max, Op.SET_ROWS: _bind_set_rows, Op.ROPE: _bind_rope,
    Op.CPY: _bind_cpy, Op.CONT: _bind_cpy, Op.DUP: _bind_cpy, Op.GET_ROWS: _bind_get_rows,
    Op.SCALE: _bind_scale, Op.MUL_MAT_ID: _bind_mul_mat_id,
}


def bind(t: Tensor, dst: np.ndarray, srcs: list, b: Binding) -> Bound:
    """The node's kernel with its arrays and the backend's options bound, for a replayed step list
    (cpu.BoundGraph): MUL_MAT on a packable model weight binds the packed product directly, and the
    attention chain's products skip masked cells; other ops their binder's call, else the generic
    kernel."""
    fast = None
    if t.op == Op.MUL_MAT:
        fast = (_bind_mul_mat_packed(t, dst, srcs, b.opts) or _bind_attention(t, dst, srcs, b)
                or _bind_mul_mat_f32(t, dst, srcs, b))
    else:
        binder = _BINDERS.get(t.op)
        fast = binder(t, dst, srcs, b) if binder is not None else None
    return fast if fast is not None else partial(KERNELS[t.op], t, dst, srcs, b.opts)


KERNELS: dict[Op, Kernel] = {
    Op.NONE: _nop, Op.VIEW: _nop, Op.RESHAPE: _nop, Op.PERMUTE: _nop, Op.TRANSPOSE: _nop,
    Op.ADD: _add, Op.MUL: _mul, Op.SCALE: _scale, Op.RMS_NORM: _rms_norm, Op.NORM: _norm,
    Op.MUL_MAT_ID: _mul_mat_id, Op.DIV: _div, Op.ADD_ID: _add_id, Op.SUM_ROWS: _sum_rows, Op.CLAMP: _clamp,
    Op.ARGSORT: _argsort, Op.UNARY: _unary, Op.GLU: _glu, Op.MUL_MAT: _mul_mat, Op.GET_ROWS: _get_rows,
    Op.SET_ROWS: _set_rows, Op.ARGMAX: _argmax, Op.SOFT_MAX: _soft_max, Op.FLASH_ATTN_EXT: _flash_attn_ext,
    Op.CPY: _cpy, Op.CONT: _cpy, Op.DUP: _cpy, Op.CONCAT: _concat, Op.ROPE: _rope, **recurrent.KERNELS,
    **gather.KERNELS}

# ops whose kernels accept quantized operands (any position)
QUANT_SRC_OPS = frozenset({Op.MUL_MAT, Op.MUL_MAT_ID, Op.GET_ROWS, Op.CPY, Op.CONT, Op.DUP})

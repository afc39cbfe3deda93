"""Op builders: ggml's shape, stride and view rules, no compute (ggml.c's ggml_<op> functions).

Each builder checks its operands the way ggml asserts them, but raises ShapeError with the operand names
and shapes, since a wrong shape here is a bug in a graph builder that its author must be able to read.
View ops (VIEW, RESHAPE, PERMUTE, TRANSPOSE) and write-into ops (CPY, SET_ROWS, *_inplace) return views:
zero-copy, owning no memory (ggml-mechanisms.md §1.2).
"""
from __future__ import annotations

from collections.abc import Sequence

from .context import Context
from .tensor import (
    MAX_DIMS,
    GLUOp,
    Op,
    SortOrder,
    Tensor,
    UnaryOp,
    are_same_shape,
    can_repeat,
    is_contiguous,
    is_contiguous_rows,
    nbytes,
)
from .types import TYPE_TRAITS, GGMLType, is_quantized


class ShapeError(ValueError):
    """Operands whose shapes or types the op does not accept."""


def _prod(ne: Sequence[int]) -> int:
    n = 1
    for x in ne:
        n *= int(x)
    return n


def _desc(t: Tensor) -> str:
    return f"'{t.name}' {t.type.name}{list(t.ne)}"


def _check(cond: bool, op: str, why: str, *ts: Tensor) -> None:
    if not cond:
        raise ShapeError(f"{op}: {why} ({', '.join(_desc(t) for t in ts)})")


def _node(ctx: Context, op: Op, type: GGMLType, ne: Sequence[int], srcs: Sequence[Tensor | None],
          params: tuple = ()) -> Tensor:
    t = ctx.new_tensor(type, ne)
    t.op, t.op_params, t.src = op, params, list(srcs)
    return t


def _inplace(ctx: Context, op: Op, a: Tensor, srcs: Sequence[Tensor | None], params: tuple = ()) -> Tensor:
    """The *_inplace variants: the result is a view of a with a real op."""
    t = ctx.view_tensor(a)
    t.op, t.op_params, t.src = op, params, list(srcs)
    return t


# -- element-wise --------------------------------------------------------------------------------
def _binary(ctx: Context, op: Op, a: Tensor, b: Tensor, inplace: bool) -> Tensor:
    _check(can_repeat(b, a), op.name, "b must broadcast to a's shape", a, b)
    if inplace:
        return _inplace(ctx, op, a, [a, b])
    # differs from ggml: a quantized a gives an F32 result (ggml_dup_tensor keeps a's type) because the
    # CPU kernels here never write quantized results of arithmetic
    return _node(ctx, op, a.type if not is_quantized(a.type) else GGMLType.F32, a.ne, [a, b])


def add(ctx: Context, a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _binary(ctx, Op.ADD, a, b, inplace)


def mul(ctx: Context, a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _binary(ctx, Op.MUL, a, b, inplace)


def div(ctx: Context, a: Tensor, b: Tensor, inplace: bool = False) -> Tensor:
    return _binary(ctx, Op.DIV, a, b, inplace)


def add_id(ctx: Context, a: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """ggml_add_id: dst[:, i1, i2] = a[:, i1, i2] + b[:, ids[i1, i2]], a bias per selected expert
    (a [ne0, n_used, n_tokens], b [ne0, n_expert], ids I32 [n_used, n_tokens])."""
    _check(a.ne[0] == b.ne[0] and a.ne[1] == ids.ne[0] and a.ne[2] == ids.ne[1], "ADD_ID",
           "a must be [b.ne0, ids.ne0, ids.ne1]", a, b, ids)
    _check(ids.type == GGMLType.I32, "ADD_ID", "ids must be I32", ids)
    _check(a.type == b.type == GGMLType.F32, "ADD_ID", "a and b must be F32", a, b)
    return _node(ctx, Op.ADD_ID, a.type, a.ne, [a, b, ids])


def sum_rows(ctx: Context, a: Tensor) -> Tensor:
    """ggml_sum_rows: ne = (1, a.ne1, a.ne2, a.ne3), each row's sum (accumulated in double on the CPU)."""
    _check(a.type == GGMLType.F32, "SUM_ROWS", "a must be F32", a)
    return _node(ctx, Op.SUM_ROWS, a.type, (1, *a.ne[1:]), [a])


def clamp(ctx: Context, a: Tensor, lo: float, hi: float) -> Tensor:
    """ggml_clamp: min(max(a, lo), hi). As in ggml the result is a view of a: it runs in place."""
    _check(a.type == GGMLType.F32, "CLAMP", "a must be F32", a)
    return _inplace(ctx, Op.CLAMP, a, [a], (float(lo), float(hi)))


def scale(ctx: Context, a: Tensor, s: float, b: float = 0.0, inplace: bool = False) -> Tensor:
    """ggml_scale / ggml_scale_bias: a*s + b."""
    params = (float(s), float(b))
    if inplace:
        return _inplace(ctx, Op.SCALE, a, [a], params)
    return _node(ctx, Op.SCALE, a.type, a.ne, [a], params)


def _norm(ctx: Context, op: Op, a: Tensor, eps: float, inplace: bool) -> Tensor:
    if inplace:
        return _inplace(ctx, op, a, [a], (float(eps),))
    return _node(ctx, op, a.type, a.ne, [a], (float(eps),))


def rms_norm(ctx: Context, a: Tensor, eps: float, inplace: bool = False) -> Tensor:
    return _norm(ctx, Op.RMS_NORM, a, eps, inplace)


def norm(ctx: Context, a: Tensor, eps: float, inplace: bool = False) -> Tensor:
    return _norm(ctx, Op.NORM, a, eps, inplace)


def unary(ctx: Context, a: Tensor, uop: UnaryOp, inplace: bool = False) -> Tensor:
    _check(is_contiguous(a) or a.nb[0] == TYPE_TRAITS[a.type].type_size, "UNARY",
           "rows must be contiguous", a)
    if inplace:
        return _inplace(ctx, Op.UNARY, a, [a], (int(uop),))
    return _node(ctx, Op.UNARY, a.type, a.ne, [a], (int(uop),))


def silu(ctx: Context, a: Tensor, inplace: bool = False) -> Tensor:
    return unary(ctx, a, UnaryOp.SILU, inplace)


def gelu(ctx: Context, a: Tensor, inplace: bool = False) -> Tensor:
    return unary(ctx, a, UnaryOp.GELU, inplace)


def glu(ctx: Context, a: Tensor, b: Tensor | None, gop: GLUOp, swapped: bool = False) -> Tensor:
    """ggml_glu / ggml_glu_split: act(a) * b, or halves of a when b is None."""
    if b is None:
        _check(a.ne[0] % 2 == 0, "GLU", "a fused GLU input needs an even ne[0]", a)
        ne = (a.ne[0] // 2, *a.ne[1:])
    else:
        _check(are_same_shape(a, b) and a.type == b.type, "GLU", "a and b must match", a, b)
        ne = a.ne
    return _node(ctx, Op.GLU, a.type, ne, [a, b] if b is not None else [a], (int(gop), int(swapped)))


def swiglu(ctx: Context, a: Tensor, b: Tensor | None = None) -> Tensor:
    return glu(ctx, a, b, GLUOp.SWIGLU)


def swiglu_oai(ctx: Context, a: Tensor, b: Tensor, alpha: float, limit: float) -> Tensor:
    """ggml_swiglu_oai (gpt-oss): x = min(a, limit), y = clamp(b, -limit, limit), x*sigmoid(alpha*x)*(y+1)."""
    _check(is_contiguous_rows(a) and is_contiguous_rows(b), "GLU", "rows must be contiguous", a, b)
    t = glu(ctx, a, b, GLUOp.SWIGLU_OAI)
    t.op_params = (*t.op_params, float(alpha), float(limit))
    return t


def sigmoid(ctx: Context, a: Tensor) -> Tensor:
    return unary(ctx, a, UnaryOp.SIGMOID)


# -- matrix ---------------------------------------------------------------------------------------
def mul_mat(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """ggml_mul_mat: dst[i, j] = sum_k a[k, i] * b[k, j]; a broadcasts over b's dims 2 and 3."""
    _check(a.ne[0] == b.ne[0], "MUL_MAT", "a.ne[0] must equal b.ne[0]", a, b)
    _check(b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0, "MUL_MAT",
           "b.ne[2], b.ne[3] must be multiples of a's", a, b)
    _check(a.nb[0] <= a.nb[1], "MUL_MAT", "a must not be transposed", a)
    _check(not is_quantized(b.type), "MUL_MAT", "b (activations) cannot be quantized", b)
    return _node(ctx, Op.MUL_MAT, GGMLType.F32, (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), [a, b])


def mul_mat_id(ctx: Context, as_: Tensor, b: Tensor, ids: Tensor) -> Tensor:
    """ggml_mul_mat_id: one matrix per expert. as_ [K, M, n_expert] (a 3-D weight), b [K, n_b, n_tokens] (the
    tokens' rows, n_b = 1, or a row per selected expert, n_b = n_used), ids I32 [n_used, n_tokens]; dst[:, e, t] =
    as_[:, :, ids[e, t]] . b[:, e % n_b, t], ne = (M, n_used, n_tokens); 0 where an id is -1 (ops_collective.py)."""
    _check(as_.nb[0] <= as_.nb[1] and as_.ne[3] == 1, "MUL_MAT_ID", "as must be 3-D, not transposed", as_)
    _check(ids.type == GGMLType.I32 and ids.ne[2] == 1 and ids.ne[3] == 1, "MUL_MAT_ID",
           "ids must be a 2-D I32 tensor", ids)
    _check(b.ne[3] == 1 and ids.ne[1] == b.ne[2], "MUL_MAT_ID", "one expert list per b row", b, ids)
    _check(as_.ne[0] == b.ne[0], "MUL_MAT_ID", "as.ne[0] must equal b.ne[0]", as_, b)
    _check(ids.ne[0] % b.ne[1] == 0, "MUL_MAT_ID", "ids.ne[0] must be a multiple of b.ne[1]", b, ids)
    _check(not is_quantized(b.type), "MUL_MAT_ID", "b (activations) cannot be quantized", b)
    return _node(ctx, Op.MUL_MAT_ID, GGMLType.F32, (as_.ne[1], ids.ne[0], b.ne[2], 1), [as_, b, ids])


def get_rows(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """ggml_get_rows: rows of a picked by the I32 ids in b; ne = (a.ne0, b.ne0, b.ne1, b.ne2)."""
    _check(b.type == GGMLType.I32, "GET_ROWS", "row ids must be I32", b)
    _check(a.ne[2] == b.ne[1] and b.ne[3] == 1, "GET_ROWS", "a.ne[2] must equal b.ne[1]", a, b)
    type = GGMLType.I32 if a.type == GGMLType.I32 else GGMLType.F32
    return _node(ctx, Op.GET_ROWS, type, (a.ne[0], b.ne[0], b.ne[1], b.ne[2]), [a, b])


def set_rows(ctx: Context, a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """ggml_set_rows: write b's rows into a at the I64/I32 indices c; returns a view of a."""
    _check(a.ne[0] == b.ne[0], "SET_ROWS", "row lengths differ", a, b)
    _check(b.ne[1] == c.ne[0], "SET_ROWS", "one index per row of b", b, c)
    _check(b.ne[2] % c.ne[1] == 0 and b.ne[3] % c.ne[2] == 0 and c.ne[3] == 1, "SET_ROWS",
           "index tensor does not broadcast over b", b, c)
    _check(a.ne[2] == b.ne[2] and a.ne[3] == b.ne[3], "SET_ROWS", "a and b differ in dims 2, 3", a, b)
    _check(c.type in (GGMLType.I64, GGMLType.I32), "SET_ROWS", "indices must be I64 or I32", c)
    _check(b.type == GGMLType.F32, "SET_ROWS", "source rows must be F32", b)
    t = ctx.view_tensor(a)
    t.op, t.src = Op.SET_ROWS, [b, c]
    return t


def argsort(ctx: Context, a: Tensor, order: SortOrder) -> Tensor:
    """ggml_argsort: per row of a, the I32 indices that sort it (the CPU sorts with std::sort)."""
    _check(a.type == GGMLType.F32 and a.nb[0] == 4, "ARGSORT", "a must be F32 with dense rows", a)
    return _node(ctx, Op.ARGSORT, GGMLType.I32, a.ne, [a], (int(order),))


def argsort_top_k(ctx: Context, a: Tensor, k: int) -> Tensor:
    """ggml_argsort_top_k: the first k of a descending argsort, a view (ne0 = k) of the full sort."""
    _check(a.ne[0] >= k > 0, "ARGSORT", f"k={k} must be in 1..ne[0]", a)
    s = argsort(ctx, a, SortOrder.DESC)
    return view_4d(ctx, s, k, s.ne[1], s.ne[2], s.ne[3], s.nb[1], s.nb[2], s.nb[3], 0)


def argmax(ctx: Context, a: Tensor) -> Tensor:
    _check(a.n_dims <= 2, "ARGMAX", "a must be a matrix", a)
    return _node(ctx, Op.ARGMAX, GGMLType.I32, (a.ne[1], 1, 1, 1), [a])


# -- normalisation, attention ----------------------------------------------------------------------
def soft_max_ext(ctx: Context, a: Tensor, mask: Tensor | None, scale: float = 1.0,
                 max_bias: float = 0.0) -> Tensor:
    """ggml_soft_max_ext: softmax(a*scale + mask*slope) along ne[0]."""
    _check(is_contiguous(a), "SOFT_MAX", "a must be contiguous", a)
    if mask is not None:
        _check(mask.type in (GGMLType.F16, GGMLType.F32), "SOFT_MAX", "mask must be F16 or F32", mask)
        _check(mask.ne[0] == a.ne[0] and mask.ne[1] >= a.ne[1], "SOFT_MAX",
               "mask must cover a's rows", a, mask)
        _check(a.ne[2] % mask.ne[2] == 0 and a.ne[3] % mask.ne[3] == 0, "SOFT_MAX",
               "mask must broadcast over a's dims 2, 3", a, mask)
    return _node(ctx, Op.SOFT_MAX, a.type, a.ne, [a, mask] if mask is not None else [a],
                 (float(scale), float(max_bias)))


def soft_max_add_sinks(a: Tensor, sinks: Tensor) -> None:
    """ggml_soft_max_add_sinks: attention sinks [n_head] (gpt-oss): each head's row is normalised as if
    a logit sinks[head] were one more column (src[2] of the SOFT_MAX node)."""
    _check(a.op == Op.SOFT_MAX and len(a.src) < 3, "SOFT_MAX", "sinks go on a soft_max without them", a)
    _check(a.src[0] is not None and a.src[0].ne[2] == sinks.ne[0] and sinks.type == GGMLType.F32, "SOFT_MAX",
           "one F32 sink per head (a.ne[2])", a, sinks)
    if len(a.src) == 1:
        a.src.append(None)
    a.src.append(sinks)


ROPE_TYPE_NORM = 0
ROPE_TYPE_NEOX = 2


def rope_ext(ctx: Context, a: Tensor, pos: Tensor, freq_factors: Tensor | None, n_dims: int, mode: int,
             n_ctx_orig: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
             ext_factor: float = 0.0, attn_factor: float = 1.0, beta_fast: float = 32.0,
             beta_slow: float = 1.0) -> Tensor:
    """ggml_rope_ext: op_params as in ggml, [n_past(0), n_dims, mode, n_ctx(0), n_ctx_orig, freq_base,
    freq_scale, ext_factor, attn_factor, beta_fast, beta_slow]."""
    _check(pos.type == GGMLType.I32 and pos.n_dims == 1, "ROPE", "positions must be an I32 vector", pos)
    _check(a.ne[2] == pos.ne[0], "ROPE", "one position per a.ne[2] (token)", a, pos)
    _check(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, "ROPE", f"n_dims={n_dims} must be even and <= ne[0]", a)
    _check(mode in (ROPE_TYPE_NORM, ROPE_TYPE_NEOX), "ROPE", f"mode {mode} is not NORM(0) or NEOX(2)", a)
    if freq_factors is not None:                # theta of pair i is divided by freq_factors[i]
        _check(freq_factors.type == GGMLType.F32, "ROPE", "frequency factors must be F32", freq_factors)
        _check(freq_factors.ne[0] >= n_dims // 2, "ROPE", "need n_dims/2 frequency factors", freq_factors)
    params = (0, int(n_dims), int(mode), 0, int(n_ctx_orig), float(freq_base), float(freq_scale),
              float(ext_factor), float(attn_factor), float(beta_fast), float(beta_slow))
    srcs = [a, pos] + ([freq_factors] if freq_factors is not None else [])
    return _node(ctx, Op.ROPE, a.type, a.ne, srcs, params)


def flash_attn_ext(ctx: Context, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                   max_bias: float = 0.0, logit_softcap: float = 0.0) -> Tensor:
    """ggml_flash_attn_ext: q [D, n_q, n_head, ne3], k [D, n_kv, n_head_kv], v [Dv, n_kv, n_head_kv];
    result [Dv, n_head, n_q, ne3] (note the permuted output, as in ggml)."""
    _check(q.ne[0] == k.ne[0], "FLASH_ATTN_EXT", "q and k head sizes differ", q, k)
    _check(k.ne[1] == v.ne[1], "FLASH_ATTN_EXT", "k and v lengths differ", k, v)
    _check(q.ne[2] % k.ne[2] == 0 and k.ne[2] == v.ne[2], "FLASH_ATTN_EXT",
           "n_head must be a multiple of n_head_kv", q, k, v)
    _check(q.ne[3] % k.ne[3] == 0, "FLASH_ATTN_EXT", "q.ne[3] must be a multiple of k.ne[3]", q, k)
    if mask is not None:
        _check(mask.ne[0] == k.ne[1] and mask.ne[1] >= q.ne[1], "FLASH_ATTN_EXT",
               "mask must be [n_kv, >= n_q]", mask, k, q)
    return _node(ctx, Op.FLASH_ATTN_EXT, GGMLType.F32, (v.ne[0], q.ne[2], q.ne[1], q.ne[3]),
                 [q, k, v, mask] if mask is not None else [q, k, v],
                 (float(scale), float(max_bias), float(logit_softcap)))


# -- copies ---------------------------------------------------------------------------------------
def cpy(ctx: Context, a: Tensor, b: Tensor) -> Tensor:
    """ggml_cpy: copy a into b (converting type); returns a view of b with op CPY."""
    _check(a.nelements == b.nelements, "CPY", "element counts differ", a, b)
    t = ctx.view_tensor(b)
    t.op, t.src = Op.CPY, [a, b]
    t.name = (f"{b.name} (copy of {a.name})" if b.name else f"{a.name} (copy)")[:63]
    return t


def cont(ctx: Context, a: Tensor, ne: Sequence[int] | None = None) -> Tensor:
    """ggml_cont / ggml_cont_Nd: a dense copy, optionally with a new shape of the same size."""
    shape = tuple(ne) if ne is not None else a.ne
    _check(_prod(shape) == a.nelements, "CONT", f"new shape {list(shape)} has a different size", a)
    t = ctx.new_tensor(a.type, shape)
    t.op, t.src = Op.CONT, [a]
    t.name = f"{a.name} (cont)"[:63]
    return t


def concat(ctx: Context, a: Tensor, b: Tensor, dim: int) -> Tensor:
    _check(0 <= dim < MAX_DIMS and a.type == b.type, "CONCAT", f"bad dim {dim} or types differ", a, b)
    _check(all(a.ne[i] == b.ne[i] for i in range(MAX_DIMS) if i != dim), "CONCAT",
           f"shapes must agree except in dim {dim}", a, b)
    ne = list(a.ne)
    ne[dim] += b.ne[dim]
    return _node(ctx, Op.CONCAT, a.type, ne, [a, b], (dim,))


# -- views ----------------------------------------------------------------------------------------
def _view_impl(ctx: Context, a: Tensor, ne: Sequence[int], nb: Sequence[int], offset: int) -> Tensor:
    """ggml_view_impl: explicit strides for the given dims; the ones beyond stay dense."""
    t = ctx.new_tensor(a.type, ne, a, offset)
    strides = [t.nb[0], *nb]                       # nb[1] of a 1-d view stays the dense row size
    if not nb:
        strides.append(t.nb[1])
    for i in range(len(strides), MAX_DIMS):
        strides.append(strides[-1] * t.ne[i - 1])
    t.nb = tuple(strides)  # type: ignore[assignment]
    root = t.view_src
    assert root is not None
    _check(t.view_offs + nbytes(t) <= nbytes(root), "VIEW",
           f"view of extent {nbytes(t)} at offset {offset} runs past the end of its source", a)
    t.op, t.op_params, t.src = Op.VIEW, (offset,), [a]
    t.name = f"{a.name} (view)"[:63]
    return t


def view_1d(ctx: Context, a: Tensor, ne0: int, offset: int) -> Tensor:
    return _view_impl(ctx, a, (ne0,), (), offset)


def view_2d(ctx: Context, a: Tensor, ne0: int, ne1: int, nb1: int, offset: int) -> Tensor:
    return _view_impl(ctx, a, (ne0, ne1), (nb1,), offset)


def view_3d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int, nb1: int, nb2: int,
            offset: int) -> Tensor:
    return _view_impl(ctx, a, (ne0, ne1, ne2), (nb1, nb2), offset)


def view_4d(ctx: Context, a: Tensor, ne0: int, ne1: int, ne2: int, ne3: int, nb1: int, nb2: int,
            nb3: int, offset: int) -> Tensor:
    return _view_impl(ctx, a, (ne0, ne1, ne2, ne3), (nb1, nb2, nb3), offset)


def reshape(ctx: Context, a: Tensor, *ne: int) -> Tensor:
    """ggml_reshape_Nd: a view with a new shape; a must be contiguous."""
    _check(is_contiguous(a), "RESHAPE", "only a contiguous tensor can be reshaped", a)
    _check(_prod(ne) == a.nelements, "RESHAPE", f"new shape {list(ne)} has a different size", a)
    t = ctx.new_tensor(a.type, ne, a, 0)
    t.op, t.src = Op.RESHAPE, [a]
    t.name = f"{a.name} (reshaped)"[:63]
    return t


def permute(ctx: Context, a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int) -> Tensor:
    """ggml_permute: source dim i moves to position ax_i."""
    axes = (ax0, ax1, ax2, ax3)
    _check(sorted(axes) == [0, 1, 2, 3], "PERMUTE", f"axes {axes} are not a permutation of 0..3", a)
    t = ctx.view_tensor(a)
    ne, nb = [0] * 4, [0] * 4
    for i, ax in enumerate(axes):
        ne[ax], nb[ax] = a.ne[i], a.nb[i]
    t.ne, t.nb = tuple(ne), tuple(nb)  # type: ignore[assignment]
    t.op, t.op_params, t.src = Op.PERMUTE, axes, [a]
    t.name = f"{a.name} (permuted)"[:63]
    return t


def transpose(ctx: Context, a: Tensor) -> Tensor:
    """ggml_transpose: swap dims 0 and 1 (a view)."""
    t = ctx.view_tensor(a)
    t.ne = (a.ne[1], a.ne[0], a.ne[2], a.ne[3])
    t.nb = (a.nb[1], a.nb[0], a.nb[2], a.nb[3])
    t.op, t.src = Op.TRANSPOSE, [a]
    t.name = f"{a.name} (transposed)"[:63]
    return t

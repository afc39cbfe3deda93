"""core/ops.py: shapes, strides, op_params and view semantics of every builder; ShapeError on bad shapes."""
import pytest

from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.ops import ShapeError
from ggml_dist.core.tensor import GLUOp, Op, UnaryOp, is_contiguous, nbytes
from ggml_dist.core.types import GGMLType

F32, F16, I32, I64, Q4_0 = GGMLType.F32, GGMLType.F16, GGMLType.I32, GGMLType.I64, GGMLType.Q4_0


@pytest.fixture
def ctx():
    return Context(1 << 22)


def _new(ctx, type, *ne, name=""):
    return ctx.new_tensor(type, ne).set_name(name)


def _fresh(t, ne, type=F32):
    """A freshly built (non-view) result with dense strides."""
    assert t.ne == tuple(ne) + (1,) * (4 - len(ne)) and t.type == type
    assert t.view_src is None and is_contiguous(t)


# -- element-wise ------------------------------------------------------------------------------------
# ADD/MUL: result has a's shape and type; b broadcasts; in-place returns a view of a with the op
@pytest.mark.parametrize("fn,op", [(ops.add, Op.ADD), (ops.mul, Op.MUL)])
def test_binary(ctx, fn, op):
    a, b = _new(ctx, F32, 8, 4, 3), _new(ctx, F32, 8, 1, 3)
    t = fn(ctx, a, b)
    _fresh(t, (8, 4, 3))
    assert t.op == op and t.src == [a, b]
    ti = fn(ctx, a, b, inplace=True)
    assert ti.op == op and ti.view_src is a and ti.view_offs == 0 and ti.src == [a, b]
    with pytest.raises(ShapeError, match=rf"{op.name}: b must broadcast.*'{a.name}' F32\[8, 4, 3, 1\]"):
        fn(ctx, b, a)


# SCALE stores (s, b) as floats; RMS_NORM/NORM store eps
def test_scale_and_norms(ctx):
    a = _new(ctx, F32, 16, 3)
    s = ops.scale(ctx, a, 0.5, 1.0)
    _fresh(s, (16, 3))
    assert s.op == Op.SCALE and s.op_params == (0.5, 1.0) and s.src == [a]
    assert ops.scale(ctx, a, 2.0, inplace=True).view_src is a
    for fn, op in ((ops.rms_norm, Op.RMS_NORM), (ops.norm, Op.NORM)):
        n = fn(ctx, a, 1e-5)
        _fresh(n, (16, 3))
        assert n.op == op and n.op_params == (1e-5,) and n.src == [a]
        assert fn(ctx, a, 1e-5, inplace=True).view_src is a


# UNARY stores the unary op; GLU halves ne[0] when fused, keeps it when split
def test_unary_and_glu(ctx):
    a = _new(ctx, F32, 16, 3)
    u = ops.silu(ctx, a)
    _fresh(u, (16, 3))
    assert u.op == Op.UNARY and u.op_params == (int(UnaryOp.SILU),)
    assert ops.gelu(ctx, a).op_params == (int(UnaryOp.GELU),)
    g = ops.swiglu(ctx, a)
    _fresh(g, (8, 3))
    assert g.op == Op.GLU and g.op_params == (int(GLUOp.SWIGLU), 0) and g.src == [a]
    b = _new(ctx, F32, 16, 3)
    g2 = ops.swiglu(ctx, a, b)
    _fresh(g2, (16, 3))
    assert g2.src == [a, b]
    with pytest.raises(ShapeError, match="GLU: a and b must match"):
        ops.swiglu(ctx, a, _new(ctx, F32, 16, 2))
    with pytest.raises(ShapeError, match="even ne"):
        ops.swiglu(ctx, _new(ctx, F32, 15, 2))


# -- matrix ----------------------------------------------------------------------------------------
# MUL_MAT: ne = (a.ne1, b.ne1, b.ne2, b.ne3), always F32; a broadcasts over b's dims 2, 3
def test_mul_mat(ctx):
    a = _new(ctx, Q4_0, 64, 10, 2)
    b = _new(ctx, F32, 64, 7, 4, 3)
    t = ops.mul_mat(ctx, a, b)
    _fresh(t, (10, 7, 4, 3))
    assert t.op == Op.MUL_MAT and t.src == [a, b]
    with pytest.raises(ShapeError, match=r"MUL_MAT: a.ne\[0\] must equal b.ne\[0\]"):
        ops.mul_mat(ctx, a, _new(ctx, F32, 32, 7))
    with pytest.raises(ShapeError, match="multiples"):
        ops.mul_mat(ctx, a, _new(ctx, F32, 64, 7, 3))
    with pytest.raises(ShapeError, match="transposed"):
        ops.mul_mat(ctx, ops.transpose(ctx, _new(ctx, F32, 4, 64)), _new(ctx, F32, 64, 2))
    with pytest.raises(ShapeError, match="cannot be quantized"):
        ops.mul_mat(ctx, _new(ctx, F32, 64, 2), _new(ctx, Q4_0, 64, 2))


# GET_ROWS: ne = (a.ne0, b.ne0, b.ne1, b.ne2), F32 (I32 for I32 a); ids must be I32
def test_get_rows(ctx):
    a = _new(ctx, Q4_0, 64, 100, 3)
    ids = _new(ctx, I32, 5, 3)
    t = ops.get_rows(ctx, a, ids)
    _fresh(t, (64, 5, 3))
    assert t.op == Op.GET_ROWS and t.src == [a, ids]
    _fresh(ops.get_rows(ctx, _new(ctx, I32, 4, 9), _new(ctx, I32, 2)), (4, 2), I32)
    with pytest.raises(ShapeError, match="row ids must be I32"):
        ops.get_rows(ctx, a, _new(ctx, I64, 5, 3))
    with pytest.raises(ShapeError, match=r"a.ne\[2\] must equal b.ne\[1\]"):
        ops.get_rows(ctx, a, _new(ctx, I32, 5, 2))


# SET_ROWS: a view of a with op SET_ROWS and src (b, c)
def test_set_rows(ctx):
    a = _new(ctx, F16, 8, 32, 2, name="cache")
    b = _new(ctx, F32, 8, 4, 2)
    c = _new(ctx, I64, 4)
    t = ops.set_rows(ctx, a, b, c)
    assert t.op == Op.SET_ROWS and t.view_src is a and t.ne == a.ne and t.nb == a.nb and t.type == F16
    assert t.src[:2] == [b, c]
    with pytest.raises(ShapeError, match="one index per row"):
        ops.set_rows(ctx, a, b, _new(ctx, I64, 3))
    with pytest.raises(ShapeError, match="source rows must be F32"):
        ops.set_rows(ctx, a, _new(ctx, F16, 8, 4, 2), c)
    with pytest.raises(ShapeError, match="row lengths"):
        ops.set_rows(ctx, a, _new(ctx, F32, 4, 4, 2), c)


# ARGMAX: one I32 per row of a matrix
def test_argmax(ctx):
    a = _new(ctx, F32, 10, 4)
    t = ops.argmax(ctx, a)
    _fresh(t, (4,), I32)
    with pytest.raises(ShapeError, match="matrix"):
        ops.argmax(ctx, _new(ctx, F32, 10, 4, 2))


# -- attention -------------------------------------------------------------------------------------
# SOFT_MAX ext: a's shape, params (scale, max_bias), optional mask broadcast over dims 2, 3
def test_soft_max_ext(ctx):
    a = _new(ctx, F32, 16, 4, 8)
    m = _new(ctx, F16, 16, 6)
    t = ops.soft_max_ext(ctx, a, m, 0.125, 0.0)
    _fresh(t, (16, 4, 8))
    assert t.op == Op.SOFT_MAX and t.src == [a, m] and t.op_params == (0.125, 0.0)
    assert ops.soft_max_ext(ctx, a, None).src == [a]
    with pytest.raises(ShapeError, match="mask must cover"):
        ops.soft_max_ext(ctx, a, _new(ctx, F32, 16, 3))
    with pytest.raises(ShapeError, match="mask must be F16 or F32"):
        ops.soft_max_ext(ctx, a, _new(ctx, I32, 16, 4))
    with pytest.raises(ShapeError, match="contiguous"):
        ops.soft_max_ext(ctx, ops.transpose(ctx, _new(ctx, F32, 4, 16)), None)


# ROPE: a's shape; src (a, pos[, freq_factors]); op_params in ggml's order
def test_rope_ext(ctx):
    a = _new(ctx, F32, 64, 4, 5)
    pos = _new(ctx, I32, 5)
    t = ops.rope_ext(ctx, a, pos, None, 32, ops.ROPE_TYPE_NEOX, 4096, 500000.0, 0.5, 0.0, 1.0, 32.0, 1.0)
    _fresh(t, (64, 4, 5))
    assert t.op == Op.ROPE and t.src == [a, pos]
    assert t.op_params == (0, 32, 2, 0, 4096, 500000.0, 0.5, 0.0, 1.0, 32.0, 1.0)
    ff = _new(ctx, F32, 16)
    assert ops.rope_ext(ctx, a, pos, ff, 32, 0, 4096).src == [a, pos, ff]
    with pytest.raises(ShapeError, match="need n_dims/2 frequency factors"):
        ops.rope_ext(ctx, a, pos, _new(ctx, F32, 8), 32, 0, 4096)
    with pytest.raises(ShapeError, match="frequency factors must be F32"):
        ops.rope_ext(ctx, a, pos, _new(ctx, F16, 16), 32, 0, 4096)
    with pytest.raises(ShapeError, match="one position per"):
        ops.rope_ext(ctx, a, _new(ctx, I32, 4), None, 32, 0, 4096)
    with pytest.raises(ShapeError, match="n_dims=33"):
        ops.rope_ext(ctx, a, pos, None, 33, 0, 4096)
    with pytest.raises(ShapeError, match="mode 1"):
        ops.rope_ext(ctx, a, pos, None, 32, 1, 4096)
    with pytest.raises(ShapeError, match="frequency factors"):
        ops.rope_ext(ctx, a, pos, _new(ctx, F32, 8), 32, 0, 4096)


# FLASH_ATTN_EXT: result [Dv, n_head, n_q, ne3] (permuted), F32, params (scale, max_bias, softcap)
def test_flash_attn_ext(ctx):
    q = _new(ctx, F32, 64, 7, 8)
    k = _new(ctx, F16, 64, 32, 2)
    v = _new(ctx, F16, 48, 32, 2)
    m = _new(ctx, F16, 32, 7)
    t = ops.flash_attn_ext(ctx, q, k, v, m, 0.125)
    _fresh(t, (48, 8, 7))
    assert t.op == Op.FLASH_ATTN_EXT and t.src == [q, k, v, m] and t.op_params == (0.125, 0.0, 0.0)
    with pytest.raises(ShapeError, match="head sizes"):
        ops.flash_attn_ext(ctx, _new(ctx, F32, 32, 7, 8), k, v, None, 1.0)
    with pytest.raises(ShapeError, match="multiple of n_head_kv"):
        ops.flash_attn_ext(ctx, _new(ctx, F32, 64, 7, 3), k, v, None, 1.0)
    with pytest.raises(ShapeError, match="mask must be"):
        ops.flash_attn_ext(ctx, q, k, v, _new(ctx, F16, 31, 7), 1.0)


# -- copies ----------------------------------------------------------------------------------------
# CPY: a view of b (type and strides of b) with op CPY and src (a, b)
def test_cpy(ctx):
    a = _new(ctx, F32, 8, 4, name="x")
    b = _new(ctx, F16, 32, name="dst")
    t = ops.cpy(ctx, a, b)
    assert t.op == Op.CPY and t.view_src is b and t.type == F16 and t.ne == b.ne and t.src == [a, b]
    assert t.name == "dst (copy of x)"
    assert ops.cpy(ctx, a, _new(ctx, F16, 32)).name == "x (copy)"
    with pytest.raises(ShapeError, match="element counts differ"):
        ops.cpy(ctx, a, _new(ctx, F16, 31))


# CONT: a fresh dense tensor, optionally reshaped; size must match
def test_cont(ctx):
    a = _new(ctx, F32, 8, 4, name="x")
    t = ops.cont(ctx, ops.transpose(ctx, a))
    _fresh(t, (4, 8))
    assert t.op == Op.CONT and t.name == "x (transposed) (cont)"
    _fresh(ops.cont(ctx, a, (2, 16)), (2, 16))
    n = ctx.n_objects
    with pytest.raises(ShapeError, match=r"CONT: new shape \[3, 16\]"):
        ops.cont(ctx, a, (3, 16))
    assert ctx.n_objects == n                                 # nothing created on failure


# CONCAT along each dim adds the extents; other dims must agree
@pytest.mark.parametrize("dim", range(4))
def test_concat(ctx, dim):
    ne_a, ne_b = [2, 3, 4, 5], [2, 3, 4, 5]
    ne_b[dim] = 7
    a, b = _new(ctx, F32, *ne_a), _new(ctx, F32, *ne_b)
    t = ops.concat(ctx, a, b, dim)
    ne = list(ne_a)
    ne[dim] += 7
    _fresh(t, ne)
    assert t.op == Op.CONCAT and t.op_params == (dim,)
    with pytest.raises(ShapeError, match="shapes must agree except in dim"):
        ops.concat(ctx, a, b, (dim + 1) % 4)


# -- views -----------------------------------------------------------------------------------------
# VIEW 1d-4d: given strides, dense beyond; offset in op_params; zero-copy onto the root
def test_views(ctx):
    a = _new(ctx, F32, 8, 6, 4, 2, name="a")            # nb = 4, 32, 192, 768
    v1 = ops.view_1d(ctx, a, 5, 12)
    assert v1.ne == (5, 1, 1, 1) and v1.nb == (4, 20, 20, 20) and v1.op_params == (12,)
    v2 = ops.view_2d(ctx, a, 4, 3, 64, 8)
    assert v2.ne == (4, 3, 1, 1) and v2.nb == (4, 64, 192, 192)
    v3 = ops.view_3d(ctx, a, 8, 2, 3, 96, 384, 0)
    assert v3.ne == (8, 2, 3, 1) and v3.nb == (4, 96, 384, 1152)
    v4 = ops.view_4d(ctx, a, 8, 6, 2, 2, 32, 384, 768, 4 * 0)
    assert v4.ne == (8, 6, 2, 2) and v4.nb == (4, 32, 384, 768)
    for v in (v1, v2, v3, v4):
        assert v.op == Op.VIEW and v.view_src is a and v.src == [a] and v.name == "a (view)"
    # a view of a view: view_src is the root and view_offs add up
    vv = ops.view_1d(ctx, v2, 2, 4)
    assert vv.view_src is a and vv.view_offs == 12 and vv.src == [v2] and vv.op_params == (4,)
    with pytest.raises(ShapeError, match="VIEW: view of extent"):
        ops.view_2d(ctx, a, 8, 2, 4000, 0)
    with pytest.raises(ValueError):
        ops.view_1d(ctx, a, 8, nbytes(a) - 4)


# a 1-d view of a block type keeps the dense row size in nb[1]
def test_view_1d_quantized(ctx):
    a = _new(ctx, Q4_0, 128, 4)
    v = ops.view_1d(ctx, a, 64, 72)
    assert v.nb == (18, 36, 36, 36) and nbytes(v) == 36 and v.view_offs == 72


# RESHAPE: a view with dense strides of the new shape; needs a contiguous input of the same size
def test_reshape(ctx):
    a = _new(ctx, F32, 8, 6, name="a")
    r = ops.reshape(ctx, a, 4, 2, 6)
    assert r.ne == (4, 2, 6, 1) and r.nb == (4, 16, 32, 192) and r.op == Op.RESHAPE
    assert r.view_src is a and r.view_offs == 0 and r.name == "a (reshaped)"
    with pytest.raises(ShapeError, match=r"RESHAPE: new shape \[5, 6\] has a different size"):
        ops.reshape(ctx, a, 5, 6)
    with pytest.raises(ShapeError, match="RESHAPE: only a contiguous tensor"):
        ops.reshape(ctx, ops.transpose(ctx, a), 48)
    with pytest.raises(ShapeError, match="different size"):
        ops.reshape(ctx, a, 100)                      # larger than the source: still a ShapeError


# PERMUTE: source dim i moves to position ax_i (ne and nb), axes in op_params
def test_permute(ctx):
    a = _new(ctx, F32, 2, 3, 4, 5, name="a")          # nb = 4, 8, 24, 96
    p = ops.permute(ctx, a, 0, 2, 1, 3)
    assert p.ne == (2, 4, 3, 5) and p.nb == (4, 24, 8, 96)
    p2 = ops.permute(ctx, a, 1, 2, 3, 0)
    assert p2.ne == (5, 2, 3, 4) and p2.nb == (96, 4, 8, 24)
    assert p2.op == Op.PERMUTE and p2.op_params == (1, 2, 3, 0) and p2.view_src is a
    assert p2.name == "a (permuted)" and nbytes(p2) == nbytes(a)
    with pytest.raises(ShapeError, match="not a permutation"):
        ops.permute(ctx, a, 0, 0, 1, 2)


# TRANSPOSE swaps dims 0 and 1; a permuted view of a view still points at the root
def test_transpose(ctx):
    a = _new(ctx, F32, 3, 5, 2, name="a")
    t = ops.transpose(ctx, a)
    assert t.ne == (5, 3, 2, 1) and t.nb == (12, 4, 60, 120) and t.op == Op.TRANSPOSE
    assert t.view_src is a and t.src == [a]
    v = ops.view_2d(ctx, a, 3, 2, 12, 24)
    tv = ops.transpose(ctx, v)
    assert tv.view_src is a and tv.view_offs == 24 and tv.src == [v]

"""core/tensor.py: strides, nbytes, contiguity, flags, shape helpers."""
import pytest

from ggml_dist.core.context import Context
from ggml_dist.core.tensor import (Tensor, TensorFlag, Op, can_repeat, default_nb, is_contiguous,
                                   is_contiguous_rows, nbytes, view_root)
from ggml_dist.core.types import GGMLType
from ggml_dist.core import ops


def _ctx() -> Context:
    return Context(1 << 20)


# fresh F32 tensors get dense strides, no row padding
def test_default_nb_f32():
    assert default_nb(GGMLType.F32, (5, 3, 2, 7)) == (4, 20, 60, 120)


# block types: nb[0] is the block size in bytes, nb[1] the row of blocks
@pytest.mark.parametrize("type,bs,ts", [(GGMLType.Q4_0, 32, 18), (GGMLType.Q8_0, 32, 34),
                                         (GGMLType.Q4_K, 256, 144), (GGMLType.Q6_K, 256, 210)])
def test_default_nb_blocks(type, bs, ts):
    nb = default_nb(type, (bs * 3, 4, 2, 1))
    assert nb == (ts, 3 * ts, 12 * ts, 24 * ts)
    t = _ctx().new_tensor(type, (bs * 3, 4, 2))
    assert t.nb == nb
    assert nbytes(t) == 24 * ts
    assert is_contiguous(t)


# nbytes of a dense tensor is product(ne) * type size; of an empty tensor 0
def test_nbytes_dense_and_empty():
    ctx = _ctx()
    assert ctx.new_tensor(GGMLType.F16, (6, 5, 4, 3)).nbytes == 6 * 5 * 4 * 3 * 2
    assert ctx.new_tensor(GGMLType.F32, (6, 0, 4)).nbytes == 0


# nbytes of a strided view is its extent, not product(ne) * type size
def test_nbytes_strided_view():
    ctx = _ctx()
    a = ctx.new_tensor(GGMLType.F32, (10, 8))
    v = ops.view_2d(ctx, a, 3, 4, a.nb[1] * 2, 4)          # every other row, 3 of 10 columns
    assert nbytes(v) == 4 + (3 - 1) * 4 + (4 - 1) * 80
    assert not is_contiguous(v)
    assert is_contiguous_rows(v)
    t = ops.transpose(ctx, a)
    assert nbytes(t) == nbytes(a)                           # same extent, other order
    assert not is_contiguous(t) and not is_contiguous_rows(t)


# a strided view of a quantized tensor: ne0 * nb0 / block size plus the row strides
def test_nbytes_strided_quantized_view():
    ctx = _ctx()
    a = ctx.new_tensor(GGMLType.Q4_0, (64, 6))              # rows of 36 B
    v = ops.view_2d(ctx, a, 32, 3, 2 * 36, 36)              # first block of rows 1, 3, 5
    assert nbytes(v) == 32 * 18 // 32 + 2 * 72
    assert not is_contiguous(v)


# dims of size 1 do not affect contiguity, whatever their stride
def test_is_contiguous_ignores_unit_dims():
    t = Tensor(GGMLType.F32, (4, 1, 3, 1), (4, 999, 16, 7))
    assert is_contiguous(t)
    t2 = Tensor(GGMLType.F32, (4, 2, 3, 1), (4, 16, 36, 7))
    assert not is_contiguous(t2)


# n_dims, nelements, nrows
def test_shape_helpers():
    t = _ctx().new_tensor(GGMLType.F32, (4, 3, 1, 1))
    assert (t.n_dims, t.nelements, t.nrows) == (2, 12, 3)
    assert _ctx().new_tensor(GGMLType.F32, (4, 1, 1, 2)).n_dims == 4
    assert _ctx().new_tensor(GGMLType.F32, (1,)).n_dims == 1


# can_repeat: b's shape is a multiple of a's in every dim
def test_can_repeat():
    ctx = _ctx()
    a = ctx.new_tensor(GGMLType.F32, (4, 1, 3))
    b = ctx.new_tensor(GGMLType.F32, (8, 5, 6))
    assert can_repeat(a, b) and not can_repeat(b, a)


# set_output marks the tensor and its view root; set_input only the tensor
def test_set_output_walks_to_root():
    ctx = _ctx()
    a = ctx.new_tensor(GGMLType.F32, (8, 4))
    v = ops.view_1d(ctx, ops.view_2d(ctx, a, 8, 2, 32, 32), 8, 0)
    assert v.view_src is a
    v.set_output()
    assert v.flags & TensorFlag.OUTPUT and a.flags & TensorFlag.OUTPUT
    w = ops.reshape(ctx, a, 32)
    w.set_input()
    assert w.flags & TensorFlag.INPUT and not a.flags & TensorFlag.INPUT


# set_param needs op NONE; view/view_op predicates are kept apart
def test_param_and_view_predicates():
    ctx = _ctx()
    a = ctx.new_tensor(GGMLType.F32, (8, 4)).set_param()
    assert a.flags & TensorFlag.PARAM
    b = ops.add(ctx, a, a)
    with pytest.raises(AssertionError):
        b.set_param()
    c = ops.cpy(ctx, b, ctx.new_tensor(GGMLType.F16, (8, 4)))
    assert c.is_view and not c.is_view_op
    r = ops.reshape(ctx, b, 32)
    assert r.is_view and r.is_view_op and view_root(r) is b
    assert not b.is_view and view_root(b) is b and b.op == Op.ADD


# names are truncated to 63 characters, as ggml's fixed-size name
def test_set_name_truncates():
    t = _ctx().new_tensor(GGMLType.F32, (1,)).set_name("x" * 100)
    assert t.name == "x" * 63

"""core/ops_collective.py: ALL_GATHER's shape, op_params and the parts it refuses."""
import pytest

from ggml_dist.core.context import Context
from ggml_dist.core.ops import ShapeError, permute
from ggml_dist.core.ops_collective import all_gather
from ggml_dist.core.tensor import Op, is_contiguous
from ggml_dist.core.types import GGMLType


@pytest.fixture
def ctx():
    return Context(1 << 20)


# a rank's (n_part, n_tokens) part becomes (sum of the parts, n_tokens): a fresh dense F32 node
def test_shape_and_params(ctx):
    part = ctx.new_tensor(GGMLType.F32, (16, 5)).set_name("part")
    t = all_gather(ctx, part, [16, 16, 16, 16])
    assert t.op == Op.ALL_GATHER and t.src == [part] and t.op_params == (16, 16, 16, 16)
    assert t.ne == (64, 5, 1, 1) and t.type == GGMLType.F32 and t.view_src is None and is_contiguous(t)
    uneven = all_gather(ctx, ctx.new_tensor(GGMLType.F32, (8, 3)), [16, 8])     # the last rank's smaller part
    assert uneven.ne == (24, 3, 1, 1)


# what the kernel cannot exchange is refused at build time, naming the part
def test_refused_parts(ctx):
    with pytest.raises(ShapeError, match=r"ALL_GATHER: the part's ne\[0\] must be one of .*\[8, 8\].*'p'"):
        all_gather(ctx, ctx.new_tensor(GGMLType.F32, (16, 2)).set_name("p"), [8, 8])
    with pytest.raises(ShapeError, match="contiguous F32"):
        all_gather(ctx, ctx.new_tensor(GGMLType.F16, (8, 2)), [8, 8])
    with pytest.raises(ShapeError, match="contiguous F32"):
        all_gather(ctx, permute(ctx, ctx.new_tensor(GGMLType.F32, (8, 2)), 1, 0, 2, 3), [2, 2])
    with pytest.raises(ShapeError, match="matrix"):
        all_gather(ctx, ctx.new_tensor(GGMLType.F32, (8, 2, 3)), [8, 8])

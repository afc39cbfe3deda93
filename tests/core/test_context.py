"""core/context.py: the metadata arena, its budget, and data placement with no_alloc=False."""
import numpy as np
import pytest

from ggml_dist.core import ops
from ggml_dist.core.context import (MEM_ALIGN, OBJECT_SIZE, TENSOR_OVERHEAD, TENSOR_SIZE, Context,
                                    ContextError, graph_overhead, tensor_overhead)
from ggml_dist.core.graph import graph_nbytes
from ggml_dist.core.types import GGMLType


# a no_alloc tensor costs exactly tensor_overhead(); n tensors fit in n * overhead
def test_budget_counts_tensor_overhead():
    ctx = Context(3 * tensor_overhead())
    for _ in range(3):
        ctx.new_tensor(GGMLType.F32, (1024, 1024))     # data is not counted with no_alloc
    assert ctx.mem_used == 3 * TENSOR_OVERHEAD and ctx.n_objects == 3
    with pytest.raises(ContextError):
        ctx.new_tensor(GGMLType.F32, (1,))


# the budget error names the context, the ask, what is free and the budget
def test_budget_error_message():
    ctx = Context(tensor_overhead() + 100, name="meta")
    ctx.new_tensor(GGMLType.F32, (4,))
    with pytest.raises(ContextError) as ei:
        ctx.new_tensor(GGMLType.F32, (4,))
    msg = str(ei.value)
    assert "'meta'" in msg and f"{TENSOR_OVERHEAD} B needed" in msg
    assert f"{ctx.mem_size} B budget" in msg and f"{ctx.mem_size - TENSOR_OVERHEAD} B free" in msg
    assert "larger mem_size" in msg


# llama.cpp's sizing (tensor overhead * n + graph overhead) fits n tensors and one graph exactly
def test_llama_style_sizing():
    n = 10
    ctx = Context(tensor_overhead() * n + graph_overhead(64))
    for _ in range(n):
        ctx.new_tensor(GGMLType.F32, (4,))
    ctx.new_graph(64)
    assert ctx.mem_used == ctx.mem_size
    with pytest.raises(ContextError, match="graph"):
        ctx.new_graph(64)
    assert graph_overhead(64) == OBJECT_SIZE + (graph_nbytes(64) + MEM_ALIGN - 1) // MEM_ALIGN * MEM_ALIGN


# mem_size 0 becomes MEM_ALIGN, and sizes are padded to MEM_ALIGN; reset keeps the memory
def test_mem_size_padding_and_reset():
    assert Context(0).mem_size == MEM_ALIGN
    assert Context(17).mem_size == 32
    ctx = Context(tensor_overhead())
    ctx.new_tensor(GGMLType.F32, (4,))
    ctx.reset()
    assert ctx.mem_used == 0 and ctx.n_objects == 0 and ctx.tensors == []
    ctx.new_tensor(GGMLType.F32, (4,))


# no_alloc=False places each tensor's bytes in the arena, right after its struct
def test_no_alloc_false_places_data_in_arena():
    ctx = Context(1 << 16, no_alloc=False)
    a = ctx.new_tensor(GGMLType.F32, (5, 3))
    b = ctx.new_tensor(GGMLType.F16, (7,))
    assert a.buffer is ctx.memory and b.buffer is ctx.memory
    assert a.data == OBJECT_SIZE + TENSOR_SIZE
    # a's object: header + pad(struct + 60 B); b's data follows b's struct
    assert b.data == a.data + ((TENSOR_SIZE + 60 + 15) // 16 * 16) - TENSOR_SIZE + OBJECT_SIZE + TENSOR_SIZE
    assert ctx.mem_used == 2 * OBJECT_SIZE + (TENSOR_SIZE + 60 + 15) // 16 * 16 + \
        (TENSOR_SIZE + 14 + 15) // 16 * 16
    ctx.memory.base[a.data:a.data + 60].view(np.float32)[...] = np.arange(15, dtype=np.float32)
    assert ctx.memory.base.size == ctx.mem_size and a.data + 60 <= b.data - TENSOR_SIZE
    # a view of an allocated tensor is pre-allocated: data = root.data + view_offs, no buffer yet
    v = ops.view_1d(ctx, a, 5, 20)
    assert v.data == a.data + 20 and v.buffer is None


# data counts against the budget when no_alloc=False
def test_no_alloc_false_budget_includes_data():
    ctx = Context(tensor_overhead() + 64, no_alloc=False)
    ctx.new_tensor(GGMLType.F32, (16,))
    with pytest.raises(ContextError, match=r"needed"):
        Context(tensor_overhead() + 64, no_alloc=False).new_tensor(GGMLType.F32, (17,))


# views of views point at the root with offsets added; a view that overruns its root is refused
def test_view_root_flattening_and_bounds():
    ctx = Context(1 << 16)
    a = ctx.new_tensor(GGMLType.F32, (16,))
    v1 = ctx.new_tensor(GGMLType.F32, (8,), a, 16)
    v2 = ctx.new_tensor(GGMLType.F32, (4,), v1, 8)
    assert v2.view_src is a and v2.view_offs == 24
    with pytest.raises(ValueError, match="does not fit"):
        ctx.new_tensor(GGMLType.F32, (8,), a, 36)


# bad shapes are refused: too many dims, negative, ne0 not a multiple of the block size
def test_new_tensor_shape_errors():
    ctx = Context(1 << 16)
    with pytest.raises(ValueError):
        ctx.new_tensor(GGMLType.F32, (1, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="negative"):
        ctx.new_tensor(GGMLType.F32, (4, -1))
    with pytest.raises(ValueError, match="Q4_0 block size 32"):
        ctx.new_tensor(GGMLType.Q4_0, (48,))


# get_tensor finds by name; view_tensor keeps strides and gets the "(view)" name
def test_get_tensor_and_view_tensor():
    ctx = Context(1 << 16)
    a = ctx.new_tensor(GGMLType.F32, (4, 6)).set_name("a")
    t = ops.transpose(ctx, a)
    v = ctx.view_tensor(t)
    assert v.nb == t.nb and v.ne == t.ne and v.view_src is a and v.name == "a (transposed) (view)"
    assert ctx.get_tensor("a") is a and ctx.get_tensor("zz") is None

"""Tests for alloc/lifetimes.py: lifetimes, the lower bounds and the naive size on small graphs."""
from __future__ import annotations

from ggml_dist.alloc.gallocr import INPLACE_OPS
from ggml_dist.alloc.lifetimes import (STEP_BEFORE, Lifetime, lower_bound_bytes, lower_bound_inplace_bytes,
                                       naive_bytes, tensor_lifetimes)
from ggml_dist.core import ops
from ggml_dist.core.context import Context, HostMemory
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType

F32 = GGMLType.F32
size64 = lambda t: (t.nbytes + 31) // 32 * 32      # noqa: E731


def _g(*roots):
    g = Graph()
    for r in roots:
        g.build_forward_expand(r)
    return g


# E1's chain: two tensors live at every step; OUTPUT lives to the end; inputs from before the first step
def test_chain_lifetimes_and_bounds():
    ctx = Context(1 << 16)
    x = ctx.new_tensor(F32, (10,)).set_input()
    a = ops.cont(ctx, x)
    b = ops.cont(ctx, a)
    c = ops.cont(ctx, b).set_output()
    g = _g(c)
    lts = tensor_lifetimes(g)
    assert lts[x] == Lifetime(STEP_BEFORE, 0) and lts[a] == Lifetime(0, 1) and lts[c] == Lifetime(2, 3)
    assert lower_bound_bytes(g, size64) == 128
    assert naive_bytes(g, size64) == 256


# views keep their root alive; pre-allocated tensors are not counted; in-place credit at handover steps (E3b)
def test_views_prealloc_and_inplace_credit():
    ctx = Context(1 << 16)
    w = ctx.new_tensor(F32, (16,))
    w.buffer, w.data = HostMemory(64), 0
    x = ctx.new_tensor(F32, (16,)).set_input()
    a = ops.cont(ctx, x)
    v = ops.reshape(ctx, a, 16)
    b = ops.scale(ctx, v, 2.0)
    c = ops.add(ctx, b, ops.reshape(ctx, x, 16))
    e = ops.add(ctx, c, w).set_output()
    g = _g(e)
    lts = tensor_lifetimes(g)
    assert w not in lts and v not in lts
    assert lts[a].end == g.nodes.index(b)
    assert lts[x].end == g.nodes.index(c)
    assert lower_bound_bytes(g, size64) == 192
    assert lower_bound_inplace_bytes(g, size64, INPLACE_OPS) == 128

"""Tests for alloc/gallocr.py: worked examples E1-E9 (ggml-mechanisms.md §5.2), plan replay, reserve and
needs_realloc rules, several buffer types, and invariants on random graphs."""
from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings, strategies as st

from ggml_dist.alloc.gallocr import INPLACE_OPS, Gallocr, TensorAlloc
from ggml_dist.alloc.lifetimes import lower_bound_bytes, lower_bound_inplace_bytes, naive_bytes
from ggml_dist.alloc.tallocr import INVALID_ADDR
from ggml_dist.core import ops
from ggml_dist.core.context import Context, HostMemory
from ggml_dist.core.graph import Graph
from ggml_dist.core.ops_collective import all_gather
from ggml_dist.core.tensor import Op, Tensor
from ggml_dist.core.types import GGMLType

from .checkers import check_all, chunk_buffers
from .fakes import FakeBufferType
from .graphgen import random_graph

F32 = GGMLType.F32


def new_ctx() -> Context:
    return Context(1 << 20)


def inp(ctx: Context, n: int, name: str = "x") -> Tensor:
    return ctx.new_tensor(F32, (n,)).set_name(name).set_input()


def sum_rows(ctx: Context, a: Tensor) -> Tensor:
    """Stand-in for ggml_sum_rows (not in core yet): a [1, ...] result from a non-in-place op."""
    t = ctx.new_tensor(F32, (1,) + a.ne[1:])
    t.op, t.src = Op.DUP, [a]
    return t


def graph_of(*roots: Tensor) -> Graph:
    g = Graph()
    for r in roots:
        g.build_forward_expand(r)
    return g


def plan(g: Graph, buft: FakeBufferType | None = None, **kw) -> Gallocr:
    galloc = Gallocr([buft or FakeBufferType(32)], **kw)
    assert galloc.alloc_graph(g)
    check_all(g, galloc)
    return galloc


def offs(*ts: Tensor) -> list[int]:
    return [t.data for t in ts]


# E1: x freed after a and reused by b (best fit), c reuses a's range through the tail (reuse factor 0)
def test_e1_cont_chain():
    ctx = new_ctx()
    x = inp(ctx, 10)
    a = ops.cont(ctx, x)
    b = ops.cont(ctx, a)
    c = ops.cont(ctx, b).set_output()
    galloc = plan(graph_of(c))
    assert offs(x, a, b, c) == [0, 64, 0, 64]
    assert galloc.get_buffer_size(0) == 128


# E2: scale is in place on its dying parent
def test_e2_inplace():
    ctx = new_ctx()
    x = inp(ctx, 10)
    a = ops.cont(ctx, x)
    b = ops.scale(ctx, a, 2.0)
    c = ops.cont(ctx, b).set_output()
    galloc = plan(graph_of(c))
    assert offs(x, a, b, c) == [0, 64, 64, 0]
    assert galloc.get_buffer_size(0) == 128


def _e3(ctx: Context):
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    v = ops.reshape(ctx, a, 16)
    b = ops.scale(ctx, v, 2.0)
    c = ops.cont(ctx, b).set_output()
    return x, a, v, b, c


# ALL_GATHER (tensor parallelism's exchange) is never in place, even on a dying parent of its size: each
# rank reads its part while the gathered parts are written
def test_all_gather_never_in_place():
    ctx = new_ctx()
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    b = all_gather(ctx, a, [16])                # a group of one: the result is exactly a's size
    c = ops.cont(ctx, b).set_output()
    assert Op.ALL_GATHER not in INPLACE_OPS
    plan(graph_of(c))
    assert b.data != a.data and b.view_src is None


# E3 as ggml: no in-place through a view parent (b gets x's freed range)
def test_e3_ggml_no_inplace_through_view():
    ctx = new_ctx()
    x, a, v, b, c = _e3(ctx)
    galloc = plan(graph_of(c), inplace_through_views=False)
    assert offs(x, a, v, b, c) == [0, 64, 64, 0, 64]
    assert galloc.get_buffer_size(0) == 128


# E3 improved: b takes a's range through the reshape (ggml: b=0, a fresh range); same 128 B here
def test_e3_inplace_through_view():
    ctx = new_ctx()
    x, a, v, b, c = _e3(ctx)
    galloc = plan(graph_of(c))
    assert offs(x, a, v, b) == [0, 64, 64, 64]
    assert c.data == 0
    assert galloc.n_inplace_views == 1
    assert galloc.get_buffer_size(0) == 128


# E3b: where the view in-place saves memory: x stays live, so ggml needs 192 B and we need 128 B
def test_e3b_inplace_through_view_saves_a_tensor():
    def build(ctx):
        x = inp(ctx, 16)
        a = ops.cont(ctx, x)
        b = ops.scale(ctx, ops.reshape(ctx, a, 16), 2.0)
        c = ops.add(ctx, b, ops.reshape(ctx, x, 16)).set_output()
        return graph_of(c)
    ggml = plan(build(new_ctx()), inplace_through_views=False)
    ours = plan(build(new_ctx()))
    assert ggml.get_buffer_size(0) == 192
    assert ours.get_buffer_size(0) == 128


# view in-place is refused when the root has another pending reader or the view is not at offset 0
def test_inplace_through_view_conditions():
    ctx = new_ctx()
    x = inp(ctx, 16)
    a = ops.cont(ctx, ops.reshape(ctx, x, 8, 2))
    v1 = ops.view_1d(ctx, a, 8, 32)               # second row: offset 32
    b1 = ops.scale(ctx, v1, 2.0)
    a2 = ops.cont(ctx, x)
    v2 = ops.reshape(ctx, a2, 16)
    b2 = ops.scale(ctx, v2, 2.0)
    d = ops.add(ctx, a2, a2)                      # a2 still read after b2
    g = graph_of(b1.set_output(), b2.set_output(), d.set_output())
    galloc = plan(g)
    assert galloc.n_inplace_views == 0
    assert b1.data != a.data and b2.data != a2.data


# E4: an OUTPUT parent blocks in place and is never freed
def test_e4_output_parent():
    ctx = new_ctx()
    x = inp(ctx, 16)
    a = ops.cont(ctx, x).set_output()
    b = ops.scale(ctx, a, 2.0)
    c = ops.cont(ctx, b).set_output()
    galloc = plan(graph_of(c))
    assert offs(x, a, b, c) == [0, 64, 0, 128]
    assert galloc.get_buffer_size(0) == 192


# E6: a parent read twice by the node is not reused in place
def test_e6_two_uses():
    ctx = new_ctx()
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    b = ops.add(ctx, a, a)
    c = ops.cont(ctx, b).set_output()
    galloc = plan(graph_of(c))
    assert offs(x, a, b, c) == [0, 64, 0, 64]
    assert galloc.get_buffer_size(0) == 128


# E7: a cpy with no consumers pins its destination's root forever
def test_e7_unconsumed_view_pins_root():
    ctx = new_ctx()
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    t = ops.cont(ctx, x)
    cp = ops.cpy(ctx, a, t)
    d = ops.cont(ctx, x)
    e = ops.cont(ctx, d).set_output()
    galloc = plan(graph_of(cp, e))
    assert offs(x, a, t, cp, d, e) == [0, 64, 128, 128, 64, 0]
    assert galloc.get_buffer_size(0) == 192


# E8: max buffer size 256: new chunks, in place on a, and ties between tail blocks keep the earlier chunk
def test_e8_chunks():
    ctx = new_ctx()
    x = inp(ctx, 48)
    a = ops.cont(ctx, x)
    b = ops.cont(ctx, x)
    c = ops.add(ctx, a, b)
    d = ops.cont(ctx, c).set_output()
    galloc = plan(graph_of(d), FakeBufferType(32, max_size=256))
    cb = chunk_buffers(galloc)
    where = [(cb[id(t.buffer)][1], t.data) for t in (x, a, b, c, d)]
    assert where == [(0, 0), (1, 0), (2, 0), (1, 0), (0, 0)]
    assert [ch.size for ch in galloc.buffers[0].chunks] == [192, 192, 192]
    assert galloc.get_buffer_size(0) == 576


# E9: leafs packed first, best-fit holes, in place on the first operand
def test_e9_leafs_and_holes():
    ctx = new_ctx()
    x, p, q, r = (ctx.new_tensor(F32, (n,)).set_name(nm) for n, nm in ((8, "x"), (24, "p"), (8, "q"), (8, "r")))
    w = ops.cont(ctx, x)
    s = sum_rows(ctx, p)
    u = sum_rows(ctx, q)
    z = ops.add(ctx, ops.add(ctx, sum_rows(ctx, w), s), ops.add(ctx, u, sum_rows(ctx, r))).set_output()
    galloc = plan(graph_of(z))
    assert offs(x, p, q, r, w, s, u, z) == [0, 32, 128, 160, 192, 192, 32, 0]
    assert galloc.get_buffer_size(0) == 224


# replay: a second alloc_graph on a same-shape graph only re-binds, to the same addresses (inv. 19)
def test_replay_does_not_plan():
    def build():
        ctx = new_ctx()
        x = inp(ctx, 16)
        a = ops.cont(ctx, x)
        b = ops.scale(ctx, a, 2.0)
        return graph_of(ops.cont(ctx, b).set_output())
    galloc = Gallocr([FakeBufferType(32)])
    g1 = build()
    assert galloc.alloc_graph(g1)
    assert galloc.n_plans == 1
    buf = galloc.buffers[0]
    g2 = build()
    assert not galloc.needs_realloc(g2)
    assert galloc.alloc_graph(g2)
    assert galloc.n_plans == 1 and galloc.buffers[0] is buf
    assert [(t.buffer, t.data) for t in g1.nodes + g1.leafs] == [(t.buffer, t.data) for t in g2.nodes + g2.leafs]
    assert buf.chunks[0].n_resets == 2
    assert galloc.alloc_graph(g2) and galloc.n_plans == 1        # already bound: still valid


# needs_realloc: counts, a grown size, a formerly pre-allocated tensor; smaller sizes do not trigger (inv. 20)
def test_needs_realloc_rules():
    def build(n, prealloc=False):
        ctx = new_ctx()
        x = inp(ctx, n)
        w = ctx.new_tensor(F32, (n,)).set_name("w")
        if prealloc:
            w.buffer, w.data = HostMemory(4 * n), 0
        y = ops.add(ctx, ops.cont(ctx, x), w)
        return graph_of(ops.cont(ctx, y).set_output())
    galloc = Gallocr([FakeBufferType(32)])
    galloc.reserve(build(16))
    assert not galloc.needs_realloc(build(16))
    assert not galloc.needs_realloc(build(8))
    assert galloc.needs_realloc(build(32))
    galloc.reserve(build(16, prealloc=True))
    assert galloc.leaf_allocs[1].leaf == TensorAlloc(-1, INVALID_ADDR, 0)
    assert galloc.needs_realloc(build(16, prealloc=False))
    assert not galloc.needs_realloc(build(16, prealloc=True))
    ctx = new_ctx()
    assert galloc.needs_realloc(graph_of(ops.cont(ctx, inp(ctx, 16))))


# buffers never shrink unless a chunk grows (inv. 21); alloc_graph auto-reserves only with one buffer
def test_buffers_monotone_and_multi_buffer_needs_reserve():
    def build(n):
        ctx = new_ctx()
        return graph_of(ops.cont(ctx, ops.cont(ctx, inp(ctx, n))).set_output())
    galloc = Gallocr([FakeBufferType(32)])
    galloc.reserve(build(64))
    big = galloc.get_buffer_size(0)
    galloc.reserve(build(8))
    assert galloc.get_buffer_size(0) == big and galloc.n_plans == 2
    galloc.reserve(build(128))
    assert galloc.get_buffer_size(0) > big
    two = Gallocr([FakeBufferType(32, name="a"), FakeBufferType(64, name="b")])
    assert not two.alloc_graph(build(8))
    assert two.n_plans == 0


# two buffer types: per-node buffer ids, leafs by leaf ids, in-place children inherit the parent's buffer
def test_two_buffer_types():
    ctx = new_ctx()
    bt0, bt1 = FakeBufferType(32, name="gpu"), FakeBufferType(64, name="cpu")
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    b = ops.scale(ctx, a, 2.0)
    c = ops.cont(ctx, b).set_output()
    g = graph_of(c)
    galloc = Gallocr([bt0, bt1])
    assert galloc.reserve_n(g, [0, 1, 1], [1])
    assert galloc.alloc_graph(g)
    check_all(g, galloc)
    assert x.buffer.buft is bt1 and a.buffer.buft is bt0
    assert b.buffer is a.buffer and b.data == a.data            # in place, in a's buffer
    assert c.buffer.buft is bt1
    assert c.data == x.data == 0                                 # x died after a
    assert galloc.get_buffer_size(0) == 64 and galloc.get_buffer_size(1) == 64


# the same buffer type twice shares one pool; the alias reports size 0
def test_shared_buffer_type():
    ctx = new_ctx()
    bt = FakeBufferType(32)
    x = inp(ctx, 16)
    a = ops.cont(ctx, x)
    c = ops.cont(ctx, a).set_output()
    g = graph_of(c)
    galloc = Gallocr([bt, bt])
    assert galloc.buf_tallocs[0] is galloc.buf_tallocs[1]
    galloc.reserve_n(g, [0, 1], [1])
    assert galloc.alloc_graph(g)
    check_all(g, galloc)
    assert galloc.buffers[0] is galloc.buffers[1]
    assert galloc.get_buffer_size(0) == 128 and galloc.get_buffer_size(1) == 0
    assert offs(x, a, c) == [0, 64, 0]          # a (buffer 0) is placed after x (buffer 1): one pool


# free_extra_space: an in-place child that needs fewer bytes than its parent (padding that depends on more
# than the layout; sizes are taken with the parent's buffer type, as in ggml) frees the parent's tail
def test_free_extra_space():
    ctx = new_ctx()
    padded = FakeBufferType(32, name="padded", extra=lambda t: 64 if t.op in (Op.CONT, Op.NONE) else 0)
    x = inp(ctx, 16)                     # 64 + 64 = 128 B
    a = ops.cont(ctx, x)                 # 128 B
    b = ops.scale(ctx, a, 2.0).set_output()   # 64 B, in place on a
    g = graph_of(b)
    galloc = Gallocr([padded])
    assert galloc.alloc_graph(g)
    assert (x.data, a.data) == (0, 128)
    assert b.data == a.data and b.buffer is a.buffer
    blocks = [(f.offset, f.size) for f in galloc.buf_tallocs[0].chunks[0].free_blocks]
    assert blocks[0] == (0, 128) and blocks[1][0] == 128 + 64     # a's last 64 B went back to the pool


# pre-allocated leafs and views of them are untouched, not planned, and views get the root's buffer
def test_preallocated_untouched():
    ctx = new_ctx()
    wbuf = HostMemory(1024, "weights")
    w = ctx.new_tensor(F32, (16,)).set_name("w")
    w.buffer, w.data = wbuf, 128
    wv = ops.view_1d(ctx, w, 8, 32)
    x = inp(ctx, 8)
    y = ops.add(ctx, x, wv)
    z = ops.scale(ctx, y, 2.0).set_output()
    g = graph_of(z)
    galloc = plan(g)
    assert (w.buffer, w.data) == (wbuf, 128)
    assert (wv.buffer, wv.data) == (wbuf, 160)
    assert z.data == y.data                                   # in place on y, not on the weight view


# a graph whose only nodes are views of a pre-allocated root needs no compute memory
def test_only_views():
    ctx = new_ctx()
    w = ctx.new_tensor(F32, (16,))
    w.buffer, w.data = HostMemory(64), 0
    g = graph_of(ops.reshape(ctx, ops.view_1d(ctx, w, 8, 0), 2, 4))
    galloc = plan(g)
    assert galloc.get_buffer_size(0) == 0


# random DAGs, one buffer type: invariants 9-18, OUTPUTs never overwritten, replay binds the same addresses
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.sampled_from([16, 32, 64]), st.sampled_from([1 << 62, 256, 1024]),
       st.sampled_from([None, True, False]))
def test_random_graphs_one_buffer(seed, alignment, max_size, through_views):
    buft = FakeBufferType(alignment, max_size=max_size)
    gen = random_graph(random.Random(seed), n_ops=rng_ops(seed))
    g = gen.graph
    before = {id(w): (w.buffer, w.data) for w in gen.weights}
    galloc = Gallocr([buft], inplace_through_views=through_views)
    assert galloc.alloc_graph(g)
    check_all(g, galloc)
    assert all((w.buffer, w.data) == before[id(w)] for w in gen.weights)
    planned = galloc.get_buffer_size(0)
    size_of = lambda t: -(-buft.get_alloc_size(t) // alignment) * alignment     # noqa: E731
    prealloc = {id(w) for w in gen.weights}
    owned = lambda t: id(t) not in prealloc and t.view_src is None                # noqa: E731
    if max_size > 1 << 40:
        assert planned <= naive_bytes(g, size_of, owned)
    # the in-place-aware lifetime bound really is a lower bound of every plan
    assert planned >= lower_bound_inplace_bytes(g, size_of, INPLACE_OPS, owned)
    assert lower_bound_bytes(g, size_of, owned) >= lower_bound_inplace_bytes(g, size_of, INPLACE_OPS, owned)
    # replay on a freshly built graph of the same shape: no planning, same addresses
    gen2 = random_graph(random.Random(seed), n_ops=rng_ops(seed))
    assert not galloc.needs_realloc(gen2.graph)
    assert galloc.alloc_graph(gen2.graph)
    assert galloc.n_plans == 1
    ids = {id(b): k for k, b in chunk_ids(galloc).items()}
    key = lambda t: (ids.get(id(t.buffer), "ext"), t.data)                        # noqa: E731
    for t1, t2 in zip(g.nodes + g.leafs, gen2.graph.nodes + gen2.graph.leafs):
        if id(t1) in prealloc or (t1.view_src is not None and id(t1.view_src) in prealloc):
            continue
        assert key(t1) == key(t2), f"{t1.name} rebinds elsewhere"


# random DAGs over two buffer types (and the same type twice): invariants hold for every assignment
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.booleans())
def test_random_graphs_two_buffers(seed, shared):
    rng = random.Random(seed ^ 0x5EED)
    bt0 = FakeBufferType(32, max_size=rng.choice([1 << 62, 512]), name="gpu")
    bt1 = bt0 if shared else FakeBufferType(64, name="cpu", extra=rng.choice([0, 16]))
    gen = random_graph(random.Random(seed), n_ops=rng_ops(seed))
    g = gen.graph
    snap = {id(w): (w.buffer, w.data) for w in gen.weights}
    node_ids = [rng.randrange(2) for _ in g.nodes]
    leaf_ids = [rng.randrange(2) for _ in g.leafs]
    galloc = Gallocr([bt0, bt1])
    assert galloc.reserve_n(g, node_ids, leaf_ids)
    assert galloc.alloc_graph(g)
    check_all(g, galloc)
    for w in gen.weights:
        assert (w.buffer, w.data) == snap[id(w)]
    gen2 = random_graph(random.Random(seed), n_ops=rng_ops(seed))
    assert galloc.alloc_graph(gen2.graph) and galloc.n_plans == 1
    check_all(gen2.graph, galloc)


def rng_ops(seed: int) -> int:
    return 8 + seed % 40


def chunk_ids(galloc: Gallocr) -> dict[tuple[int, int], object]:
    return {(i, c): b for i, vb in enumerate(galloc.buffers) if vb is not None
            for c, b in enumerate(vb.chunks)}


# the default plans with and without view in-place and keeps the smaller: never worse than ggml's rules
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1))
def test_auto_variant_never_worse(seed):
    sizes = {}
    for variant in (None, True, False):
        gen = random_graph(random.Random(seed), n_ops=rng_ops(seed))
        galloc = Gallocr([FakeBufferType(32)], inplace_through_views=variant)
        assert galloc.alloc_graph(gen.graph)
        check_all(gen.graph, galloc)
        sizes[variant] = galloc.get_buffer_size(0)
    assert sizes[None] == min(sizes[True], sizes[False])

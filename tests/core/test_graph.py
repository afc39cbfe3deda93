"""core/graph.py: the graph invariants of ggml-mechanisms.md §5.1 (1-8), limits, deep chains, dumps."""
import pytest

from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph, GraphError, hash_size
from ggml_dist.core.tensor import Op, TensorFlag
from ggml_dist.core.types import GGMLType

F32 = GGMLType.F32


@pytest.fixture
def ctx():
    return Context(1 << 24)


def _check_invariants(g: Graph) -> None:
    """§5.1 invariants 1-4 on a built graph."""
    pos = {t: i for i, t in enumerate(g.nodes)}
    ids = [id(t) for t in g.nodes + g.leafs]
    assert len(ids) == len(set(ids)), "a tensor appears twice in nodes ∪ leafs"
    for i, t in enumerate(g.nodes):
        for s in t.src:
            if s is not None and s in pos:
                assert pos[s] < i, f"{s.name} after its consumer {t.name}"
    for t in g.leafs:
        assert t.op == Op.NONE and not t.flags & TensorFlag.PARAM
    for t in g.nodes:
        assert t.op != Op.NONE or t.flags & TensorFlag.PARAM
    edges: dict = {}
    for t in g.nodes:
        for s in t.src:
            if s is not None:
                edges[s] = edges.get(s, 0) + 1
    for t in g.nodes + g.leafs:
        assert g.use_count(t) == edges.get(t, 0), t.name


def _mlp(ctx):
    x = ctx.new_tensor(F32, (8, 3)).set_name("x")
    w = ctx.new_tensor(F32, (8, 8)).set_name("w")
    h = ops.mul_mat(ctx, w, x)
    n = ops.rms_norm(ctx, h, 1e-5)
    y = ops.add(ctx, n, x)
    return x, w, h, n, y


# a small graph: post-order, leafs are x and w, the last node is the expanded tensor
def test_topological_order_and_classification(ctx):
    x, w, h, n, y = _mlp(ctx)
    g = Graph()
    g.build_forward_expand(y)
    assert g.nodes == [h, n, y] and g.leafs == [w, x]
    assert g.nodes[-1] is y
    assert all(t.flags & TensorFlag.COMPUTE for t in g.nodes)
    assert not any(t.flags & TensorFlag.COMPUTE for t in g.leafs)
    _check_invariants(g)
    assert g.use_count(x) == 2 and g.use_count(h) == 1 and g.use_count(y) == 0


# dedup by identity: expanding the same tensor twice adds nothing
def test_dedup_by_identity(ctx):
    x, w, h, n, y = _mlp(ctx)
    g = Graph()
    g.build_forward_expand(y)
    g.build_forward_expand(y)
    g.build_forward_expand(h)
    assert g.n_nodes == 3 and g.n_leafs == 2 and g.use_count(x) == 2
    _check_invariants(g)


# a node that uses the same src twice adds 2 to its use count
def test_same_src_twice_counts_two(ctx):
    a = ctx.new_tensor(F32, (4,))
    b = ops.mul(ctx, a, a)
    c = ops.add(ctx, b, b)
    g = Graph()
    g.build_forward_expand(c)
    assert g.use_count(a) == 2 and g.use_count(b) == 2
    _check_invariants(g)


# leafs vs nodes: op NONE non-PARAM is a leaf; view ops and write-into views are nodes;
# a PARAM tensor with op NONE is a node; ggml_view_tensor (op NONE) is a leaf
def test_leaf_node_rule(ctx):
    a = ctx.new_tensor(F32, (8, 4)).set_name("a")
    p = ctx.new_tensor(F32, (8, 4)).set_name("p").set_param()
    vt = ctx.view_tensor(a)
    r = ops.reshape(ctx, a, 32)
    v = ops.view_1d(ctx, a, 4, 0)
    tr = ops.transpose(ctx, a)
    pm = ops.permute(ctx, a, 1, 0, 2, 3)
    cp = ops.cpy(ctx, ops.add(ctx, a, p), ctx.new_tensor(GGMLType.F16, (8, 4)))
    g = Graph()
    for t in (vt, r, v, tr, pm, cp):
        g.build_forward_expand(t)
    assert vt in g.leafs and a in g.leafs
    assert p in g.nodes and p.name == "p"
    for t in (r, v, tr, pm, cp):
        assert t in g.nodes
    _check_invariants(g)


# unnamed tensors get leaf_<i> / node_<i> names in order of classification
def test_default_names(ctx):
    a = ctx.new_tensor(F32, (4,))
    b = ctx.new_tensor(F32, (4,))
    c = ops.add(ctx, ops.mul(ctx, a, b), a)
    g = Graph()
    g.build_forward_expand(c)
    assert [t.name for t in g.leafs] == ["leaf_0", "leaf_1"]
    assert [t.name for t in g.nodes] == ["node_0", "node_1"]
    assert g.get_tensor("node_1") is c and g.get_tensor("leaf_1") is b and g.get_tensor("x") is None


# build_forward_order places nodes without COMPUTE; a later expand lifts them
def test_order_then_expand_lifts_compute(ctx):
    x, w, h, n, y = _mlp(ctx)
    g = Graph()
    g.build_forward_order(n)
    assert g.nodes == [h, n]
    assert not h.flags & TensorFlag.COMPUTE and not n.flags & TensorFlag.COMPUTE
    g.build_forward_expand(y)                 # y's src n was visited: re-visit lifts n and h
    assert g.nodes == [h, n, y]
    assert all(t.flags & TensorFlag.COMPUTE for t in (h, n, y))
    assert g.use_count(h) == 1 and g.use_count(n) == 1   # re-visit adds no use counts
    _check_invariants(g)


# build_forward_select: same nodes/leafs whatever idx; only the selected branch is COMPUTE
@pytest.mark.parametrize("idx", [0, 1])
def test_build_forward_select(idx):
    ctx = Context(1 << 20)
    x = ctx.new_tensor(F32, (8,)).set_name("x")
    shared = ops.scale(ctx, x, 2.0).set_name("shared")
    b0 = ops.silu(ctx, shared).set_name("b0")
    b1 = ops.add(ctx, ops.mul(ctx, shared, x).set_name("m"), x).set_name("b1")
    g = Graph()
    assert g.build_forward_select([b0, b1], idx) is (b0, b1)[idx]
    assert [t.name for t in g.nodes] == ["shared", "b0", "m", "b1"]
    assert [t.name for t in g.leafs] == ["x"]
    computed = {t.name for t in g.nodes if t.flags & TensorFlag.COMPUTE}
    assert computed == ({"shared", "b0"} if idx == 0 else {"shared", "m", "b1"})
    _check_invariants(g)
    with pytest.raises(IndexError):
        Graph().build_forward_select([b0], 1)


# the node limit raises GraphError naming the limit
def test_node_limit(ctx):
    a = ctx.new_tensor(F32, (4,))
    t = a
    for _ in range(4):
        t = ops.scale(ctx, t, 1.0)
    g = Graph(3)
    with pytest.raises(GraphError, match="node limit 3"):
        g.build_forward_expand(t)
    leafs = [ctx.new_tensor(F32, (4,)) for _ in range(3)]
    g2 = Graph(2)
    with pytest.raises(GraphError, match="leaf limit 2"):
        g2.build_forward_expand(ops.add(ctx, ops.add(ctx, leafs[0], leafs[1]), leafs[2]))


# a 5000-node chain builds without hitting Python's recursion limit
def test_deep_chain(ctx):
    x = ctx.new_tensor(F32, (4,))
    t = x
    for _ in range(5000):
        t = ops.add(ctx, t, x)
    g = Graph(8192)
    g.build_forward_expand(t)
    assert g.n_nodes == 5000 and g.n_leafs == 1 and g.nodes[-1] is t
    assert g.use_count(x) == 5001                      # the first add uses x twice
    _check_invariants(g)


# a deep chain built with order-only, then lifted by expand, also avoids recursion
def test_deep_chain_lift(ctx):
    x = ctx.new_tensor(F32, (4,))
    t = x
    for _ in range(5000):
        t = ops.scale(ctx, t, 1.0)
    g = Graph(8192)
    g.build_forward_order(t)
    g.build_forward_expand(ops.add(ctx, t, x))
    assert all(n.flags & TensorFlag.COMPUTE for n in g.nodes)


# view(i0, i1) shares use counts; copy keeps nodes, leafs and counts; clear empties
def test_view_copy_clear(ctx):
    x, w, h, n, y = _mlp(ctx)
    g = Graph()
    g.build_forward_expand(y)
    v = g.view(1, 3)
    assert v.nodes == [n, y] and v.leafs == [] and v.use_counts is g.use_counts and v.uid == 0
    c = g.copy()
    assert c.nodes == g.nodes and c.leafs == g.leafs and c.use_count(x) == 2
    with pytest.raises(GraphError):
        g.copy(2)
    g.clear()
    assert g.n_nodes == 0 and g.n_leafs == 0 and x not in g


# hash_size: smallest tabled prime >= n, n | 1 beyond the table
def test_hash_size():
    assert hash_size(1) == 2 and hash_size(4096) == 4099 and hash_size(4099) == 4099
    assert hash_size(2**32) == 2**32 | 1


# dump() lists nodes (shape, op, flags, uses, sources) and leafs
def test_dump(ctx):
    x, w, h, n, y = _mlp(ctx)
    y.set_output()
    g = Graph()
    g.build_forward_expand(y)
    text = g.dump()
    lines = text.splitlines()
    assert lines[0] == "=== GRAPH: 3 nodes, 2 leafs"
    assert "MUL_MAT" in lines[1] and "uses=1" in lines[1] and "<- [w, x]" in lines[1]
    assert "ADD" in lines[3] and " co " in lines[3]
    assert lines[4].startswith(" - leaf   0:") and lines[4].endswith(" w")


# dump_dot() is a digraph with one record per tensor and labelled src edges
def test_dump_dot(ctx):
    x, w, h, n, y = _mlp(ctx)
    y.set_name("y|<out>")
    g = Graph()
    g.build_forward_expand(y)
    dot = g.dump_dot()
    assert dot.startswith("digraph G {") and dot.rstrip().endswith("}")
    assert dot.count("shape=record") == 5 and dot.count("fillcolor=pink") == 2
    assert dot.count("->") == 5                        # h<-w,x; n<-h; y<-n,x
    assert 'label="src 1"' in dot and "y\\|\\<out\\>" in dot

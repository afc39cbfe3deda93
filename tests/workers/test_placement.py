"""Placement on a cluster's nodes: every stage fits its node, one stage per node, the fewest stages, the
best balance; against brute force on small cases, and clear errors when nothing fits."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from ggml_dist.workers.model_sizes import MIB, ModelSizes
from ggml_dist.workers.placement import NodeInfo, PlacementError, place_on_nodes


def _nodes(mems: list[int], cpus: list[float] | None = None) -> list[NodeInfo]:
    return [NodeInfo(f"n{i}", f"10.0.0.{i + 2}", m, (cpus or [1.0] * len(mems))[i]) for i, m in enumerate(mems)]


def _compute(per: int = 0, last_extra: int = 0):
    return lambda k: [per] * (k - 1) + [per + last_extra]


def _brute(m: ModelSizes, nodes: list[NodeInfo], k: int, compute, overhead: int) -> int | None:
    """The smallest largest-stage read bytes over every choice of k nodes, order and split; None if none fits."""
    best = None
    comp = compute(k)
    for order in itertools.permutations(nodes, k):
        for cuts in itertools.combinations(range(1, m.n_layer), k - 1):
            bounds = (0, *cuts, m.n_layer)
            ok, worst = True, 0
            for i in range(k):
                lo, hi = bounds[i], bounds[i + 1]
                need = m.weights(lo, hi, i == 0, i == k - 1) + m.kv_per_layer * (hi - lo) + comp[i] + overhead
                if need > order[i].memory_bytes:
                    ok = False
                    break
                worst = max(worst, m.read_per_token(lo, hi, i == k - 1))
            if ok and (best is None or worst < best):
                best = worst
    return best


def _check(pl, m: ModelSizes, nodes: list[NodeInfo]) -> None:
    mem = {n.node_id: n.memory_bytes for n in nodes}
    assert pl.stages[0].layers[0] == 0 and pl.stages[-1].layers[1] == m.n_layer
    for a, b in zip(pl.stages, pl.stages[1:]):
        assert a.layers[1] == b.layers[0] and a.layers[0] < a.layers[1]
    assert len({s.node_id for s in pl.stages}) == len(pl.stages)          # one stage per node
    for s in pl.stages:
        assert s.total_bytes <= mem[s.node_id] == s.node_memory_bytes


sizes = st.builds(
    lambda per, first, last, kv, tied: ModelSizes(per, first, last, tied, kv),
    st.lists(st.integers(1, 40), min_size=2, max_size=6), st.integers(0, 30), st.integers(0, 30),
    st.integers(0, 3), st.booleans())


# --stages auto: the fewest stages that fit, and among their splits the best balance (brute force)
@settings(max_examples=150, deadline=None)
@given(m=sizes, mems=st.lists(st.integers(10, 120), min_size=1, max_size=4), comp=st.integers(0, 5),
       overhead=st.integers(0, 8))
def test_auto_is_fewest_and_balanced(m, mems, comp, overhead):
    nodes = _nodes(mems)
    want = [(k, _brute(m, nodes, k, _compute(comp), overhead)) for k in range(1, min(len(nodes), m.n_layer) + 1)]
    feasible = [(k, b) for k, b in want if b is not None]
    if not feasible:
        with pytest.raises(PlacementError, match="does not fit"):
            place_on_nodes(m, nodes, None, _compute(comp), overhead)
        return
    pl = place_on_nodes(m, nodes, None, _compute(comp), overhead)
    _check(pl, m, nodes)
    k, bound = feasible[0]
    assert len(pl.stages) == k
    assert max(m.read_per_token(*s.layers, s.stage == k - 1) for s in pl.stages) == bound


# --stages K: K stages on K distinct nodes that can hold them, or a clear error
@settings(max_examples=100, deadline=None)
@given(m=sizes, mems=st.lists(st.integers(10, 120), min_size=1, max_size=4), k=st.integers(1, 4))
def test_fixed_k(m, mems, k):
    nodes = _nodes(mems)
    if k > min(len(nodes), m.n_layer):
        with pytest.raises(PlacementError):
            place_on_nodes(m, nodes, k, _compute(), 0)
        return
    bound = _brute(m, nodes, k, _compute(), 0)
    if bound is None:
        with pytest.raises(PlacementError, match=f"--stages {k}: the model does not fit"):
            place_on_nodes(m, nodes, k, _compute(), 0)
        return
    pl = place_on_nodes(m, nodes, k, _compute(), 0)
    _check(pl, m, nodes)
    assert max(m.read_per_token(*s.layers, s.stage == k - 1) for s in pl.stages) == bound


# a head with no CPUs takes no stage; heterogeneous nodes get ranges that fit each
def test_heterogeneous_and_cpu_less_head():
    m = ModelSizes([10 * MIB] * 12, 4 * MIB, 6 * MIB, False, MIB)
    nodes = [NodeInfo("head", "10.0.0.1", 10**12, 0.0)] + _nodes([100 * MIB, 40 * MIB, 60 * MIB])
    pl = place_on_nodes(m, nodes, None, _compute(2 * MIB), 5 * MIB)
    _check(pl, m, nodes)
    assert "head" not in {s.node_id for s in pl.stages}
    by_node = {s.node_ip: s.layers[1] - s.layers[0] for s in pl.stages}
    assert by_node["10.0.0.2"] > by_node.get("10.0.0.3", 0)       # the 100 MiB node holds the most layers


# nothing fits: one line naming the stage, its need, the largest node and what would fit
def test_no_fit_message():
    m = ModelSizes([50 * MIB] * 8, 10 * MIB, 10 * MIB, False, 0)
    with pytest.raises(PlacementError) as e:
        place_on_nodes(m, _nodes([120 * MIB, 120 * MIB]), None, _compute(), 20 * MIB)
    msg = str(e.value)
    assert "\n" not in msg and "needs" in msg and "largest node has 120.0 MiB" in msg
    assert "needs 8 nodes of >= 80 MiB; the cluster has 2 nodes" in msg
    with pytest.raises(PlacementError, match="no alive node has 2 CPUs"):
        place_on_nodes(m, _nodes([10**12]), None, _compute(), 0, threads=2)


# explicit --layers: the neediest range goes to the largest node
def test_explicit_layers_assigned_by_need():
    m = ModelSizes([10 * MIB] * 6, 0, 0, False, 0)
    pl = place_on_nodes(m, _nodes([30 * MIB, 45 * MIB]), None, _compute(), 0, layers=[(0, 2), (2, 6)])
    assert [(s.layers, s.node_ip) for s in pl.stages] == [((0, 2), "10.0.0.2"), ((2, 6), "10.0.0.3")]
    with pytest.raises(PlacementError, match="largest node left"):
        place_on_nodes(m, _nodes([30 * MIB, 35 * MIB]), None, _compute(), 0, layers=[(0, 2), (2, 6)])

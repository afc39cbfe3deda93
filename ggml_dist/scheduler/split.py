"""Pass 5 of ggml_backend_sched_split_graph and the graph copy the allocator sees (spec §3.3 S5, S8-S11, §3.5).

Functions over a Sched (duck-typed): they cut the assigned node list into splits, create the per-backend,
per-copy tensor copies of each split's inputs, and lay out the graph copy (dependency views, copies, the
split's nodes; pipeline copies before the original leafs).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..backends.base import Backend, GraphPlan
from ..core.graph import Graph
from ..core.tensor import Tensor, TensorFlag
from .assign import buffer_supported, is_weight, tensor_backend_id

log = logging.getLogger(__name__)

GGML_SCHED_MAX_SPLIT_INPUTS = 30


@dataclass(slots=True)
class Split:
    """ggml_backend_sched_split: nodes [i_start, i_end) of the user's graph on one backend."""
    backend_id: int
    i_start: int
    i_end: int = 0
    inputs: list[Tensor] = field(default_factory=list)
    inputs_capacity: int = GGML_SCHED_MAX_SPLIT_INPUTS
    graph: Graph | None = None
    # not in ggml: the backend's plan of `graph` (Backend.graph_plan_create), made at the first compute
    # and replayed after; the split owns it, since its tensors keep their places for the split's life
    # (a graph placed anew is split anew)
    plan: GraphPlan | None = None

    @property
    def n_inputs(self) -> int:
        return len(self.inputs)

    def compute(self, backend: Backend) -> None:
        """Run the split's graph on its backend: through the backend's plan of it where the backend has
        the graph_plan slots (planned at the first compute, replayed after), else graph_compute."""
        assert self.graph is not None
        if backend.graph_plan_create is None or backend.graph_plan_compute is None:
            backend.graph_compute(self.graph)
            return
        if self.plan is None:
            self.plan = backend.graph_plan_create(self.graph)
        backend.graph_plan_compute(self.plan)


def _grow_set(arr: list[int], i: int, v: int) -> None:
    """Write arr[i], growing it with zeros: positions past the last graph keep stale values, as ggml's
    fixed-size id arrays do (alloc_splits compares positionally)."""
    if i >= len(arr):
        arr.extend([0] * (i + 1 - len(arr)))
    arr[i] = v


def tensor_copy_slot(sched, s: Tensor, b: int) -> list[Tensor | None]:
    per_backend = sched.hv_tensor_copies.get(s)
    if per_backend is None:
        per_backend = sched.hv_tensor_copies[s] = [[None] * sched.n_copies for _ in range(sched.n_backends)]
    return per_backend[b]


def dup_tensor_layout(sched, s: Tensor, name: str) -> Tensor:
    """ggml_dup_tensor_layout: same type, ne and nb (a copy of a view keeps the view's strides)."""
    t = sched.ctx.new_tensor(s.type, s.ne)
    t.nb = s.nb
    t.set_name(name)
    return t


def pass5_split(sched, graph: Graph) -> None:
    """Pass 5 (§3.3 S5): cut the node list into splits and create the copies of the inputs."""
    nodes = graph.nodes
    i_first = 0     # the first node that is not a view
    first_backend = -1
    while i_first < len(nodes):
        if not nodes[i_first].is_view_op:
            first_backend = tensor_backend_id(sched, nodes[i_first])
            break
        i_first += 1
    if first_backend == -1:
        # differs from ggml: a graph with only view ops leaves splits[0].backend_id stale there; here
        # it is the last backend (CPU), which has nothing to compute for it anyway
        first_backend = sched.n_backends - 1
    split = Split(first_backend, 0)
    sched.splits = [split]
    cur = first_backend
    for i in range(i_first, len(nodes)):
        node = nodes[i]
        if node.is_view_op:
            continue
        nb = tensor_backend_id(sched, node)
        assert nb != -1, f"node '{node.name}' has no backend after pass 4"
        need_new_split = False
        if nb == cur and split.n_inputs > 0:
            for s in node.src:
                if s is None:
                    continue
                sb = tensor_backend_id(sched, s)
                # (w) a weight on another backend that cur cannot read: a new split lets the memory of
                # earlier offloaded weight copies be reused
                if is_weight(s) and sb != cur and not buffer_supported(sched, s, cur):
                    need_new_split = True
                    break
                # (c) the input list is full and s would need a new copy
                if (split.n_inputs >= split.inputs_capacity and sb != cur
                        and sched.tensor_id_copy(s, cur, 0) is None and not buffer_supported(sched, s, cur)):
                    need_new_split = True
                    break
        if nb != cur or need_new_split:
            split.i_end = i
            split = Split(nb, i)
            sched.splits.append(split)
            cur = nb
        for j, s in enumerate(node.src):
            if s is None:
                continue
            sb = tensor_backend_id(sched, s)
            assert sb != -1, f"source '{s.name}' of '{node.name}' has no backend after pass 4"
            if s.flags & TensorFlag.INPUT and sched.n_copies > 1 and sched.tensor_id_copy(s, sb, 0) is None:
                # (g) graph inputs get n_copies slots on their own backend; slot cur_copy is s itself
                slot = tensor_copy_slot(sched, s, sb)
                bname = sched.backends[sb].name
                for c in range(sched.n_copies):
                    cp = s if c == sched.cur_copy else dup_tensor_layout(sched, s, f"{bname}#{s.name}#{c}")
                    cp.flags |= TensorFlag.INPUT | TensorFlag.OUTPUT   # never freed by the allocator
                    slot[c] = cp
                    sched.causes[cp] = "4.cpy"
                assert len(sched.graph_inputs) < GGML_SCHED_MAX_SPLIT_INPUTS, "too many graph inputs"
                sched.graph_inputs.append(s)
            if sb != cur and not buffer_supported(sched, s, cur):
                # (x) a cross-backend operand: one copy per (tensor, backend), made by the first split
                if sched.tensor_id_copy(s, cur, 0) is None:
                    slot = tensor_copy_slot(sched, s, cur)
                    bname = sched.backends[cur].name
                    for c in range(sched.n_copies):
                        cp = dup_tensor_layout(sched, s, f"{bname}#{s.name}#{c}")
                        if sched.n_copies > 1:
                            cp.flags |= TensorFlag.INPUT | TensorFlag.OUTPUT
                        slot[c] = cp
                        sched.causes[cp] = "4.cpy"
                    if split.n_inputs >= split.inputs_capacity:
                        split.inputs_capacity *= 2
                        log.warning("split #%d: more than %d inputs, growing the list to %d",
                                    len(sched.splits) - 1, split.n_inputs, split.inputs_capacity)
                    split.inputs.append(s)
                node.src[j] = sched.tensor_id_copy(s, cur, sched.cur_copy)   # mutates the user's graph
    split.i_end = len(nodes)


def build_graph_copy(sched, graph: Graph) -> None:
    """S8-S11: the graph copy. Per split, each input gets a dependency view (keeps the source alive up
    to here) and its copy (allocated at the start of the split); then the split's own nodes. Leafs:
    pipeline copies first (n_copies > 1), then the original leafs (§3.3 S9-S10, §3.5)."""
    n_inputs = sum(sp.n_inputs for sp in sched.splits)
    size = max(graph.n_nodes, graph.n_leafs) + 2 * sched.n_copies * (len(sched.graph_inputs) + n_inputs)
    gc = sched.graph
    gc.size = max(gc.size, size)
    gc.nodes, gc.leafs, gc.use_counts = [], [], {}
    nodes, leafs = gc.nodes, gc.leafs
    ids, leaf_ids = sched.node_backend_ids, sched.leaf_backend_ids
    for sp in sched.splits:
        sp.graph = graph.view(sp.i_start, sp.i_end)
        for s in sp.inputs:
            cp = sched.tensor_id_copy(s, sp.backend_id, sched.cur_copy)
            assert cp is not None
            dep = sched.ctx.view_tensor(s)
            dep.src = [s]
            _grow_set(ids, len(nodes), tensor_backend_id(sched, s))
            nodes.append(dep)
            _grow_set(ids, len(nodes), sp.backend_id)
            nodes.append(cp)
        for t in graph.nodes[sp.i_start:sp.i_end]:
            _grow_set(ids, len(nodes), tensor_backend_id(sched, t))
            nodes.append(t)
    if sched.n_copies > 1:
        for s in sched.graph_inputs:
            sb = tensor_backend_id(sched, s)
            for c in range(sched.n_copies):
                _grow_set(leaf_ids, len(leafs), sb)
                leafs.append(sched.tensor_id_copy(s, sb, c))
        for sp in sched.splits:
            for s in sp.inputs:
                for c in range(sched.n_copies):
                    _grow_set(leaf_ids, len(leafs), sp.backend_id)
                    leafs.append(sched.tensor_id_copy(s, sp.backend_id, c))
    for t in graph.leafs:
        _grow_set(leaf_ids, len(leafs), tensor_backend_id(sched, t))
        leafs.append(t)
    uc = gc.use_counts
    for t in nodes:
        uc.setdefault(t, 0)
        for s in t.src:
            if s is not None:
                uc[s] = uc.get(s, 0) + 1
    for t in leafs:
        uc.setdefault(t, 0)

"""Tensor lifetimes over a graph's execution order, and the memory bounds they imply.

Used to judge a plan: `lower_bound_bytes` is what any allocator needs at the busiest step if no two
simultaneously live tensors share bytes; `naive_bytes` is what one allocation per tensor costs. In-place
reuse (a dying operand's bytes taken over by its consumer) can plan below that bound, since at that step
both are counted; `lower_bound_inplace_bytes` credits every such handover the in-place rules could allow,
so it bounds any allocator that reuses in place only on ggml's in-place op set.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..core.graph import Graph
from ..core.tensor import Op, Tensor, TensorFlag

STEP_BEFORE = -1      # leafs and INPUT tensors are written before the first node runs


@dataclass(frozen=True, slots=True)
class Lifetime:
    """Steps (node indices) during which a root tensor's bytes must be kept; both ends inclusive."""
    start: int
    end: int


def _unallocated(t: Tensor) -> bool:
    return t.data is None and t.buffer is None


def tensor_lifetimes(graph: Graph, is_owned: Callable[[Tensor], bool] = _unallocated) -> dict[Tensor, Lifetime]:
    """Lifetimes of the graph's owned root tensors (views count via their root).

    A root lives from its producer (or before the first step, for leafs and INPUT tensors) to the last
    node that reads it or one of its views, or that is itself a view of it (a CPY/SET_ROWS writes into its
    root); to the end of the graph if it is OUTPUT. `is_owned` tells which tensors need planned memory;
    by default the ones that are not bound yet (weights and the KV cache are).
    """
    n = len(graph.nodes)
    start: dict[Tensor, int] = {}
    for leaf in graph.leafs:
        if leaf.view_src is None and is_owned(leaf):
            start[leaf] = STEP_BEFORE
    for i, node in enumerate(graph.nodes):
        if node.view_src is None and is_owned(node):
            start[node] = STEP_BEFORE if node.flags & TensorFlag.INPUT else i
        for s in node.src:
            if s is not None and s.view_src is None and s.flags & TensorFlag.INPUT and is_owned(s):
                start[s] = STEP_BEFORE
    end = dict(start)
    for i, node in enumerate(graph.nodes):
        if node.view_src is not None and node.view_src in end:
            end[node.view_src] = max(end[node.view_src], i)
        for s in node.src:
            if s is None:
                continue
            r = s.view_src if s.view_src is not None else s
            if r in end:
                end[r] = max(end[r], i)
    for r in end:
        if r.flags & TensorFlag.OUTPUT:
            end[r] = n
    return {r: Lifetime(start[r], end[r]) for r in start}


def live_bytes_per_step(lifetimes: dict[Tensor, Lifetime], size_of: Callable[[Tensor], int],
                        n_nodes: int) -> list[int]:
    """Summed sizes of the tensors live at each step; index 0 is STEP_BEFORE, index i+1 is node i."""
    delta = [0] * (n_nodes + 3)
    for t, lt in lifetimes.items():
        size = size_of(t)
        delta[lt.start + 1] += size
        delta[min(lt.end, n_nodes) + 2] -= size
    out, acc = [], 0
    for i in range(n_nodes + 1):
        acc += delta[i]
        out.append(acc)
    return out


def lower_bound_bytes(graph: Graph, size_of: Callable[[Tensor], int],
                      is_owned: Callable[[Tensor], bool] = _unallocated) -> int:
    """Max over steps of the summed (aligned) sizes of live owned tensors."""
    lts = tensor_lifetimes(graph, is_owned)
    steps = live_bytes_per_step(lts, size_of, len(graph.nodes))
    return max(steps, default=0)


def naive_bytes(graph: Graph, size_of: Callable[[Tensor], int],
                is_owned: Callable[[Tensor], bool] = _unallocated) -> int:
    """One allocation per owned tensor, no reuse."""
    return sum(size_of(t) for t in tensor_lifetimes(graph, is_owned))


def lower_bound_inplace_bytes(graph: Graph, size_of: Callable[[Tensor], int], inplace_ops: frozenset[Op],
                              is_owned: Callable[[Tensor], bool] = _unallocated) -> int:
    """Like lower_bound_bytes, but at the step of a node computed by an op in `inplace_ops`, the node may
    take over one operand's root that dies at that step (same layout, at offset 0, not OUTPUT): the
    smaller of the two is counted once."""
    lts = tensor_lifetimes(graph, is_owned)
    steps = live_bytes_per_step(lts, size_of, len(graph.nodes))
    for i, node in enumerate(graph.nodes):
        if node.op not in inplace_ops or node not in lts:
            continue
        best = 0
        for s in node.src:
            if s is None:
                continue
            r = s.view_src if s.view_src is not None else s
            if (r in lts and lts[r].end == i and not r.flags & TensorFlag.OUTPUT and s.view_offs == 0
                    and s.type == node.type and s.ne == node.ne and s.nb == node.nb):
                best = max(best, min(size_of(node), size_of(r)))
        steps[i + 1] -= best
    return max(steps, default=0)

"""struct ggml_cgraph and ggml_visit_parents_graph (ggml-mechanisms.md §1.4–§1.6).

The pointer hash set becomes a dict keyed by tensor identity (§1.5: nothing observable depends on slot
numbers). The post-order visit is iterative, because a deep model's residual chain is deeper than
Python's recursion limit; it performs exactly the recursive visit's steps in the same order.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

from .tensor import Op, Tensor, TensorFlag

DEFAULT_GRAPH_SIZE = 2048
CGRAPH_SIZE = 80           # sizeof(struct ggml_cgraph) on 64-bit targets
_HASH_PRIMES = [2, 3, 5, 11, 17, 37, 67, 131, 257, 521, 1031, 2053, 4099, 8209, 16411, 32771, 65537,
                131101, 262147, 524309, 1048583, 2097169, 4194319, 8388617, 16777259, 33554467,
                67108879, 134217757, 268435459, 536870923, 1073741827, 2147483659]


class GraphError(RuntimeError):
    """A graph that cannot hold what is added to it."""


def hash_size(n: int) -> int:
    """ggml_hash_size: the smallest tabled prime >= n (n | 1 beyond the table)."""
    i = bisect.bisect_left(_HASH_PRIMES, n)
    return _HASH_PRIMES[i] if i < len(_HASH_PRIMES) else n | 1


def graph_nbytes(size: int, grads: bool = False) -> int:
    """ggml_graph_nbytes: struct + nodes + leafs + use_counts + keys (+ grads) + the used bitset."""
    hs = hash_size(2 * size)
    n = CGRAPH_SIZE + 2 * size * 8 + hs * 4 + hs * 8 + ((hs + 31) // 32) * 4
    return n + (2 * hs * 8 if grads else 0)


class Graph:
    """Mirrors ggml_cgraph: nodes in a valid execution order, leafs, use counts."""

    def __init__(self, size: int = DEFAULT_GRAPH_SIZE) -> None:
        if size <= 0:
            raise ValueError(f"graph size must be positive, got {size}")
        self.size = size
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self.use_counts: dict[Tensor, int] = {}    # the visited hash set and use_counts in one
        self.uid = 0

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_leafs(self) -> int:
        return len(self.leafs)

    def __contains__(self, t: Tensor) -> bool:
        return t in self.use_counts

    def use_count(self, t: Tensor) -> int:
        """ggml_node_get_use_count: consumer edges among this graph's nodes."""
        return self.use_counts.get(t, 0)

    # -- building --------------------------------------------------------------------------------
    def build_forward_expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand: add t and everything it needs, marked COMPUTE."""
        self._build(t, compute=True)

    def build_forward_order(self, t: Tensor) -> None:
        """ggml_build_forward_order: place t and its parents, without marking them COMPUTE."""
        self._build(t, compute=False)

    def build_forward_select(self, ts: Sequence[Tensor], idx: int) -> Tensor:
        """ggml_build_forward_select: same topology whichever branch; only ts[idx] is computed."""
        if not 0 <= idx < len(ts):
            raise IndexError(f"select index {idx} out of range for {len(ts)} branches")
        for i, t in enumerate(ts):
            self._build(t, compute=(i == idx))
        return ts[idx]

    def _build(self, t: Tensor, compute: bool) -> None:
        n0 = len(self.nodes)
        self._visit(t, compute)
        if len(self.nodes) > n0:
            assert self.nodes[-1] is t, "the last node added must be the tensor being expanded"

    def _visit(self, root: Tensor, compute: bool) -> None:
        """ggml_visit_parents_graph, iteratively: frames are (tensor, compute, next src index)."""
        stack: list[tuple[Tensor, bool, int]] = [(root, compute, -1)]
        use_counts = self.use_counts
        while stack:
            t, c, i = stack.pop()
            if i < 0:                                   # entering t
                if c and t.op != Op.NONE:
                    t.flags |= TensorFlag.COMPUTE       # set before the visited check (§1.6 step 1)
                if t in use_counts:
                    if c:                               # lift parents added "for ordering only"
                        for s in t.src:
                            if s is not None and not s.flags & TensorFlag.COMPUTE:
                                stack.append((s, True, -1))
                    continue
                use_counts[t] = 0
                i = 0
            else:                                       # back from visiting t.src[i - 1]
                use_counts[t.src[i - 1]] += 1          # type: ignore[index]
            while i < len(t.src) and t.src[i] is None:
                i += 1
            if i < len(t.src):
                stack.append((t, c, i + 1))
                stack.append((t.src[i], c, -1))        # type: ignore[arg-type]
                continue
            self._classify(t)

    def _classify(self, t: Tensor) -> None:
        if t.op == Op.NONE and not t.flags & TensorFlag.PARAM:
            if len(self.leafs) >= self.size:
                raise GraphError(f"graph leaf limit {self.size} reached at '{t.name}'; "
                                 f"create the graph with a larger size")
            if not t.name:
                t.name = f"leaf_{len(self.leafs)}"
            self.leafs.append(t)
        else:
            if len(self.nodes) >= self.size:
                raise GraphError(f"graph node limit {self.size} reached at '{t.name}' ({t.op.name}); "
                                 f"create the graph with a larger size")
            if not t.name:
                t.name = f"node_{len(self.nodes)}"
            self.nodes.append(t)

    # -- whole-graph operations -----------------------------------------------------------------
    def clear(self) -> None:
        """ggml_graph_clear."""
        self.nodes.clear()
        self.leafs.clear()
        self.use_counts.clear()

    def view(self, i0: int, i1: int) -> Graph:
        """ggml_graph_view: nodes i0..i1, no leafs, shared use counts, uid 0.

        differs from ggml: the node list is a copy, not shared storage, so reordering a view does not
        reorder its parent; nothing here reorders views."""
        g = Graph(max(1, i1 - i0))
        g.nodes = self.nodes[i0:i1]
        g.use_counts = self.use_counts
        return g

    def copy(self, size: int | None = None) -> Graph:
        """ggml_graph_cpy into a graph of at least this size."""
        size = self.size if size is None else size
        if size < max(self.n_nodes, self.n_leafs):
            raise GraphError(f"cannot copy a graph of {self.n_nodes} nodes into one of size {size}")
        g = Graph(size)
        g.nodes, g.leafs = list(self.nodes), list(self.leafs)
        g.use_counts = dict(self.use_counts)
        g.uid = self.uid
        return g

    def get_tensor(self, name: str) -> Tensor | None:
        """ggml_graph_get_tensor: search nodes, then leafs, by name."""
        for t in self.nodes + self.leafs:
            if t.name == name:
                return t
        return None

    # -- dumps -----------------------------------------------------------------------------------
    def dump(self) -> str:
        """ggml_graph_print as text: nodes with shape, op, flags and use count, then leafs."""
        lines = [f"=== GRAPH: {self.n_nodes} nodes, {self.n_leafs} leafs"]
        for i, t in enumerate(self.nodes):
            flags = "c" if t.flags & TensorFlag.COMPUTE else "-"
            flags += "o" if t.flags & TensorFlag.OUTPUT else "-"
            srcs = ", ".join(s.name for s in t.src if s is not None)
            lines.append(f" - {i:3d}: {_shape(t):>24} {t.op.name:>14} {flags} "
                         f"uses={self.use_count(t)} {t.name} <- [{srcs}]")
        for i, t in enumerate(self.leafs):
            lines.append(f" - leaf {i:3d}: {_shape(t):>24} {t.type.name:>6} {t.name}")
        return "\n".join(lines)

    def dump_dot(self) -> str:
        """ggml_graph_dump_dot: nodes as records (colour by op kind), leafs as pink boxes, edges src->dst."""
        ids = {t: f"t{i}" for i, t in enumerate(self.nodes + self.leafs)}
        out = ["digraph G {", "  newrank = true;", "  rankdir = TB;"]
        for t in self.nodes:
            color = "yellow" if t.flags & TensorFlag.OUTPUT else (
                "lightgrey" if t.is_view else "white")
            out.append(f'  {ids[t]} [style=filled; fillcolor={color}; shape=record; '
                       f'label="{_esc(t.name)} ({t.type.name})|{_shape(t)}|{t.op.name}"];')
        for t in self.leafs:
            out.append(f'  {ids[t]} [style=filled; fillcolor=pink; shape=record; '
                       f'label="<x>{_esc(t.name)} ({t.type.name})|{_shape(t)}"];')
        for t in self.nodes:
            for j, s in enumerate(t.src):
                if s is not None and s in ids:
                    out.append(f'  {ids[s]} -> {ids[t]} [arrowhead=vee; label="src {j}"];')
        out.append("}")
        return "\n".join(out)


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(n) for n in t.ne) + "]"


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("|", "\\|").replace("{", "\\{") \
        .replace("}", "\\}").replace("<", "\\<").replace(">", "\\>")

"""The graph allocator: lifetime-based planning of compute buffers (ggml-alloc.c, ggml_gallocr).

`reserve` simulates one execution of the graph in node order, placing every owned tensor with a
`DynTallocr` and freeing it after its last consumer; the outcome is recorded per graph position
(`NodeAlloc`, `LeafAlloc`). `alloc_graph` replays that record onto a graph of the same shape: it binds
tensors to (chunk buffer, offset) and does no planning (ggml-mechanisms.md §2.1–§2.9).

Layers, bottom-up: buffer-type protocol and records; virtual buffers; allocate/free of one tensor;
the three planning phases; reserve; replay.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..core.graph import Graph
from ..core.tensor import Op, Tensor, TensorFlag
from .tallocr import INVALID_ADDR, AllocError, BufferAddress, DynTallocr, aligned_size

# ggml_op_can_inplace (§2.4): ops listed here may be computed in place, so their kernels must allow dst
# to alias any src of the same layout. Names absent from core's Op enum are simply not built yet.
_INPLACE_OP_NAMES = ("FILL", "SCALE", "DIAG_MASK_ZERO", "DIAG_MASK_INF", "ADD", "ADD_ID", "ADD1", "SUB",
                     "MUL", "DIV", "SQR", "SQRT", "LOG", "UNARY", "ROPE", "ROPE_BACK", "SILU_BACK",
                     "RMS_NORM", "RMS_NORM_BACK", "SOFT_MAX", "SOFT_MAX_BACK")
INPLACE_OPS = frozenset(Op[n] for n in _INPLACE_OP_NAMES if n in Op.__members__)


def are_same_layout(a: Tensor, b: Tensor) -> bool:
    """ggml_are_same_layout: same type, ne and nb."""
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


# -- buffer types (duck-typed; alloc never imports backends) -------------------------------------------
class BufferLike(Protocol):
    """A chunk buffer: only its size is needed here. A backend buffer also declares reset() and
    init_tensor(t) (backends/base.py's optional slots, no-ops by default); a size-only planning buffer
    (bench/alloc.py's PlanOnlyBuffer) has neither, so VBuffer.reset and _init_tensor look them up."""
    size: int


class BufferTypeLike(Protocol):
    """What the allocator needs from a buffer type (backends/base.py's BufferType satisfies it)."""
    name: str
    alignment: int       # power of two
    max_size: int        # bytes per chunk; one oversize tensor may still get a larger chunk

    def get_alloc_size(self, t: Tensor) -> int: ...
    def alloc_buffer(self, size: int) -> BufferLike: ...


# -- records --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class HashNode:
    """struct hash_node: per-tensor planning state; buffer_id/addr survive the free (the plan needs them)."""
    n_children: int = 0
    n_views: int = 0
    buffer_id: int = 0
    addr: BufferAddress = INVALID_ADDR
    allocated: bool = False


@dataclass(slots=True)
class TensorAlloc:
    """struct tensor_alloc: size_max == 0 means pre-allocated, view, or absent."""
    buffer_id: int = -1
    addr: BufferAddress = INVALID_ADDR
    size_max: int = 0


@dataclass(slots=True)
class NodeAlloc:
    dst: TensorAlloc = field(default_factory=TensorAlloc)
    src: list[TensorAlloc] = field(default_factory=list)


@dataclass(slots=True)
class LeafAlloc:
    leaf: TensorAlloc = field(default_factory=TensorAlloc)


# -- virtual buffers (§2.3) -------------------------------------------------------------------------------
class VBuffer:
    """struct vbuffer: one physical buffer per DynTallocr chunk."""

    def __init__(self, chunks: list[BufferLike]) -> None:
        self.chunks = chunks

    @classmethod
    def alloc(cls, buft: BufferTypeLike, talloc: DynTallocr) -> VBuffer:
        """ggml_vbuffer_alloc: chunk n gets exactly its high-water mark."""
        return cls([buft.alloc_buffer(talloc.max_size(c)) for c in range(talloc.n_chunks)])

    def chunk_size(self, c: int) -> int:
        return self.chunks[c].size if c < len(self.chunks) else 0

    @property
    def size(self) -> int:
        return sum(b.size for b in self.chunks)

    def reset(self) -> None:
        """ggml_vbuffer_reset: let each chunk drop per-tensor extras; memory is kept."""
        for b in self.chunks:
            reset = getattr(b, "reset", None)      # BufferLike: a size-only buffer has no reset
            if reset is not None:
                reset()

    def tensor_alloc(self, t: Tensor, addr: BufferAddress) -> None:
        """ggml_vbuffer_tensor_alloc."""
        buf = self.chunks[addr.chunk]
        t.buffer, t.data = buf, addr.offset
        _init_tensor(buf, t)


def _init_tensor(buf: Any, t: Tensor) -> None:
    init = getattr(buf, "init_tensor", None)       # BufferLike: a size-only buffer has no init_tensor
    if init is not None:
        init(t)


def view_init(t: Tensor) -> None:
    """ggml_backend_view_init: a view lives in its root's buffer at root.data + view_offs."""
    root = t.view_src
    assert root is not None and root.data is not None and root.buffer is not None, \
        f"view '{t.name}' initialised before its root"
    t.buffer, t.data = root.buffer, root.data + t.view_offs
    _init_tensor(t.buffer, t)


# -- the allocator ----------------------------------------------------------------------------------------
class Gallocr:
    """Mirrors ggml_gallocr: plan with `reserve`/`reserve_n`, bind with `alloc_graph`.

    Buffer types that are the same object share one DynTallocr and one VBuffer (§2.1), so two backends on
    host memory draw from one pool. `n_plans` counts reserves; a replay leaves it unchanged.

    `inplace_through_views`: True plans with in-place reuse through view parents, False with ggml's exact
    rules; None (the default) plans both ways and keeps the smaller plan (ties go to the view variant).
    differs from ggml: ggml plans once with its rules, because it has no view in-place to compare with;
    here the view variant saves memory on some graphs (E3b) but can fragment the pool on others (llama
    prefill: +1.4 %), and reserve is rare enough to afford two plans, so the better one is kept.
    """

    def __init__(self, bufts: Sequence[BufferTypeLike], inplace_through_views: bool | None = None) -> None:
        if not bufts:
            raise ValueError("Gallocr needs at least one buffer type")
        self.bufts = list(bufts)
        self.buffers: list[VBuffer | None] = [None] * len(self.bufts)
        self.buf_tallocs: list[DynTallocr] = []
        for i, buft in enumerate(self.bufts):
            shared = next((self.buf_tallocs[j] for j in range(i) if self.bufts[j] is buft), None)
            self.buf_tallocs.append(shared if shared is not None
                                    else DynTallocr(buft.alignment, buft.max_size))
        self.inplace_through_views = inplace_through_views
        self._variants: tuple[bool, ...] = ((True, False) if inplace_through_views is None
                                            else (inplace_through_views,))
        self._views_inplace = self._variants[0]     # the variant being planned
        self.hash_values: dict[Tensor, HashNode] = {}
        self.node_allocs: list[NodeAlloc] = []
        self.leaf_allocs: list[LeafAlloc] = []
        self.n_nodes = 0
        self.n_leafs = 0
        self.n_plans = 0
        self.n_inplace = 0          # in-place reuses in the last plan (ggml's + through views)
        self.n_inplace_views = 0    # of which through a view parent

    @property
    def n_buffers(self) -> int:
        return len(self.bufts)

    # -- per-tensor state ----------------------------------------------------------------------------
    def _hn(self, t: Tensor) -> HashNode:
        hn = self.hash_values.get(t)
        if hn is None:
            hn = self.hash_values[t] = HashNode()
        return hn

    def _is_allocated(self, t: Tensor) -> bool:
        return t.data is not None or t.buffer is not None or self._hn(t).allocated

    def _alloc_size(self, buffer_id: int, t: Tensor) -> int:
        return self.bufts[buffer_id].get_alloc_size(t)

    # -- allocate_node / free_node (§2.4, §2.5) --------------------------------------------------------
    def _allocate_node(self, t: Tensor, buffer_id: int) -> None:
        """Mirrors ggml_gallocr_allocate_node: in-place reuse of a dying parent, else a fresh range."""
        assert buffer_id >= 0, f"'{t.name}' has no buffer id"
        hn = self._hn(t)
        if self._is_allocated(t) or t.view_src is not None:
            return
        hn.allocated = True
        if t.op in INPLACE_OPS:
            for p in t.src:
                if p is None:
                    continue
                p_hn = self._hn(p)
                if not p_hn.allocated:                                      # (b) owned and live
                    if (self._views_inplace and p.view_src is not None
                            and self._inplace_through_view(t, hn, p, p_hn)):
                        return
                    continue
                if p.flags & TensorFlag.OUTPUT or (
                        p.view_src is not None and p.view_src.flags & TensorFlag.OUTPUT):   # (c)
                    continue
                if not are_same_layout(t, p):                               # (d)
                    continue
                if p_hn.n_children == 1 and p_hn.n_views == 0:              # (e) t is p's last consumer
                    # (p is never a view here: views are never `allocated`, §2.4)
                    hn.buffer_id, hn.addr = p_hn.buffer_id, p_hn.addr
                    p_hn.allocated = False                                  # t now owns p's bytes
                    self._free_extra_space(t, p)
                    self.n_inplace += 1
                    return
        hn.buffer_id = buffer_id
        hn.addr = self.buf_tallocs[buffer_id].alloc(self._alloc_size(buffer_id, t))

    def _inplace_through_view(self, t: Tensor, hn: HashNode, p: Tensor, p_hn: HashNode) -> bool:
        """In-place reuse of a dying view parent's root (spec example E3).

        differs from ggml: ggml's view-parent branch is unreachable (a view is never `allocated`, so test
        (b) rejects it first); here it is reachable, because a view at offset 0 of an owned root that has
        no other pending use is exactly as dead as a plain parent, and reusing it saves a whole tensor.
        """
        r = p.view_src
        assert r is not None
        r_hn = self._hn(r)
        if not r_hn.allocated or r.flags & TensorFlag.OUTPUT or p.flags & TensorFlag.OUTPUT:
            return False
        if not are_same_layout(t, p) or p.view_offs != 0:
            return False
        if not (p_hn.n_children == 1 and p_hn.n_views == 0
                and r_hn.n_views == 1 and r_hn.n_children == 0):
            return False
        if self._alloc_size(r_hn.buffer_id, r) < self._alloc_size(r_hn.buffer_id, t):
            return False
        hn.buffer_id, hn.addr = r_hn.buffer_id, r_hn.addr
        r_hn.allocated = False        # when p retires, r is not freed: t owns its bytes
        self._free_extra_space(t, r)
        self.n_inplace += 1
        self.n_inplace_views += 1
        return True

    def _free_extra_space(self, t: Tensor, p: Tensor) -> None:
        """ggml_gallocr_free_extra_space: give back the part of p's range that t does not need."""
        hn, p_hn = self._hn(t), self._hn(p)
        p_size = self._alloc_size(p_hn.buffer_id, p)
        t_size = self._alloc_size(hn.buffer_id, t)
        assert p_size >= t_size, f"in-place '{t.name}' ({t_size} B) is larger than '{p.name}' ({p_size} B)"
        talloc = self.buf_tallocs[p_hn.buffer_id]
        p_size, t_size = aligned_size(p_size, talloc.alignment), aligned_size(t_size, talloc.alignment)
        if p_size > t_size:
            talloc.free_bytes(BufferAddress(p_hn.addr.chunk, p_hn.addr.offset + t_size), p_size - t_size)

    def _free_node(self, t: Tensor) -> None:
        """ggml_gallocr_free_node: outputs keep their range until the next reserve."""
        if t.flags & TensorFlag.OUTPUT:
            return
        hn = self._hn(t)
        self.buf_tallocs[hn.buffer_id].free_bytes(hn.addr, self._alloc_size(hn.buffer_id, t))
        hn.allocated = False

    # -- planning: ggml_gallocr_alloc_graph_impl (§2.6) --------------------------------------------------
    def _alloc_graph_impl(self, graph: Graph, node_buffer_ids: Sequence[int] | None,
                          leaf_buffer_ids: Sequence[int] | None) -> None:
        """Phase 1: leafs; phase 2: counting and explicit inputs; phase 3: simulated execution."""
        self.hash_values = {}
        self.n_inplace = self.n_inplace_views = 0
        nodes, leafs = graph.nodes, graph.leafs
        self._phase1_leafs(leafs, leaf_buffer_ids)
        self._phase2_count(nodes, node_buffer_ids)
        self._phase3_execute(nodes, node_buffer_ids)

    def _phase1_leafs(self, leafs: Sequence[Tensor], leaf_buffer_ids: Sequence[int] | None) -> None:
        for i, leaf in enumerate(leafs):
            self._allocate_node(leaf, leaf_buffer_ids[i] if leaf_buffer_ids is not None else 0)

    def _phase2_count(self, nodes: Sequence[Tensor], node_buffer_ids: Sequence[int] | None) -> None:
        for i, node in enumerate(nodes):
            bid = node_buffer_ids[i] if node_buffer_ids is not None else 0
            if node.view_src is not None and node.op != Op.NONE:   # op NONE views only order things (§3.5)
                self._hn(node.view_src).n_views += 1
            if node.flags & TensorFlag.INPUT:
                self._allocate_node(node, bid)
            for src in node.src:
                if src is None:
                    continue
                self._hn(src).n_children += 1
                if src.flags & TensorFlag.INPUT:
                    self._allocate_node(src, bid)                    # the consumer's buffer id

    def _phase3_execute(self, nodes: Sequence[Tensor], node_buffer_ids: Sequence[int] | None) -> None:
        for i, node in enumerate(nodes):
            bid = node_buffer_ids[i] if node_buffer_ids is not None else 0
            for src in node.src:                       # normally a no-op: leafs and earlier nodes are placed
                if src is not None:
                    self._allocate_node(src, bid)
            self._allocate_node(node, bid)
            for p in node.src:                         # once per occurrence, in slot order
                if p is None:
                    continue
                p_hn = self._hn(p)
                p_hn.n_children -= 1
                if p_hn.n_children == 0 and p_hn.n_views == 0:
                    if p.view_src is not None:
                        r_hn = self._hn(p.view_src)
                        r_hn.n_views -= 1
                        if r_hn.n_views == 0 and r_hn.n_children == 0 and r_hn.allocated:
                            self._free_node(p.view_src)
                    elif p_hn.allocated:
                        self._free_node(p)

    # -- reserve (§2.7) -------------------------------------------------------------------------------
    def _record(self, t: Tensor) -> TensorAlloc:
        if t.view_src is not None or t.data is not None:
            return TensorAlloc()
        hn = self._hn(t)
        return TensorAlloc(hn.buffer_id, hn.addr, self._alloc_size(hn.buffer_id, t))

    def reserve_n(self, graph: Graph, node_buffer_ids: Sequence[int] | None = None,
                  leaf_buffer_ids: Sequence[int] | None = None) -> bool:
        """ggml_gallocr_reserve_n: plan the graph, record the plan, grow the buffers that are too small."""
        self._plan(graph, node_buffer_ids, leaf_buffer_ids)
        return self._realloc_buffers(no_alloc=False)

    def reserve(self, graph: Graph) -> bool:
        """ggml_gallocr_reserve: everything in buffer 0."""
        return self.reserve_n(graph, None, None)

    def _plan(self, graph: Graph, node_buffer_ids: Sequence[int] | None,
              leaf_buffer_ids: Sequence[int] | None) -> None:
        if node_buffer_ids is not None and len(node_buffer_ids) < graph.n_nodes:
            raise ValueError(f"{len(node_buffer_ids)} node buffer ids for {graph.n_nodes} nodes")
        if leaf_buffer_ids is not None and len(leaf_buffer_ids) < graph.n_leafs:
            raise ValueError(f"{len(leaf_buffer_ids)} leaf buffer ids for {graph.n_leafs} leafs")
        distinct = list({id(t): t for t in self.buf_tallocs}.values())
        best: tuple | None = None
        for variant in self._variants:
            self._views_inplace = variant
            for talloc in distinct:
                talloc.reset()
            self._alloc_graph_impl(graph, node_buffer_ids, leaf_buffer_ids)
            total = sum(t.total_max_size() for t in distinct)
            if best is None or total < best[0]:
                node_allocs = [NodeAlloc(self._record(node),
                                         [self._record(s) if s is not None else TensorAlloc() for s in node.src])
                               for node in graph.nodes]
                leaf_allocs = [LeafAlloc(self._record(leaf)) for leaf in graph.leafs]
                chunks = [t.chunks for t in distinct]     # reset() replaces the list, so no copy needed
                best = (total, node_allocs, leaf_allocs, chunks, self.hash_values,
                        self.n_inplace, self.n_inplace_views)
        assert best is not None
        _, self.node_allocs, self.leaf_allocs, chunks, self.hash_values, \
            self.n_inplace, self.n_inplace_views = best
        for talloc, ch in zip(distinct, chunks):
            talloc.chunks = ch
        self.n_plans += 1
        self.n_nodes, self.n_leafs = graph.n_nodes, graph.n_leafs

    def _realloc_buffers(self, no_alloc: bool) -> bool:
        for i in range(self.n_buffers):
            for j in range(i):
                if self.buf_tallocs[j] is self.buf_tallocs[i]:
                    self.buffers[i] = self.buffers[j]
                    break
            talloc, cur = self.buf_tallocs[i], self.buffers[i]
            realloc = cur is None
            for c in range(talloc.n_chunks):
                if talloc.max_size(c) > (cur.chunk_size(c) if cur is not None else 0):
                    realloc = True
            if realloc:
                self.buffers[i] = None
                if not no_alloc:
                    try:
                        self.buffers[i] = VBuffer.alloc(self.bufts[i], talloc)
                    except MemoryError as e:
                        raise AllocError(
                            f"{self.bufts[i].name}: failed to allocate a compute buffer of "
                            f"{talloc.total_max_size()} B in {talloc.n_chunks} chunk(s): {e}") from e
        return True

    def get_buffer_size(self, buffer_id: int) -> int:
        """ggml_gallocr_get_buffer_size: 0 for a buffer that aliases an earlier one."""
        buf = self.buffers[buffer_id]
        if buf is None:
            return 0
        if any(self.buffers[i] is buf for i in range(buffer_id)):
            return 0
        return buf.size

    # -- saved plans (not in ggml) ----------------------------------------------------------------------
    _PLAN_FIELDS = ("node_allocs", "leaf_allocs", "hash_values", "n_nodes", "n_leafs", "n_inplace",
                    "n_inplace_views")

    def save_plan(self) -> dict:
        """The current plan (what alloc_graph replays), for restore_plan. Each reserve makes new
        records, so shallow copies are enough."""
        return {k: getattr(self, k) for k in self._PLAN_FIELDS} | {"buffers": list(self.buffers)}

    def restore_plan(self, plan: dict) -> bool:
        """Make a saved plan current again, if the buffers are still the ones it was planned into
        (a later reserve that grew them makes it stale: False, nothing changed)."""
        if len(plan["buffers"]) != len(self.buffers) or \
                any(a is not b for a, b in zip(plan["buffers"], self.buffers)):
            return False
        for k in self._PLAN_FIELDS:
            setattr(self, k, plan[k])
        return True

    # -- replay (§2.8) --------------------------------------------------------------------------------
    def _tensor_alloc_valid(self, t: Tensor, rec: TensorAlloc) -> bool:
        """ggml_gallocr_node_needs_realloc (which, despite its name, answers 'still valid')."""
        if t.data is not None or t.view_src is not None:
            return True
        if rec.buffer_id < 0:
            return False              # planned as pre-allocated or a view, now needs memory
        return self._alloc_size(rec.buffer_id, t) <= rec.size_max

    def needs_realloc(self, graph: Graph) -> bool:
        """ggml_gallocr_needs_realloc: positional check of counts and sizes (no topology compare)."""
        if self.n_nodes != graph.n_nodes or self.n_leafs != graph.n_leafs:
            return True
        valid = self._tensor_alloc_valid
        for node, na in zip(graph.nodes, self.node_allocs):
            if not valid(node, na.dst):
                return True
            for j, src in enumerate(node.src):
                if src is None:
                    continue
                if j >= len(na.src) or not valid(src, na.src[j]):
                    return True
        return False

    def _init_tensor(self, t: Tensor, rec: TensorAlloc) -> None:
        """ggml_gallocr_init_tensor: bind t to its recorded address (or view-init it)."""
        if t.view_src is not None:
            if t.buffer is None:
                if t.view_src.buffer is None:
                    return                    # root allocated outside any buffer
                view_init(t)
        elif t.data is None:
            vbuf = self.buffers[rec.buffer_id]
            assert vbuf is not None and rec.addr.chunk >= 0, f"'{t.name}' has no planned address"
            vbuf.tensor_alloc(t, rec.addr)

    def alloc_graph(self, graph: Graph) -> bool:
        """ggml_gallocr_alloc_graph: re-plan only when needed (auto only with one buffer), then bind."""
        if self.needs_realloc(graph):
            if self.n_buffers != 1:
                return False
            self.reserve(graph)
        for buf in self.buffers:
            if buf is not None:
                buf.reset()
        init = self._init_tensor
        for leaf, la in zip(graph.leafs, self.leaf_allocs):
            init(leaf, la.leaf)
        for node, na in zip(graph.nodes, self.node_allocs):
            for j, src in enumerate(node.src):
                if src is not None:
                    init(src, na.src[j])
            init(node, na.dst)
        return True

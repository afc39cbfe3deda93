"""Backend assignment: passes 1-4 of ggml_backend_sched_split_graph (ggml-mechanisms.md §3.2, §3.3).

Each pass is one function and records, per tensor, the cause label ggml's SET_CAUSE would record:

  pass 1  _pass1_from_cur        1.dst, 1.vsrc, 1.inp, 1.off, 1.wgt<i>
  pass 2  _pass2_expand          2.sup   (GPU down, GPU up, rest down, rest up)
  pass 3  _pass3_best_upgrade    3.best, 3.upg
  pass 4  _pass4_views_srcs      4.vsrc, 4.cur, 2.sup (last resort)

`assign_backends` runs the four in order; pass 5 (splits and the copies of their inputs) is in
split.py. The functions take the scheduler duck-typed (`SchedLike`): they read backends, bufts,
n_backends and op_offload and write hv_tensor_backend_ids and causes. A missing hash entry reads as -1
(ggml's find_or_insert quirk of §3.2 is harmless here: a dict lookup with .get inserts nothing). A
tensor no backend can place raises SchedAssignError where ggml aborts.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..backends.base import BufferUsage
from ..core.graph import Graph
from ..core.tensor import Op, Tensor, TensorFlag


class SchedAssignError(RuntimeError):
    """A tensor the scheduler cannot place (ggml aborts in these cases)."""


class SchedLike(Protocol):
    backends: list[Any]
    bufts: list[Any]
    n_backends: int
    op_offload: bool
    hv_tensor_backend_ids: dict[Tensor, int]
    causes: dict[Tensor, str]


# -- helper predicates (§3.2) ------------------------------------------------------------------------
def supports_op(sched: SchedLike, b: int, t: Tensor) -> bool:
    return bool(sched.backends[b].device.supports_op(t))


def supports_buft(sched: SchedLike, b: int, buft: Any) -> bool:
    return bool(sched.backends[b].device.supports_buft(buft))


def offload_op(sched: SchedLike, b: int, t: Tensor) -> bool:
    return bool(sched.backends[b].device.offload_op(t))


def tensor_backend_id(sched: SchedLike, t: Tensor | None) -> int:
    """-1 for unassigned, and for a missing view_src (ggml reads a NULL key as -1)."""
    if t is None:
        return -1
    return sched.hv_tensor_backend_ids.get(t, -1)


def set_backend(sched: SchedLike, t: Tensor, b: int, cause: str) -> None:
    sched.hv_tensor_backend_ids[t] = b
    sched.causes[t] = cause


def root_buffer(t: Tensor) -> Any:
    return t.view_src.buffer if t.view_src is not None else t.buffer


def is_weight(t: Tensor) -> bool:
    """The tensor's own buffer (not its root's, as ggml checks src->buffer) holds weights."""
    return t.buffer is not None and t.buffer.usage == BufferUsage.WEIGHTS


def backend_from_buffer(sched: SchedLike, t: Tensor, op: Tensor) -> int:
    """ggml_backend_sched_backend_from_buffer: the lowest backend that can use t's (root's) buffer type
    and run op; -1 if t is unallocated or none can."""
    buf = root_buffer(t)
    if buf is None:
        return -1
    for b in range(sched.n_backends):
        if supports_buft(sched, b, buf.buft) and supports_op(sched, b, op):
            return b
    return -1


def buffer_supported(sched: SchedLike, t: Tensor, b: int) -> bool:
    """ggml_backend_sched_buffer_supported: backend b can use the buffer type t lives (or will live) in."""
    buf = root_buffer(t)
    buft = None
    if buf is not None:
        buft = buf.buft
    else:
        tb = tensor_backend_id(sched, t)
        if tb == -1 and t.view_src is not None:
            tb = tensor_backend_id(sched, t.view_src)
        if tb != -1:
            buft = sched.bufts[tb]
    return buft is not None and supports_buft(sched, b, buft)


def set_if_supported(sched: SchedLike, node: Tensor, b: int) -> None:
    """ggml_backend_sched_set_if_supported: cause 2.sup."""
    if supports_op(sched, b, node):
        set_backend(sched, node, b, "2.sup")


# -- pass 1: facts -----------------------------------------------------------------------------------
_NO_WEIGHT_RULE = frozenset({Op.ROPE, Op.FLASH_ATTN_EXT})


def backend_id_from_cur(sched: SchedLike, t: Tensor) -> tuple[int, str]:
    """ggml_backend_sched_backend_id_from_cur (§3.3 S1): returns (backend, cause); (-1, "") if no fact."""
    b = backend_from_buffer(sched, t, t)
    if b != -1:
        return b, "1.dst"
    if t.view_src is not None:
        b = backend_from_buffer(sched, t.view_src, t)       # dead in practice (§3.3 S1.2)
        if b != -1:
            return b, "1.vsrc"
    buf = root_buffer(t)
    if buf is not None:
        raise SchedAssignError(
            f"pre-allocated tensor '{t.name}' in a buffer ({buf.buft.name}) that no backend can run "
            f"the operation ({t.op.name}) on; give a backend that supports both the op and the buffer")
    if t.flags & TensorFlag.INPUT:
        return sched.n_backends - 1, "1.inp"
    if t.op in _NO_WEIGHT_RULE:
        return -1, ""
    for i, s in enumerate(t.src):
        if s is None or not is_weight(s):
            continue
        w = backend_from_buffer(sched, s, t)
        if sched.op_offload and w == sched.n_backends - 1 and bool(s.buffer.buft.is_host):
            for b in range(w):
                if supports_op(sched, b, t) and offload_op(sched, b, t):
                    return b, "1.off"
        return w, f"1.wgt{i}"                               # may be -1: the scan stops at the first weight
    return -1, ""


def _pass1_from_cur(sched: SchedLike, graph: Graph) -> None:
    """Leafs first, then nodes; user assignments (already != -1) are never overwritten."""
    for t in graph.leafs + graph.nodes:
        if tensor_backend_id(sched, t) == -1:
            b, cause = backend_id_from_cur(sched, t)
            if b != -1:
                set_backend(sched, t, b, cause)
            elif cause:
                sched.causes[t] = cause


# -- pass 2: expansion -------------------------------------------------------------------------------
def _expand(sched: SchedLike, nodes: list[Tensor], skip_cpu: bool) -> None:
    cpu = sched.n_backends - 1
    cur = -1
    for node in nodes:
        if node.is_view_op:
            continue
        nb = tensor_backend_id(sched, node)
        if nb != -1:
            cur = -1 if (skip_cpu and nb == cpu) else nb
        elif cur != -1:
            set_if_supported(sched, node, cur)              # unsupported: stays -1, cur is kept


def _pass2_expand(sched: SchedLike, graph: Graph) -> None:
    """GPU down, GPU up (the last backend never spreads), then rest down, rest up."""
    nodes = graph.nodes
    rev = nodes[::-1]
    _expand(sched, nodes, skip_cpu=True)
    _expand(sched, rev, skip_cpu=True)
    _expand(sched, nodes, skip_cpu=False)
    _expand(sched, rev, skip_cpu=False)


# -- pass 3: best supported inputs, upgrade ----------------------------------------------------------
def _pass3_best_upgrade(sched: SchedLike, graph: Graph) -> None:
    for node in graph.nodes:
        if node.is_view_op:
            continue
        c = tensor_backend_id(sched, node)
        if c == -1:
            n_best = -1
            for b in range(sched.n_backends):
                if not supports_op(sched, b, node):
                    continue
                n = 0
                for s in node.src:
                    if s is None:
                        continue
                    assigned = tensor_backend_id(sched, s) != -1 or tensor_backend_id(sched, s.view_src) != -1
                    if assigned and buffer_supported(sched, s, b):
                        n += 1
                if n > n_best:                               # strictly larger: ties keep the lower index
                    n_best = n
                    set_backend(sched, node, b, "3.best")
        else:
            for b in range(c):
                if sched.bufts[b] is sched.bufts[c] and supports_op(sched, b, node) and all(
                        buffer_supported(sched, s, b) for s in node.src if s is not None):
                    set_backend(sched, node, b, "3.upg")
                    break


# -- pass 4: views, sources, last resort -------------------------------------------------------------
def _pass4_views_srcs(sched: SchedLike, graph: Graph) -> None:
    for node in graph.nodes:
        if node.view_src is not None and tensor_backend_id(sched, node) == -1:
            set_backend(sched, node, tensor_backend_id(sched, node.view_src), "4.vsrc")
        cur = tensor_backend_id(sched, node)
        for s in node.src:
            if s is None or tensor_backend_id(sched, s) != -1:
                continue
            if s.view_src is not None:
                set_backend(sched, s, tensor_backend_id(sched, s.view_src), "4.vsrc")
            else:
                set_backend(sched, s, cur, "4.cur")
        for b in range(sched.n_backends):
            if tensor_backend_id(sched, node) != -1:
                break
            set_if_supported(sched, node, b)
        if tensor_backend_id(sched, node) == -1:
            raise SchedAssignError(
                f"no backend supports node '{node.name}' ({node.op.name}); the last backend (CPU) "
                f"should implement every op")


def assign_backends(sched: SchedLike, graph: Graph) -> None:
    """Passes 1-4 of §3.3, in order. Afterwards every node has a backend (pass 4 asserts it)."""
    _pass1_from_cur(sched, graph)
    _pass2_expand(sched, graph)
    _pass3_best_upgrade(sched, graph)
    _pass4_views_srcs(sched, graph)

"""Shared allocator checkers (ggml-mechanisms.md §5.1 invariants 9-18), independent of Gallocr internals.

They look only at the graph and at what alloc_graph bound: (t.buffer, t.data). "Owned" tensors are the
ones bound into one of the gallocr's chunk buffers.
"""
from __future__ import annotations

from typing import Any

from ggml_dist.alloc.gallocr import INPLACE_OPS, Gallocr
from ggml_dist.alloc.lifetimes import tensor_lifetimes
from ggml_dist.core.tensor import Tensor, TensorFlag


def chunk_buffers(galloc: Gallocr) -> dict[int, tuple[int, int]]:
    """id(chunk buffer) -> (buffer_id of its first owner, chunk index)."""
    out: dict[int, tuple[int, int]] = {}
    for i, vb in enumerate(galloc.buffers):
        if vb is None:
            continue
        for c, b in enumerate(vb.chunks):
            out.setdefault(id(b), (i, c))
    return out


def _all_tensors(graph: Any) -> list[Tensor]:
    seen: dict[int, Tensor] = {}
    for t in list(graph.leafs) + list(graph.nodes):
        seen.setdefault(id(t), t)
        for s in t.src:
            if s is not None:
                seen.setdefault(id(s), s)
    return list(seen.values())


def check_all_allocated(graph: Any) -> None:
    """Every tensor of the graph is bound; views sit at root + view_offs in the root's buffer (inv. 14)."""
    for t in _all_tensors(graph):
        if t.view_src is not None and t.view_src.buffer is None:
            continue                        # root allocated outside any buffer
        assert t.data is not None and t.buffer is not None, f"'{t.name}' was not allocated"
        if t.view_src is not None:
            assert t.buffer is t.view_src.buffer, f"view '{t.name}' is not in its root's buffer"
            assert t.data == t.view_src.data + t.view_offs, f"view '{t.name}' is not at root + view_offs"


def check_alignment(graph: Any, galloc: Gallocr) -> None:
    """Every owned tensor starts at a multiple of its buffer type's alignment (inv. 10)."""
    owners = chunk_buffers(galloc)
    for t in _all_tensors(graph):
        if t.view_src is None and id(t.buffer) in owners:
            bid, _ = owners[id(t.buffer)]
            align = galloc.bufts[bid].alignment
            assert t.data % align == 0, f"'{t.name}' at {t.data} is not {align}-aligned"


def check_max_size(graph: Any, galloc: Gallocr) -> None:
    """Each owned tensor fits its chunk; a chunk exceeds max_size only for one oversize tensor (inv. 18)."""
    owners = chunk_buffers(galloc)
    biggest: dict[int, int] = {}
    for t in _all_tensors(graph):
        if t.view_src is not None or id(t.buffer) not in owners:
            continue
        bid, _ = owners[id(t.buffer)]
        size = galloc.bufts[bid].get_alloc_size(t)
        assert t.data + size <= t.buffer.size, \
            f"'{t.name}' [{t.data}, {t.data + size}) runs past its chunk of {t.buffer.size} B"
        biggest[id(t.buffer)] = max(biggest.get(id(t.buffer), 0), size)
    for i, vb in enumerate(galloc.buffers):
        if vb is None:
            continue
        buft = galloc.bufts[i]
        for c, b in enumerate(vb.chunks[:15]):
            align = buft.alignment
            limit = max(buft.max_size, -(-biggest.get(id(b), 0) // align) * align)
            assert b.size <= limit, f"chunk {c} of buffer {i} is {b.size} B, over the limit {limit} B"


def check_no_overlap(graph: Any, galloc: Gallocr) -> None:
    """No two owned tensors whose lifetimes overlap share a byte (inv. 9, 11, 12, 13).

    Lifetimes are semantic (tensor_lifetimes: producer .. last reader, OUTPUT to the end), not the
    allocator's own bookkeeping. The one allowed touch is in-place reuse: B is produced by an in-place
    capable op at exactly the step where A is last read, and B aliases one of its operands (A or a view
    of A) exactly: same address, same layout.
    """
    owners = chunk_buffers(galloc)
    owned = lambda t: id(t.buffer) in owners                      # noqa: E731
    lts = tensor_lifetimes(graph, owned)
    by_buffer: dict[int, list[tuple[int, int, Tensor]]] = {}
    for t in lts:
        bid, _ = owners[id(t.buffer)]
        size = galloc.bufts[bid].get_alloc_size(t)
        if size > 0:
            by_buffer.setdefault(id(t.buffer), []).append((t.data, t.data + size, t))
    for ranges in by_buffer.values():
        ranges.sort(key=lambda r: r[0])
        for i, (a0, a1, a) in enumerate(ranges):
            for b0, b1, b in ranges[i + 1:]:
                if b0 >= a1:
                    break
                la, lb = lts[a], lts[b]
                if la.end < lb.start or lb.end < la.start:
                    continue
                assert _inplace_handover(graph, a, b, la, lb) or _inplace_handover(graph, b, a, lb, la), (
                    f"'{a.name}' [{a0},{a1}) live {la.start}..{la.end} overlaps "
                    f"'{b.name}' [{b0},{b1}) live {lb.start}..{lb.end}")


def _inplace_handover(graph: Any, a: Tensor, b: Tensor, la: Any, lb: Any) -> bool:
    if la.end != lb.start or lb.start < 0 or graph.nodes[lb.start] is not b or b.op not in INPLACE_OPS:
        return False
    if a.flags & TensorFlag.OUTPUT:
        return False
    # the kernel aliases dst with an operand element for element: same bytes, same layout (inv. 13)
    return any(s is not None and (s is a or s.view_src is a) and s.buffer is b.buffer and s.data == b.data
               and s.type == b.type and s.ne == b.ne and s.nb == b.nb for s in b.src)


def snapshot_bindings(graph: Any) -> dict[int, tuple[Any, int | None]]:
    return {id(t): (t.buffer, t.data) for t in _all_tensors(graph)}


def check_all(graph: Any, galloc: Gallocr) -> None:
    check_all_allocated(graph)
    check_alignment(graph, galloc)
    check_max_size(graph, galloc)
    check_no_overlap(graph, galloc)

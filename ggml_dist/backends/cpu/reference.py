"""The plain reference executor: every tensor in its own array, nodes run in order.

It is the oracle for everything above the kernels: the allocator's and the scheduler's results must
equal what this gives. It binds tensors only for the duration of `compute` and restores their previous
bindings afterwards, so the same graph can then be planned by a real allocator.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ...core.graph import Graph
from ...core.tensor import Tensor, TensorFlag, nbytes
from ..base import tensor_array
from .backend import CPUBufferType, compute_node
from .ops import ComputeOptions

_HOST = CPUBufferType("reference")


class ReferenceExecutor:
    def __init__(self, opts: ComputeOptions = ComputeOptions()) -> None:
        self.opts = opts

    def compute(self, graph: Graph, inputs: Mapping[Tensor, np.ndarray] | None = None
                ) -> dict[Tensor, np.ndarray]:
        """Run the graph; returns a copy of every node's and leaf's value (numpy order, 4-d)."""
        inputs = inputs or {}
        tensors = _all_tensors(graph)
        saved = {t: (t.buffer, t.data) for t in tensors}
        try:
            for t in tensors:                          # roots first: each unallocated one gets an arena
                if t.view_src is None and (t.buffer is None or t.data is None):
                    t.buffer, t.data = _HOST.alloc_buffer(max(nbytes(t), 1)), 0
            for t in tensors:
                if t.view_src is not None:
                    root = t.view_src
                    t.buffer, t.data = root.buffer, root.data + t.view_offs  # type: ignore[operator]
            for t, value in inputs.items():
                t.buffer.set_tensor(t, value)
            missing = [t.name for t in graph.leafs if saved[t][0] is None and t not in inputs
                       and t.view_src is None]
            if missing:
                raise ValueError(f"no value given for unallocated leafs {missing}")
            for t in graph.nodes:
                if t.flags & TensorFlag.COMPUTE and not t.is_view_op and t.op.value != 0:
                    compute_node(t, self.opts)
            return {t: tensor_array(t).copy() for t in tensors}
        finally:
            for t, (buf, data) in saved.items():
                t.buffer, t.data = buf, data


def _all_tensors(graph: Graph) -> list[Tensor]:
    """Leafs, nodes and any view roots outside the graph, each once."""
    seen: dict[Tensor, None] = {}
    for t in graph.leafs + graph.nodes:
        if t.view_src is not None:
            seen.setdefault(t.view_src, None)
        for s in t.src:
            if s is not None:
                seen.setdefault(s, None)
        seen.setdefault(t, None)
    return list(seen)

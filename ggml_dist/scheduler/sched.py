"""The backend scheduler: splits, copies, allocation and compute (ggml-backend.cpp, ggml_backend_sched).

`Sched` runs one graph over an ordered list of backends (priority order, CPU last), ggml-mechanisms.md §3:

  split_graph     passes 1-4 (assign.py), then pass 5 (splits and the copies of their inputs) and the
                  graph copy the allocator sees (split.py, §3.3 S5, §3.5)
  alloc_splits    one Gallocr over the backends' buffer types; buffer id = backend id (§3.4)
  compute_splits  copy each split's inputs (copy.py), compute the split on its backend, record events
                  (§3.6); an eval callback may look at nodes as they are computed, a trace recorder
                  (trace.py) times each split

Lifecycle (§3.7): reset -> [set_tensor_backend] -> alloc_graph -> graph_compute(_async) ... -> reset.
With n_copies > 1 (pipeline parallelism) every split input has one copy per micro-batch slot and
cur_copy rotates on each alloc_graph, so micro-batch m+1's first splits can run while m's later
splits still run on other (asynchronous) backends. Not in ggml: save_plan/restore_plan keep an
allocated graph's assignments, splits and allocator plan (a shape that comes back is not split and
planned again), and a split keeps its backend's graph plan (bound once, replayed). Layers, bottom-up:
constants; the Sched (lifecycle, saved plans, split_graph, alloc_splits, compute_splits, getters, debug).
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..alloc.gallocr import Gallocr
from ..backends.base import DeviceType
from ..core.context import TENSOR_SIZE, Context, graph_overhead
from ..core.graph import Graph
from ..core.tensor import Tensor, TensorFlag
from .assign import SchedAssignError, assign_backends, tensor_backend_id
from .copy import _is_async_capable, cpy_tensor_async, tensor_copy
from .split import GGML_SCHED_MAX_SPLIT_INPUTS, Split, build_graph_copy, pass5_split
from .trace import TraceRecorder

log = logging.getLogger(__name__)

GGML_SCHED_MAX_BACKENDS = 16
GGML_SCHED_MAX_COPIES = 4

EvalCallback = Callable[[Tensor, bool], bool]


def _shallow(v: Any) -> Any:
    """A copy of a dict or list (the scheduler clears and refills those in place); other values as is."""
    return type(v)(v) if isinstance(v, (dict, list)) else v


class SchedError(RuntimeError):
    """The scheduler could not allocate or run a graph."""


# -- the scheduler ---------------------------------------------------------------------------------------
class Sched:
    """Mirrors ggml_backend_sched."""

    def __init__(self, backends: Sequence[Any], bufts: Sequence[Any] | None = None, graph_size: int = 2048,
                 n_copies: int = 1, op_offload: bool = True, parallel: bool = False) -> None:
        """ggml_backend_sched_new. parallel=True means n_copies = GGML_SCHED_MAX_COPIES, as in ggml;
        n_copies may also be given directly (1..4)."""
        n = len(backends)
        if not 0 < n <= GGML_SCHED_MAX_BACKENDS:
            raise ValueError(f"a scheduler takes 1 to {GGML_SCHED_MAX_BACKENDS} backends, got {n}")
        if backends[-1].device.type != DeviceType.CPU:
            raise ValueError(f"the last backend must be a CPU device, got '{backends[-1].name}' "
                             f"({backends[-1].device.type.name}); put the CPU backend last")
        if parallel and n_copies == 1:
            n_copies = GGML_SCHED_MAX_COPIES
        if not 1 <= n_copies <= GGML_SCHED_MAX_COPIES:
            raise ValueError(f"n_copies must be 1..{GGML_SCHED_MAX_COPIES}, got {n_copies}")
        self.backends = list(backends)
        self.n_backends = n
        self.bufts = list(bufts) if bufts is not None else [b.device.get_buffer_type() for b in backends]
        for b, buft in zip(self.backends, self.bufts):
            if not b.device.supports_buft(buft):
                raise ValueError(f"backend '{b.name}' cannot use buffer type '{buft.name}'")
        self.graph_size = graph_size
        self.n_copies = n_copies
        self.op_offload = op_offload
        self.cur_copy = 0
        self.next_copy = 0
        # events exist only with pipeline copies and a backend that has them; otherwise every wait is a
        # full synchronisation (§3.6). events[b][c] is the last recorded event (None: never recorded).
        self.has_events = [n_copies > 1 and _is_async_capable(b) for b in self.backends]
        self.events: list[list[Any]] = [[None] * n_copies for _ in range(n)]
        self._stream_ordered = [_is_async_capable(b) for b in self.backends]
        self.galloc = Gallocr(self.bufts)
        self.ctx = Context(graph_size * GGML_SCHED_MAX_SPLIT_INPUTS * 2 * TENSOR_SIZE
                           + graph_overhead(graph_size), no_alloc=True, name="sched")
        self.hv_tensor_backend_ids: dict[Tensor, int] = {}
        self.hv_tensor_copies: dict[Tensor, list[list[Tensor | None]]] = {}
        self.causes: dict[Tensor, str] = {}
        self.node_backend_ids: list[int] = []
        self.leaf_backend_ids: list[int] = []
        self.prev_node_backend_ids: list[int] = []
        self.prev_leaf_backend_ids: list[int] = []
        self.graph = Graph(graph_size)               # the graph copy the allocator sees
        self.splits: list[Split] = []
        self.graph_inputs: list[Tensor] = []
        self.callback_eval: EvalCallback | None = None
        self.trace: TraceRecorder | None = None
        self.is_reset = False
        self.is_alloc = False
        self.backend_ids_changed = False             # what the last alloc_splits found (§5.3 S-0)
        self._user_graph: Graph | None = None
        self.debug = int(os.environ.get("GGML_SCHED_DEBUG", "0") or 0)
        self.debug_realloc = int(os.environ.get("GGML_SCHED_DEBUG_REALLOC", "0") or 0)
        self.reset()

    # -- lifecycle (§3.7) -------------------------------------------------------------------------------
    def reset(self) -> None:
        """ggml_backend_sched_reset: forget every assignment and copy. Tensors the scheduler allocated
        now dangle; build the next graph from fresh tensors."""
        if not self.is_reset:
            self.hv_tensor_backend_ids.clear()
            self.hv_tensor_copies.clear()
            self.causes.clear()
            self.is_reset = True
        self.is_alloc = False

    def set_tensor_backend(self, t: Tensor, backend: Any) -> None:
        """ggml_backend_sched_set_tensor_backend: a user assignment, never overwritten (cause usr)."""
        b = self.get_backend_id(backend)
        assert 0 <= b < self.n_backends, f"backend {backend} is not one of this scheduler's"
        self.hv_tensor_backend_ids[t] = b
        self.causes[t] = "usr"
        self.is_reset = False

    def reserve(self, graph: Graph) -> None:
        """ggml_backend_sched_reserve: size the buffers for a worst-case graph; leaves the scheduler
        reset. No reset first, so user assignments made while building the graph are honoured."""
        self.synchronize()
        self.split_graph(graph)
        self.galloc.reserve_n(self.graph, self._node_ids(), self._leaf_ids())
        self.reset()

    def alloc_graph(self, graph: Graph) -> bool:
        """ggml_backend_sched_alloc_graph: rotate the copy slot, split, allocate."""
        assert not self.is_alloc, "alloc_graph on an allocated scheduler; call reset first"
        self.cur_copy = self.next_copy
        self.next_copy = (self.next_copy + 1) % self.n_copies
        self.split_graph(graph)
        if not self.alloc_splits():
            return False
        self.is_alloc = True
        return True

    # -- saved plans (not in ggml: llama.cpp rebuilds, splits and re-plans a graph whose shape comes
    # back, which costs ~0.1 ms in C but tens of ms here) ---------------------------------------------
    _PLAN_FIELDS = ("hv_tensor_backend_ids", "hv_tensor_copies", "causes", "node_backend_ids",
                    "leaf_backend_ids", "prev_node_backend_ids", "prev_leaf_backend_ids", "splits",
                    "graph_inputs", "_user_graph", "backend_ids_changed")

    def save_plan(self) -> dict:
        """The allocated state of the current graph: assignments, splits, the graph copy and the
        allocator's plan, for restore_plan."""
        assert self.is_alloc, "save_plan needs an allocated scheduler"
        gc = self.graph                         # one Graph object, refilled by every split_graph
        return {"sched": {k: _shallow(getattr(self, k)) for k in self._PLAN_FIELDS},
                "graph_copy": (list(gc.nodes), list(gc.leafs), dict(gc.use_counts), gc.size),
                "galloc": self.galloc.save_plan()}

    def restore_plan(self, plan: dict) -> bool:
        """alloc_graph for a graph allocated before, without splitting and planning it again: its
        tensors still hold their addresses, the allocator's plan is made current and replayed (binding
        every tensor as alloc_graph would). False, with the scheduler reset, when the allocator's
        buffers were reallocated since: then call alloc_graph."""
        assert not self.is_alloc, "restore_plan on an allocated scheduler; call reset first"
        if not self.galloc.restore_plan(plan["galloc"]):
            return False
        for k, v in plan["sched"].items():
            setattr(self, k, _shallow(v))
        nodes, leafs, use_counts, size = plan["graph_copy"]
        gc = self.graph
        gc.nodes, gc.leafs, gc.use_counts = list(nodes), list(leafs), dict(use_counts)
        gc.size = max(gc.size, size)
        self.is_reset = False
        self.cur_copy = self.next_copy
        self.next_copy = (self.next_copy + 1) % self.n_copies
        if self.galloc.needs_realloc(self.graph) or not self.galloc.alloc_graph(self.graph):
            self.reset()
            return False
        self.is_alloc = True
        return True

    def graph_compute_async(self, graph: Graph) -> None:
        """ggml_backend_sched_graph_compute_async. On an allocated scheduler `graph` is ignored and the
        stored splits run again with the same cur_copy (llama.cpp's graph reuse relies on this).

        With asynchronous backends and n_copies == 1, inputs share compute memory with the previous
        graph's tensors: call synchronize() before writing the next graph's inputs. With n_copies > 1
        every input has its own slot per copy, which is what lets micro-batches overlap."""
        if not self.is_reset and not self.is_alloc:
            self.reset()
        if not self.is_alloc and not self.alloc_graph(graph):
            raise SchedError(f"failed to allocate the graph ({graph.n_nodes} nodes) over "
                             f"{[b.name for b in self.backends]}")
        self.compute_splits()

    def graph_compute(self, graph: Graph) -> None:
        self.graph_compute_async(graph)
        self.synchronize()

    def synchronize(self) -> None:
        """ggml_backend_sched_synchronize. When not allocated, the next alloc_graph uses copy 0."""
        for b in self.backends:
            b.synchronize()
        if not self.is_alloc:
            self.next_copy = 0

    # -- split_graph (§3.3) -------------------------------------------------------------------------------
    def split_graph(self, graph: Graph) -> None:
        """ggml_backend_sched_split_graph: S0 prologue, passes 1-4 (assign.py), S5 splits and copies,
        S6 debug print, S7 swap of the id arrays, S8-S10 the graph copy."""
        self.splits = []
        self.graph_inputs = []
        self.is_reset = False
        self.ctx.reset()
        self._user_graph = graph
        assign_backends(self, graph)
        self._pass5_split(graph)
        if self.debug:
            print(self.debug_str(self.debug), file=sys.stderr)
        self.node_backend_ids, self.prev_node_backend_ids = self.prev_node_backend_ids, self.node_backend_ids
        self.leaf_backend_ids, self.prev_leaf_backend_ids = self.prev_leaf_backend_ids, self.leaf_backend_ids
        self._build_graph_copy(graph)

    def tensor_id_copy(self, s: Tensor, b: int, c: int) -> Tensor | None:
        per_backend = self.hv_tensor_copies.get(s)
        return per_backend[b][c] if per_backend is not None else None

    def _pass5_split(self, graph: Graph) -> None:
        """Pass 5 (§3.3 S5): cut the node list into splits and create the copies of the inputs."""
        pass5_split(self, graph)

    def _build_graph_copy(self, graph: Graph) -> None:
        """S8-S11: the graph copy (split.py)."""
        build_graph_copy(self, graph)

    def _node_ids(self) -> list[int]:
        return self.node_backend_ids[: self.graph.n_nodes]

    def _leaf_ids(self) -> list[int]:
        # differs from ggml: a leaf nobody consumes stays unassigned (-1), which ggml would use as an
        # array index; it is placed in the last (CPU) backend's buffer instead
        cpu = self.n_backends - 1
        return [b if b != -1 else cpu for b in self.leaf_backend_ids[: self.graph.n_leafs]]

    # -- alloc_splits (§3.4) ------------------------------------------------------------------------------
    def _ids_changed(self, cur: list[int], prev: list[int], n: int) -> bool:
        bufts = self.bufts
        for i in range(n):
            a = cur[i]
            p = prev[i] if i < len(prev) else 0
            if a != p and (a == -1 or p == -1 or bufts[a] is not bufts[p]):
                return True
        return False

    def alloc_splits(self) -> bool:
        """ggml_backend_sched_alloc_splits: replay the plan, or re-plan when the backends' buffer types at
        some position changed or the plan no longer fits."""
        changed = (self._ids_changed(self.node_backend_ids, self.prev_node_backend_ids, self.graph.n_nodes)
                   or self._ids_changed(self.leaf_backend_ids, self.prev_leaf_backend_ids, self.graph.n_leafs))
        self.backend_ids_changed = changed
        if changed or not self.galloc.alloc_graph(self.graph):
            if self.debug_realloc and not changed and self.galloc.n_nodes == self.graph.n_nodes \
                    and self.galloc.n_leafs == self.graph.n_leafs:
                raise SchedError("unexpected graph reallocation (GGML_SCHED_DEBUG_REALLOC): same graph "
                                 "size and backend ids, but the plan no longer fits")
            for b in self.backends:                  # not self.synchronize(): that would reset next_copy
                b.synchronize()
            self.galloc.reserve_n(self.graph, self._node_ids(), self._leaf_ids())
            if not self.galloc.alloc_graph(self.graph):
                log.error("failed to allocate graph")
                return False
        return True

    # -- compute_splits (§3.6) ----------------------------------------------------------------------------
    def _event_synchronize(self, b: int) -> None:
        """Host wait for backend b's event of the current copy, or for the whole backend."""
        if self.has_events[b]:
            ev = self.events[b][self.cur_copy]
            if ev is not None:
                ev.wait()
        else:
            self.backends[b].synchronize()

    def compute_splits(self) -> None:
        """ggml_backend_sched_compute_splits: per split, wait as ggml does, copy the inputs, compute."""
        backends, cc = self.backends, self.cur_copy
        by_value = [b.inputs_by_value for b in backends]
        trace = self.trace
        prev = -1
        for split_id, sp in enumerate(self.splits):
            B = sp.backend_id
            backend = backends[B]
            if prev >= 0 and prev != B and self._stream_ordered[prev] and self._stream_ordered[B]:
                # differs from ggml: B's stream waits for the previous split (no host block). ggml orders
                # a split only through its input copies, or, without inputs, by the host wait below
                # (upstream #26040). That misses a split that reads the previous backend's tensors
                # directly (a shared buffer type, so no copy), harmless where such backends are
                # synchronous (BLAS + CPU) but a race between asynchronous ones.
                backend.event_wait(backends[prev].event_record())
            elif sp.n_inputs == 0 and prev >= 0 and prev != B:
                # the allocator may reuse memory across splits (upstream #26040)
                if self.has_events[prev]:
                    ev = self.events[prev][cc]
                    if ev is not None:
                        ev.wait()
                else:
                    backends[prev].synchronize()
            for s in sp.inputs:
                dst = self.tensor_id_copy(s, B, cc)
                assert dst is not None
                src_backend = backends[tensor_backend_id(self, s)]
                if s.flags & TensorFlag.INPUT:
                    # user data: copy now, the user may overwrite s right after this call.
                    # differs from ggml: a backend that snapshots what it is given (a stage proxy sends
                    # the bytes with its next call) has no copy slot still being read: no wait; and it
                    # may take the input from another call's result instead (Buffer.feed: the token
                    # the last stage sampled, handed to the first without the driver)
                    if not by_value[B]:
                        self._event_synchronize(B)
                    elif backend.cpy_tensor_async is not None and backend.cpy_tensor_async(src_backend, s, dst):
                        continue
                    tensor_copy(s, dst)
                else:
                    ev = self.events[B][cc] if self.has_events[B] else None
                    if ev is not None:
                        backend.event_wait(ev)
                    elif not self.has_events[B]:
                        backend.synchronize()
                    if not cpy_tensor_async(src_backend, backend, s, dst, ev):
                        src_backend.synchronize()
                        self._event_synchronize(B)
                        tensor_copy(s, dst)
            assert sp.graph is not None
            label = f"split #{split_id}"
            if trace is not None:
                backend.submit(lambda n=backend.name, lb=label: trace.begin(n, lb))
            if self.callback_eval is None:
                sp.compute(backend)
            else:
                self._compute_with_callback(backend, sp.graph)
            if trace is not None:
                backend.submit(lambda n=backend.name, lb=label: trace.end(n, lb))
            if self.has_events[B]:
                self.events[B][cc] = backend.event_record()
            prev = B

    def _compute_with_callback(self, backend: Any, g: Graph) -> None:
        """Compute up to each node the callback asks for, synchronise, show it; a False answer stops the
        rest of *this split* only (later splits still run, §3.6)."""
        cb = self.callback_eval
        assert cb is not None
        nodes = g.nodes
        j0 = 0
        while j0 < len(nodes):
            j1 = j0
            need = cb(nodes[j0], True)
            while not need and j1 < len(nodes) - 1:
                j1 += 1
                need = cb(nodes[j1], True)
            backend.graph_compute(g.view(j0, j1 + 1))
            backend.synchronize()
            if need and not cb(nodes[j1], False):
                break
            j0 = j1 + 1

    # -- getters, callbacks ------------------------------------------------------------------------------
    def set_eval_callback(self, cb: EvalCallback | None) -> None:
        """ggml_backend_sched_set_eval_callback: cb(t, ask=True) -> wanted?; cb(t, ask=False) -> go on?"""
        self.callback_eval = cb

    def set_trace(self, trace: TraceRecorder | None) -> None:
        self.trace = trace

    def get_backend_id(self, backend: Any) -> int:
        for i, b in enumerate(self.backends):
            if b is backend:
                return i
        return -1

    def get_n_backends(self) -> int:
        return self.n_backends

    def get_backend(self, i: int) -> Any:
        return self.backends[i]

    def get_n_splits(self) -> int:
        return len(self.splits)

    def get_n_copies(self) -> int:
        return self.n_copies

    def get_tensor_backend(self, t: Tensor) -> Any:
        b = tensor_backend_id(self, t)
        return self.backends[b] if b != -1 else None

    def get_cause(self, t: Tensor) -> str:
        return self.causes.get(t, "")

    def get_buffer_size(self, backend: Any) -> int:
        """Bytes of this backend's compute buffer; 0 where it aliases an earlier backend's."""
        b = self.get_backend_id(backend)
        assert b != -1, f"backend {backend} is not one of this scheduler's"
        return self.galloc.get_buffer_size(b)

    # -- debug (§3.3 S6) ----------------------------------------------------------------------------------
    def debug_str(self, level: int = 2) -> str:
        """ggml_backend_sched_print_assignments: split headers with their inputs; with level >= 2 every
        non-view node with backend, cause, use count, compute flag and sources."""
        g = self._user_graph
        if g is None:
            return ""
        lines: list[str] = []
        i_split = 0
        for i, node in enumerate(g.nodes):
            if i_split < len(self.splits) and i == self.splits[i_split].i_start:
                sp = self.splits[i_split]
                ins = " ".join(f"[{s.name} ({s.nbytes} B)]" for s in sp.inputs)
                lines.append(f"## SPLIT #{i_split}: {self.backends[sp.backend_id].name} # "
                             f"{sp.n_inputs} inputs" + (f": {ins}" if ins else ""))
                i_split += 1
            if node.is_view_op or level < 2:
                continue
            srcs = "".join(f" {s.name} [{self._bname(s)} {self.get_cause(s)}]" for s in node.src
                           if s is not None)
            lines.append(f"node #{i:3d} ({node.op.name:>10.10}): {node.name} ({node.nbytes} B) "
                         f"[{self._bname(node)} {self.get_cause(node)}] use={g.use_count(node)},"
                         f"c={1 if node.flags & TensorFlag.COMPUTE else 0}:{srcs}")
        return "\n".join(lines)

    def _bname(self, t: Tensor) -> str:
        b = self.get_tensor_backend(t)
        return b.name if b is not None else "NULL"


__all__ = ["GGML_SCHED_MAX_BACKENDS", "GGML_SCHED_MAX_COPIES", "GGML_SCHED_MAX_SPLIT_INPUTS", "Sched",
           "SchedAssignError", "SchedError", "Split", "cpy_tensor_async", "tensor_copy"]

"""The CPU backend: host buffers of numpy bytes, kernels from ops.py, optional asynchronous compute.

With `async_compute=True` the backend runs its graphs on one worker thread, in submission order, and
exposes ggml's event calls (record / wait / synchronize) on that queue. numpy releases the GIL in its
kernels, so two such backends overlap on two cores: that is how the scheduler's n_copies pipelining is
tested on one machine.

Binding and replay are the backend's graph_plan slots (ggml's graph_plan_create / graph_plan_compute):
a BoundGraph is a graph's plan, kept by whoever owns the graph (a scheduler's split, a stage's plan);
graph_compute binds and runs once.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from threading import get_ident

import numpy as np

from ...core.graph import Graph
from ...core.tensor import Op, Tensor, TensorFlag, nbytes
from ..base import (
    Backend,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceType,
    Event,
    GraphPlan,
    OpTable,
    UnsupportedOpError,
    array_at,
    tensor_array,
)
from .entry import Flat, flat
from .fusion import fuse
from .ops import KERNELS, QUANT_SRC_OPS, Binding, ComputeOptions, bind, resolve
from .threads import get_threads, launch

TENSOR_ALIGNMENT = 32               # ggml's CPU buffer alignment


_MALLOC_TUNED = False


def keep_freed_host_memory() -> None:
    """Make glibc's malloc keep freed blocks for reuse instead of handing them back to the kernel.

    ggml computes in buffers planned once; a Python step still allocates a few large arrays (the logits
    it returns, 196 KB per row for a 49K vocabulary; kernel scratch). glibc serves blocks over its mmap
    threshold (128 KB at first) with fresh mappings and unmaps them on free, and trims the heap top past
    its trim threshold, so each step page-faults its arrays in again: on these VMs about 2.5 us per
    4 KB page, 3 ms of a 30 ms step of 8 sequences. With the mmap threshold at glibc's maximum (32 MB)
    and the trim threshold at 128 MB, freed blocks come back from the heap. Once per process; glibc
    only (a no-op elsewhere)."""
    global _MALLOC_TUNED
    if _MALLOC_TUNED:
        return
    _MALLOC_TUNED = True
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 128 << 20)
    except (OSError, AttributeError):      # not glibc
        pass


class CPUBuffer(Buffer):
    """ggml_backend_cpu_buffer: a numpy uint8 arena (`base`)."""
    base: np.ndarray

    def __init__(self, buft: CPUBufferType, size: int) -> None:
        self.buft: BufferType = buft        # a CPUBufferType, or a stage's arena (workers/stage.py)
        self.size = size
        self.usage = BufferUsage.ANY
        self.base = np.zeros(max(size, 1), dtype=np.uint8)   # zeroed lazily by the OS

    def __repr__(self) -> str:
        return f"{self.buft.name} buffer ({self.size} B)"

    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int = 0) -> None:
        arr = array_at(self.base, t.data, t)                    # type: ignore[arg-type]
        src = np.asarray(data)
        if src.dtype == np.uint8 and arr.dtype != np.uint8 and src.nbytes == nbytes(t):
            src = src.view(arr.dtype)                           # raw bytes of a dense tensor
        arr[...] = src.reshape(arr.shape) if src.size == arr.size else src

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return array_at(self.base, t.data, t).copy()            # type: ignore[arg-type]

    def clear(self, value: int = 0) -> None:
        self.base.fill(value)


class CPUBufferType(BufferType):
    """ggml_backend_cpu_buffer_type: host memory, 32-byte alignment, no size limit."""

    def __init__(self, name: str = "CPU", alignment: int = TENSOR_ALIGNMENT,
                 max_size: int = 2**62, is_host: bool = True) -> None:
        self.name = name
        self.alignment = alignment
        self.max_size = max_size
        self.is_host = is_host

    def __repr__(self) -> str:
        return f"BufferType({self.name})"

    def alloc_buffer(self, size: int) -> CPUBuffer:
        return CPUBuffer(self, size)


# What the CPU kernels implement: every op in KERNELS; quantized operands only where the kernel
# dequantizes blocks; quantized destinations only for copies.
CPU_OPS = OpTable(frozenset(KERNELS), QUANT_SRC_OPS)
cpu_supports_op = CPU_OPS.supports


class CPUBackend(Backend):
    """ggml_backend_cpu: graph_compute walks the nodes and runs each COMPUTE node's kernel. It has events
    (synchronous or not) and no cpy_tensor_async of its own: the scheduler copies in the source's stream."""

    def __init__(self, device: Device, async_compute: bool = False,
                 opts: ComputeOptions = ComputeOptions()) -> None:
        self.device = device
        self.name = device.name
        self.opts = resolve(opts)           # the host's kernel choice, made once for this backend
        self.eval_callback: Callable[[Tensor, bool], bool] | None = None
        keep_freed_host_memory()
        self._queue: queue.Queue | None = None
        self._error: BaseException | None = None
        if async_compute:
            self._queue = queue.Queue()
            threading.Thread(target=self._worker, name=f"{self.name}-worker", daemon=True).start()

    # -- compute -----------------------------------------------------------------------------------
    def graph_compute(self, graph: Graph) -> None:
        """Bind the graph and run it once: now (synchronous) or enqueued (ggml_backend_graph_compute_async).
        A graph computed again is better planned once (graph_plan_create) and replayed."""
        self.submit(BoundGraph(graph, self.opts).run)

    def graph_plan_create(self, graph: Graph) -> BoundGraph:
        """ggml_backend_graph_plan_create: the graph's compute as prebound kernel calls."""
        return BoundGraph(graph, self.opts)

    def graph_plan_compute(self, plan: GraphPlan) -> None:
        """ggml_backend_graph_plan_compute: replay a plan, in stream order. A plan bound with options this
        backend no longer has (its compiled kernels took over: host.use_compiled_kernels) binds again."""
        assert isinstance(plan, BoundGraph), f"{plan!r} is not a CPU backend's plan"
        if plan.opts is not self.opts:
            plan.bind(self.opts)
        self.submit(plan.run)

    def submit(self, fn: Callable[[], object]) -> None:
        """Run fn in this backend's stream order (a copy into this backend's buffers, say)."""
        if self._queue is None:
            fn()
        else:
            self._queue.put(fn)

    def synchronize(self) -> None:
        if self._queue is not None:
            done = threading.Event()
            self._queue.put(done.set)
            done.wait()
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    # -- events (ggml_backend_event_*) ---------------------------------------------------------------
    def event_record(self) -> threading.Event:
        """An event that is set once everything submitted so far has run."""
        ev = threading.Event()
        self.submit(ev.set)
        return ev

    def event_wait(self, ev: Event) -> None:
        """Make this backend's later work wait for ev (recorded on another backend)."""
        self.submit(ev.wait)

    def _worker(self) -> None:
        assert self._queue is not None
        while True:
            fn = self._queue.get()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on synchronize
                self._error = e


class BoundGraph:
    """A graph's compute as a flat list of prebound kernel calls (bind once, replay many).

    Binding resolves, once, each node's kernel, the backend's options and the array views of its
    destination and sources; nodes that one kernel computes (fusion.py: runs of consecutive nodes, and
    products of one activation) become one call. A replay runs the prologue (per-step values several
    calls share) and walks the list: no graph walk, no view construction, no option lookups per op.
    After one replay by a thread at a thread count, the next ones by it at that count are flat
    (entry.flat): each call's entry point called with its arguments, under one launch() for them all,
    without the bound calls' own frames (a SmolLM2 decode step makes 273 calls).

    A plan holds array views of its tensors' places: it is valid while they stay there, which its owner
    knows (it placed them), so a replay checks nothing. differs from ggml: ggml-cpu binds nothing across
    calls (its graph_plan only sizes the work buffer)."""

    def __init__(self, graph: Graph, opts: ComputeOptions) -> None:
        self.graph = graph
        self.bind(opts)

    def bind(self, opts: ComputeOptions) -> None:
        """Resolve every node's kernel, options and views once (again, with other options)."""
        graph, self.opts = self.graph, opts
        consumers: dict[Tensor, list[Tensor]] = {}
        for t in graph.nodes:
            for x in t.src:
                if x is not None:
                    consumers.setdefault(x, []).append(t)
        nodes = [t for t in graph.nodes if t.op not in _NO_COMPUTE and t.flags & TensorFlag.COMPUTE]
        for t in nodes:
            if t.op not in KERNELS:
                raise UnsupportedOpError(f"CPU backend has no kernel for {t.op.name} ('{t.name}')")
        b = Binding(opts, consumers, graph.use_counts, tensor_array)
        self.calls: list[Callable[[], None]] = []      # what run() replays (ops.bind, fusion.fuse)
        self.call_nodes: list[list[Tensor]] = []       # the nodes each call computes (for profiles)
        taken: set[int] = set()                         # nodes past i that a fused call already runs
        for i, t in enumerate(nodes):
            if i in taken:
                continue
            fused = fuse(nodes, i, b, taken)
            if fused is None:
                self.calls.append(bind(t, tensor_array(t), [tensor_array(x) if x is not None else None
                                                            for x in t.src], b))
                self.call_nodes.append([t])
                continue
            self.calls.append(fused[0])
            self.call_nodes.append([nodes[j] for j in fused[1]])
            taken.update(fused[1])
        self.prologue = b.prologue
        self._flat: list[Flat] = []
        self._flat_for: tuple[int, int] | None = None   # the (thread, thread count) _flat was made by

    def run(self) -> None:
        for call in self.prologue:
            call()
        key = (get_ident(), get_threads())
        if key == self._flat_for:
            with launch():
                for f, args, fallback in self._flat:
                    if f(*args) is False and fallback is not None:
                        fallback()
            return
        for call in self.calls:
            call()
        self._flat = [flat(call, key[1]) or (call, (), None) for call in self.calls]
        self._flat_for = key


_NO_COMPUTE = frozenset({Op.NONE, Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE})


def compute_graph(graph: Graph, opts: ComputeOptions = ComputeOptions()) -> None:
    """Run every COMPUTE node of a graph whose tensors are bound to host buffers, once (bound now,
    not kept: a graph run again is a BoundGraph kept by its owner)."""
    BoundGraph(graph, opts).run()


def compute_node(t: Tensor, opts: ComputeOptions = ComputeOptions()) -> None:
    kernel = KERNELS.get(t.op)
    if kernel is None:
        raise UnsupportedOpError(f"CPU backend has no kernel for {t.op.name} ('{t.name}')")
    srcs = [tensor_array(s) if s is not None else None for s in t.src]
    kernel(t, tensor_array(t), srcs, opts)


class CPUDevice(Device):
    """ggml_backend_cpu_device."""
    type = DeviceType.CPU
    op_table = CPU_OPS

    def __init__(self, name: str = "CPU") -> None:
        self.name = name
        self.buft = CPUBufferType(name)

    def get_buffer_type(self) -> CPUBufferType:
        return self.buft

    def supports_op(self, t: Tensor) -> bool:
        return cpu_supports_op(t)

    def supports_buft(self, buft: BufferType) -> bool:
        return buft.is_host

    def memory(self) -> tuple[int, int]:
        try:
            pages, avail = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
            size = os.sysconf("SC_PAGE_SIZE")
            return avail * size, pages * size
        except (ValueError, OSError):
            return 0, 0

    def init_backend(self, async_compute: bool = False,
                     opts: ComputeOptions = ComputeOptions()) -> CPUBackend:
        return CPUBackend(self, async_compute, opts)

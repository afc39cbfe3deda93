"""The backend protocol's optional slots (backends/base.py): their defaults, what each implementation
declares, and the scheduler's paths for a backend that declares none of them."""
from __future__ import annotations

import numpy as np

from ggml_dist.backends.accel import AccelDevice
from ggml_dist.backends.base import (
    Backend,
    Buffer,
    BufferType,
    BufferUsage,
    Device,
    DeviceInfo,
    DeviceType,
    tensor_array,
)
from ggml_dist.backends.cpu.backend import CPUBackend, CPUBuffer, CPUBufferType, CPUDevice, compute_graph
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import Tensor
from ggml_dist.core.types import GGMLType
from ggml_dist.model.weights import MappedBuffer, MappedBufferType
from ggml_dist.scheduler.copy import cpy_tensor_async
from ggml_dist.scheduler.sched import Sched
from ggml_dist.scheduler.trace import TraceRecorder
from ggml_dist.workers.proxy import Call, RemoteBuffer, RemoteBufferType, StageDevice, StageProxy
from tests.scheduler.common import alloc_weights

F32 = GGMLType.F32
D, N = 16, 8


class _SizeOnlyBuffer(Buffer):
    def __init__(self, size: int) -> None:
        self.size = size


class _MinimalBufferType(BufferType):
    name, alignment, max_size = "min", 32, 1 << 30


class _MinimalDevice(Device):
    name, type = "min", DeviceType.GPU


class _SyncBackend(Backend):
    """Only the required slots: computes at once, no events, no copies of its own."""

    def __init__(self, device: AccelDevice) -> None:
        self.device, self.name = device, device.name

    def graph_compute(self, graph: Graph) -> None:
        compute_graph(graph)

    def synchronize(self) -> None:
        pass


# a buffer, buffer type, device and backend that declare nothing optional read ggml's NULL-slot defaults
def test_defaults_of_the_optional_slots():
    ctx = Context(1 << 12)
    t = ctx.new_tensor(F32, (10, 3))
    buf = _SizeOnlyBuffer(64)
    slots = (buf.usage, buf.base, buf.get_tensor_async)
    assert slots == (BufferUsage.ANY, None, None)
    # the device layer knows devices only: sampling and token feedback are a pipeline's (PipelineHooks)
    assert not hasattr(buf, "set_sampling") and not hasattr(buf, "feed")
    assert buf.init_tensor(t) is None and buf.reset() is None and buf.release_pages(0, 64) is None
    buft = _MinimalBufferType()
    assert not buft.is_host and buft.get_alloc_size(t) == t.nbytes
    assert not _MinimalDevice().offload_op(t)
    be = _SyncBackend(AccelDevice("GPU0"))
    assert not be.inputs_by_value
    assert (be.event_record, be.event_wait, be.cpy_tensor_async) == (None, None, None)
    ran: list[int] = []
    be.submit(lambda: ran.append(1))                   # a synchronous backend's stream order is "now"
    assert ran == [1]


# each implementation subclasses its Protocol (so it inherits the defaults) and declares what it supports
def test_implementations_declare_their_slots():
    for cls, proto in ((CPUBuffer, Buffer), (CPUBufferType, BufferType), (CPUBackend, Backend),
                       (CPUDevice, Device), (AccelDevice, Device), (RemoteBuffer, Buffer),
                       (RemoteBufferType, BufferType), (StageDevice, Device), (StageProxy, Backend),
                       (MappedBuffer, Buffer), (MappedBufferType, BufferType)):
        assert proto in cls.__mro__, f"{cls.__name__} does not subclass {proto.__name__}"
    cpu = CPUDevice()
    assert cpu.buft.is_host
    assert not AccelDevice("GPU0").buft.is_host and MappedBufferType().is_host
    for async_compute in (False, True):                # events either way; copies by the scheduler
        be = cpu.init_backend(async_compute=async_compute)
        assert be.event_record is not None and be.event_wait is not None
        assert be.cpy_tensor_async is None and not be.inputs_by_value
    cb = CPUBuffer(CPUBufferType(), 16)
    assert cb.base is not None and cb.get_tensor_async is None
    dev = StageDevice("stage0", DeviceInfo.of(cpu))       # what a CPU stage's device says of itself
    proxy = StageProxy(0, (0, 1), Call(lambda *a: None, lambda hs: [], lambda hs: None), dev)
    assert proxy.inputs_by_value
    assert proxy.cpy_tensor_async is not None and proxy.event_record is not None
    rb = dev.buft.alloc_buffer(16)
    assert not dev.buft.is_host
    assert rb.base is None and rb.get_tensor_async is not None
    assert MappedBuffer.release_pages is not Buffer.release_pages        # a mapping has pages to drop


def _graph(w1: Tensor, w2: Tensor) -> tuple[Graph, Tensor, Tensor]:
    """x (INPUT) -> GPU0: silu(w1 @ x) -> CPU: scale(w2 @ h)."""
    ctx = Context(1 << 16, no_alloc=True)
    x = ctx.new_tensor(F32, (D, N)).set_name("x").set_input()
    h = ops.silu(ctx, ops.mul_mat(ctx, w1, x)).set_name("h")
    y = ops.scale(ctx, ops.mul_mat(ctx, w2, h), 0.25).set_name("y").set_output()
    g = Graph(64)
    g.build_forward_expand(y)
    return g, x, y


# a backend without events or copies of its own: the scheduler synchronises instead of recording events
# and copies synchronously; a trace's marks still run (Backend.submit's default), and results match
def test_sched_over_a_backend_without_optional_slots():
    gpu, cpu_dev = AccelDevice("GPU0"), CPUDevice("CPU")
    sync, cpu = _SyncBackend(gpu), cpu_dev.init_backend(async_compute=True)
    sched = Sched([sync, cpu], n_copies=2)
    assert sched.has_events == [False, True]
    trace = TraceRecorder()
    sched.set_trace(trace)
    ctx = Context(1 << 16, no_alloc=True)
    w1, w2 = ctx.new_tensor(F32, (D, D)).set_name("w1"), ctx.new_tensor(F32, (D, D)).set_name("w2")
    alloc_weights(gpu.buft, [w1])
    alloc_weights(cpu_dev.buft, [w2], np.random.default_rng(1))
    rng = np.random.default_rng(7)
    for _ in range(3):
        g, x, y = _graph(w1, w2)
        value = rng.standard_normal((N, D)).astype(np.float32)
        want = ReferenceExecutor().compute(g, {x: value})[y]
        sched.reset()
        assert sched.alloc_graph(g)
        x.buffer.set_tensor(x, value)
        sched.graph_compute(g)
        np.testing.assert_array_equal(tensor_array(y), want)
        h = next(s for sp in sched.splits for s in sp.inputs if s.name == "h")
        dst = sched.tensor_id_copy(h, 1, sched.cur_copy)
        assert dst is not None and not cpy_tensor_async(sync, cpu, h, dst)   # no stream to copy in
    assert {e.backend for e in trace.events} == {"GPU0", "CPU"}

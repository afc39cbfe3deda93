"""The device protocol: device -> buffer type -> buffer -> backend (ggml-backend-impl.h).

Each level is a small Protocol. An implementation subclasses its Protocol explicitly (`class
CPUBuffer(Buffer)`), one level deep; implementations do not inherit from each other. The one place where
a tensor's (buffer, data) becomes an array with ggml's strides is `tensor_array`: `ne`/`nb` are reversed
into a numpy shape/strides there and nowhere else.

Optional slots. ggml's `*_i` tables mark some slots "(optional)", leave them NULL, and the caller tests
the pointer or the public wrapper supplies the default. Here every optional slot is declared on its
Protocol with its default, an implementation inherits the defaults by subclassing and overrides what it
supports, and callers read the slot instead of probing for it. Two kinds:
  * neutral defaults, used as they are: a value (`Buffer.usage` ANY, `BufferType.is_host` False,
    `Backend.inputs_by_value` False) or a method that does what ggml's wrapper does for a NULL slot
    (`Buffer.init_tensor`, `reset` and `release_pages` do nothing, `BufferType.get_alloc_size` is
    nbytes, `Device.offload_op` is False, `Backend.submit` runs fn now);
  * `None` slots, where the caller takes another path without one, and tests `is not None` as ggml
    tests a NULL pointer: `Buffer.base` (host bytes; None: copies go through get/set_tensor),
    `Buffer.get_tensor_async`, `Backend.event_record` / `event_wait` (events:
    the scheduler orders streams with them; None: it synchronises), `Backend.cpy_tensor_async`
    (None: the scheduler's own copy, scheduler/copy.py), `Backend.graph_plan_create` /
    `graph_plan_compute` (ggml's graph_plan_*: a graph bound once and replayed; None: graph_compute
    every time) and `Device.op_table` (what the device computes, as data; None: ask supports_op).

What crosses a process boundary is data, never a device object: `BackendOptions` (what a run asks of a
backend, ggml_backend_dev_init's params typed), `OpTable` and `DeviceInfo` (what a device is and
computes: a stage's device answers its driver-side proxy with it).
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..core.graph import Graph
from ..core.tensor import Op, Tensor, nbytes
from ..core.types import TYPE_TRAITS, GGMLType, is_quantized

# element types that map to a numpy dtype; BF16 is raw uint16 bits (numpy has no bfloat16)
NP_DTYPE: dict[GGMLType, np.dtype] = {
    GGMLType.F32: np.dtype(np.float32), GGMLType.F16: np.dtype(np.float16),
    GGMLType.BF16: np.dtype(np.uint16), GGMLType.F64: np.dtype(np.float64),
    GGMLType.I8: np.dtype(np.int8), GGMLType.I16: np.dtype(np.int16),
    GGMLType.I32: np.dtype(np.int32), GGMLType.I64: np.dtype(np.int64),
}


class DeviceType(enum.IntEnum):
    """ggml_backend_dev_type."""
    CPU = 0
    GPU = 1
    ACCEL = 2


class BufferUsage(enum.IntEnum):
    """ggml_backend_buffer_usage."""
    ANY = 0
    WEIGHTS = 1
    COMPUTE = 2


class UnsupportedOpError(RuntimeError):
    """A backend was asked to compute an op it does not implement."""


class StageLostError(RuntimeError):
    """A backend in another process lost the state its caller relies on (a pipeline stage died or was
    restarted): raised by the transports that reach it, where a result is waited for; a context recovers
    by restoring the backend and replaying its ubatch log (model/recovery.py)."""

    def __init__(self, msg: str, stage: int = -1) -> None:
        super().__init__(msg)
        self.stage = stage


@dataclass(frozen=True)
class BackendOptions:
    """What a run asks of every backend it creates (ggml_backend_dev_init's params, typed): the numerics
    and the threads. Each device kind maps them onto its own options (backends/devices.py; the CPU's
    ComputeOptions), so they travel by value to a stage in another process.

    exact: f32 activations in MUL_MAT instead of ggml's vec_dot conversion (--exact).
    compiled: the compiled kernels where the device has them (False: its reference kernels, the same bits).
    batch_invariant: every row reduced in the order of a row alone (--deterministic).
    n_threads: kernel threads (0: the device's default)."""
    exact: bool = False
    compiled: bool = True
    batch_invariant: bool = False
    n_threads: int = 0


@dataclass(frozen=True)
class OpTable:
    """The ops a device computes, as data: a device may answer supports_op from it, and a device in
    another process (a stage's) sends it to the proxy that stands for it on the driver.

    ops: the ops it computes, for sources of any non-block element type.
    quantized_src: of those, the ops whose sources may also be block-quantized (the kernel dequantizes
    blocks on the fly); the others refuse a quantized source."""
    ops: frozenset[Op]
    quantized_src: frozenset[Op] = frozenset()

    def supports(self, t: Tensor) -> bool:
        if t.op not in self.ops:
            return False
        if t.op in self.quantized_src:
            return True
        return not any(s is not None and is_quantized(s.type) for s in t.src)


@runtime_checkable
class Buffer(Protocol):
    """ggml_backend_buffer: a byte arena."""
    size: int
    buft: BufferType    # a subclass may narrow it to its own buffer type class
    usage: BufferUsage = BufferUsage.ANY
    base: np.ndarray | None = None    # host buffers: the uint8 arena; None: bytes this process cannot address
    # (optional) get_tensor_async(t) -> a call that returns t's value: a fetch started now and waited for
    # later (ggml_backend_tensor_get_async; a stage's export); None: read with get_tensor after synchronising
    get_tensor_async: Callable[..., Callable[[], np.ndarray]] | None = None

    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int = 0) -> None: ...
    def get_tensor(self, t: Tensor) -> np.ndarray: ...
    def clear(self, value: int = 0) -> None: ...

    def init_tensor(self, t: Tensor) -> None:
        """(optional) ggml's init_tensor: called when t is placed in this buffer. Default: nothing."""
        return None

    def reset(self) -> None:
        """(optional) ggml's reset: drop per-tensor extras before a replay; memory is kept. Default:
        nothing."""
        return None

    def release_pages(self, offset: int, size: int) -> None:
        """(optional) drop the resident pages of bytes [offset, offset+size) that a backend now keeps in
        a form of its own (a file mapping's pages, model/weights.py). Default: nothing to drop."""
        return None


@runtime_checkable
class BufferType(Protocol):
    """ggml_backend_buffer_type."""
    name: str
    alignment: int      # power of two; the allocator pads every size to it
    max_size: int       # bytes per chunk; one oversize tensor may still get a larger chunk
    is_host: bool = False   # an array of the buffer can be read by the CPU directly

    def alloc_buffer(self, size: int) -> Buffer: ...

    def get_alloc_size(self, t: Tensor) -> int:
        """(optional) bytes t takes in a buffer of this type. Default: nbytes(t)."""
        return nbytes(t)


class Event(Protocol):
    """ggml_backend_event: what Backend.event_record returns; wait() blocks the host until it is done."""
    def wait(self) -> object: ...


class GraphPlan(Protocol):
    """ggml_backend_graph_plan_t: what Backend.graph_plan_create returns; opaque but for its graph."""
    graph: Graph


@runtime_checkable
class Backend(Protocol):
    """ggml_backend: computes graphs whose tensors live in buffers it can use."""
    name: str
    device: Device
    # graph inputs are snapshotted when copied in (a stage proxy sends them with its next call), so the
    # scheduler need not wait before overwriting an input's copy slot
    inputs_by_value: bool = False
    # (optional) events, both or neither: event_record() -> an Event set once everything submitted so
    # far has run; event_wait(ev): later work waits for ev (recorded on another backend). None: the
    # scheduler synchronises the backend where it would wait for an event
    event_record: Callable[[], Event] | None = None
    event_wait: Callable[[Event], None] | None = None
    # (optional) cpy_tensor_async(src_backend, src, dst) -> bool: this backend's own copy of src into
    # dst (one of its tensors); False: the caller copies synchronously. None: the scheduler's own copy
    cpy_tensor_async: Callable[[Any, Tensor, Tensor], bool] | None = None
    # (optional) ggml's graph_plan_create / graph_plan_compute, both or neither: graph_plan_create(graph)
    # binds a graph whose tensors are placed (kernels, views, options) into a GraphPlan, and
    # graph_plan_compute(plan) replays it (in stream order, as graph_compute). The plan is valid while
    # the graph's tensors stay where they were placed: whoever owns the graph keeps its plan, and makes a
    # new one when it places them again (a scheduler's split, a stage's plan). None: graph_compute
    graph_plan_create: Callable[[Graph], GraphPlan] | None = None
    graph_plan_compute: Callable[[GraphPlan], None] | None = None

    def graph_compute(self, graph: Graph) -> None: ...
    def synchronize(self) -> None: ...

    def submit(self, fn: Callable[[], object]) -> None:
        """(optional) run fn in this backend's stream order. Default: now (a synchronous backend)."""
        fn()


@runtime_checkable
class Device(Protocol):
    """ggml_backend_device: what the scheduler asks before placing work."""
    name: str
    type: DeviceType
    # (optional) what the device computes, as data (supports_op's answer for every tensor); None: only
    # supports_op knows, and the device cannot be described to another process
    op_table: OpTable | None = None

    def get_buffer_type(self) -> BufferType: ...
    def supports_op(self, t: Tensor) -> bool: ...
    def supports_buft(self, buft: BufferType) -> bool: ...
    def memory(self) -> tuple[int, int]: ...              # (free, total) bytes
    def init_backend(self) -> Backend: ...

    def offload_op(self, t: Tensor) -> bool:
        """(optional) run t here although its weights live elsewhere (ggml's offload_op). Default: no."""
        return False


@dataclass(frozen=True)
class DeviceInfo:
    """A device as data (ggml_backend_dev_get_props): what a stage's device tells its driver-side proxy,
    which answers the scheduler's questions with it."""
    name: str
    type: DeviceType
    memory: tuple[int, int]              # (free, total) bytes
    alignment: int                       # of its buffer type
    max_size: int
    op_table: OpTable

    @classmethod
    def of(cls, dev: Device) -> DeviceInfo:
        buft = dev.get_buffer_type()
        if dev.op_table is None:
            raise UnsupportedOpError(f"device '{dev.name}' declares no op_table, so it cannot be described to "
                                     f"another process; give its Device class an OpTable")
        return cls(dev.name, dev.type, dev.memory(), buft.alignment, buft.max_size, dev.op_table)


# -- binding tensors to arrays ----------------------------------------------------------------------
def shape_strides(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype]:
    """ggml (ne, nb) -> numpy (shape, strides, dtype). Block types become uint8 rows of blocks:
    shape (ne3, ne2, ne1, row_bytes)."""
    if t.type in NP_DTYPE:
        return (t.ne[3], t.ne[2], t.ne[1], t.ne[0]), (t.nb[3], t.nb[2], t.nb[1], t.nb[0]), NP_DTYPE[t.type]
    tt = TYPE_TRAITS[t.type]
    row_bytes = t.ne[0] // tt.blck_size * tt.type_size
    return (t.ne[3], t.ne[2], t.ne[1], row_bytes), (t.nb[3], t.nb[2], t.nb[1], 1), np.dtype(np.uint8)


def array_at(base: np.ndarray, offset: int, t: Tensor) -> np.ndarray:
    """A zero-copy view of `t` at byte `offset` of the uint8 array `base`."""
    shape, strides, dtype = shape_strides(t)
    size = nbytes(t)
    if offset < 0 or offset + size > base.nbytes:
        raise ValueError(f"'{t.name}' ({size} B at offset {offset}) lies outside its "
                         f"{base.nbytes} B buffer")
    if size == 0:
        return np.zeros(shape, dtype)
    return np.ndarray(shape, dtype=dtype, buffer=base.data, offset=offset, strides=strides)


def tensor_array(t: Tensor) -> np.ndarray:
    """The array of an allocated tensor on a host buffer: 4-d, numpy order (ne reversed)."""
    if t.buffer is None or t.data is None:
        raise ValueError(f"tensor '{t.name}' is not allocated")
    return array_at(t.buffer.base, t.data, t)


def tensor_alloc(buffer: Any, t: Tensor, offset: int) -> None:
    """ggml_backend_tensor_alloc: place t at offset in buffer."""
    assert t.view_src is None, f"'{t.name}' is a view; use view_init"
    t.buffer, t.data = buffer, offset


def view_init(t: Tensor) -> None:
    """ggml_backend_view_init: a view shares its root's buffer at root.data + view_offs."""
    root = t.view_src
    assert root is not None and root.buffer is not None and root.data is not None, \
        f"view '{t.name}' initialised before its source"
    t.buffer, t.data = root.buffer, root.data + t.view_offs


def tensor_set(t: Tensor, value: np.ndarray) -> None:
    """ggml_backend_tensor_set for a whole tensor; value is in numpy order (ne reversed) or flat."""
    t.buffer.set_tensor(t, np.asarray(value))


def tensor_get(t: Tensor) -> np.ndarray:
    """ggml_backend_tensor_get: a copy of the tensor's contents, shape ne reversed (4-d)."""
    return t.buffer.get_tensor(t)

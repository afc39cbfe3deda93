"""The driver-side proxy: a stage actor seen through the backend protocol the scheduler uses.

    StageDevice   the stage's device as its process described it (DeviceInfo: type, memory, op table),
                  with a non-host buffer type of its alignment standing for its memory
    RemoteBuffer  where the driver's allocator places the stage's tensors: addresses only, no memory;
                  set_tensor snapshots a graph input for the next call, get_tensor fetches an export
    StageProxy    graph_compute(split) = one asynchronous actor call carrying the split's plan id (and
                  its description the first time), the inputs that came from the driver, and the
                  producing stages' result handles; its graph plan (RemotePlan, kept by the scheduler's
                  split) holds the split's descriptions, so a replayed split is described once

Only this module and workers/actor.py know that a handle is a Ray ObjectRef: `Call` wraps the
submission function, so the scheduler sees a backend whose compute returns at once and whose
copies are recorded, not performed. Ray resolves a call's argument refs before running it: the
dependency between stages is the event.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import Backend, Buffer, BufferType, BufferUsage, Device, DeviceInfo, Event, GraphPlan
from ..core.graph import Graph
from ..core.tensor import Tensor, TensorFlag
from .plan import describe, plan_id, plan_name
from .wire import WireTensor, decode, encode

# submit(pid, desc | None, inputs msg, *upstream handles) -> handle; get(handles) -> messages
Submit = Callable[..., Any]
Get = Callable[[list], list]


@dataclass
class Exports:
    """Which tensors each stage returns, and under which key; shared by the proxies of one graph.

    Keys are node positions in the user graph, so the same graph shape gives the same plan ids."""
    keys: dict[Tensor, str] = field(default_factory=dict)
    handles: dict[Tensor, Any] = field(default_factory=dict)   # export -> handle of the call that made it
    feeds: dict[Tensor, tuple[Any, str]] = field(default_factory=dict)   # graph input -> (handle, key)

    @classmethod
    def of(cls, sched: Any, graph: Graph) -> Exports:
        pos = {t: i for i, t in enumerate(graph.nodes)}
        ex = cls()
        for sp in sched.splits:
            for s in sp.inputs:
                if isinstance(sched.get_tensor_backend(s), StageProxy):
                    ex.keys[s] = f"n{pos[s]}"
        for t in graph.nodes:
            if t.flags & TensorFlag.OUTPUT and isinstance(sched.get_tensor_backend(t), StageProxy):
                ex.keys[t] = f"n{pos[t]}"
        return ex


class RemoteBufferType(BufferType):
    """A stage's memory as the driver sees it: planned, never touched (not host memory)."""

    def __init__(self, name: str, alignment: int = 32, max_size: int = 2**62) -> None:
        self.name = name
        self.alignment = alignment
        self.max_size = max_size
        self.proxy: StageProxy | None = None

    def alloc_buffer(self, size: int) -> RemoteBuffer:
        return RemoteBuffer(self, size)


class RemoteBuffer(Buffer):
    """No bytes here (base None): set_tensor and get_tensor(_async) go through the stage's calls."""
    buft: RemoteBufferType

    def __init__(self, buft: RemoteBufferType, size: int, usage: BufferUsage = BufferUsage.ANY) -> None:
        self.buft = buft
        self.size = size
        self.usage = usage

    def __repr__(self) -> str:
        return f"{self.buft.name} remote buffer ({self.size} B)"

    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int = 0) -> None:
        assert self.buft.proxy is not None
        self.buft.proxy.pending_host[t] = np.array(data, copy=True)    # the caller may reuse `data`

    def get_tensor(self, t: Tensor) -> np.ndarray:
        return self.get_tensor_async(t)()

    def get_tensor_async(self, t: Tensor, suffix: str = "") -> Fetch:
        """A fetch of t's value as made by the call that last computed it (captured now); suffix
        ":tok": the tokens that call chose from it (driver.DriverPipeline.sample)."""
        proxy = self.buft.proxy
        assert proxy is not None and proxy.exports is not None
        key, handle = proxy.exports.keys.get(t), proxy.exports.handles.get(t)
        if key is None or handle is None:
            raise RuntimeError(f"'{t.name}' is not exported by {proxy.name}; only split outputs and "
                               f"OUTPUT tensors can be read back from a stage")
        return Fetch(proxy, handle, key + suffix)

    def clear(self, value: int = 0) -> None:
        pass                                   # the stage clears its own memory


class StageDevice(Device):
    """A stage's device on the driver: what the stage's own device answered (DeviceInfo), so the
    scheduler asks it what the remote device supports. The scheduler places work on it as on any
    backend but the last: ggml's scheduler expands assignments onto every backend before the last (the
    CPU) by position, whatever their type."""

    def __init__(self, name: str, info: DeviceInfo) -> None:
        self.name = name
        self.info = info
        self.type = info.type
        self.op_table = info.op_table
        self.buft = RemoteBufferType(name, info.alignment, info.max_size)

    def get_buffer_type(self) -> RemoteBufferType:
        return self.buft

    def supports_op(self, t: Tensor) -> bool:
        return self.info.op_table.supports(t)

    def supports_buft(self, buft: BufferType) -> bool:
        return buft is self.buft

    def memory(self) -> tuple[int, int]:
        return self.info.memory

    def init_backend(self) -> StageProxy:
        raise RuntimeError("a stage proxy is created with its actor (workers/cluster.py)")


@dataclass(eq=False)
class RemotePlan:
    """A stage proxy's graph plan (GraphPlan): the split's description, one per sources of its inputs (a
    token from the driver, or fed by the last stage's call), with its plan id. The scheduler's split keeps
    it for the split's life."""
    graph: Graph
    descs: dict[tuple, tuple[str, dict]] = field(default_factory=dict)


@dataclass
class Call:
    """How a proxy reaches its actor: submit returns a handle at once; get waits for handles;
    takes_refs: whether any later call (not only the next stage's) may take a handle as an input."""
    submit: Submit
    get: Get
    wait: Callable[[list], object]
    takes_refs: Callable[[], bool] = lambda: True


@dataclass(frozen=True, eq=False)
class Fetch:
    """An export of one stage call, read when called (RemoteBuffer.get_tensor_async), or fed to a
    later call as its handle (RemoteBuffer.feed)."""
    proxy: StageProxy
    handle: Any
    key: str

    def __call__(self) -> np.ndarray:
        return self.proxy.fetch(self.handle, self.key)


class StageProxy(Backend):
    """The scheduler's backend for one stage actor: events are call handles, copies between stages are
    its own (cpy_tensor_async)."""
    inputs_by_value = True           # graph inputs are snapshotted at copy time (no slot hazards)

    def __init__(self, stage_id: int, layers: tuple[int, int], call: Call, device: StageDevice) -> None:
        self.stage_id = stage_id
        self.layers = layers
        self.call = call
        self.device = device
        self.name = device.name
        device.buft.proxy = self
        self.exports: Exports | None = None
        self.pending_host: dict[Tensor, np.ndarray] = {}
        self.pending_up: dict[Tensor, tuple[Any, str]] = {}      # input copy -> (handle, key)
        self.pending_sample: dict | None = None                   # DriverPipeline.sample's request
        self.pending_state: list[list] = []                       # DriverPipeline.state_op's row operations
        self.sent_plans: OrderedDict[str, None] = OrderedDict()   # mirrors the stage's plan LRU
        self.last_handle: Any = None
        self.n_calls = 0

    def __repr__(self) -> str:
        return f"StageProxy({self.name}, layers {self.layers[0]}..{self.layers[1] - 1})"

    # -- copies: recorded, sent with the next call --------------------------------------------------
    def cpy_tensor_async(self, src_backend: Any, src: Tensor, dst: Tensor) -> bool:
        ex = self.exports
        if ex is not None and src in ex.feeds:          # a graph input fed from a call's result
            self.pending_up[dst] = ex.feeds.pop(src)
            return True
        if isinstance(src_backend, StageProxy) and ex is not None and src in ex.handles:
            self.pending_up[dst] = (ex.handles[src], ex.keys[src])
            return True
        return False                     # the scheduler falls back to get_tensor + set_tensor

    # -- compute ------------------------------------------------------------------------------------
    def graph_plan_create(self, graph: Graph) -> RemotePlan:
        """ggml_backend_graph_plan_create: the split as the stage will run it, described at its first compute."""
        return RemotePlan(graph)

    def graph_plan_compute(self, plan: GraphPlan) -> None:
        assert isinstance(plan, RemotePlan), f"{plan!r} is not a stage proxy's plan"
        self._submit(plan)

    def graph_compute(self, graph: Graph) -> None:
        self._submit(RemotePlan(graph))

    def _submit(self, plan: RemotePlan) -> None:
        assert self.exports is not None, "Exports.of(sched, graph) must be bound before compute"
        pid, desc = self._describe(plan)
        host = [WireTensor(f"h:{plan_name(t)}", t.type, t.ne, a) for t, a in self.pending_host.items()]
        ups = list({id(h): h for h, _ in self.pending_up.values()}.values())   # each producer's result once
        known = pid in self.sent_plans
        meta: dict[str, Any] = {} if self.pending_sample is None else {"sample": self.pending_sample}
        if self.pending_state:
            meta["state"] = self.pending_state
        handle = self.call.submit(pid, None if known else desc, encode(host, meta or None), *ups)
        self._touch_plan(pid)
        self.pending_host.clear()
        self.pending_up.clear()
        self.pending_sample = None
        self.pending_state = []
        for t in plan.graph.nodes:
            if t in self.exports.keys:
                self.exports.handles[t] = handle
        self.last_handle = handle
        self.n_calls += 1

    def _touch_plan(self, pid: str) -> None:
        """The stage runs calls in order and keeps MAX_PLANS plans, least recently used out: the
        same bookkeeping here tells whether it still has a plan, so a description is resent in time."""
        from .stage import MAX_PLANS
        self.sent_plans[pid] = None
        self.sent_plans.move_to_end(pid)
        while len(self.sent_plans) > MAX_PLANS:
            self.sent_plans.popitem(last=False)

    def _describe(self, plan: RemotePlan) -> tuple[str, dict]:
        """The split's plan id and description for the sources of this call's inputs (a graph input from
        the driver, or another call's result), kept in its RemotePlan: a replayed split costs a lookup."""
        ck = (tuple((t, k) for t, (_, k) in self.pending_up.items()), tuple(self.pending_host))
        hit = plan.descs.get(ck)
        if hit is not None:
            return hit
        assert self.exports is not None
        up_keys = {t: k for t, (_, k) in self.pending_up.items()}
        host = set(self.pending_host)

        def resolve(t: Tensor) -> tuple[str, str] | None:
            if t in up_keys:
                return "input", up_keys[t]
            if t in host:
                return "input", f"h:{plan_name(t)}"
            buf = t.buffer
            if buf is not None and buf.usage == BufferUsage.WEIGHTS:
                return "weight", t.name
            if buf is not None and buf.buft is self.device.buft:
                return "kv", t.name
            return None

        graph = plan.graph
        exports = [(t, self.exports.keys[t]) for t in graph.nodes if t in self.exports.keys]
        desc = describe(graph.nodes, resolve, exports)
        out = plan.descs[ck] = (plan_id(desc), desc)
        return out

    def fetch(self, handle: Any, key: str) -> np.ndarray:
        (msg,) = self.call.get([handle])
        for wt in decode(msg)[0]:
            if wt.name == key:
                return np.array(wt.data)
        raise RuntimeError(f"{self.name}: the call's result holds no '{key}'")

    def reset(self) -> None:
        """Forget everything the actor was told or asked: after it restarted, it knows no plans and
        its results in flight are gone."""
        self.sent_plans.clear()
        self.pending_host.clear()
        self.pending_up.clear()
        self.pending_sample = None
        self.pending_state = []                  # a restarted stage's rows are zero: the replay remakes them
        self.last_handle = None
        if self.exports is not None:
            self.exports.handles.clear()
            self.exports.feeds.clear()

    # -- synchronisation ----------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self.last_handle is not None:
            self.call.wait([self.last_handle])

    def submit(self, fn: Callable[[], object]) -> None:
        fn()                              # nothing runs on the driver in this backend's stream

    def event_record(self) -> HandleEvent:
        return HandleEvent(self.call, self.last_handle)

    def event_wait(self, ev: Event) -> None:
        pass                              # Ray orders a call after the calls whose results it takes


class HandleEvent:
    def __init__(self, call: Call, handle: Any) -> None:
        self.call, self.handle = call, handle

    def wait(self) -> None:
        if self.handle is not None:
            self.call.wait([self.handle])

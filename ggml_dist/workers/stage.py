"""The stage worker: one backend, its weights, its KV-cache layers, its own gallocr and split plans.

A plain class, testable without Ray; `ray.remote(...)` is applied where actors are created
(workers/cluster.py). One `compute` call per micro-batch runs every split this stage has in the graph:

    compute(plan_id, desc | None, inputs msg, *upstream msgs) -> exports msg

The first call of a graph shape carries the plan description; the stage rebuilds it, reserves its
allocator for it and keeps it. Later calls carry only the id and the inputs. Upstream messages are the
producing stages' return values; Ray resolves those ObjectRefs before the call runs, which is the event.
"""
from __future__ import annotations

import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..alloc.gallocr import Gallocr
from ..backends.base import BufferUsage, tensor_array
from ..backends.cpu import CPUDevice, compute_graph
from ..backends.cpu_ops import ComputeOptions
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model.gguf import load_gguf
from ..model.kv_cache import KVCache
from ..model.weights import MAPPED_BUFT, MappedBuffer, load_weights
from .plan import PlanError, RebuiltPlan, rebuild
from .wire import WireTensor, decode, encode

MAX_PLANS = 32           # plans a stage keeps (LRU); its proxy mirrors the same LRU


class PlanMissingError(RuntimeError):
    """A call names a plan this stage never received: it was restarted and lost its plans."""


class WeightsMissingError(PlanMissingError):
    """The stage cannot read the GGUF and holds no weights: restarted, it needs them sent again (the
    driver's recovery does that, as for any lost stage)."""


@dataclass
class StageSpec:
    """What one stage loads: a layer range (plus embeddings / head when first / last)."""
    stage_id: int
    model_path: str
    layers: tuple[int, int]            # [first, last) layer indices
    first: bool
    last: bool
    n_ctx: int
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    type_kv: int = int(GGMLType.F16)
    n_seq_max: int = 1
    exact: bool = False
    n_threads: int = 0
    kv_unified: bool = True

    def weight_names(self, all_names: list[str], tied: bool) -> list[str]:
        lo, hi = self.layers
        out = []
        for n in all_names:
            if n.startswith("blk."):
                if lo <= int(n.split(".")[1]) < hi:
                    out.append(n)
            elif n == "token_embd.weight":
                if self.first or (self.last and tied):
                    out.append(n)
            elif self.last:
                out.append(n)
        return out


class ReceivedBuffer:
    """Weights sent by the driver: a read-only host buffer over the received message."""
    is_host = True

    def __init__(self, msg: Any) -> None:
        self.base = np.frombuffer(msg, dtype=np.uint8)
        self.size = self.base.nbytes
        self.buft = MAPPED_BUFT
        self.usage = BufferUsage.WEIGHTS


@dataclass
class StageStats:
    n_calls: int = 0
    n_plans: int = 0
    compute_s: float = 0.0
    decode_s: float = 0.0
    bytes_in: int = 0
    bytes_out: int = 0
    timeline: list = field(default_factory=list)   # (start, end, label) wall times of computes


class StageWorker:
    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        if spec.n_threads > 0:
            os.environ.setdefault("OMP_NUM_THREADS", str(spec.n_threads))
            try:
                from ..backends import qkernels
                qkernels.set_threads(spec.n_threads)
            except (ImportError, ValueError):
                pass
        self.weights: dict[str, Tensor] = {}
        self._weight_msg: Any = None                 # keeps received weight bytes alive
        if os.access(spec.model_path, os.R_OK):      # map our layers from the file, zero-copy
            f = load_gguf(spec.model_path)
            names = spec.weight_names(list(f.tensors), "output.weight" not in f.tensors)
            self._set_weights(load_weights(f, names, MappedBuffer(str(f.path))))
        self.device = CPUDevice(f"stage{spec.stage_id}")
        self.buft = self.device.get_buffer_type()
        self.kv = KVCache(spec.n_embd_k_gqa, spec.n_embd_v_gqa, spec.n_ctx, range(*spec.layers),
                          GGMLType(spec.type_kv), GGMLType(spec.type_kv), spec.n_seq_max, spec.kv_unified)
        self.kv.allocate(self.buft)
        self.kv_tensors = {t.name: t for t in self.kv.tensors()}
        self.opts = ComputeOptions(exact=spec.exact)
        self.plans: OrderedDict[str, tuple[RebuiltPlan, Gallocr]] = OrderedDict()
        self.stats = StageStats()

    def _set_weights(self, weights: dict[str, Tensor]) -> None:
        self.weights = weights
        if self.spec.last and "output.weight" not in weights:   # tied head: token_embd under its name
            self.weights["output.weight"] = weights["token_embd.weight"]

    @property
    def needs_weights(self) -> bool:
        return not self.weights

    def receive_weights(self, msg: Any) -> int:
        """This node cannot read the GGUF path: take the layers' weights from the driver, once. They
        stay as received (quantized blocks), in one host buffer over the message's bytes."""
        tensors, _ = decode(msg)
        buf = ReceivedBuffer(msg)
        ctx = Context(len(tensors) * 400 + 1024, no_alloc=True, name="received-weights")
        weights = {}
        base = np.frombuffer(msg, dtype=np.uint8)
        for wt in tensors:
            t = ctx.new_tensor(wt.type, wt.ne).set_name(wt.name)
            t.buffer, t.data = buf, int(wt.data.ctypes.data - base.ctypes.data)
            weights[wt.name] = t
        self._weight_msg = msg
        self._set_weights(weights)
        return sum(t.nbytes for t in weights.values())

    # -- info ---------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        node_id = ""
        try:
            import ray
            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"stage": self.spec.stage_id, "pid": os.getpid(), "node": os.uname().nodename,
                "node_id": node_id, "needs_weights": self.needs_weights,
                "layers": list(self.spec.layers), "weight_bytes": sum(t.nbytes for t in self.weights.values()),
                "kv_bytes": self.kv.nbytes, "compute_bytes": self.compute_bytes()}

    def compute_bytes(self) -> int:
        return max((g.get_buffer_size(0) for _, g in self.plans.values()), default=0)

    def get_stats(self) -> dict[str, Any]:
        s = self.stats
        return {"n_calls": s.n_calls, "n_plans": s.n_plans, "compute_s": s.compute_s,
                "decode_s": s.decode_s, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                "timeline": list(s.timeline)}

    def ping(self) -> int:
        return os.getpid()

    # -- compute ------------------------------------------------------------------------------------
    def _plan(self, pid: str, desc: dict | None) -> tuple[RebuiltPlan, Gallocr]:
        if pid in self.plans:
            self.plans.move_to_end(pid)
            return self.plans[pid]
        if desc is None:
            raise PlanMissingError(f"stage {self.spec.stage_id}: unknown plan {pid} (restarted?) and no "
                                   f"description sent")
        plan = rebuild(desc, self.weights, self.kv_tensors)
        galloc = Gallocr([self.buft])
        galloc.reserve(plan.graph)
        galloc.alloc_graph(plan.graph)
        self.plans[pid] = (plan, galloc)
        self.stats.n_plans += 1
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return plan, galloc

    def compute(self, pid: str, desc: dict | None, inputs: bytes, *upstream: bytes) -> bytearray:
        if self.needs_weights:
            raise WeightsMissingError(f"stage {self.spec.stage_id} cannot read {self.spec.model_path} and "
                                      f"was sent no weights")
        t0 = time.perf_counter()
        plan, galloc = self._plan(pid, desc)
        if not galloc.alloc_graph(plan.graph):       # replay: binds the recorded addresses
            raise RuntimeError(f"stage {self.spec.stage_id}: plan {pid} no longer fits its buffer")
        got: dict[str, np.ndarray] = {}
        for msg in (inputs, *upstream):
            self.stats.bytes_in += len(msg)
            tensors, _ = decode(msg)
            for wt in tensors:
                got[wt.name] = wt.data
        for key, t in plan.inputs.items():
            if key not in got:
                raise PlanError(f"stage {self.spec.stage_id}: input '{t.name}' ({key}) missing from the call")
            arr = tensor_array(t)
            arr[...] = got[key].reshape(arr.shape)
        t1 = time.perf_counter()
        compute_graph(plan.graph, self.opts)
        t2 = time.perf_counter()
        out = encode([WireTensor(key, t.type, t.ne, tensor_array(t)) for key, t in plan.exports])
        s = self.stats
        s.n_calls += 1
        s.compute_s += t2 - t1
        s.decode_s += (t1 - t0)
        s.bytes_out += len(out)
        s.timeline.append((time.time() - (time.perf_counter() - t1), time.time() - (time.perf_counter() - t2),
                           pid[:6]))
        if len(s.timeline) > 10000:
            del s.timeline[:5000]
        return out

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
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..alloc.gallocr import Gallocr
from ..backends.base import BufferUsage, tensor_array
from ..backends.cpu.backend import CPUBuffer, CPUDevice, compute_graph
from ..backends.cpu.ops import ComputeOptions, resolve
from ..core.tensor import Tensor, nbytes
from ..core.types import GGMLType
from ..model import layout
from ..model.gguf import load_gguf
from ..model.kv_cache import KVCache
from ..model.warmup import Warmup, background_compile
from ..model.weights import MappedBuffer, load_weights
from .plan import PlanError, RebuiltPlan, rebuild
from .shipping import WeightManifest, WeightReceiver
from .wire import Message, WireTensor, decode, encode

MAX_PLANS = 32           # plans a stage keeps (LRU); its proxy mirrors the same LRU


class PlanMissingError(RuntimeError):
    """A call names a plan this stage never received: it was restarted and lost its plans."""


class StateLostError(PlanMissingError):
    """A call meant for an earlier incarnation of this stage: the process was restarted, and its KV
    cache is empty. Without this check a call that carries a new plan's description would be computed
    over the empty cache, silently wrong."""


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
    background_compile: bool = False        # model/warmup.py: numpy kernels while the cache fills
    batch_invariant: bool = False           # ComputeOptions.batch_invariant (--deterministic)

    def weight_names(self, all_names: list[str], tied: bool) -> list[str]:
        return layout.stage_tensors(all_names, self.layers, self.first, self.last, tied)


class StageArena:
    """One compute buffer for every plan of a stage (a buffer type whose buffers are views of it).

    A stage runs its calls one at a time and a plan's buffer is scratch between calls (its exports are
    encoded before the call returns), so the plans can share memory: the stage holds its largest
    plan's buffer, not the sum of its plans' (a prompt of each length is a plan of its own)."""
    is_host = True

    def __init__(self, name: str, alignment: int) -> None:
        self.name = name
        self.alignment = alignment
        self.max_size = 2**62
        self.base = np.zeros(1, dtype=np.uint8)

    def alloc_buffer(self, size: int) -> CPUBuffer:
        if size > self.base.nbytes:
            self.base = np.zeros(size, dtype=np.uint8)          # plans bound to the old one are redone
        buf = CPUBuffer.__new__(CPUBuffer)
        buf.buft, buf.size, buf.usage, buf.base = self, size, BufferUsage.ANY, self.base[:max(size, 1)]
        return buf

    def get_alloc_size(self, t: Tensor) -> int:
        return nbytes(t)


@dataclass
class StageStats:
    n_calls: int = 0
    n_plans: int = 0
    compute_s: float = 0.0
    decode_s: float = 0.0
    bytes_in: int = 0            # every message received: the driver's inputs and upstream results
    bytes_in_host: int = 0       # of which from the driver (tokens, positions, masks, KV slots)
    bytes_out: int = 0
    timeline: list = field(default_factory=list)   # per call, wall times: (start, compute start,
                                                   # compute end, end, plan label)


class StageWorker:
    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        if spec.n_threads > 0:
            os.environ.setdefault("OMP_NUM_THREADS", str(spec.n_threads))
            try:
                from ..backends.cpu import threads
                threads.set_threads(spec.n_threads)
            except (ImportError, ValueError):
                pass
        self.weights: dict[str, Tensor] = {}
        self._receiver = WeightReceiver()
        if os.access(spec.model_path, os.R_OK):      # map our layers from the file, zero-copy
            f = load_gguf(spec.model_path)
            names = spec.weight_names(list(f.tensors), layout.tied_head(f))
            self._set_weights(load_weights(f, names, MappedBuffer(str(f.path))))
        self.device = CPUDevice(f"stage{spec.stage_id}")
        self.buft = self.device.get_buffer_type()
        self.kv = KVCache(spec.n_embd_k_gqa, spec.n_embd_v_gqa, spec.n_ctx, range(*spec.layers),
                          GGMLType(spec.type_kv), GGMLType(spec.type_kv), spec.n_seq_max, spec.kv_unified)
        self.kv.allocate(self.buft)
        self.arena = StageArena(f"stage{spec.stage_id}-compute", self.buft.alignment)
        self.kv_tensors = {t.name: t for t in self.kv.tensors()}
        self.opts = resolve(ComputeOptions(exact=spec.exact, batch_invariant=spec.batch_invariant))  # chosen once
        self.warmup: Warmup | None = None
        if spec.background_compile and self.opts.numba and os.access(spec.model_path, os.R_OK):
            self.warmup = background_compile(spec.model_path)
            self.opts = replace(self.opts, numba=self.warmup is None)
        self.plans: OrderedDict[str, tuple[RebuiltPlan, Gallocr]] = OrderedDict()
        self.incarnation = os.urandom(8).hex()       # this process's life: a restart gets another
        self.stats = StageStats()
        self.computing: tuple[float, int] | None = None   # (wall start, thread id) of the call in progress
        self._wedge: threading.Event | None = None         # wedge(): the next call blocks on it

    def _set_weights(self, weights: dict[str, Tensor]) -> None:
        self.weights = weights
        if self.spec.last and layout.HEAD not in weights:        # tied head: token_embd under its name
            self.weights[layout.HEAD] = weights[layout.EMBD]
        for name in layout.EVERY_STAGE & set(weights):           # each layer's copy, under its own name
            for il in range(*self.spec.layers):
                self.weights[f"blk.{il}.{name}"] = weights[name]

    @property
    def needs_weights(self) -> bool:
        return not self.weights

    # -- weights sent by the driver (this node cannot read the GGUF path): workers/shipping.py ------
    def open_weights(self, manifest: dict) -> bool:
        """True if the node's cache holds these weights (now mapped); else chunks are to follow."""
        m = WeightManifest.from_dict(manifest)
        if self._receiver.open(m):
            self._set_weights(self._receiver.mapped())
            return True
        return False

    def weights_chunk(self, offset: int, data: Any) -> int:
        return self._receiver.write(offset, data)

    def finish_weights(self) -> int:
        self._receiver.finish()
        self._set_weights(self._receiver.mapped())
        return sum(t.nbytes for t in self.weights.values())

    # -- info ---------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        node_id = ""
        try:
            import ray
            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return {"stage": self.spec.stage_id, "pid": os.getpid(), "incarnation": self.incarnation,
                "node": os.uname().nodename,
                "node_id": node_id, "needs_weights": self.needs_weights,
                "layers": list(self.spec.layers), "weight_bytes": sum(t.nbytes for t in self.weights.values()),
                "kv_bytes": self.kv.nbytes, "compute_bytes": self.compute_bytes()}

    def compute_bytes(self) -> int:
        return self.arena.base.nbytes if self.plans else 0

    def get_stats(self) -> dict[str, Any]:
        s = self.stats
        return {"n_calls": s.n_calls, "n_plans": s.n_plans, "compute_s": s.compute_s,
                "decode_s": s.decode_s, "bytes_in": s.bytes_in, "bytes_in_host": s.bytes_in_host,
                "bytes_out": s.bytes_out, "cpu_s": time.process_time(),    # every thread of the process
                "timeline": list(s.timeline)}

    def ping(self) -> int:
        return os.getpid()

    def progress(self) -> dict[str, Any]:
        """What the health port says (workers/health.py): calls done; for a call in progress, when it
        began (wall clock), for how long, and the CPU seconds of the thread running it."""
        cur = self.computing
        out: dict[str, Any] = {"calls": self.stats.n_calls, "busy_since": None, "busy_s": None, "cpu_s": None}
        if cur is not None:
            start, tid = cur
            out.update(busy_since=start, busy_s=round(time.time() - start, 3))
            try:
                out["cpu_s"] = time.clock_gettime(time.pthread_getcpuclockid(tid))
            except (OSError, AttributeError):
                pass
        return out

    def wedge(self) -> None:
        """Fault injection: the next call blocks (uses no CPU) until the process ends, as a compute stuck on
        a lock or a read that never returns would; the driver's watch must declare the stage lost."""
        self._wedge = threading.Event()

    # -- compute ------------------------------------------------------------------------------------
    def _plan(self, pid: str, desc: dict | None) -> tuple[RebuiltPlan, Gallocr]:
        if pid in self.plans:
            self.plans.move_to_end(pid)
            return self.plans[pid]
        if desc is None:
            raise PlanMissingError(f"stage {self.spec.stage_id}: unknown plan {pid} (restarted?) and no "
                                   f"description sent")
        plan = rebuild(desc, self.weights, self.kv_tensors)
        arena = self.arena.base
        galloc = self._allocate(plan)
        if self.arena.base is not arena:             # it grew: the other plans move into the new one
            for k, (p, _) in self.plans.items():
                self.plans[k] = (p, self._allocate(p))
        self.plans[pid] = (plan, galloc)
        self.stats.n_plans += 1
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return plan, galloc

    def _allocate(self, plan: RebuiltPlan) -> Gallocr:
        for t in (*plan.graph.nodes, *plan.graph.leafs):   # a plan moving to a grown arena is redone
            if t.buffer is not None and t.buffer.buft is self.arena:
                t.buffer = t.data = None
        galloc = Gallocr([self.arena])
        galloc.reserve(plan.graph)
        galloc.alloc_graph(plan.graph)
        return galloc

    def _exports(self, plan: RebuiltPlan, sample: Any) -> list[WireTensor]:
        """The plan's exports; with a sampling request (the driver's inputs' meta: {"export": key,
        "rows": [RowSampling lists], "keep": bool}) the token chosen from each row of that export goes
        back as `key:tok` (int32), and its logits only if kept."""
        out = []
        for key, t in plan.exports:
            arr = tensor_array(t)
            if sample is not None and key == sample.get("export"):
                out.append(WireTensor(f"{key}:tok", GGMLType.I32, (len(sample["rows"]), 1, 1, 1),
                                      _sample_rows(arr, sample["rows"])))
                if not sample.get("keep", True):
                    continue
            out.append(WireTensor(key, t.type, t.ne, arr))
        return out

    def compute(self, pid: str, desc: dict | None, inputs: Message, *upstream: Message,
                incarnation: str | None = None) -> bytearray:
        """incarnation: the one the driver last saw in info(); a call for another is refused."""
        if incarnation is not None and incarnation != self.incarnation:
            raise StateLostError(f"stage {self.spec.stage_id} was restarted (incarnation {self.incarnation}, the "
                                 f"call was for {incarnation}): its KV cache is gone")
        if self.needs_weights:
            raise WeightsMissingError(f"stage {self.spec.stage_id} cannot read {self.spec.model_path} and "
                                      f"was sent no weights")
        self.computing = (time.time(), threading.get_ident())
        try:
            return self._compute(pid, desc, inputs, upstream)
        finally:
            self.computing = None

    def _compute(self, pid: str, desc: dict | None, inputs: Message, upstream: tuple[Message, ...]) -> bytearray:
        if self._wedge is not None:
            self._wedge.wait()
        t0 = time.perf_counter()
        plan, _ = self._plan(pid, desc)              # allocated when made (or moved with the arena):
                                                     # its tensors keep their addresses between calls
        got: dict[str, np.ndarray] = {}
        self.stats.bytes_in_host += len(inputs)
        sample = None
        for i, msg in enumerate((inputs, *upstream)):
            self.stats.bytes_in += len(msg)
            tensors, meta = decode(msg)
            if i == 0:
                sample = meta.get("sample")
            for wt in tensors:
                got[wt.name] = wt.data
        for key, t in plan.inputs.items():
            if key not in got:
                raise PlanError(f"stage {self.spec.stage_id}: input '{t.name}' ({key}) missing from the call")
            arr = tensor_array(t)
            arr[...] = got[key].reshape(arr.shape)
        t1 = time.perf_counter()
        if self.warmup is not None and self.warmup.ready():     # the compiled kernels are cached now
            self.warmup, self.opts = None, resolve(replace(self.opts, numba=True))
        compute_graph(plan.graph, self.opts)
        t2 = time.perf_counter()
        out = encode(self._exports(plan, sample))
        s = self.stats
        s.n_calls += 1
        s.compute_s += t2 - t1
        s.decode_s += (t1 - t0)
        s.bytes_out += len(out)
        wall = time.time() - time.perf_counter()     # perf_counter -> wall clock, comparable across stages
        s.timeline.append((wall + t0, wall + t1, wall + t2, wall + time.perf_counter(), pid[:6]))
        if len(s.timeline) > 10000:
            del s.timeline[:5000]
        return out


def _sample_rows(logits: np.ndarray, rows: Any) -> np.ndarray:
    """One token per row of a logits export (model/sampling.py's sample_row, the driver's choice)."""
    from ..model.sampling import RowSampling, sample_row
    lg = logits.reshape(-1, logits.shape[-1])
    if not isinstance(rows, list) or len(rows) != lg.shape[0]:
        raise PlanError(f"sampling for {len(rows) if isinstance(rows, list) else '?'} rows of a "
                        f"{lg.shape[0]}-row export")
    return np.array([sample_row(lg[r], RowSampling.from_list(v)) for r, v in enumerate(rows)], np.int32)

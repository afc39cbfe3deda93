"""The stage worker: one backend on one device, its weights, its KV-cache layers, its own gallocr and
split plans.

A plain class, testable without Ray; `ray.remote(...)` is applied where actors are created
(workers/actor.py). The stage knows devices only through the device protocol: its spec names a device
kind and its options (backends/devices.py), and the backend opened from them holds the KV cache and the
compute arena in its buffer type, and computes every plan (bound once through its graph_plan slot where
it has one). One `compute` call per micro-batch runs every split this stage has in the graph:

    compute(plan_id, desc | None, inputs msg, *upstream msgs) -> exports msg

The first call of a graph shape carries the plan description; the stage rebuilds it, reserves its
allocator for it and keeps it. Later calls carry only the id and the inputs. Upstream messages are the
producing stages' return values; Ray resolves those ObjectRefs before the call runs, which is the event.
"""
from __future__ import annotations

import bisect
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..alloc.gallocr import Gallocr
from ..backends import host
from ..backends.base import Buffer, BufferType, DeviceInfo, GraphPlan
from ..backends.devices import open_backend
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model import layout
from ..model.gguf import load_gguf
from ..model.kv_cache import KVCache
from ..model.recurrent_state import RecurrentState
from ..model.tensor_parallel import rank_weights
from ..model.warmup import Warmup, background_compile
from ..model.weights import MAPPED_BUFT, MappedBuffer, load_weights, upload_weights
from .collective import MeshListener, mesh_connect
from .plan import PlanError, RebuiltPlan, rebuild
from .shipping import WeightManifest, WeightReceiver
from .stage_data import StageInfo, StageSpec, StageStats, rss_bytes
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


class ArenaBufferType(BufferType):
    """One compute buffer for every plan of a stage: a buffer type over the device's whose
    alloc_buffer hands out one shared buffer, grown (anew) when a plan needs more.

    A stage runs its calls one at a time and a plan's buffer is scratch between calls (its exports are
    read before the call returns), so the plans can share memory: the stage holds its largest plan's
    buffer, not the sum of its plans' (a prompt of each length is a plan of its own)."""

    def __init__(self, buft: BufferType) -> None:
        self.buft = buft
        self.name = f"{buft.name}-arena"
        self.alignment, self.max_size, self.is_host = buft.alignment, buft.max_size, buft.is_host
        self.buffer: Buffer | None = None

    def alloc_buffer(self, size: int) -> Buffer:
        if self.buffer is None or size > self.buffer.size:
            self.buffer = self.buft.alloc_buffer(size)      # plans placed in the old one are placed again
        return self.buffer

    def get_alloc_size(self, t: Tensor) -> int:
        return self.buft.get_alloc_size(t)


@dataclass(eq=False)
class StagePlan:
    """A split plan as the stage keeps it: the rebuilt graph, its allocator, and the backend's bound
    plan of it (Backend.graph_plan_create; None until its first compute, or where the backend has none)."""
    rebuilt: RebuiltPlan
    galloc: Gallocr
    bound: GraphPlan | None = None


class StageWorker:
    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        params, name = spec.params, f"stage{spec.stage_id}"
        readable = os.access(spec.model_path, os.R_OK)
        self.backend = open_backend(spec.device, name)      # sets the kernels' threads, which a compile reads
        self.warmup: Warmup | None = None
        if params.background_compile and spec.device.options.compiled and readable:
            self.warmup = background_compile(spec.model_path)
            if self.warmup is not None:              # the reference kernels (the same bits) until it is done
                opts = replace(spec.device.options, compiled=False)
                self.backend = open_backend(replace(spec.device, options=opts), name)
        self.device = self.backend.device
        self.buft = self.device.get_buffer_type()
        self.weights: dict[str, Tensor] = {}
        self._receiver = WeightReceiver()
        if readable:                                  # map our layers from the file, zero-copy
            f = load_gguf(spec.model_path)
            names = spec.weight_names(list(f.tensors), layout.tied_head(f))
            self._set_weights(load_weights(f, names, MappedBuffer(str(f.path))))
        self.kv = KVCache(spec.n_embd_k_gqa, spec.n_embd_v_gqa, params.n_ctx, spec.kv_layers,
                          params.type_k, params.type_v, params.n_seq_max, params.kv_unified)
        self.kv.allocate(self.buft)
        # the recurrent state of its layers: the driver keeps their positions, and sends row operations
        self.rs = None if not spec.recurrent else \
            RecurrentState(spec.recurrent, spec.n_embd_r, spec.n_embd_s, params.n_seq_max)
        if self.rs is not None:
            self.rs.allocate(self.buft)
        self.arena = ArenaBufferType(self.buft)
        self.kv_tensors = {t.name: t for t in (*self.kv.tensors(), *(self.rs.tensors() if self.rs else ()))}
        self.plans: OrderedDict[str, StagePlan] = OrderedDict()
        self.incarnation = os.urandom(8).hex()       # this process's life: a restart gets another
        self.stats = StageStats()
        self.computing: tuple[float, int] | None = None   # (wall start, thread id) of the call in progress
        self._wedge: threading.Event | None = None         # wedge(): the next call blocks on it

    def _set_weights(self, weights: dict[str, Tensor], sliced: bool = False) -> None:
        """sliced: the weights are this rank's rows already (sent by the driver, which ships the slices)."""
        spec = self.spec
        if spec.tp_size > 1 and not sliced:   # a rank's rows (views of the same bytes); a tied head, its vocabulary's
            assert spec.tp_hp is not None, "a tensor-parallel stage's spec carries the model's hparams"
            weights = rank_weights(weights, spec.tp_hp, spec.tp_rank, spec.tp_size, tied_head=spec.last)
        if not self.device.supports_buft(MAPPED_BUFT):          # a device that cannot read host memory
            weights = upload_weights(weights, self.buft)
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
            self._set_weights(self._receiver.mapped(), sliced=True)
            return True
        return False

    def weights_chunk(self, offset: int, data: Any) -> int:
        return self._receiver.write(offset, data)

    def finish_weights(self) -> int:
        self._receiver.finish()
        self._set_weights(self._receiver.mapped(), sliced=True)
        return sum(t.nbytes for t in self.weights.values())

    # -- info ---------------------------------------------------------------------------------------
    def info(self) -> StageInfo:
        node_id = ""
        try:
            import ray
            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        except ImportError:
            pass
        return StageInfo(self.spec.stage_id, os.getpid(), self.incarnation, os.uname().nodename, node_id,
                         self.needs_weights, self.spec.layers, sum(t.nbytes for t in self.weights.values()),
                         self.kv.nbytes + (self.rs.nbytes if self.rs else 0), self.compute_bytes(),
                         DeviceInfo.of(self.device))

    def compute_bytes(self) -> int:
        return self.arena.buffer.size if self.plans and self.arena.buffer is not None else 0

    def get_stats(self, since: float = 0.0) -> StageStats:
        """A snapshot, with the timeline's calls that ended at or after `since` (wall clock) only: the
        server's live view asks for its last second every second, not for the 10000 calls kept."""
        tl = self.stats.timeline
        i = bisect.bisect_left(tl, since, key=lambda e: e[3]) if since > 0 else 0   # ends grow: appended in order
        copies = 0 if self.rs is None else sum(a.nbytes for rows in self.rs.kept.values() for a in rows)
        return replace(self.stats, cpu_s=time.process_time(), rss_bytes=rss_bytes(), incarnation=self.incarnation,
                       state_copy_bytes=copies, timeline=tl[i:])

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

    # -- a tensor-parallel stage's exchanges with its stage's other ranks (workers/tp_stages.py) -----
    def tp_listen(self, host: str) -> str:
        """Open this rank's mesh listener on host; where the stage's other ranks reach it."""
        self._tp_listener = MeshListener(host, advertise=host)
        return self._tp_listener.address

    def tp_connect(self, addresses: list[str], secret: bytes, timeout_s: float, exchange_timeout_s: float) -> None:
        """Join the stage's mesh (every rank calls it at once); its backend's ALL_GATHER nodes exchange there."""
        coll = mesh_connect(self.spec.tp_rank, addresses, secret, self._tp_listener, timeout_s, exchange_timeout_s)
        be: Any = self.backend
        be.opts = replace(be.opts, collective=coll)

    # -- compute ------------------------------------------------------------------------------------
    def _plan(self, pid: str, desc: dict | None) -> StagePlan:
        if pid in self.plans:
            self.plans.move_to_end(pid)
            return self.plans[pid]
        if desc is None:
            raise PlanMissingError(f"stage {self.spec.stage_id}: unknown plan {pid} (restarted?) and no "
                                   f"description sent")
        rebuilt = rebuild(desc, self.weights, self.kv_tensors)
        arena = self.arena.buffer
        plan = StagePlan(rebuilt, self._allocate(rebuilt, None))
        if self.arena.buffer is not arena:           # it grew: the other plans move into the new one
            for p in self.plans.values():
                p.galloc, p.bound = self._allocate(p.rebuilt, arena), None
        self.plans[pid] = plan
        self.stats.n_plans += 1
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return plan

    def _allocate(self, plan: RebuiltPlan, old: Buffer | None) -> Gallocr:
        """Place the plan's tensors in the arena; those placed in `old` (the arena before it grew) first
        leave it."""
        if old is not None:
            for t in (*plan.graph.nodes, *plan.graph.leafs):
                if t.buffer is old:
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
            arr = t.buffer.get_tensor(t)
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
        sp = self._plan(pid, desc)                   # allocated when made (or moved with the arena):
        plan = sp.rebuilt                            # its tensors keep their addresses between calls
        got: dict[str, np.ndarray] = {}
        self.stats.bytes_in_host += len(inputs)
        sample = None
        for i, msg in enumerate((inputs, *upstream)):
            self.stats.bytes_in += len(msg)
            tensors, meta = decode(msg)
            if i == 0:
                sample = meta.get("sample")
                if meta.get("state"):                # the recurrent rows' edits asked since the last call
                    if self.rs is None:
                        raise PlanError(f"stage {self.spec.stage_id} holds no recurrent layers: {meta['state']}")
                    self.rs.apply(meta["state"])
            for wt in tensors:
                got[wt.name] = wt.data
        for key, t in plan.inputs.items():
            if key not in got:
                raise PlanError(f"stage {self.spec.stage_id}: input '{t.name}' ({key}) missing from the call")
            t.buffer.set_tensor(t, got[key])
        t1 = time.perf_counter()
        if self.warmup is not None and self.warmup.ready():     # the compiled kernels are cached now
            self.warmup = None
            host.use_compiled_kernels([self.backend])
        be = self.backend
        if be.graph_plan_compute is not None:       # bound once, replayed (the plan owns its binding)
            if sp.bound is None:
                assert be.graph_plan_create is not None
                sp.bound = be.graph_plan_create(plan.graph)
            be.graph_plan_compute(sp.bound)
        else:
            be.graph_compute(plan.graph)
        be.synchronize()
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

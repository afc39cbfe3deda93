"""Ray: start or join a cluster, create the stage actors, and give the driver a pipelined context.

    connect(address)            ray.init: join `address` (or the job's cluster), else start a local,
                                loopback-only Ray with bounded CPUs and object store
    Pipeline.launch(...)        placement -> one actor per stage -> a StageProxy per actor ->
                                driver-side weights and KV tensors bound to the stages' remote buffers
                                -> a LlamaContext whose scheduler sees [proxy_0 .. proxy_K-1, CPU]

Ray's loopback behaviour: a local Ray advertises the machine's primary address unless told otherwise;
`_node_ip_address="127.0.0.1"` keeps a started-here instance on loopback.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import BufferUsage
from ..backends.cpu import CPUDevice
from ..backends.cpu_ops import ComputeOptions
from ..core.context import Context
from ..core.graph import Graph
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model.context import ContextParams, LlamaContext, StageLostError
from ..model.kv_cache import kv_cells
from ..model.model import LlamaModel
from .placement import Placement, place
from .proxy import Call, Exports, RemoteBuffer, StageDevice, StageProxy
from .stage import PlanMissingError, StageSpec, StageWorker


class RayStartError(RuntimeError):
    """Ray could not be started or joined."""


class RecoveryError(RuntimeError):
    """A lost stage could not be brought back (no node can hold its layers)."""


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_mb: int = 512) -> str:
    """Join a cluster (address, or RAY_ADDRESS inside `ray job submit`), else start a local Ray."""
    try:
        import ray
    except ImportError as e:                     # pragma: no cover - ray is a dependency
        raise RayStartError("Ray is not installed; install ggml-dist with its dependencies "
                            "(pip install ggml-dist)") from e
    if ray.is_initialized():
        return "already connected"
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        if address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=address or os.environ["RAY_ADDRESS"], log_to_driver=True)
            return f"joined {address or os.environ['RAY_ADDRESS']}"
        ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
                 object_store_memory=object_store_mb * 2**20, _node_ip_address="127.0.0.1",
                 log_to_driver=True, configure_logging=False)
        return "started a local Ray (loopback)"
    except Exception as e:
        raise RayStartError(f"could not {'join ' + str(address) if address else 'start a local Ray'}: "
                            f"{e}; check `ray status`, or run without --address for a local instance") from e


class StageActor:
    """The Ray face of a StageWorker: results are numpy bytes, which Ray stores without pickling."""

    def __init__(self, spec: StageSpec) -> None:
        self.worker = StageWorker(spec)

    def info(self) -> dict[str, Any]:
        return self.worker.info()

    def receive_weights(self, msg: np.ndarray) -> int:
        return self.worker.receive_weights(msg)

    def stats(self) -> dict[str, Any]:
        return self.worker.get_stats()

    def ping(self) -> int:
        return self.worker.ping()

    def compute(self, pid: str, desc: dict | None, inputs: np.ndarray, *upstream: np.ndarray) -> np.ndarray:
        return np.frombuffer(self.worker.compute(pid, desc, inputs, *upstream), dtype=np.uint8)


def _lost(e: BaseException) -> bool:
    """Does this Ray error mean a stage's state is gone (actor died or restarted, objects lost)?"""
    import ray.exceptions as rex
    lost_types = tuple(t for t in (getattr(rex, n, None) for n in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
        "ObjectReconstructionFailedError", "NodeDiedError", "WorkerCrashedError",
        "ActorUnschedulableError")) if t is not None)
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, lost_types) or isinstance(e, PlanMissingError):
            return True
        e = getattr(e, "cause", None) or e.__cause__          # RayTaskError keeps the original in .cause
    return False


def _ray_call(actor: Any, stage: int, layers: tuple[int, int]) -> Call:
    import ray

    def submit(pid: str, desc: dict | None, inputs: bytearray, *ups: Any) -> Any:
        return actor.compute.remote(pid, desc, np.frombuffer(inputs, dtype=np.uint8), *ups)

    def guarded(fn):
        def call(handles: list):
            try:
                return fn(handles)
            except Exception as e:
                if _lost(e):
                    raise StageLostError(f"stage {stage} (layers {layers[0]}..{layers[1] - 1}) lost its "
                                         f"state: {type(e).__name__}", stage) from e
                raise RuntimeError(f"stage {stage} (layers {layers[0]}..{layers[1] - 1}) failed: {e}") from e
        return call

    return Call(submit, guarded(lambda hs: ray.get(hs)), guarded(lambda hs: ray.get(hs)))


@dataclass
class Pipeline:
    """The driver's view of a running pipeline: actors, proxies and the context over them."""
    model: LlamaModel
    placement: Placement
    actors: list[Any]
    proxies: list[StageProxy]
    ctx: LlamaContext
    infos: list[dict] = field(default_factory=list)
    specs: list[StageSpec] = field(default_factory=list)
    actor_cls: Any = None
    recover_timeout_s: float = 120.0

    @classmethod
    def launch(cls, model_path: str, n_stages: int, params: ContextParams = ContextParams(),
               n_copies: int | None = None, layers: list[tuple[int, int]] | None = None,
               budgets: list[int] | None = None, threads_per_stage: int = 1,
               max_restarts: int = 3, node_ids: list[str] | None = None,
               stage_model_path: str | None = None) -> "Pipeline":
        """Place the layers, start one actor per stage (spread over the nodes, or pinned to node_ids)
        and wait until every stage has mapped its weights."""
        import ray
        model = LlamaModel.load(model_path)
        hp = model.hp
        kv_size = 2 if params.type_k == GGMLType.F16 else 4
        cells, n_stream = kv_cells(params.n_ctx, params.n_seq_max, params.kv_unified)
        placement = place(model.file, hp, n_stages, cells * n_stream, kv_size, 0, 1, budgets, layers)
        actor_cls = ray.remote(num_cpus=threads_per_stage, max_restarts=max_restarts,
                               max_task_retries=0)(StageActor)
        actors, proxies, specs = [], [], []
        for sp in placement.stages:
            spec = StageSpec(sp.stage, stage_model_path or str(model.path), sp.layers, sp.stage == 0,
                             sp.stage == n_stages - 1, params.n_ctx, hp.n_embd_k_gqa, hp.n_embd_v_gqa,
                             int(params.type_k), params.n_seq_max, params.exact, threads_per_stage,
                             params.kv_unified)
            specs.append(spec)
            actor = actor_cls.options(scheduling_strategy=_strategy(node_ids, sp.stage)).remote(spec)
            actors.append(actor)
            proxies.append(StageProxy(sp.stage, sp.layers, _ray_call(actor, sp.stage, sp.layers),
                                      StageDevice(f"stage{sp.stage}")))
        infos = ray.get([a.info.remote() for a in actors])      # fail fast if a stage cannot load
        for k, info in enumerate(infos):
            if info["needs_weights"]:                           # its node cannot read the file
                _send_weights(model, specs[k], actors[k])
                infos[k] = ray.get(actors[k].info.remote())
        weights = _driver_weights(model, placement, proxies)
        cpu = CPUDevice("driver").init_backend(opts=ComputeOptions(exact=params.exact))
        stage_of = {il: p for p in proxies for il in range(*p.layers)}
        ctx = LlamaContext(model, params, backends=[*proxies, cpu],
                           n_copies=n_copies or max(1, min(4, n_stages)), weights=weights,
                           layer_buft=lambda il: stage_of[il].device.buft,
                           after_alloc=lambda sched, g: _bind_exports(sched, g, proxies))
        # the driver's allocator planned each stage's splits: that is the stage's compute buffer
        placement = Placement([dataclasses.replace(sp, compute_bytes=ctx.sched.get_buffer_size(p))
                               for sp, p in zip(placement.stages, proxies)])
        pl = cls(model, placement, actors, proxies, ctx, infos, specs, actor_cls)
        ctx.recovery = pl.recover_stages
        return pl

    # -- faults ---------------------------------------------------------------------------------------
    def kill_stage(self, k: int, timeout_s: float = 60.0) -> None:
        """Kill stage k's actor process (Ray restarts it if restarts remain): fault injection. Returns once
        the killed process is gone: ray.kill only sends the kill, and a call made right after it could
        still run on the old process, so the fault would land after the next step instead of in it."""
        import ray
        import ray.exceptions as rex
        actor = self.actors[k]
        pid = ray.get(actor.ping.remote(), timeout=timeout_s)
        ray.kill(actor, no_restart=False)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:                                # a restarted actor answers with another pid
                if ray.get(actor.ping.remote(), timeout=max(1.0, deadline - time.time())) != pid:
                    return
            except (rex.RayActorError, rex.GetTimeoutError):
                return                          # dead (for good, or not yet restarted)
            time.sleep(0.01)

    def recover_stages(self) -> None:
        """Wait until every stage answers again: Ray restarts a killed actor (on another node if its
        node is gone); a stage dead for good gets a new actor. Then forget what the stages knew
        (plans, in-flight results): the context replays its log next."""
        import ray
        import ray.exceptions as rex
        deadline = time.time() + self.recover_timeout_s
        for k in range(len(self.actors)):
            n_dead = 0
            while True:
                left = deadline - time.time()
                try:
                    ray.get(self.actors[k].ping.remote(), timeout=max(1.0, left))
                    if ray.get(self.actors[k].info.remote())["needs_weights"]:
                        _send_weights(self.model, self.specs[k], self.actors[k])
                    break
                except rex.GetTimeoutError:
                    raise self._unrecoverable(k) from None
                except rex.RayActorError:
                    # a restarting actor queues the ping; one that keeps refusing is dead for good
                    n_dead += 1
                    if left <= 0:
                        raise self._unrecoverable(k) from None
                    if n_dead >= 3:
                        self._replace(k)
                        n_dead = 0
                    time.sleep(0.2)
        for p in self.proxies:
            p.reset()

    def _replace(self, k: int) -> None:
        """A new actor for stage k, anywhere it fits (its old one is dead for good)."""
        sp = self.specs[k]
        actor = self.actor_cls.options(scheduling_strategy="SPREAD").remote(sp)
        self.actors[k] = actor
        self.proxies[k].call = _ray_call(actor, k, sp.layers)

    def _unrecoverable(self, k: int) -> RecoveryError:
        s = self.placement.stages[k]
        return RecoveryError(
            f"stage {k} (layers {s.layers[0]}..{s.layers[1] - 1}) did not come back within "
            f"{self.recover_timeout_s:.0f} s: no node could take it (it needs "
            f"{(s.weight_bytes + s.kv_bytes) / 2**20:.1f} MiB: weights {s.weight_bytes / 2**20:.1f}, "
            f"KV {s.kv_bytes / 2**20:.1f}); add a node with that much memory and retry")

    def stats(self) -> list[dict]:
        import ray
        return ray.get([a.stats.remote() for a in self.actors], timeout=30)

    def write_trace(self, path: str) -> None:
        """Chrome/Perfetto trace: one track per stage actor, one slice per micro-batch split it ran."""
        import json
        stats = self.stats()
        t0 = min((e[0] for st in stats for e in st["timeline"]), default=0.0)
        events: list[dict] = []
        for k, st in enumerate(stats):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": k,
                           "args": {"name": f"stage{k} layers {self.placement.stages[k].layers}"}})
            for i, (a, b, label) in enumerate(st["timeline"]):
                events.append({"name": f"mb{i} plan {label}", "ph": "X", "pid": 1, "tid": k,
                               "ts": round((a - t0) * 1e6, 1), "dur": round((b - a) * 1e6, 1)})
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)

    def shutdown(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)
        self.actors.clear()


def _send_weights(model: LlamaModel, spec: StageSpec, actor: Any) -> None:
    """Send a stage the bytes of its layers' weights, once, as one wire message (quantized as stored)."""
    import ray
    from ..backends.base import tensor_array
    from .wire import WireTensor, encode
    names = spec.weight_names(list(model.weights), "output.weight" not in model.weights)
    msg = encode([WireTensor(n, model.weights[n].type, model.weights[n].ne, tensor_array(model.weights[n]))
                  for n in names])
    ray.get(actor.receive_weights.remote(np.frombuffer(msg, dtype=np.uint8)))


def _strategy(node_ids: list[str] | None, stage: int) -> Any:
    """SPREAD over the cluster's nodes, or node_ids[stage] (soft: if that node is lost, Ray may restart
    the stage on another node that has room)."""
    if not node_ids:
        return "SPREAD"
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(node_id=node_ids[stage % len(node_ids)], soft=True)


def _bind_exports(sched: Any, graph: Graph, proxies: list[StageProxy]) -> None:
    ex = Exports.of(sched, graph)
    for p in proxies:
        p.exports = ex


def _driver_weights(model: LlamaModel, placement: Placement, proxies: list[StageProxy]) -> dict[str, Tensor]:
    """The weights as the driver's graph sees them: metadata bound to the owning stage's buffer type
    (usage WEIGHTS), so the scheduler's weight rule sends each layer's ops to its stage."""
    n = len(proxies)
    ctx = Context(len(model.weights) * 400 + 4096, no_alloc=True, name="driver-weights")
    bufs = [RemoteBuffer(p.device.buft, 0, BufferUsage.WEIGHTS) for p in proxies]
    owner = {il: k for k, s in enumerate(placement.stages) for il in range(*s.layers)}
    out: dict[str, Tensor] = {}
    for name, w in model.weights.items():
        if name.startswith("blk."):
            k = owner[int(name.split(".")[1])]
        elif name == "token_embd.weight":
            k = 0
        else:
            k = n - 1
        t = ctx.new_tensor(w.type, w.ne).set_name(name)
        t.buffer, t.data = bufs[k], w.data
        out[name] = t
    if "output.weight" not in out:                # tied head: the last stage's own mapping of it
        w = model.weights["token_embd.weight"]
        t = ctx.new_tensor(w.type, w.ne).set_name("output.weight")
        t.buffer, t.data = bufs[n - 1], w.data
        out["output.weight"] = t
    return out


def wait_ready(actors: list[Any], timeout_s: float = 120.0) -> None:
    import ray
    t0 = time.time()
    ray.get([a.ping.remote() for a in actors], timeout=max(1.0, timeout_s - (time.time() - t0)))

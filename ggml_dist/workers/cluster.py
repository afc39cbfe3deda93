"""A pipeline of stage actors on Ray: create them, give the driver a pipelined context, bring lost
stages back.

    Pipeline.launch(...)        placement (on the cluster's nodes, by their memory, when joined) -> one
                                actor per stage (workers/actor.py), reserving its memory, CPUs and what
                                its device kind needs, pinned to its node -> weights shipped to stages
                                that cannot read the file -> a StageProxy per actor, describing the
                                stage's device as it answered -> a LlamaContext whose scheduler sees
                                [proxy_0 .. proxy_K-1, CPU]
    Pipeline.recover_stages()   after a StageLostError: a stage that stopped answering is replaced on
                                another node with room; one that Ray restarts is waited for

Ray itself is started or joined by workers/local_ray.py.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..backends.devices import DeviceKind, DeviceSpec, ray_resources
from ..model import layout
from ..model.context import ContextParams, LlamaContext
from ..model.model import LlamaModel
from ..model.tensor_parallel import rank_model
from .actor import StageActor, _ray_call, _stage_error
from .compiled import CompiledChain
from .direct import DirectChain, fall_back_line
from .driver import DriverPipeline, default_copies, driver_context, plan_stages, stage_kinds
from .health import StageWatch
from .local_ray import started_local
from .placement import STAGE_OVERHEAD_BYTES, NodeInfo, Placement, PlacementError
from .proxy import Call, StageDevice, StageProxy
from .resources import cluster_nodes, stage_options
from .shipping import WeightManifest, manifest, ship
from .stage_data import StageInfo, StageSpec, StageStats, recurrent_fields
from .timeline import trace_events
from .tp_plan import rank_placement


class RecoveryError(RuntimeError):
    """A lost stage could not be brought back (no node can hold its layers)."""


def _pinned(placement: Placement, node_ids: list[str], overhead: int) -> Placement:
    """Stage k on node_ids[k % len]: the caller chose the nodes (their memory is not checked)."""
    known = {n.node_id: n for n in cluster_nodes(available=False)}
    out = []
    for s in placement.stages:
        node = known.get(node_ids[s.stage % len(node_ids)])
        if node is None:
            raise PlacementError(f"node {node_ids[s.stage % len(node_ids)]} for stage {s.stage} is not an alive "
                                 f"node of the cluster")
        out.append(dataclasses.replace(s, overhead_bytes=overhead, node_ip=node.ip, node_id=node.node_id,
                                       node_memory_bytes=node.memory_bytes))
    return Placement(out)


def compiled_fits(placement: Placement, threads: int, on_nodes: bool) -> bool:
    """Does every process that waits on the compiled graph's channels have cores of its own? A waiting
    reader spins (Ray's channels poll with sched_yield) where a plain call's waiter sleeps: a stage
    needs its threads' cores on its node, the driver one on its own, or the spinning takes the cores
    the kernels need (on a 2-core VM, 1 stage decoded 1.43x faster compiled, 2 stages no faster than
    plain). Local Ray: the cores this process may use; on nodes: each node's Ray CPUs."""
    if not on_nodes:
        return len(placement.stages) * threads + 1 <= len(os.sched_getaffinity(0))
    import ray
    need: dict[str, float] = {ray.get_runtime_context().get_node_id(): 1}       # the driver's node
    for s in placement.stages:
        need[s.node_id] = need.get(s.node_id, 0) + threads
    cpus = {n.node_id: n.cpus for n in cluster_nodes(available=False)}
    return all(cpus.get(n, 0.0) >= k for n, k in need.items())


@dataclass
class Pipeline:
    """The driver's view of a running pipeline: actors, proxies and the context over them."""
    model: LlamaModel
    placement: Placement
    actors: list[Any]
    proxies: list[StageProxy]
    ctx: LlamaContext
    infos: list[StageInfo | None] = field(default_factory=list)   # as each stage last described itself
    specs: list[StageSpec] = field(default_factory=list)
    actor_cls: Any = None
    watch: StageWatch = field(default_factory=lambda: StageWatch(str))
    threads: int = 1
    on_nodes: bool = False                 # placed on the cluster's nodes by their memory
    recover_timeout_s: float = 120.0
    ping_timeout_s: float = 10.0           # a stage that does not answer a ping in recovery is replaced
    launch_timeout_s: float = 300.0
    manifests: dict[int, tuple[list[str], WeightManifest]] = field(default_factory=dict)
    chain: CompiledChain | None = None     # the stage calls as a compiled graph (None: plain calls)
    direct: DirectChain | None = None      # the stage calls as frames on sockets (workers/direct.py)
    hooks: DriverPipeline | None = None    # a tensor-parallel rank's pipeline: its context's hooks (no ctx)

    @classmethod
    def launch(cls, model_path: str, n_stages: int | None, params: ContextParams | None = None,
               n_copies: int | None = None, layers: list[tuple[int, int]] | None = None,
               budgets: list[int] | None = None, threads_per_stage: int = 1,
               max_restarts: int = 3, node_ids: list[str] | None = None,
               stage_model_path: str | None = None, nodes: list[NodeInfo] | None = None,
               on_plan: Callable[[Placement], None] | None = None, calls: str = "auto",
               devices: list[DeviceKind] | None = None, rank: tuple[int, int] = (0, 1)) -> Pipeline:
        """Place the layers (n_stages None: the fewest stages that fit the cluster's nodes), start one
        actor per stage and wait until every stage holds its weights. On a cluster this process joined
        (not a local Ray it started), stages go one per node, sized by the nodes' Ray memory; node_ids
        limits them to those nodes. on_plan sees the placement before any actor starts. calls:
        "compiled" runs a step's stage calls as one execution of a Ray Compiled Graph
        (workers/compiled.py), "plain" as actor calls, "auto" picks (compiled_fits). devices: each
        stage's device kind (one for all, or one per stage; default the CPU). rank (r, K): the pipeline of
        rank r of K of a tensor-parallel group per stage (workers/tp_stages.py): its stages hold its rows,
        are not restarted (their stage's mesh is not remade), and its context is the caller's to make
        (ctx None; its hooks are)."""
        if calls not in ("auto", "direct", "compiled", "plain"):
            raise ValueError(f"calls must be 'auto', 'direct', 'compiled' or 'plain', not {calls!r}")
        import ray
        if params is None:
            params = ContextParams()
        model = full = LlamaModel.load(model_path)
        if rank[1] > 1:
            model = rank_model(full, *rank)
        if nodes is None and not node_ids and not started_local() and budgets is None and rank[1] == 1:
            nodes = cluster_nodes()
        # the one memory account (driver.plan_stages): what `plan` prints, and run's table and --json
        placement = plan_stages(full, params, n_stages if nodes is not None else n_stages or 1, nodes=nodes,
                                budgets=budgets, layers=layers, threads=threads_per_stage, kinds=devices)
        if rank[1] > 1:
            placement = rank_placement(placement, full, *rank)
        if nodes is None and node_ids:           # stage k on node_ids[k], as the caller says
            placement = _pinned(placement, node_ids, STAGE_OVERHEAD_BYTES)
        if on_plan is not None:
            on_plan(placement)
        n = len(placement.stages)
        actor_cls = ray.remote(max_restarts=max_restarts if rank[1] == 1 else 0, max_task_retries=0)(StageActor)
        pl = cls(model, placement, [], [], None, [], [], actor_cls,  # type: ignore[arg-type]
                 threads=threads_per_stage, on_nodes=nodes is not None or bool(node_ids))
        pl.watch = StageWatch(pl._describe)
        if calls in ("auto", "direct"):
            pl.direct = DirectChain(n, lambda: pl.actors, pl.watch,
                                    pl._incarnation,
                                    pl._describe)
        elif calls == "compiled":
            pl.chain = CompiledChain(n, lambda: pl.actors, pl._plain_call, pl.watch,
                                     pl._incarnation,
                                     lambda e: _stage_error(e, "a stage of the compiled graph"))
        options = params.backend_options(threads_per_stage)
        for sp, kind in zip(placement.stages, stage_kinds(devices, n)):
            pl.specs.append(StageSpec(sp.stage, stage_model_path or str(model.path), sp.layers, sp.stage == 0,
                                      sp.stage == n - 1, params, model.hp.n_embd_k_gqa, model.hp.n_embd_v_gqa,
                                      DeviceSpec(kind, options), **recurrent_fields(model.hp, sp.layers),
                                      tp_rank=rank[0], tp_size=rank[1], tp_hp=full.hp if rank[1] > 1 else None))
            pl.actors.append(actor_cls.options(**pl._actor_options(k=sp.stage)).remote(pl.specs[-1]))
        pl.infos = [None] * n
        pl.watch.addresses = [""] * n
        for k in range(n):
            pl._await_stage(k, pl.launch_timeout_s)
        for sp, info in zip(placement.stages, pl.infos):      # each stage's device, as it described itself
            assert info is not None, f"stage {sp.stage} awaited but not described"
            pl.proxies.append(StageProxy(sp.stage, sp.layers, pl._call(sp.stage),
                                         StageDevice(f"stage{sp.stage}", info.device)))
        pl._connect_direct()
        copies = n_copies or default_copies(n)
        if rank[1] == 1:
            pl.ctx = driver_context(model, params, placement, pl.proxies, copies, pl.recover_stages)
        else:
            pl.hooks = DriverPipeline(model, params, placement, pl.proxies, copies)
        return pl

    def _incarnation(self, k: int) -> str | None:
        """The incarnation stage k last described (a call for another is refused there)."""
        info = self.infos[k] if k < len(self.infos) else None
        return None if info is None else info.incarnation

    def _actor_options(self, k: int) -> dict[str, Any]:
        """Stage k's actor's Ray options: its memory and CPUs (resources.stage_options), and what its
        device kind reserves besides."""
        return {**stage_options(self.placement.stages[k], self.threads), **ray_resources(self.specs[k].device.kind)}

    def _call(self, k: int) -> Call:
        """How stage k's proxy reaches its actors: direct links, the compiled chain, or plain calls."""
        if self.direct is not None:
            return self.direct.call(k)
        return self._plain_call(k) if self.chain is None else self.chain.call(k)

    def _connect_direct(self) -> None:
        """Open the direct links (after launch, and after a recovery); where they cannot be opened (a
        firewall between the nodes, say), the calls go as plain Ray calls from then on."""
        if self.direct is None:
            return
        try:
            self.direct.connect()
        except Exception as e:  # noqa: BLE001 - plain calls work wherever Ray does
            fall_back_line(f"the direct links could not be opened ({type(e).__name__}: {e})")
            self.direct.reset()
            self.direct = None
            for k, p in enumerate(self.proxies):
                p.call = self._plain_call(k)

    def _plain_call(self, k: int) -> Call:
        """Plain calls to stage k's current actor; each call names the incarnation the driver last saw
        (info()), so a restarted process refuses calls meant for the one before it."""
        return _ray_call(self.actors[k], k, self.placement.stages[k].layers, self.watch,
                         lambda: self._incarnation(k))

    def _describe(self, k: int) -> str:
        s = self.placement.stages[k]
        return f"stage {k} (layers {s.layers[0]}..{s.layers[1] - 1}){' on ' + s.node_ip if s.node_ip else ''}"

    def _await_stage(self, k: int, timeout_s: float) -> None:
        """Wait for stage k's actor to start (Ray may hold it until a node has the resources it
        reserves), give it its weights if its node cannot read the file, and learn its health port."""
        import ray
        import ray.exceptions as rex
        try:
            info = ray.get(self.actors[k].info.remote(), timeout=timeout_s)
        except rex.GetTimeoutError:
            s = self.placement.stages[k]
            raise PlacementError(f"{self._describe(k)} did not start within {timeout_s:.0f} s: Ray found no node "
                                 f"with {s.total_bytes / 2**20:.1f} MiB of memory and {self.threads} CPU(s) "
                                 f"free for it (see `ray status`)") from None
        if info.needs_weights:                              # its node cannot read the file
            self._give_weights(k)
            info = ray.get(self.actors[k].info.remote(), timeout=timeout_s)
        self.infos[k] = info
        self.watch.addresses[k] = info.health

    def _give_weights(self, k: int) -> None:
        """Ship stage k its weights: self.model's (a tensor-parallel rank's: its rows, sent as they are; a
        tied head there is its own rows of token_embd, output.weight, so the last stage gets those alone)."""
        spec = self.specs[k]
        if k not in self.manifests:
            tied = self.model.hp.tie_word_embeddings and layout.HEAD not in self.model.weights
            names = spec.weight_names(list(self.model.weights), tied)
            self.manifests[k] = (names, manifest(self.model.weights, names))
        names, m = self.manifests[k]
        ship(self.model.weights, names, m, self.actors[k], self._describe(k))

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

    def wedge_stage(self, k: int) -> None:
        """Make stage k's next call block without using CPU (fault injection: a wedged compute, whose
        process still answers its health port)."""
        import ray
        ray.get(self.actors[k].wedge.remote(), timeout=60)

    def recover_stages(self) -> None:
        """Bring every stage back, then forget what the stages knew (plans, in-flight results): the
        context replays its log next. A stage the watch found unreachable is replaced on another node
        at once; Ray restarts a killed actor (on another node if its node is gone), and a stage that
        stays dead, or does not answer a ping within ping_timeout_s (its calls wait on a result that
        is not coming), gets a new actor."""
        import ray
        import ray.exceptions as rex
        t0 = time.time()
        if self.chain is not None:
            self.chain.reset(lost=True)
        if self.direct is not None:
            self.direct.reset()
        bad_nodes = {i.node_id for k in self.watch.lost if (i := self.infos[k]) is not None} - {""}
        for k in sorted(self.watch.lost):
            self._replace(k, bad_nodes)
        self.watch.lost.clear()
        deadline = time.time() + self.recover_timeout_s
        for k in range(len(self.actors)):
            n_dead = 0
            while True:
                left = deadline - time.time()
                if left <= 0:
                    raise self._unrecoverable(k)
                try:
                    ray.get(self.actors[k].ping.remote(), timeout=min(left, self.ping_timeout_s))
                    self._await_stage(k, max(1.0, left))
                    break
                except rex.GetTimeoutError:
                    self._replace(k, bad_nodes)
                except rex.RayActorError:
                    n_dead += 1                 # a restarting actor queues the ping; one that keeps
                    if n_dead >= 3:             # refusing is dead for good
                        self._replace(k, bad_nodes)
                        n_dead = 0
                    time.sleep(0.2)
        for p in self.proxies:
            p.reset()
        self._connect_direct()
        print(f"ggml-dist: every stage answers again after {time.time() - t0:.1f} s; replaying the KV log",
              file=sys.stderr, flush=True)

    def _replace(self, k: int, bad_nodes: set[str]) -> None:
        """A new actor for stage k (its old one is killed): on a node with room for it, not one of
        `bad_nodes` nor one holding another stage, when placed on nodes; anywhere it fits otherwise."""
        import ray
        ray.kill(self.actors[k], no_restart=True)
        sp = self.placement.stages[k]
        if self.on_nodes:
            node = self._node_for(k, bad_nodes)
            if node is None:
                raise self._unrecoverable(k)
            sp = dataclasses.replace(sp, node_ip=node.ip, node_id=node.node_id, node_memory_bytes=node.memory_bytes)
            self.placement.stages[k] = sp
            print(f"ggml-dist: {self._describe(k)}: a new stage actor", file=sys.stderr, flush=True)
        self.actors[k] = self.actor_cls.options(**self._actor_options(k)).remote(self.specs[k])
        self.proxies[k].call = self._call(k)
        self.watch.addresses[k] = ""

    def _node_for(self, k: int, bad_nodes: set[str]) -> NodeInfo | None:
        sp = self.placement.stages[k]
        others = {s.node_id for j, s in enumerate(self.placement.stages) if j != k}
        fits = []
        for n in cluster_nodes(available=True):
            free = n.memory_bytes + (sp.total_bytes if n.node_id == sp.node_id else 0)   # its own, freed
            if n.node_id not in bad_nodes | others and n.cpus >= self.threads and free >= sp.total_bytes:
                fits.append(n)
        return max(fits, key=lambda n: (n.node_id == sp.node_id, n.memory_bytes), default=None)

    def _unrecoverable(self, k: int) -> RecoveryError:
        s = self.placement.stages[k]
        return RecoveryError(
            f"{self._describe(k)} did not come back within {self.recover_timeout_s:.0f} s: no node could "
            f"take it (it needs {s.total_bytes / 2**20:.1f} MiB: weights {s.weight_bytes / 2**20:.1f}, "
            f"KV {s.kv_bytes / 2**20:.1f}, compute {s.compute_bytes / 2**20:.1f}, process "
            f"{s.overhead_bytes / 2**20:.1f}); add a node with that much memory and retry")

    def feeds_tokens(self) -> bool:
        """Whether a step's token input can be a result handle (LlamaContext.submit(tokens_from=)): plain
        calls; a compiled graph's executions take their inputs from the driver."""
        return self.chain is None or not self.chain.enabled

    def calls_used(self) -> str:
        """How the steps so far reached the stages: "direct", "compiled", "plain", or "compiled, then
        plain" (a fall-back: workers/compiled.py says why on stderr)."""
        if self.direct is not None:
            return "direct"
        c = self.chain
        if c is None or not c.n_executions:
            return "plain"
        return "compiled" if c.enabled else "compiled, then plain"

    def stats(self, since: float = 0.0) -> list[StageStats]:
        import ray
        return ray.get([a.stats.remote(since) for a in self.actors], timeout=30)

    def poll_stats(self, since: float, timeout_s: float) -> list[StageStats | None]:
        """Each stage's stats with its timeline since `since` (wall clock), None for a stage that did not
        answer within timeout_s (lost, restarting, or its calls queued past it): the server's live view,
        which must show a lost stage as lost rather than wait for it."""
        import ray
        refs = [a.stats.remote(since) for a in self.actors]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout_s)[0])
        out: list[StageStats | None] = []
        for r in refs:
            try:
                out.append(ray.get(r) if r in ready else None)
            except ray.exceptions.RayError:
                out.append(None)
        return out

    def write_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the stages' calls so far: a track per stage, one per hop between
        stages (queueing and transfer), flow arrows per micro-batch (workers/timeline.py)."""
        import json
        timelines = [st.timeline for st in self.stats()]
        names = [f"stage{k} layers {s.layers}" for k, s in enumerate(self.placement.stages)]
        with open(path, "w") as f:
            json.dump({"traceEvents": trace_events(timelines, names)}, f)

    def shutdown(self) -> None:
        import ray
        if self.chain is not None:
            self.chain.reset()
        if self.direct is not None:
            self.direct.reset()
        for a in self.actors:
            ray.kill(a)
        self.actors.clear()

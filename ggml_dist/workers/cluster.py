"""Ray: start or join a cluster, create the stage actors, and give the driver a pipelined context.

    connect(address)            ray.init: join `address` (or the job's cluster), shipping the ggml_dist
                                package to the job's workers (py_modules), else start a local,
                                loopback-only Ray with bounded CPUs and object store
    shutdown_local()            end that local Ray, every process of it (atexit runs it too)
    Pipeline.launch(...)        placement (on the cluster's nodes, by their memory, when joined) -> one
                                actor per stage, reserving its memory and CPUs, pinned to its node ->
                                a StageProxy per actor -> weights shipped to stages that cannot read the
                                file -> a LlamaContext whose scheduler sees [proxy_0 .. proxy_K-1, CPU]
    Pipeline.recover_stages()   after a StageLostError: a stage that stopped answering is replaced on
                                another node with room; one that Ray restarts is waited for

Ray's loopback behaviour: on Linux `ray.init(_node_ip_address="127.0.0.1")` is rewritten to the
machine's primary address (services.resolve_ip_for_localhost), and with it every server of the
instance listens on all interfaces or on that address. Ray's local-only mode keeps the address:
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (the mode it uses on Windows and macOS), under which the node IP
is 127.0.0.1, and Ray's gRPC servers (GCS, raylet, object manager, core workers), its agents and its
metrics ports all bind to it (see _loopback_only: Ray parses the variable when it is imported).

Ray's daemons die with the thread that started them (PR_SET_PDEATHSIG is tied to the forking thread),
and the raylet's agents outlive a raylet that is killed rather than stopped: so a local Ray is started
from a thread that lives until shutdown_local, which stops it and then ends what is left by pid.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backends.base import DeviceInfo
from ..backends.devices import DeviceKind, DeviceSpec, ray_resources
from ..model.context import ContextParams, LlamaContext, StageLostError
from ..model.model import LlamaModel
from .compiled import CompiledChain
from .direct import DirectChain, fall_back_line
from .driver import default_copies, driver_context, plan_stages, stage_kinds
from .health import HealthServer, StageWatch
from .placement import STAGE_OVERHEAD_BYTES, NodeInfo, Placement, PlacementError
from .proxy import Call, StageDevice, StageProxy
from .resources import cluster_nodes, stage_options
from .shipping import WeightManifest, manifest, ship
from .stage import PlanMissingError, StageSpec, StageWorker
from .stage_loop import StageLoop
from .timeline import trace_events
from .wire import Message, ray_payload


class RayStartError(RuntimeError):
    """Ray could not be started or joined."""


class RecoveryError(RuntimeError):
    """A lost stage could not be brought back (no node can hold its layers)."""


_started_local = False       # this process started the Ray it is connected to (one machine)


@dataclass(slots=True)
class _LocalRay:
    """What a started-here Ray is made of: its processes, and the thread that started them."""
    procs: dict[int, int]                 # pid -> start time (ticks since boot): survives pid reuse
    release: threading.Event | None       # lets the owner thread end (None: the main thread started it)


_local: _LocalRay | None = None
# held by a local start from before its ray.init until its processes are recorded in _local:
# shutdown_local takes it, so a stop that comes while a local Ray starts (a server's engine thread
# starts it) waits for the start and then ends every process of it
_start_lock = threading.Lock()


def connect(address: str | None = None, num_cpus: int | None = None,
            object_store_mb: int = 512, verbose: bool | None = None) -> str:
    """Join a cluster (address, or RAY_ADDRESS inside `ray job submit`), else start a local Ray.

    Joining reads Ray's token as `ray start` does (_token_auth: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
    ~/.ray/auth_token turn token auth on where RAY_AUTH_MODE is unset; a bare ray.init(address) does
    not, and a cluster with token auth then refuses it), and joins a loopback head (127.0.0.1) in Ray's
    local-only mode, as it was started (_loopback_only; else Ray rewrites the address to the machine's
    own and finds no GCS there). Ray's own notices (its token-auth notice, "Connecting to existing Ray
    cluster", the packaging of the code it ships, the SIGTERM handler it cannot set from a thread, and
    the C++ failure handler's "*** SIGTERM received ... PC: @" report of a clean stop) stay out of the
    output unless verbose (default: $GGML_DIST_VERBOSE, which `--verbose` sets)."""
    global _started_local
    try:
        import ray
    except ImportError as e:                     # pragma: no cover - ray is a dependency
        raise RayStartError("Ray is not installed; install ggml-dist with its dependencies "
                            "(pip install ggml-dist)") from e
    if ray.is_initialized():
        return "already connected"
    if verbose is None:
        verbose = os.environ.get("GGML_DIST_VERBOSE", "") in ("1", "true", "yes")
    shutdown_local()                 # what is left of a local Ray that a bare ray.shutdown() stopped
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    target = address or os.environ.get("RAY_ADDRESS")
    try:
        with _quiet_ray(verbose):
            if target:
                token = _token_auth()
                with _loopback_only() if _loopback_target(target) else contextlib.nullcontext():
                    ray.init(address=target, log_to_driver=True, runtime_env=_code_runtime_env(),
                             configure_logging=verbose)
                _started_local = False
                return f"joined {target}{' (token auth)' if token else ''}"
            # address "local": a new instance, even where a `ray start` this process was not asked to join
            # runs here (a bare ray.init() would join it, and refuse num_cpus)
            _start_local(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2),
                         include_dashboard=False, object_store_memory=object_store_mb * 2**20,
                         _node_ip_address="127.0.0.1", log_to_driver=True, configure_logging=False)
        _started_local = True
        return "started a local Ray (loopback)"
    except Exception as e:
        hint = ""
        if target and "uthentication" in str(e):
            hint = ("; the cluster uses token auth: put its token in ~/.ray/auth_token (or RAY_AUTH_TOKEN_PATH, "
                    "RAY_AUTH_TOKEN) here and set RAY_AUTH_MODE=token")
        raise RayStartError(f"could not {'join ' + target if target else 'start a local Ray'}: "
                            f"{e}{hint}; check `ray status`, or run without --address for a local instance") from e


def _token_auth() -> bool:
    """Ray's token auth for a join, as its CLI's `ray start` decides it: RAY_AUTH_MODE as set, else on
    where a token is found (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token). A Ray without token
    auth: off. The mode goes into os.environ, so the processes this one starts inherit it."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode is not None:
        return mode.lower() == "token"
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:                          # a Ray before token auth (2.60's)
        return False
    return bool(maybe_enable_token_auth_if_token_available(warn_if_disabled=False))


def _loopback_target(target: str) -> bool:
    host = target.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


@contextmanager
def _quiet_ray(verbose: bool) -> Iterator[None]:
    """While Ray starts or joins: its Python loggers at ERROR (the notices are info lines and warnings,
    and the log records of a ray.init with configure_logging=False reach only Python's last-resort
    handler, which prints warnings), and no C++ failure-signal handler in this process (with it a clean
    SIGTERM prints a stack report that reads as a crash, and it aborts the process 3 s later). verbose:
    Ray as it is."""
    if verbose:
        yield
        return
    import logging

    from ray._private import ray_constants
    lg = logging.getLogger("ray")
    level, handler = lg.level, ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER
    lg.setLevel(logging.ERROR)
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True     # read when this process's core worker starts
    try:
        yield
    finally:
        lg.setLevel(level)
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = handler


@contextmanager
def _loopback_only() -> Iterator[None]:
    """Ray's local-only mode while a local instance starts: the node IP stays 127.0.0.1, and every
    process of the instance binds to it. Those processes inherit the variable (the raylet hands it on
    to the workers it starts later). Ray parsed it when `ray` was imported, so its parsed value is set
    too; both get their old values back afterwards, so that a later join of a real cluster from this
    process sees the machine's address."""
    from ray._private import ray_constants
    var = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    env, parsed = os.environ.get(var), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[var], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = parsed
        if env is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = env


def _start_local(**init_kwargs: Any) -> None:
    """ray.init of a local instance, from a thread that lives as long as the instance: the main
    thread, or else (serve loads the model in a worker thread) a daemon thread of its own, which
    shutdown_local lets go. Records the instance's processes, and registers shutdown_local."""
    global _local
    import ray
    with _start_lock:
        before = set(_children(os.getpid()))
        with _loopback_only():
            if threading.current_thread() is threading.main_thread():
                ray.init(**init_kwargs)
                release = None
                # ray.init set SIGTERM to sys.exit, but its core worker then put absl's failure handler
                # in front, which aborts the process 3 s later; a stop takes longer than that
                signal.signal(signal.SIGTERM, exit_on_signal)
            else:
                release = _init_in_owner_thread(init_kwargs)
        table = _proc_table()
        roots = [p for p in _children(os.getpid(), table) if p not in before]
        _local = _LocalRay(_descendants(roots, table), release)   # daemons + agents; workers come later
    atexit.unregister(shutdown_local)
    atexit.register(shutdown_local)             # after Ray's own atexit hook, so it runs before it


def _init_in_owner_thread(init_kwargs: dict[str, Any]) -> threading.Event:
    import ray
    started, release = threading.Event(), threading.Event()
    error: list[BaseException] = []

    def own() -> None:
        try:
            ray.init(**init_kwargs)
        except BaseException as e:  # noqa: BLE001 - not carried on: re-raised in the caller's thread
            error.append(e)
        started.set()
        if not error:
            release.wait()

    threading.Thread(target=own, name="ggml-dist-ray-owner", daemon=True).start()
    started.wait()
    if error:
        raise error[0]
    return release


def exit_on_signal(signum: int, frame: Any) -> None:
    """A SIGTERM handler that unwinds (finally blocks, atexit) instead of dying on the spot."""
    raise SystemExit(128 + signum)


def shutdown_local(timeout_s: float = 5.0) -> None:
    """End the local Ray this process started, every process of it: ray.shutdown() stops the daemons
    it spawned, and they their workers and agents; whatever is still there timeout_s later is killed,
    by pid (an agent whose raylet was killed rather than stopped stays up). Does nothing when this
    process joined a cluster, or started none; safe to call twice. A local start in progress (in
    another thread) is waited for first, up to a minute."""
    global _local, _started_local
    locked = _start_lock.acquire(timeout=60)
    try:
        local, _local = _local, None
    finally:
        if locked:
            _start_lock.release()
    if local is None:
        return
    import ray
    procs = {**local.procs, **_descendants(list(local.procs), _proc_table())}   # with the workers
    try:
        ray.shutdown(wait_for_processes=True)
    finally:
        _started_local = False
        if local.release is not None:
            local.release.set()
        _end_processes(procs, timeout_s)


# -- processes by pid (/proc) -------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, start time, state) of every process, from /proc/<pid>/stat."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()   # comm, in parentheses, may hold spaces
            except OSError:
                continue                                      # gone meanwhile
            table[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def _children(pid: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    return [p for p, (ppid, _, _) in (table or _proc_table()).items() if ppid == pid]


def _descendants(roots: list[int], table: dict[int, tuple[int, int, str]]) -> dict[int, int]:
    """roots and everything below them that is alive: pid -> start time."""
    out: dict[int, int] = {}
    todo = [p for p in roots if p in table]
    while todo:
        p = todo.pop()
        if p not in out:
            out[p] = table[p][1]
            todo += _children(p, table)
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    """Those of procs still running (a zombie has ended; a pid with another start time is another
    process)."""
    table = _proc_table()
    return {p: t for p, t in procs.items() if p in table and table[p][1] == t and table[p][2] != "Z"}


def _end_processes(procs: dict[int, int], timeout_s: float) -> None:
    """Wait up to timeout_s for procs to end, then SIGKILL the rest, and wait for them too."""
    deadline = time.monotonic() + timeout_s
    left = _alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _alive(procs)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5.0
    while _alive(left) and time.monotonic() < deadline:
        time.sleep(0.05)


def _code_runtime_env() -> dict | None:
    """Ship this ggml_dist package to the job's workers (py_modules), so a node with Ray and the
    dependencies but without ggml-dist runs its stage, and every node runs the driver's code. Not when
    the job brings its own code (py_modules or pip in `ray job submit --runtime-env-json`: Ray refuses
    two values of one field), or GGML_DIST_SHIP_CODE=0."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR
    if os.environ.get("GGML_DIST_SHIP_CODE", "1") == "0":
        return None
    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR, "{}")).get("runtime_env") or {}
    if job.get("py_modules") or job.get("pip"):
        return None
    import ggml_dist
    return {"py_modules": [os.path.dirname(os.path.abspath(ggml_dist.__file__))],
            "excludes": ["__pycache__", "*.pyc", "*.nbi", "*.nbc"]}


def local_ray_cpu_s() -> dict[int, float]:
    """pid -> CPU seconds (user + system, every thread) of each live process of the local Ray this process
    started: its daemons, agents and workers (the stage actors among them). Empty when it joined a
    cluster."""
    if _local is None:
        return {}
    table = _proc_table()
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _descendants(list(_local.procs), table):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def started_local() -> bool:
    return _started_local


class StageActor:
    """The Ray face of a StageWorker: messages in and out are wire.ray_payload's (bytes or arrays). A
    health port on the node's IP answers while the stage's calls queue (workers/health.py)."""

    def __init__(self, spec: StageSpec) -> None:
        import ray

        from ..backends.cpu.compile_progress import install
        install(f"stage {spec.stage_id}")         # its compiles reach the driver's log (log_to_driver)
        self.worker = StageWorker(spec)
        self.health = HealthServer(ray.util.get_node_ip_address(), self.worker.progress)
        self.loop: StageLoop | None = None

    def info(self) -> dict[str, Any]:
        import ray
        return {**self.worker.info(), "health": self.health.address, "node_ip": ray.util.get_node_ip_address()}

    def open_weights(self, m: dict) -> bool:
        return self.worker.open_weights(m)

    def weights_chunk(self, offset: int, data: np.ndarray) -> int:
        return self.worker.weights_chunk(offset, data)

    def finish_weights(self) -> int:
        return self.worker.finish_weights()

    def stats(self) -> dict[str, Any]:
        return self.worker.get_stats()

    def ping(self) -> int:
        return self.worker.ping()

    def wedge(self) -> None:
        self.worker.wedge()

    def direct_open(self, secret: str) -> str:
        """The direct transport's loop (workers/stage_loop.py): started once, reset on later opens (after a
        recovery: what was in flight is gone); returns where it listens."""
        import ray
        if self.loop is None:
            self.loop = StageLoop(self.worker, ray.util.get_node_ip_address(), bytes.fromhex(secret))
        else:
            self.loop.secret = bytes.fromhex(secret)
            self.loop.reset()
        return self.loop.address

    def direct_peers(self, addresses: list[str]) -> None:
        assert self.loop is not None
        self.loop.set_peers(addresses)

    def compute(self, pid: str, desc: dict | None, inputs: Message, incarnation: str | None,
                *upstream: Message) -> bytes | np.ndarray:
        """StageWorker.compute; every argument positional (a keyword costs Ray ~0.1 ms per call)."""
        return ray_payload(self.worker.compute(pid, desc, inputs, *upstream, incarnation=incarnation))

    def compute_chained(self, args: tuple, up: bytes | None = None) -> bytes:
        """compute() as a node of the compiled graph (workers/compiled.py): args are the driver's
        (pid, desc, inputs, incarnation) for this stage, up the stage before's result. Messages travel
        as bytes, which the channels pickle without a lookup per message."""
        pid, desc, inputs, incarnation = args
        ups = () if up is None else (up,)
        return bytes(self.worker.compute(pid, desc, inputs, *ups, incarnation=incarnation))


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


def _lost(e: BaseException) -> bool:
    """Does this Ray error mean a stage's state is gone (actor died or restarted, objects lost, the compiled
    graph's channels closed by a dead actor)?"""
    import ray.exceptions as rex
    lost_types = tuple(t for t in (getattr(rex, n, None) for n in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
        "ObjectReconstructionFailedError", "NodeDiedError", "WorkerCrashedError",
        "ActorUnschedulableError", "RayChannelError")) if t is not None)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (*lost_types, PlanMissingError)):
            return True
        cur = getattr(cur, "cause", None) or cur.__cause__    # RayTaskError keeps the original in .cause
    return False


def _stage_error(e: BaseException, what: str, stage: int = -1) -> BaseException:
    """The error a failed stage result raises on the driver: StageLostError (the context recovers)
    where the stage's state is gone, else a RuntimeError naming the stage; e is its cause."""
    if isinstance(e, StageLostError):
        return e
    err: BaseException
    if _lost(e):
        err = StageLostError(f"{what} lost its state: {type(e).__name__}", stage)
    else:
        err = RuntimeError(f"{what} failed: {e}")
    err.__cause__ = e
    return err


def _ray_call(actor: Any, stage: int, layers: tuple[int, int], watch: StageWatch,
              incarnation: Callable[[], str | None]) -> Call:
    def submit(pid: str, desc: dict | None, inputs: bytearray, *ups: Any) -> Any:
        return actor.compute.remote(pid, desc, ray_payload(inputs), incarnation(), *ups)

    def guarded(handles: list) -> list:
        try:
            return watch.wait(handles)
        except Exception as e:
            err = _stage_error(e, f"stage {stage} (layers {layers[0]}..{layers[1] - 1})", stage)
            if err is e:
                raise
            raise err from e

    return Call(submit, guarded, guarded)


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
    infos: list[dict] = field(default_factory=list)
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

    @classmethod
    def launch(cls, model_path: str, n_stages: int | None, params: ContextParams | None = None,
               n_copies: int | None = None, layers: list[tuple[int, int]] | None = None,
               budgets: list[int] | None = None, threads_per_stage: int = 1,
               max_restarts: int = 3, node_ids: list[str] | None = None,
               stage_model_path: str | None = None, nodes: list[NodeInfo] | None = None,
               on_plan: Callable[[Placement], None] | None = None, calls: str = "auto",
               devices: list[DeviceKind] | None = None) -> Pipeline:
        """Place the layers (n_stages None: the fewest stages that fit the cluster's nodes), start one
        actor per stage and wait until every stage holds its weights. On a cluster this process joined
        (not a local Ray it started), stages go one per node, sized by the nodes' Ray memory; node_ids
        limits them to those nodes. on_plan sees the placement before any actor starts. calls:
        "compiled" runs a step's stage calls as one execution of a Ray Compiled Graph
        (workers/compiled.py), "plain" as actor calls, "auto" picks (compiled_fits). devices: each
        stage's device kind (one for all, or one per stage; default the CPU)."""
        if calls not in ("auto", "direct", "compiled", "plain"):
            raise ValueError(f"calls must be 'auto', 'direct', 'compiled' or 'plain', not {calls!r}")
        import ray
        if params is None:
            params = ContextParams()
        model = LlamaModel.load(model_path)
        if nodes is None and not node_ids and not _started_local and budgets is None:
            nodes = cluster_nodes()
        # the one memory account (driver.plan_stages): what `plan` prints, and run's table and --json
        placement = plan_stages(model, params, n_stages if nodes is not None else n_stages or 1, nodes=nodes,
                                budgets=budgets, layers=layers, threads=threads_per_stage, kinds=devices)
        if nodes is None and node_ids:           # stage k on node_ids[k], as the caller says
            placement = _pinned(placement, node_ids, STAGE_OVERHEAD_BYTES)
        if on_plan is not None:
            on_plan(placement)
        n = len(placement.stages)
        actor_cls = ray.remote(max_restarts=max_restarts, max_task_retries=0)(StageActor)
        pl = cls(model, placement, [], [], None, [], [], actor_cls,  # type: ignore[arg-type]
                 threads=threads_per_stage, on_nodes=nodes is not None or bool(node_ids))
        pl.watch = StageWatch(pl._describe)
        if calls in ("auto", "direct"):
            pl.direct = DirectChain(n, lambda: pl.actors, pl.watch,
                                    lambda k: pl.infos[k].get("incarnation") if k < len(pl.infos) else None,
                                    pl._describe)
        elif calls == "compiled":
            pl.chain = CompiledChain(n, lambda: pl.actors, pl._plain_call, pl.watch,
                                     lambda k: pl.infos[k].get("incarnation") if k < len(pl.infos) else None,
                                     lambda e: _stage_error(e, "a stage of the compiled graph"))
        options = params.backend_options(threads_per_stage)
        for sp, kind in zip(placement.stages, stage_kinds(devices, n)):
            pl.specs.append(StageSpec(sp.stage, stage_model_path or str(model.path), sp.layers, sp.stage == 0,
                                      sp.stage == n - 1, params, model.hp.n_embd_k_gqa, model.hp.n_embd_v_gqa,
                                      DeviceSpec(kind, options)))
            pl.actors.append(actor_cls.options(**pl._actor_options(k=sp.stage)).remote(pl.specs[-1]))
        pl.infos = [{}] * n
        pl.watch.addresses = [""] * n
        for k in range(n):
            pl._await_stage(k, pl.launch_timeout_s)
        for sp, info in zip(placement.stages, pl.infos):      # each stage's device, as it described itself
            device: DeviceInfo = info["device"]
            pl.proxies.append(StageProxy(sp.stage, sp.layers, pl._call(sp.stage),
                                         StageDevice(f"stage{sp.stage}", device)))
        pl._connect_direct()
        pl.ctx = driver_context(model, params, placement, pl.proxies, n_copies or default_copies(n))
        pl.ctx.recovery.restore = pl.recover_stages
        return pl

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
                         lambda: self.infos[k].get("incarnation") if k < len(self.infos) else None)

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
        if info["needs_weights"]:                           # its node cannot read the file
            self._give_weights(k)
            info = ray.get(self.actors[k].info.remote(), timeout=timeout_s)
        self.infos[k] = info
        self.watch.addresses[k] = info.get("health", "")

    def _give_weights(self, k: int) -> None:
        spec = self.specs[k]
        if k not in self.manifests:
            names = spec.weight_names(list(self.model.weights), self.model.hp.tie_word_embeddings)
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
        bad_nodes = {self.infos[k].get("node_id", "") for k in self.watch.lost} - {""}
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

    def stats(self) -> list[dict]:
        import ray
        return ray.get([a.stats.remote() for a in self.actors], timeout=30)

    def write_trace(self, path: str) -> None:
        """Chrome/Perfetto trace of the stages' calls so far: a track per stage, one per hop between
        stages (queueing and transfer), flow arrows per micro-batch (workers/timeline.py)."""
        import json
        timelines = [st["timeline"] for st in self.stats()]
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

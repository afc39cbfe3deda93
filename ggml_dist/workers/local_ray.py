"""The local Ray: join a cluster, or start a Ray of this process's own, loopback-only, and end it with
every process of it.

    connect(address)            ray.init: join `address` (or the job's cluster), shipping the ggml_dist
                                package to the job's workers (py_modules), else start a local,
                                loopback-only Ray with bounded CPUs and object store
    shutdown_local()            end that local Ray, every process of it (atexit runs it too); a start in
                                progress in another thread (a server's engine) is waited for first
    local_ray_cpu_s()           CPU seconds of each process of that Ray (the benchmarks' account)

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
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


class RayStartError(RuntimeError):
    """Ray could not be started or joined."""


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
    output unless verbose (the run's --verbose; None: $GGML_DIST_VERBOSE)."""
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

"""A real multi-host Ray cluster on one Linux machine: each host a network namespace with a CPU of its own.

Each host is a network namespace with its own IP on a private bridge (testbed/netns.py), its own CPU
budget and memory limit (a cgroup per host, testbed/cgroups.py: `cpu=0.6` is 0.6 core as a CFS quota with
a 5 ms period), its own shaped link (`link_rate`), and runs its own `ray start --block` (host 0 is the
head, where drivers run: its budget is the head's and the driver's). The hosts share the file system,
/dev/shm and the memory bus, but not the network nor the CPU time: every process of a host (its
`ray start` and all it forks, and every command run there) is placed in the host's groups before it
execs, so each host's CPU seconds and throttling are read from its cgroup (`usage()`).

    with NamespaceCluster([HostSpec(num_cpus=0, cpu=0.5),
                           HostSpec(num_cpus=1, cpu=0.6, memory_bytes=200 * 2**20)]) as c:
        c.run_in(0, [sys.executable, str(script), c.gcs_address], check=True)
        print(c.usage())

A Ray driver must run on a Ray node, so drivers run inside a host's namespace (`run_in`,
`popen_in`; host 0 is the usual place). Their default cwd is the cluster's work dir, not the
caller's: Ray adds a driver's cwd and script dir to every worker's sys.path, so a driver
started from the repository root would make ggml_dist importable on a host meant to lack it.

Teardown kills exactly the processes the cluster started: those inside its namespaces (by
/proc/PID/ns/net) or its cgroups, those carrying GGML_DIST_NETNS=<cluster tag>:<host>[:run] in their
environment, and the process groups and descendants of what it spawned; then it removes its groups,
veths, namespaces and bridge. It never runs `ray stop`, pkill or killall.

Needs root, iproute2 (`ip`, `tc`), util-linux (`unshare`) and `mount`; `netns_available()` and
`cgroups_available()` say why not.
"""
from __future__ import annotations

import atexit
import contextlib
import copy
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cgroups import DEFAULT_PERIOD_US, HostGroup, cgroups_available
from .netns import Network, link_exists, namespace_exists, netns_available
from .procs import TAG_ENV, ancestors, env_tag, http_get, netns_id, pid_alive, proc_table, tail

DEFAULT_OBJECT_STORE_BYTES = 80 * 2**20      # Ray's minimum is 75 MiB
_SOCKET_PATH_MAX = 107                       # AF_UNIX sun_path
_RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
_seq = itertools.count(1)
_live: weakref.WeakSet[NamespaceCluster] = weakref.WeakSet()

# The base environment of every process a cluster starts (a cluster's or host's env overrides it).
DEFAULT_ENV: dict[str, str] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray 2.60 turns token auth on when ~/.ray/auth_token exists; these clusters are private
    # (a bridge only this machine sees), so it is off unless a test asks for it.
    "RAY_AUTH_MODE": "disabled",
    # a driver shows every worker's lines, not "[repeated 2x across cluster]"
    "RAY_DEDUP_LOGS": "0",
}


class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message has the tails of the hosts' logs."""


class ClusterStopError(RuntimeError):
    """Some process the cluster started is still alive after SIGKILL."""


@dataclass
class HostSpec:
    """One host: its `ray start` resources and what it sees.

    python: the interpreter that runs this host's `ray start` (and so its Ray workers);
        None = sys.executable. E.g. venv_without_ggml_dist(...) for a host lacking ggml_dist.
    hide_dirs: directories this host's processes see as empty (a private tmpfs over each,
        in a mount namespace of its own; the rest of the machine keeps seeing the files).
    env: extra environment for this host's processes (a value of None removes the variable).
    dashboard: head only: start the dashboard on the head's IP.
    cpu: the host's CPU in cores (a CFS quota of cpu x cpu_period_us per period); None: no limit, its
        use still accounted. memory_limit_bytes: its cgroup memory limit (None: none; the Ray
        `memory` resource is memory_bytes, a scheduling figure that nothing enforces by itself).
    link_rate: its link's rate each way (tc units: "1gbit"); link_delay_ms: a fixed delay each way,
        where the kernel has netem (else left out, and `shaping` says why).
    cpus: pin the host to these CPUs (a cpuset); None: the cluster pins a host with a CPU limit of at most
        one core to the least loaded CPU where it fits (pin_cpus).
    """
    num_cpus: int = 1
    memory_bytes: int | None = None
    cpu: float | None = None
    cpu_period_us: int = DEFAULT_PERIOD_US
    memory_limit_bytes: int | None = None
    link_rate: str | None = None
    link_delay_ms: float | None = None
    cpus: tuple[int, ...] | None = None
    python: str | None = None
    hide_dirs: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    dashboard: bool = False
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    resources: dict[str, float] | None = None
    extra_args: list[str] = field(default_factory=list)


def health_check_config(period_ms: int = 1000, timeout_ms: int = 1000, failure_threshold: int = 3,
                        initial_delay_ms: int | None = None) -> dict[str, int]:
    """A head `system_config` under which the GCS declares an unreachable node dead within about
    period_ms * failure_threshold + timeout_ms (Ray's default is 3000 ms x 5 + 10000 ms)."""
    cfg = {"health_check_period_ms": period_ms, "health_check_timeout_ms": timeout_ms,
           "health_check_failure_threshold": failure_threshold}
    if initial_delay_ms is not None:
        cfg["health_check_initial_delay_ms"] = initial_delay_ms
    return cfg


# ---------------------------------------------------------------------------------------------
# the cluster

# Waits (in a host's namespace) until the GCS at `address` lists every ip in `alive` as an alive
# node and none in `dead`, then prints ray.nodes() as JSON. Needs no driver (no ray.init).
_NODES_PROBE = r"""
import json, sys, time
args = json.loads(sys.argv[1])
from ray._private.internal_api import get_state_from_address
deadline = time.monotonic() + args["timeout"]
state, nodes, err = None, None, None
while True:
    try:
        if state is None:
            state = get_state_from_address(args["address"])
        nodes = state.node_table()
        err = None
    except Exception as e:
        state, nodes, err = None, None, repr(e)
    if nodes is not None:
        up = {n["NodeManagerAddress"] for n in nodes if n["Alive"]}
        if set(args["alive"]) <= up and not (set(args["dead"]) & up):
            break
    if time.monotonic() > deadline:
        print(json.dumps({"timeout": True, "error": err, "nodes": nodes}, default=str))
        sys.exit(3)
    time.sleep(args["poll"])
print(json.dumps(nodes, default=str))
"""

_CONNECT_PROBE = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except OSError as e:
    print("fail", repr(e))
"""


class NamespaceCluster:
    """A Ray cluster of len(hosts) "hosts", each a network namespace; host 0 is the head.

    Use as a context manager (or start()/stop()). Attributes once started: head_ip,
    gcs_address ("IP:PORT"), dashboard_url ("http://IP:PORT"), ips, namespaces, veths (root-side
    ends), bridge, subnet, workdir, log_dir; log_path(i) is host i's `ray start` output and
    ray_temp_dir(i) its Ray temp dir (session logs under session_*/logs).

    system_config: JSON-able dict passed to the head's `ray start --system-config` (GCS-wide
    settings such as health_check_config(...)). env: extra environment for every process.
    keep_files: keep workdir (Ray temp dirs, logs) after stop(); it is kept anyway when the
    cluster fails to start or the `with` body raises. log_dir: where the hosts' `ray start`
    logs go (default workdir/logs); when given, stop() also copies each host's Ray session logs
    there (hostI-session_*/), so they outlive the cluster (a pytest tmp dir keeps them).
    """

    def __init__(self, hosts: Sequence[HostSpec], subnet_index: int | None = None, *,
                 port: int = 6379, dashboard_port: int = 8265,
                 system_config: dict[str, Any] | None = None,
                 env: dict[str, str | None] | None = None,
                 start_timeout_s: float = 120.0, stop_grace_s: float = 5.0,
                 keep_files: bool = False, log_dir: str | os.PathLike | None = None,
                 pin_cpus: bool = True) -> None:
        if not hosts:
            raise ValueError("a cluster needs at least one host")
        if len(hosts) > 200:
            raise ValueError("at most 200 hosts")
        for i, h in enumerate(hosts):
            if h.dashboard and i != 0:
                raise ValueError(f"host {i}: only the head (host 0) can run the dashboard")
        if subnet_index is not None and not 0 <= subnet_index <= 255:
            raise ValueError("subnet_index is the X of 10.213.X.0/24, 0..255")
        self.hosts = [copy.deepcopy(h) for h in hosts]
        self.subnet_index = subnet_index
        self.port = port
        self.dashboard_port = dashboard_port
        self.system_config = dict(system_config) if system_config else None
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.stop_grace_s = stop_grace_s
        self.keep_files = keep_files
        self.pin_cpus = pin_cpus
        self._log_dir_arg = log_dir

        self.tag = ""
        self.net: Network | None = None
        self.groups: list[HostGroup | None] = [None] * len(self.hosts)   # each host's cgroups
        self.workdir: Path | None = None
        self.log_dir: Path | None = None
        self.started_pids: set[int] = set()   # every pid seen belonging to this cluster
        self.survivors: list[int] = []        # pids alive after stop() (should stay empty)

        self._hosts_procs: list[subprocess.Popen | None] = [None] * len(self.hosts)
        self._extra_procs: list[subprocess.Popen] = []   # popen_in's, while they run
        self._proc_host: dict[int, int] = {}               # popen_in's pid -> its host
        self._log_files: list[Any] = []
        self._started = False
        self._starting = False
        self._stopped = False
        self._failed = False

    # -- addresses ------------------------------------------------------------------------------
    @property
    def ips(self) -> list[str]:
        return self.net.ips if self.net is not None else []

    @property
    def namespaces(self) -> list[str]:
        return self.net.namespaces if self.net is not None else []

    @property
    def veths(self) -> list[str]:
        return self.net.veths if self.net is not None else []

    @property
    def bridge(self) -> str:
        return self.net.bridge if self.net is not None else ""

    @property
    def subnet(self) -> str:
        return self.net.subnet if self.net is not None else ""

    @property
    def head_ip(self) -> str:
        return self.ips[0]

    @property
    def gcs_address(self) -> str:
        return f"{self.ips[0]}:{self.port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.ips[0]}:{self.dashboard_port}"

    def log_path(self, i: int) -> Path:
        assert self.log_dir is not None
        return self.log_dir / f"host{i}.log"

    def ray_temp_dir(self, i: int) -> Path:
        assert self.workdir is not None
        return self.workdir / f"h{i}"

    def python_of(self, i: int) -> str:
        return self.hosts[i].python or sys.executable

    def __repr__(self) -> str:
        return (f"NamespaceCluster(tag={self.tag!r}, bridge={self.bridge!r}, ips={self.ips}, "
                f"workdir={str(self.workdir)!r})")

    # -- context manager ------------------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._failed = True
            try:
                self.stop()
            except ClusterStopError as e:           # do not hide the body's exception
                print(f"testbed: {e}", file=sys.stderr)
        else:
            self.stop()

    # -- start ----------------------------------------------------------------------------------
    def start(self) -> NamespaceCluster:
        if self._started:
            raise RuntimeError("a NamespaceCluster starts once")
        reason = netns_available()
        if reason:
            raise ClusterStartError(f"network namespaces unavailable: {reason}")
        self._started = self._starting = True
        _live.add(self)
        try:
            self._make_workdir()
            self._check_hide_dirs()
            self.net = Network(self.tag, len(self.hosts), self.subnet_index)
            self.net.setup()
            self.subnet_index = self.net.subnet_index
            self._setup_hosts()
            t0 = time.monotonic()
            deadline = t0 + self.start_timeout_s
            self._launch(0)
            self._wait_tcp(self.head_ip, self.port, deadline, what="the head's GCS port")
            for i in range(1, len(self.hosts)):
                self._launch(i)
            self.wait_for_nodes(alive=self.ips, timeout=max(1.0, deadline - time.monotonic()))
            if self.hosts[0].dashboard:
                self._wait_dashboard(deadline)
            self.started_pids |= self.pids()
        except BaseException as e:
            self._failed = True
            diag = ""
            with contextlib.suppress(Exception):
                diag = self.diagnostics()
            with contextlib.suppress(Exception):
                self.stop()
            if isinstance(e, Exception):
                raise ClusterStartError(f"{self!r} did not start: {e}\n{diag}") from e
            raise
        finally:
            self._starting = False
        return self

    def _make_workdir(self) -> None:
        pid = os.getpid()
        while True:
            self.tag = f"gd{pid:x}-{next(_seq)}"
            if not (namespace_exists(f"{self.tag}n0") or link_exists(f"{self.tag}b")):
                break
        # Ray's unix sockets live under the temp dir, so it must be short: /tmp, not $TMPDIR
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.tag}.", dir="/tmp"))
        longest = len(str(self.ray_temp_dir(len(self.hosts) - 1))) + _RAY_SOCKET_SUFFIX
        if longest > _SOCKET_PATH_MAX:
            raise ClusterStartError(f"Ray temp dir {self.ray_temp_dir(0)} is too long for its "
                                    f"unix sockets ({longest} > {_SOCKET_PATH_MAX} chars)")
        self.log_dir = Path(self._log_dir_arg) if self._log_dir_arg else self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i in range(len(self.hosts)):
            (self.ray_temp_dir(i) / "tmp").mkdir(parents=True)

    def _check_hide_dirs(self) -> None:
        for i, h in enumerate(self.hosts):
            dirs = []
            for d in h.hide_dirs:
                real = os.path.realpath(d)
                if not os.path.isdir(real):
                    raise ValueError(f"host {i}: hide_dirs entry {d} is not a directory")
                needed = [str(self.workdir), str(self.log_dir), sysconfig.get_paths()["purelib"],
                          os.path.dirname(os.path.realpath(self.python_of(i))),
                          os.path.dirname(self.python_of(i))]
                for need in needed:
                    n = os.path.realpath(need)
                    if n == real or n.startswith(real.rstrip("/") + "/"):
                        raise ValueError(f"host {i}: hiding {d} would hide {n}, which the host needs")
                dirs.append(real)
            h.hide_dirs = dirs

    # -- network --------------------------------------------------------------------------------
    def _setup_hosts(self) -> None:
        """Each host's cgroups (CPU quota, memory limit, accounting) and link shaping."""
        assert self.net is not None
        need_groups = any(h.cpu is not None or h.memory_limit_bytes is not None for h in self.hosts)
        why = cgroups_available()
        if why is not None and need_groups:
            raise ClusterStartError(f"host CPU or memory limits need cgroups: {why}")
        self._pin()
        for i, h in enumerate(self.hosts):
            cpus = h.cpus
            if why is None:            # accounted even without a limit
                self.groups[i] = HostGroup.create(f"gd-{self.tag}-h{i}", h.cpu, h.cpu_period_us, h.memory_limit_bytes,
                                                  cpus=cpus)
            if h.link_rate or h.link_delay_ms:
                self.net.shape(i, h.link_rate, h.link_delay_ms)

    def _pin(self) -> None:
        """With pin_cpus: each host with a CPU limit of at most a core on one CPU (a pinned host's ticker
        needs one thread, and its tasks do not move between CPUs), the workers largest first, then the
        head, onto the least loaded CPU; a host that would overload every CPU (past 0.95 of it) stays
        unpinned."""
        if not self.pin_cpus:
            return
        load = dict.fromkeys(sorted(os.sched_getaffinity(0)), 0.0)
        for h in self.hosts:
            if h.cpus is not None and h.cpu is not None:
                for c in h.cpus:
                    load[c] = load.get(c, 0.0) + h.cpu / len(h.cpus)
        order = sorted((i for i, h in enumerate(self.hosts) if h.cpus is None and h.cpu is not None and h.cpu <= 1),
                       key=lambda i: (i == 0, -(self.hosts[i].cpu or 0.0), i))     # the head last
        for i in order:
            h = self.hosts[i]
            assert h.cpu is not None
            c = min(load, key=lambda c: (load[c], c))
            if load[c] + h.cpu <= 0.95:
                load[c] += h.cpu
                h.cpus = (c,)

    def link_down(self, i: int) -> None:
        """Cut host i's cable: its root-side veth goes down, so nothing reaches it or leaves it."""
        assert self.net is not None
        self.net.link_down(i)

    def link_up(self, i: int, timeout: float = 10.0) -> None:
        """Plug host i's cable back in; returns once the link has carrier on both ends."""
        assert self.net is not None
        self.net.link_up(i, timeout)

    def usage(self) -> list[dict[str, Any]]:
        """Per host, from its cgroups: CPU seconds used, bandwidth throttling (periods, throttled
        periods and time), peak memory; with its budget (cpu cores, period) and link shaping."""
        out = []
        for i, (h, g) in enumerate(zip(self.hosts, self.groups)):
            row: dict[str, Any] = {"host": i, "ip": self.ips[i] if self.ips else None, "cpu": h.cpu,
                                   "cpus": list(h.cpus) if h.cpus is not None else None,
                                   "cpu_period_us": h.cpu_period_us, "memory_limit_bytes": h.memory_limit_bytes,
                                   "link": self.net.shaping[i] if self.net is not None else {}}
            if g is not None and g.dirs:
                row.update(g.snapshot())
            out.append(row)
        return out

    # -- processes in a host --------------------------------------------------------------------
    def argv_in(self, i: int, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run inside host i: its cgroups (joined before anything execs), its network
        namespace, and its hidden dirs."""
        cmd = ["ip", "netns", "exec", self.namespaces[i]]
        dirs = self.hosts[i].hide_dirs
        if dirs:
            mounts = " && ".join(f"mount -t tmpfs -o size=4m,mode=0755 gdhidden {shlex.quote(d)}"
                                 for d in dirs)
            cmd += ["unshare", "--mount", "--propagation", "private", "--",
                    "sh", "-c", f'{mounts} && exec "$@"', "sh"]
        cmd += [str(a) for a in argv]
        g = self.groups[i]
        return g.wrap(cmd) if g is not None else cmd

    def env_for(self, i: int, extra: dict[str, str | None] | None = None, *,
                driver: bool = True) -> dict[str, str]:
        """The environment of a process in host i (driver=True: one run by run_in/popen_in,
        which also gets RAY_ADDRESS=gcs_address). A value of None removes the variable."""
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        if os.path.realpath(self.python_of(i)) != os.path.realpath(sys.executable):
            env.pop("PYTHONPATH", None)             # a different python: keep it clean
        env.update(DEFAULT_ENV)
        no_proxy = ",".join(x for x in (env.get("NO_PROXY") or env.get("no_proxy"),
                                        self.subnet, *self.ips, "127.0.0.1", "localhost") if x)
        env["NO_PROXY"] = env["no_proxy"] = no_proxy
        if driver:
            env["RAY_ADDRESS"] = self.gcs_address
        else:       # Ray's own temp files (the dashboard's pymp-* dirs...) go when the cluster does
            env["TMPDIR"] = str(self.ray_temp_dir(i) / "tmp")
        for overrides in (self.env, self.hosts[i].env, extra or {}):
            for k, v in overrides.items():
                if v is None:
                    env.pop(k, None)
                else:
                    env[k] = str(v)
        env[TAG_ENV] = f"{self.tag}:{i}:run" if driver else f"{self.tag}:{i}"
        return env

    def run_in(self, i: int, argv: Sequence[str], *, env: dict[str, str | None] | None = None,
               cwd: str | os.PathLike | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
        """subprocess.run(argv) inside host i (cwd defaults to the cluster's workdir, env to
        env_for(i, env)); other kwargs go to subprocess.run (check, timeout, capture_output...)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        check = kwargs.pop("check", False)
        return subprocess.run(self.argv_in(i, argv), check=check, env=self.env_for(i, env),
                              cwd=str(cwd or self.workdir), **kwargs)

    def popen_in(self, i: int, argv: Sequence[str], *, env: dict[str, str | None] | None = None,
                 cwd: str | os.PathLike | None = None, **kwargs: Any) -> subprocess.Popen:
        """subprocess.Popen(argv) inside host i, in a session of its own; stop() ends it if it
        still runs."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.argv_in(i, argv), env=self.env_for(i, env),
                             cwd=str(cwd or self.workdir), **kwargs)
        self._proc_host[p.pid] = i
        self._extra_procs.append(p)
        self.started_pids.add(p.pid)
        return p

    def _ray_start_argv(self, i: int) -> list[str]:
        h = self.hosts[i]
        argv = [self.python_of(i), "-m", "ray.scripts.scripts", "start", "--block",
                f"--node-ip-address={self.ips[i]}", f"--num-cpus={h.num_cpus}",
                f"--object-store-memory={h.object_store_bytes}",
                f"--temp-dir={self.ray_temp_dir(i)}", "--disable-usage-stats"]
        if i == 0:
            argv += ["--head", f"--port={self.port}",
                     f"--include-dashboard={'true' if h.dashboard else 'false'}"]
            if h.dashboard:
                argv += [f"--dashboard-host={self.ips[0]}", f"--dashboard-port={self.dashboard_port}"]
            if self.system_config:
                argv.append(f"--system-config={json.dumps(self.system_config)}")
        else:
            argv.append(f"--address={self.gcs_address}")
        if h.memory_bytes is not None:
            argv.append(f"--memory={int(h.memory_bytes)}")
        if h.resources:
            argv.append(f"--resources={json.dumps(h.resources)}")
        return argv + list(h.extra_args)

    def _launch(self, i: int) -> None:
        log = open(self.log_path(i), "ab")       # noqa: SIM115 - open while the host runs; stop() closes it
        self._log_files.append(log)
        argv = self._ray_start_argv(i)
        log.write(f"# host {i} ns={self.namespaces[i]} ip={self.ips[i]}\n# "
                  f"{shlex.join(self.argv_in(i, argv))}\n".encode())
        log.flush()
        p = subprocess.Popen(self.argv_in(i, argv), env=self.env_for(i, driver=False),
                             cwd=str(self.ray_temp_dir(i)), stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self._hosts_procs[i] = p
        self.started_pids.add(p.pid)

    def host_alive(self, i: int) -> bool:
        p = self._hosts_procs[i]
        return p is not None and p.poll() is None

    def _check_hosts(self) -> None:
        for i, p in enumerate(self._hosts_procs):
            if p is not None and p.poll() is not None:
                raise ClusterStartError(f"host {i}'s `ray start` exited with {p.returncode}")

    def _wait_tcp(self, ip: str, port: int, deadline: float, what: str) -> None:
        while True:
            self._check_hosts()
            with contextlib.suppress(OSError):
                socket.create_connection((ip, port), timeout=1.0).close()
                return
            if time.monotonic() > deadline:
                raise ClusterStartError(f"{what} ({ip}:{port}) did not open in time")
            time.sleep(0.2)

    def _wait_dashboard(self, deadline: float) -> None:
        err: Exception | None = None
        while time.monotonic() < deadline:
            self._check_hosts()
            try:
                if http_get(self.dashboard_url + "/api/version", timeout=2.0)[0] == 200:
                    return
            except Exception as e:                   # noqa: BLE001
                err = e
            time.sleep(0.3)
        raise ClusterStartError(f"the dashboard at {self.dashboard_url} did not answer: {err}")

    # -- Ray state ------------------------------------------------------------------------------
    def wait_for_nodes(self, alive: Iterable[str] = (), dead: Iterable[str] = (),
                       timeout: float = 60.0, poll_s: float = 0.25, via: int = 0) -> list[dict]:
        """Wait until the GCS lists every IP in `alive` as an alive node and none in `dead`;
        returns ray.nodes() (dead nodes included). Runs a probe inside host `via`."""
        args = {"address": self.gcs_address, "alive": list(alive), "dead": list(dead),
                "timeout": timeout, "poll": poll_s}
        p = self.popen_in(via, [self.python_of(via), "-c", _NODES_PROBE, json.dumps(args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout + 30
        out = err = ""
        try:
            while True:
                try:
                    out, err = p.communicate(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self._starting:
                    self._check_hosts()
                if time.monotonic() > deadline:
                    raise ClusterStartError(f"the node probe hung past {timeout + 30:.0f}s")
        finally:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        try:
            result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise ClusterStartError(f"the node probe failed ({p.returncode}): {err.strip()[-1500:]}") from None
        if p.returncode != 0 or isinstance(result, dict):
            state = [(n.get("NodeManagerAddress"), n.get("Alive")) for n in result.get("nodes") or []]
            raise TimeoutError(f"nodes not as wanted (alive={list(alive)} dead={list(dead)}) after "
                               f"{timeout:.0f}s; GCS says {state}; last error {result.get('error')}")
        return result

    def nodes(self) -> list[dict]:
        """ray.nodes() of the cluster, asked from inside the head's namespace."""
        return self.wait_for_nodes(timeout=30.0)

    def node_id_of(self, ip: str, nodes: list[dict] | None = None) -> str:
        """The Ray node id (hex) of the alive node at ip."""
        for n in nodes if nodes is not None else self.nodes():
            if n["NodeManagerAddress"] == ip and n["Alive"]:
                return n["NodeID"]
        raise KeyError(f"no alive Ray node at {ip}")

    def node_ids(self) -> dict[str, str]:
        """{ip: node id} of the alive nodes."""
        return {n["NodeManagerAddress"]: n["NodeID"] for n in self.nodes() if n["Alive"]}

    def try_connect(self, from_host: int, ip: str, port: int, timeout: float = 1.0) -> str:
        """A TCP connect from inside host `from_host` to ip:port: "ok", or the error's repr
        (TimeoutError(...) when the packets go nowhere, ConnectionRefusedError(...) when the
        host is there but nothing listens)."""
        p = self.run_in(from_host, [self.python_of(from_host), "-c", _CONNECT_PROBE, ip, str(port),
                                    str(timeout)], capture_output=True, text=True,
                        timeout=timeout + 60)
        out = p.stdout.strip()
        return "ok" if out == "ok" else (out[len("fail "):] or f"probe failed: {p.stderr.strip()}")

    def can_connect(self, from_host: int, ip: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connect from inside host `from_host` to ip:port succeeds within timeout."""
        return self.try_connect(from_host, ip, port, timeout) == "ok"

    # -- processes ------------------------------------------------------------------------------
    def pids(self, host: int | None = None, commands: bool = True) -> set[int]:
        """The live (non-zombie) pids of this cluster: every process inside its namespaces (by
        /proc/PID/ns/net, which neither setsid nor setproctitle hides), plus those found by
        TAG_ENV, by the process groups of what it spawned and by parentage. host=i: host i's
        only; commands=False: without the commands that run_in/popen_in started (and their
        children), i.e. a host's Ray processes."""
        self._extra_procs = [p for p in self._extra_procs if p.poll() is None]
        table = proc_table()
        hosts = list(range(len(self.hosts))) if host is None else [host]
        ns_ids = {self.net.ns_ids[i] for i in hosts if self.net is not None and i in self.net.ns_ids}
        in_groups = set().union(*(g.pids() for g in (self.groups[i] for i in hosts) if g is not None))
        ray_roots = [p for p in (self._hosts_procs[i] for i in hosts) if p is not None]
        cmd_roots = [p for p in self._extra_procs if host is None or self._proc_host.get(p.pid) == host]
        ray_tags = {f"{self.tag}:{i}" for i in hosts}
        cmd_tags = {f"{self.tag}:{i}:run" for i in hosts}
        ray_groups = {p.pid for p in ray_roots if p.returncode is None}   # unreaped: not reused
        cmd_groups = {p.pid for p in cmd_roots if p.returncode is None}
        children: dict[int, list[int]] = {}
        for pid, (ppid, _pgid, _state) in table.items():
            children.setdefault(ppid, []).append(pid)

        def closure(seed: set[int]) -> set[int]:
            out, stack = set(seed), list(seed)
            while stack:
                for c in children.get(stack.pop(), []):
                    if c not in out:
                        out.add(c)
                        stack.append(c)
            return out

        found, cmds = set(), set()
        for pid, (_ppid, pgid, state) in table.items():
            if state in ("Z", "X"):
                continue
            tag = env_tag(pid)
            if tag in cmd_tags or pgid in cmd_groups:
                cmds.add(pid)
            if tag in ray_tags or tag in cmd_tags or pgid in ray_groups or pgid in cmd_groups \
                    or netns_id(pid) in ns_ids or pid in in_groups:
                found.add(pid)
        found = closure(found | {p.pid for p in ray_roots + cmd_roots
                                 if p.returncode is None and p.pid in table})
        if not commands:
            found -= closure(cmds | {p.pid for p in cmd_roots
                                     if p.returncode is None and p.pid in table})
        found -= ancestors(os.getpid())
        found = {p for p in found if pid_alive(p)}
        self.started_pids |= found
        return found

    def _terminate(self, host: int | None) -> None:
        """SIGTERM to each `ray start` (only to it: it ends its children itself, within ~3 s;
        a SIGTERM to its whole process group leaves it waiting) and to the groups of the
        commands started by popen_in."""
        hosts = range(len(self.hosts)) if host is None else [host]
        for i in hosts:
            p = self._hosts_procs[i]
            if p is not None and p.poll() is None:
                with contextlib.suppress(OSError):
                    os.kill(p.pid, signal.SIGTERM)
        if host is None:
            for p in self._extra_procs:
                if p.poll() is None:
                    with contextlib.suppress(OSError):
                        os.killpg(p.pid, signal.SIGTERM)

    def _kill(self, pids: Iterable[int], procs: Iterable[subprocess.Popen]) -> None:
        for p in procs:
            if p.returncode is None and p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _end(self, host: int | None, grace: float, commands: bool = True) -> list[int]:
        procs = [p for p in ([*self._hosts_procs] if host is None else [self._hosts_procs[host]])
                 if p is not None]
        if commands:
            procs += [p for p in self._extra_procs if host is None or self._proc_host.get(p.pid) == host]
        pids = self.pids(host, commands)
        if grace > 0 and pids:
            self._terminate(host)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                for p in procs:
                    p.poll()
                if not self.pids(host, commands):
                    break
                time.sleep(0.1)
        deadline = time.monotonic() + 10.0
        while True:
            pids = self.pids(host, commands)
            if pids:
                self._kill(pids, procs)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    if p.returncode is None:
                        p.wait(timeout=0.2)
            pids = {q for q in pids if pid_alive(q)}
            if not pids and all(p.returncode is not None for p in procs):
                return []
            if time.monotonic() > deadline:
                return sorted(pids)
            time.sleep(0.1)

    def kill_host(self, i: int, sig: int = signal.SIGKILL, commands: bool = False) -> None:
        """Crash host i: signal its Ray processes (commands=True: also what run_in/popen_in run
        there) and, for SIGKILL, wait until they are gone. The GCS notices at its next health
        checks (see health_check_config)."""
        if sig == signal.SIGKILL:
            left = self._end(i, grace=0, commands=commands)
            if left:
                raise ClusterStopError(f"host {i}: pids {left} survive SIGKILL")
        else:
            for pid in self.pids(i, commands):
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)

    # -- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        """End every process the cluster started (SIGTERM, then SIGKILL after stop_grace_s),
        then delete its veths, namespaces and bridge. Idempotent."""
        if self._stopped or not self._started:
            return
        self._stopped = True
        _live.discard(self)
        try:
            self.survivors = self._end(None, self.stop_grace_s)
        finally:
            for f in self._log_files:
                with contextlib.suppress(Exception):
                    f.close()
            if self.net is not None:
                self.net.teardown()
            for g in self.groups:
                if g is not None and g.dirs:
                    self.survivors += g.remove()
            if self._log_dir_arg is not None:               # a log dir of the caller's:
                self._copy_ray_logs()                       # Ray's logs outlive the cluster
            launched = any(p is not None for p in self._hosts_procs)
            keep = self.keep_files or self.survivors or (self._failed and launched)
            if self.workdir is not None and not keep:     # kept on failure: logs to read
                shutil.rmtree(self.workdir, ignore_errors=True)
        if self.survivors:
            raise ClusterStopError(f"{self!r}: pids {self.survivors} are alive after SIGKILL")

    # -- diagnostics ----------------------------------------------------------------------------
    def ray_log_dirs(self, i: int) -> list[Path]:
        """Host i's Ray session log dirs (raylet.out, gcs_server.out, worker-*.out...)."""
        if self.workdir is None:
            return []
        dirs = {d.resolve() for d in self.ray_temp_dir(i).glob("session_*/logs") if d.is_dir()}
        return sorted(dirs)

    def _copy_ray_logs(self) -> None:
        assert self.log_dir is not None
        for i in range(len(self.hosts)):
            for d in self.ray_log_dirs(i):
                with contextlib.suppress(Exception):
                    shutil.copytree(d, self.log_dir / f"host{i}-{d.parent.name}", symlinks=True,
                                    ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)

    def diagnostics(self, lines: int = 25) -> str:
        """The tails of each host's `ray start` log and of its Ray session's error logs."""
        out = []
        for i in range(len(self.hosts)):
            if self.log_dir is None:
                break
            p = self._hosts_procs[i]
            status = "not started" if p is None else (
                "running" if p.poll() is None else f"exited {p.returncode}")
            out.append(f"--- host {i} ({self.ips[i] if self.ips else '?'}, {status}): "
                       f"{self.log_path(i)}\n{tail(self.log_path(i), lines)}")
            for d in self.ray_log_dirs(i):
                for name in ("gcs_server.err", "raylet.err", "raylet.out"):
                    if (d / name).exists():
                        t = tail(d / name, 8 if name.endswith(".out") else lines).strip()
                        if t:
                            out.append(f"--- host {i} {d / name}\n{t}")
        return "\n".join(out)


@atexit.register
def _stop_live_clusters() -> None:          # a with-block cut short by interpreter exit
    for c in list(_live):
        with contextlib.suppress(Exception):
            c.stop()


# ---------------------------------------------------------------------------------------------
# a streaming `ggml-dist run` whose stage-1 host loses its link mid-generation

@dataclass
class CutRun:
    returncode: int
    text: str                     # what the run streamed on stdout
    log: str                      # its stderr
    victim: int | None            # the host whose link was cut
    cut_to_end_s: float | None    # from the cut to the run's exit
    recoveries: int               # from the run's closing line
    detect_s: float | None        # from the cut to the run's detection of the loss (its detected_at)
    restore_s: float | None       # the restart and the replay of the KV log
    first_token_s: float | None   # from detection to the first token after it


def run_with_link_cut(c: NamespaceCluster, argv: Sequence[str], after_chars: int,
                      timeout: float = 900.0) -> CutRun:
    """Run `argv` (a `ggml-dist run` without --json, so text streams) in the head's namespace; once
    `after_chars` characters have streamed, cut the link of the host that holds stage 1 (read from the
    plan table the run prints on stderr before it loads); restore it when the run ends."""
    import re
    import threading
    p = c.popen_in(0, list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[str] = []
    assert p.stdout is not None and p.stderr is not None
    stderr = p.stderr
    reader = threading.Thread(target=lambda: err.extend(ln.decode() for ln in stderr), daemon=True)
    reader.start()
    text, cut_at, cut_wall, victim = b"", None, None, None
    try:
        while b := os.read(p.stdout.fileno(), 64):
            text += b
            if cut_at is None and len(text) >= after_chars:
                row = next(ln for ln in err if re.match(r"\s+1 ", ln))
                victim = c.ips.index(row.split()[1])
                c.link_down(victim)
                cut_at, cut_wall = time.perf_counter(), time.time()
        p.wait(timeout=timeout)
        reader.join(10)
    finally:
        if victim is not None:
            c.link_up(victim)
    log = "".join(err)
    m = re.search(r"recoveries (\d+): detected after \S+ s \(at ([\d.]+)\), restored in ([\d.]+) s, first token "
                  r"([\d.]+) s", log)
    detect = float(m.group(2)) - cut_wall if m and cut_wall is not None else None
    return CutRun(p.returncode, text.decode(), log, victim, time.perf_counter() - cut_at if cut_at else None,
                  int(m.group(1)) if m else 0, None if detect is None else round(detect, 3),
                  float(m.group(3)) if m else None, float(m.group(4)) if m else None)

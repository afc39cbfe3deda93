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
from pathlib import Path
from typing import Any

from . import diagnostics, reaper
from .cgroups import HostGroup, cgroups_available
from .hosts import DEFAULT_ENV, HostSpec, health_check_config
from .link_cut import CutRun, run_with_link_cut
from .netns import Network, link_exists, namespace_exists, netns_available
from .probes import CONNECT_PROBE, NODES_PROBE
from .procs import TAG_ENV, http_get

__all__ = ["ClusterStartError", "ClusterStopError", "CutRun", "HostSpec", "NamespaceCluster", "health_check_config",
           "run_with_link_cut"]

_SOCKET_PATH_MAX = 107                       # AF_UNIX sun_path
_RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
_seq = itertools.count(1)
_live: weakref.WeakSet[NamespaceCluster] = weakref.WeakSet()

class ClusterStartError(RuntimeError):
    """The cluster did not come up; the message has the tails of the hosts' logs."""


class ClusterStopError(RuntimeError):
    """Some process the cluster started is still alive after SIGKILL."""


# ---------------------------------------------------------------------------------------------
# the cluster

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

        self.host_procs: list[subprocess.Popen | None] = [None] * len(self.hosts)
        self.extra_procs: list[subprocess.Popen] = []   # popen_in's, while they run
        self.proc_host: dict[int, int] = {}               # popen_in's pid -> its host
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
        self.proc_host[p.pid] = i
        self.extra_procs.append(p)
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
        self.host_procs[i] = p
        self.started_pids.add(p.pid)

    def host_alive(self, i: int) -> bool:
        p = self.host_procs[i]
        return p is not None and p.poll() is None

    def _check_hosts(self) -> None:
        for i, p in enumerate(self.host_procs):
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
        p = self.popen_in(via, [self.python_of(via), "-c", NODES_PROBE, json.dumps(args)],
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
        p = self.run_in(from_host, [self.python_of(from_host), "-c", CONNECT_PROBE, ip, str(port),
                                    str(timeout)], capture_output=True, text=True,
                        timeout=timeout + 60)
        out = p.stdout.strip()
        return "ok" if out == "ok" else (out[len("fail "):] or f"probe failed: {p.stderr.strip()}")

    def can_connect(self, from_host: int, ip: str, port: int, timeout: float = 1.0) -> bool:
        """Whether a TCP connect from inside host `from_host` to ip:port succeeds within timeout."""
        return self.try_connect(from_host, ip, port, timeout) == "ok"

    # -- processes ------------------------------------------------------------------------------
    def pids(self, host: int | None = None, commands: bool = True) -> set[int]:
        """The live pids of this cluster (host=i: host i's only; commands=False: without the commands
        that run_in/popen_in started): testbed/reaper.py."""
        return reaper.cluster_pids(self, host, commands)

    def kill_host(self, i: int, sig: int = signal.SIGKILL, commands: bool = False) -> None:
        """Crash host i: signal its Ray processes (commands=True: also what run_in/popen_in run
        there) and, for SIGKILL, wait until they are gone. The GCS notices at its next health
        checks (see health_check_config)."""
        if sig == signal.SIGKILL:
            left = reaper.end(self, i, grace=0, commands=commands)
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
            self.survivors = reaper.end(self, None, self.stop_grace_s)
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
                diagnostics.copy_ray_logs(self)             # Ray's logs outlive the cluster
            launched = any(p is not None for p in self.host_procs)
            keep = self.keep_files or self.survivors or (self._failed and launched)
            if self.workdir is not None and not keep:     # kept on failure: logs to read
                shutil.rmtree(self.workdir, ignore_errors=True)
        if self.survivors:
            raise ClusterStopError(f"{self!r}: pids {self.survivors} are alive after SIGKILL")

    # -- diagnostics ----------------------------------------------------------------------------
    def diagnostics(self, lines: int = 25) -> str:
        """The tails of each host's `ray start` log and of its Ray session's error logs."""
        return diagnostics.report(self, lines)


@atexit.register
def _stop_live_clusters() -> None:          # a with-block cut short by interpreter exit
    for c in list(_live):
        with contextlib.suppress(Exception):
            c.stop()



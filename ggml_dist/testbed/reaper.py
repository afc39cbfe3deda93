"""Which processes belong to a testbed cluster, and ending them: exactly those it started (cluster.py's
docstring), found inside its namespaces (by /proc/PID/ns/net) or its cgroups, by the GGML_DIST_NETNS tag in
their environment, by the process groups of what it spawned and by parentage; never `ray stop`, pkill or
killall.

    cluster_pids(c, host, commands)   the live pids of the cluster (or of one host; without the commands run there)
    end(c, host, grace)       SIGTERM to each `ray start` and command group, then SIGKILL after grace;
                              the pids still alive after 10 s more (none, normally)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any

from .procs import ancestors, env_tag, netns_id, pid_alive, proc_table

# the cluster these read is a testbed.cluster.NamespaceCluster (typed Any here: cluster.py imports this module)
NamespaceCluster = Any


def cluster_pids(c: NamespaceCluster, host: int | None = None, commands: bool = True) -> set[int]:
    """The live (non-zombie) pids of cluster c: every process inside its namespaces (by
    /proc/PID/ns/net, which neither setsid nor setproctitle hides), plus those found by
    TAG_ENV, by the process groups of what it spawned and by parentage. host=i: host i's
    only; commands=False: without the commands that run_in/popen_in started (and their
    children), i.e. a host's Ray processes."""
    c.extra_procs = [p for p in c.extra_procs if p.poll() is None]
    table = proc_table()
    hosts = list(range(len(c.hosts))) if host is None else [host]
    ns_ids = {c.net.ns_ids[i] for i in hosts if c.net is not None and i in c.net.ns_ids}
    in_groups = set().union(*(g.pids() for g in (c.groups[i] for i in hosts) if g is not None))
    ray_roots = [p for p in (c.host_procs[i] for i in hosts) if p is not None]
    cmd_roots = [p for p in c.extra_procs if host is None or c.proc_host.get(p.pid) == host]
    ray_tags = {f"{c.tag}:{i}" for i in hosts}
    cmd_tags = {f"{c.tag}:{i}:run" for i in hosts}
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
    c.started_pids |= found
    return found

def terminate(c: NamespaceCluster, host: int | None) -> None:
    """SIGTERM to each `ray start` (only to it: it ends its children itself, within ~3 s;
    a SIGTERM to its whole process group leaves it waiting) and to the groups of the
    commands started by popen_in."""
    hosts = range(len(c.hosts)) if host is None else [host]
    for i in hosts:
        p = c.host_procs[i]
        if p is not None and p.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGTERM)
    if host is None:
        for p in c.extra_procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGTERM)

def kill(pids: Iterable[int], procs: Iterable[subprocess.Popen]) -> None:
    for p in procs:
        if p.returncode is None and p.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

def end(c: NamespaceCluster, host: int | None, grace: float, commands: bool = True) -> list[int]:
    procs = [p for p in ([*c.host_procs] if host is None else [c.host_procs[host]])
             if p is not None]
    if commands:
        procs += [p for p in c.extra_procs if host is None or c.proc_host.get(p.pid) == host]
    pids = cluster_pids(c, host, commands)
    if grace > 0 and pids:
        terminate(c, host)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()
            if not cluster_pids(c, host, commands):
                break
            time.sleep(0.1)
    deadline = time.monotonic() + 10.0
    while True:
        pids = cluster_pids(c, host, commands)
        if pids:
            kill(pids, procs)
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

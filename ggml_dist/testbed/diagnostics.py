"""What a testbed cluster's hosts logged: each host's Ray session log dirs, their copy into the cluster's
log dir, and the tails that explain a start that failed.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any

from .procs import tail

# the cluster these read is a testbed.cluster.NamespaceCluster (typed Any here: cluster.py imports this module)
NamespaceCluster = Any


def ray_log_dirs(c: NamespaceCluster, i: int) -> list[Path]:
    """Host i's Ray session log dirs (raylet.out, gcs_server.out, worker-*.out...)."""
    if c.workdir is None:
        return []
    dirs = {d.resolve() for d in c.ray_temp_dir(i).glob("session_*/logs") if d.is_dir()}
    return sorted(dirs)

def copy_ray_logs(c: NamespaceCluster) -> None:
    """Each host's Ray session logs into the cluster's log dir (hostI-session_*/), so they outlive it."""
    assert c.log_dir is not None
    for i in range(len(c.hosts)):
        for d in ray_log_dirs(c, i):
            with contextlib.suppress(Exception):
                shutil.copytree(d, c.log_dir / f"host{i}-{d.parent.name}", symlinks=True,
                                ignore=shutil.ignore_patterns("*.sock"), dirs_exist_ok=True)

def report(c: NamespaceCluster, lines: int = 25) -> str:
    """The tails of each host's `ray start` log and of its Ray session's error logs."""
    out = []
    for i in range(len(c.hosts)):
        if c.log_dir is None:
            break
        p = c.host_procs[i]
        status = "not started" if p is None else (
            "running" if p.poll() is None else f"exited {p.returncode}")
        out.append(f"--- host {i} ({c.ips[i] if c.ips else '?'}, {status}): "
                   f"{c.log_path(i)}\n{tail(c.log_path(i), lines)}")
        for d in ray_log_dirs(c, i):
            for name in ("gcs_server.err", "raylet.err", "raylet.out"):
                if (d / name).exists():
                    t = tail(d / name, 8 if name.endswith(".out") else lines).strip()
                    if t:
                        out.append(f"--- host {i} {d / name}\n{t}")
    return "\n".join(out)

"""Processes by pid, from /proc: what the testbed uses to find and end exactly what it started.

A host's processes are found by their network namespace (/proc/PID/ns/net), by the tag the testbed puts
in their environment, by process group and parentage (no single criterion is enough: Ray puts each
worker in a process group of its own, and setproctitle can overwrite a process's environ), and by the
host's cgroup where it has one (testbed/cgroups.py).
"""
from __future__ import annotations

import os
import urllib.request
from pathlib import Path

TAG_ENV = "GGML_DIST_NETNS"                  # marks every process a cluster starts


def proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, pgid, state) of pid, None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = data[data.rfind(")") + 2:].split()
    return int(rest[1]), int(rest[2]), rest[0]


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    st = proc_stat(pid)
    return st is not None and st[2] not in ("Z", "X")


def proc_table() -> dict[int, tuple[int, int, str]]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = proc_stat(int(name))
            if st is not None:
                table[int(name)] = st
    return table


def env_tag(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    key = TAG_ENV.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key):].decode(errors="replace")
    return None


def netns_id(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def ancestors(pid: int) -> set[int]:
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = proc_stat(pid)
        if st is None:
            break
        pid = st[0]
    return out


def tail(path: Path, lines: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"<{e}>"
    return "\n".join(text.splitlines()[-lines:])


def http_get(url: str, timeout: float) -> tuple[int, bytes]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # never via a proxy
    with opener.open(url, timeout=timeout) as r:
        return r.status, r.read()


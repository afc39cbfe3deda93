"""The testbed's network: one namespace per host on a private bridge, each with its own IP and link.

    net = Network(tag, n_hosts)
    net.setup()                       # bridge 10.213.X.1/24; host i is 10.213.X.(10+i) in namespace tagn<i>
    net.shape(i, rate="1gbit")        # tc tbf on both ends of host i's link; and delay_ms (below)
    net.set_delay(i, 0.5)             # host i's traffic to the other hosts waits 0.5 ms (0: none), at any time
    net.link_down(i); net.link_up(i)  # cut host i's cable (its root-side veth), and plug it back
    net.teardown()                    # veths, namespaces and the bridge it made

Each host has its own loopback and port space, so the default Ray ports never clash with another Ray on
this machine, and a cut link is a real partition. Shaping: a token bucket (tbf) limits the rate each
way; a fixed delay is netem's where the kernel has it, else (this machine's kernel: `tc qdisc add ... netem`
answers "Specified qdisc kind is unknown") a userspace delay line on each host's egress to the other
hosts (testbed/delay.py), and `shape` says which it used.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import ipaddress
import json
import os
import shutil
import subprocess
import sys
import time

from .delay import DELAY_BY, DelayLine

SUBNET_BASE = "10.213"                       # testbeds use 10.213.X.0/24
_LOCK_PATH = "/tmp/ggml_dist_netns.lock"     # serializes subnet choice across processes


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def tc(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["tc", *args]
    p = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}`{' in ' + ns if ns else ''} failed ({p.returncode}): "
                           f"{p.stderr.strip()}")
    return p


def namespace_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}") or os.path.exists(f"/var/run/netns/{name}")


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


@functools.cache
def netns_available() -> str | None:
    """None if this process can build namespace hosts, else a one-line reason (for skip)."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    for tool in ("ip", "unshare", "mount", "sh"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH"
    tag = f"gdq{os.getpid():x}"
    ns, br, veth = f"{tag}n", f"{tag}b", f"{tag}v"
    try:
        steps = [(("netns", "add", ns), "`ip netns add` failed"),
                 (("link", "add", br, "type", "bridge"), "cannot make a bridge"),
                 (("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns),
                  "cannot make a veth pair"),
                 (("link", "set", veth, "master", br), "cannot attach a veth to a bridge")]
        for args, what in steps:
            p = ip(*args, check=False)
            if p.returncode != 0:
                return f"{what}: {p.stderr.strip() or p.returncode}"
        p = subprocess.run(["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation",
                            "private", "sh", "-c", "mount -t tmpfs gdprobe /mnt"],
                           check=False, capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            return f"cannot mount a tmpfs in a private mount namespace: {p.stderr.strip()}"
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"namespace probe failed: {e}"
    finally:
        for args in (("link", "del", veth), ("link", "del", br), ("netns", "del", ns)):
            with contextlib.suppress(Exception):
                ip(*args, check=False)


@functools.cache
def netem_available() -> str | None:
    """None if the kernel has the netem qdisc (link delay), else why not."""
    if shutil.which("tc") is None:
        return "`tc` is not on PATH"
    veth = f"gdm{os.getpid():x}"
    try:
        ip("link", "add", veth, "type", "veth", "peer", "name", veth + "p")
        p = tc("qdisc", "add", "dev", veth, "root", "netem", "delay", "1ms", check=False)
        return None if p.returncode == 0 else f"no netem qdisc in this kernel (tc: {p.stderr.strip()})"
    except RuntimeError as e:
        return str(e)
    finally:
        ip("link", "del", veth, check=False)


class Network:
    """The bridge, namespaces and veth pairs of one testbed; names start with `tag`."""

    def __init__(self, tag: str, n_hosts: int, subnet_index: int | None = None) -> None:
        if subnet_index is not None and not 0 <= subnet_index <= 255:
            raise ValueError("subnet_index is the X of 10.213.X.0/24, 0..255")
        self.tag = tag
        self.n_hosts = n_hosts
        self.subnet_index = subnet_index
        self.bridge = f"{tag}b"
        self.namespaces = [f"{tag}n{i}" for i in range(n_hosts)]
        self.veths = [f"{tag}v{i}" for i in range(n_hosts)]      # root-side ends
        self.subnet = self.bridge_ip = ""
        self.ips: list[str] = []
        self.ns_ids: dict[int, tuple[int, int]] = {}              # host -> (st_dev, st_ino) of its netns
        self.shaping: list[dict] = [{} for _ in range(n_hosts)]  # what shape() set, per host
        self.delay_lines: dict[int, DelayLine] = {}              # host -> its userspace delay relay
        self._created_ns: list[str] = []
        self._created_links: list[str] = []
        self._bridge_created = False

    def _subnet_free(self, x: int) -> bool:
        net = ipaddress.ip_network(f"{SUBNET_BASE}.{x}.0/24")
        for link in json.loads(ip("-4", "-j", "addr", "show").stdout or "[]"):
            for a in link.get("addr_info", []):
                if a.get("local") and ipaddress.ip_network(
                        f"{a['local']}/{a.get('prefixlen', 32)}", strict=False).overlaps(net):
                    return False
        for r in json.loads(ip("-4", "-j", "route", "show", "table", "all").stdout or "[]"):
            dst = r.get("dst", "default")
            if dst != "default":
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_network(dst, strict=False).overlaps(net):
                        return False
        return True

    def _choose_subnet(self) -> int:
        if self.subnet_index is not None:
            if not self._subnet_free(self.subnet_index):
                raise RuntimeError(f"subnet {SUBNET_BASE}.{self.subnet_index}.0/24 is in use by an interface "
                                   "or route")
            return self.subnet_index
        start = (os.getpid() * 7 + sum(map(ord, self.tag)) * 13) % 250
        x = next((c for c in ((start + k) % 250 + 2 for k in range(250)) if self._subnet_free(c)), None)
        if x is None:
            raise RuntimeError(f"no free {SUBNET_BASE}.X.0/24 subnet")
        return x

    def setup(self) -> None:
        with open(_LOCK_PATH, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                x = self.subnet_index = self._choose_subnet()
                self.subnet, self.bridge_ip = f"{SUBNET_BASE}.{x}.0/24", f"{SUBNET_BASE}.{x}.1"
                self.ips = [f"{SUBNET_BASE}.{x}.{10 + i}" for i in range(self.n_hosts)]
                ip("link", "add", self.bridge, "type", "bridge")
                self._bridge_created = True
                ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
                ip("link", "set", self.bridge, "up")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.veths, self.ips)):
            ip("netns", "add", ns)
            self._created_ns.append(ns)
            st = os.stat(f"/var/run/netns/{ns}")
            self.ns_ids[i] = (st.st_dev, st.st_ino)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._created_links.append(veth)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "route", "add", "default", "via", self.bridge_ip)

    def shape(self, i: int, rate: str | None = None, delay_ms: float | None = None,
              burst: str = "64kb", latency: str = "50ms") -> dict:
        """Host i's link, each way: a token bucket of `rate` (tc's units: 1gbit, 100mbit) and a delay
        (netem, where the kernel has it; else set_delay's userspace delay line on what host i sends to
        the other hosts, so every path between two hosts still gets it once each way). Returns what was
        set: {"rate", "delay_ms", "delay_by"}."""
        done: dict = {}
        ends = [(self.veths[i], None), ("eth0", self.namespaces[i])]      # into the host, out of it
        if delay_ms:
            if netem_available() is None:
                for dev, ns in ends:
                    tc("qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms",
                       ns=ns)
                done.update(delay_ms=delay_ms, delay_by="netem")
            else:
                done.update(self.set_delay(i, delay_ms))
        if rate:
            for dev, ns in ends:
                parent = ["parent", "1:1"] if done.get("delay_by") == "netem" else ["root"]
                tc("qdisc", "replace", "dev", dev, *parent, "tbf", "rate", rate, "burst", burst, "latency", latency,
                   ns=ns)
            done["rate"] = rate
        self.shaping[i] = done
        return done

    def set_delay(self, i: int, delay_ms: float) -> dict:
        """Host i's packets to the other hosts wait delay_ms, through its userspace delay line
        (testbed/delay.py; replaced when already there; 0 ends it). Returns {"delay_ms", "delay_by"}."""
        old = self.delay_lines.pop(i, None)
        if old is not None:
            old.stop()
        for key in ("delay_ms", "delay_by"):
            self.shaping[i].pop(key, None)
        if delay_ms <= 0:
            return {"delay_ms": 0.0, "delay_by": None}
        peers = [a for j, a in enumerate(self.ips) if j != i]
        line = DelayLine(self.namespaces[i], self.ips[i], peers, delay_ms, env_tag=f"{self.tag}:{i}")
        line.start()
        self.delay_lines[i] = line
        self.shaping[i].update(delay_ms=delay_ms, delay_by=DELAY_BY)
        return {"delay_ms": delay_ms, "delay_by": DELAY_BY}

    def link_down(self, i: int) -> None:
        """Cut host i's cable: its root-side veth goes down, so nothing reaches it or leaves it."""
        ip("link", "set", self.veths[i], "down")

    def link_up(self, i: int, timeout: float = 10.0) -> None:
        """Plug host i's cable back in; returns once the link has carrier on both ends."""
        ip("link", "set", self.veths[i], "up")
        deadline = time.monotonic() + timeout
        while True:
            root = json.loads(ip("-j", "link", "show", self.veths[i]).stdout)[0]
            inner = json.loads(ip("-n", self.namespaces[i], "-j", "link", "show", "eth0").stdout)[0]
            if "LOWER_UP" in root.get("flags", []) and "LOWER_UP" in inner.get("flags", []):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"host {i}'s link has no carrier after {timeout}s")
            time.sleep(0.05)

    def teardown(self) -> None:
        for line in self.delay_lines.values():
            line.stop()
        self.delay_lines.clear()
        for link in self._created_links:
            if link_exists(link):
                ip("link", "del", link, check=False)
        for ns in self._created_ns:
            ip("netns", "del", ns, check=False)
        if self._bridge_created:
            ip("link", "del", self.bridge, check=False)
        self._created_links.clear()
        self._created_ns.clear()
        self._bridge_created = False

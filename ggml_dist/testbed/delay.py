"""A fixed added delay on a testbed host's link, in userspace, for kernels without netem (issue 54 item 6).

    line = DelayLine(ns, host_ip, peer_ips, delay_ms)    # Network.set_delay(i, ms) makes and ends these
    line.start(); line.stop()
    tcp_rtt_ms(ns_a, ns_b, ip_b)                         # the ping-pong check: a TCP round trip's median
    delay_every_host(net, ms, plain_rtt_ms)              # bench cluster's sweep point, with its check

How: a TUN device (`gdl0`) in the host's namespace and a relay process that owns it. A policy rule sends
every packet the host itself originates (`iif lo`) to another testbed host through table 100, whose
routes (one /32 per peer) lead into gdl0; the relay reads each packet, holds it `delay_ms`, and writes
it back into gdl0, where the kernel receives it and forwards it out of eth0 as usual (ip_forward on,
accept_local so the host's own source address is not a martian). A packet the relay writes arrives on
gdl0, not lo, so it is routed by the main table and does not loop.

So each host delays what it sends to the other hosts, and every path between two hosts gets the delay
once each way, whatever the protocol or port: Ray's own traffic (GCS, raylets, object transfers, actor
calls), the stages' direct links and the collective's mesh alike. Not delayed: traffic inside a host
(its loopback, its own IP) and traffic to the bridge's address (the root namespace, not a host).

Why not the alternatives: a TCP relay per listening port cannot follow Ray's many, partly random
ports, and changes the peers' addresses; nfqueue needs the iptables NFQUEUE target and a netlink
client (neither is here); a TUN device is in every kernel with /dev/net/tun and needs nothing else.
The cost: the relay is one Python process per delayed host, a few microseconds of CPU per packet (a TCP
segment of up to 64 KiB: the TUN device takes segmentation offload), outside the host's CPU budget (it
is the wire, not the host); it adds its own wake-up time on top of delay_ms (timer slack 1 us, timed
waits ended early by their measured lateness): measured with tcp_rtt_ms, 0.5 ms each way adds 1.05-1.07
ms to a 0.018 ms round trip and 0.1 ms adds 0.24-0.28 ms; a 4 MiB transfer passes at ~190 MB/s (814 MB/s
on the plain veth). With delay 0 no relay runs: the link is the plain veth.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import fcntl
import os
import select
import struct
import subprocess
import sys
import time
from typing import Any

DEV = "gdl0"
TABLE = "100"
RULE_PRIORITY = "100"
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TUN, _IFF_NO_PI, _IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6 = 0x01, 0x02, 0x04
_PR_SET_TIMERSLACK = 29
DELAY_BY = "userspace relay (testbed/delay.py): each host's egress to the other hosts, all protocols"


def _ns(ns: str, *argv: str) -> None:
    p = subprocess.run(["ip", "netns", "exec", ns, *argv], check=False, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` in {ns} failed ({p.returncode}): {p.stderr.strip()}")


class DelayLine:
    """The relay of one host: start() makes gdl0, its routes and the rule; stop() ends the relay, and
    the device and its routes go with it (the rule, left pointing at an empty table, is harmless)."""

    def __init__(self, ns: str, host_ip: str, peer_ips: list[str], delay_ms: float, env_tag: str = "") -> None:
        if delay_ms <= 0:
            raise ValueError("a delay line needs delay_ms > 0 (0: no relay, the plain link)")
        self.ns, self.host_ip, self.peer_ips, self.delay_ms = ns, host_ip, list(peer_ips), delay_ms
        self.env_tag = env_tag
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        env = {**os.environ, **({"GGML_DIST_NETNS": self.env_tag} if self.env_tag else {})}
        # the file itself, isolated (-I): the relay needs only the standard library, wherever ggml_dist is
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-I", os.path.abspath(__file__),
                                      "--dev", DEV, "--delay-ms", str(self.delay_ms)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     start_new_session=True)
        out, err_f = self.proc.stdout, self.proc.stderr
        assert out is not None and err_f is not None, "the relay's pipes"
        try:
            ready, _, _ = select.select([out], [], [], timeout_s)
            line = out.readline() if ready else ""
            if line.strip() != "ready":
                err = err_f.read() if self.proc.poll() is not None else ""
                raise RuntimeError(f"the delay relay of {self.ns} did not start: {line.strip()} {err[-1000:]}")
            for key in ("net.ipv4.ip_forward=1", f"net.ipv4.conf.{DEV}.accept_local=1",
                        f"net.ipv4.conf.{DEV}.rp_filter=0", "net.ipv4.conf.all.rp_filter=0"):
                _ns(self.ns, "sysctl", "-q", "-w", key)
            _ns(self.ns, "ip", "link", "set", DEV, "up", "mtu", "1500")
            for peer in self.peer_ips:
                _ns(self.ns, "ip", "route", "replace", f"{peer}/32", "dev", DEV, "src", self.host_ip, "table", TABLE)
            subprocess.run(["ip", "netns", "exec", self.ns, "ip", "rule", "del", "priority", RULE_PRIORITY],
                           check=False, capture_output=True, timeout=30)           # a rule left by an earlier line
            _ns(self.ns, "ip", "rule", "add", "priority", RULE_PRIORITY, "iif", "lo", "lookup", TABLE)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        self.proc = None


# -------------------------------------------------------------------------------------------- the relay


def _open_tun(dev: str) -> int:
    """The TUN device, with a virtio-net header on each packet and TCP segmentation offload: the kernel
    hands over a TCP flow's data in segments of up to 64 KiB (and takes them back as such, to be cut
    for eth0 on the way out), so a bulk transfer costs the relay a read and a write per 64 KiB rather
    than per 1500 bytes (~58 MB/s through the relay without it)."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", dev.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR))
    fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6)
    os.set_blocking(fd, False)
    return fd


def relay(dev: str, delay_s: float) -> None:
    """Read every packet from the TUN device, write each back delay_s later, in order (a fixed delay
    keeps FIFO order, so a deque is the whole schedule). A packet the kernel will not take is dropped,
    as a full wire would."""
    with open("/proc/self/comm", "w") as f:
        f.write(f"delay-{dev}")
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)     # 1 us, not 50 us
    fd = _open_tun(dev)
    print("ready", flush=True)
    queue: collections.deque[tuple[float, bytes]] = collections.deque()
    read, write, now = os.read, os.write, time.monotonic
    late = 0.0                  # how long past its deadline a timed wait ends (moving average): woken that
    while True:                 # much early, a packet leaves on time rather than that much after it
        target = queue[0][0] - late if queue else 0.0
        r, _, _ = select.select([fd], [], [], max(0.0, target - now()) if queue else None)
        t = now()
        if r:
            due = t + delay_s
            while True:
                try:
                    queue.append((due, read(fd, 65536 + 64)))     # a header and a segment
                except BlockingIOError:
                    break
        elif queue:
            late += 0.1 * (min(t - target, delay_s / 4) - late)      # bounded: never a quarter early
        while queue and queue[0][0] - late <= t:
            try:
                write(fd, queue.popleft()[1])
            except OSError:
                pass


# ------------------------------------------------------------------------------------ the ping-pong check

_ECHO = ("import socket, sys\ns = socket.create_server((sys.argv[1], 0)); print(s.getsockname()[1], flush=True)\n"
         "c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
         "while (b := c.recv(64)): c.sendall(b)\n")
_PING = ("import socket, statistics, sys, time\n"
         "c = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
         "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\nts = []\n"
         "for _ in range(int(sys.argv[3])):\n t0 = time.perf_counter(); c.sendall(b'x'); c.recv(64)\n"
         " ts.append(time.perf_counter() - t0)\nprint(statistics.median(ts[10:]) * 1e3)\n")


def tcp_rtt_ms(ns_a: str, ns_b: str, ip_b: str, n: int = 300) -> float:
    """The median round trip, in ms, of a 1-byte TCP ping-pong from namespace ns_a to an echo server in
    ns_b at ip_b (the first 10 trips not counted)."""
    echo = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", _ECHO, ip_b],
                            stdout=subprocess.PIPE, text=True)
    try:
        port = echo.stdout.readline().strip()                            # type: ignore[union-attr]
        p = subprocess.run(["ip", "netns", "exec", ns_a, sys.executable, "-c", _PING, ip_b, port, str(n + 10)],
                           check=False, capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"the ping-pong from {ns_a} to {ip_b} failed: {p.stderr[-1000:]}")
        return float(p.stdout.strip())
    finally:
        echo.kill()
        echo.wait(10)
        if echo.stdout is not None:
            echo.stdout.close()


def delay_every_host(net: Any, delay_ms: float, plain_rtt_ms: float) -> dict[str, Any]:
    """Every host of the testbed Network `net` delays its packets to the other hosts by delay_ms (0: no
    relay), checked with tcp_rtt_ms between two hosts against the plain link's round trip: what bench
    cluster reports per delay."""
    i, j = (1, 2) if len(net.ips) > 2 else (0, 1)
    done = [net.set_delay(h, delay_ms) for h in range(len(net.ips))]
    by = done[0]["delay_by"]
    rtt = tcp_rtt_ms(net.namespaces[i], net.namespaces[j], net.ips[j]) if delay_ms else plain_rtt_ms
    return {"delay_ms": delay_ms, "delay_by": by, "ping_pong_hosts": [i, j], "rtt_ms": round(rtt, 3),
            "added_rtt_ms": round(rtt - plain_rtt_ms, 3),
            "covers": "every packet between two hosts, each way (Ray's own traffic, the stages' direct links, "
                      "the collective's mesh); not a host's traffic to itself" if delay_ms else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the delay relay of one testbed host (run in its namespace)")
    ap.add_argument("--dev", default=DEV)
    ap.add_argument("--delay-ms", type=float, required=True)
    a = ap.parse_args(argv)
    relay(a.dev, a.delay_ms / 1e3)
    return 0


if __name__ == "__main__":
    sys.exit(main())

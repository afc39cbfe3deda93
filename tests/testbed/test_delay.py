"""The testbed's userspace delay line (ggml_dist/testbed/delay.py): with netem absent, a host's packets to
the other hosts wait a fixed time, checked with a TCP ping-pong: +0.5 ms each way shows as about +1 ms a
round trip, and a delay of 0 (no relay) adds nothing."""
from __future__ import annotations

import os

import pytest

from ggml_dist.testbed.delay import DELAY_BY, tcp_rtt_ms
from ggml_dist.testbed.netns import Network, namespace_exists, netns_available

NS = netns_available()
need_ns = pytest.mark.skipif(NS is not None, reason=f"no network namespaces: {NS}")


@need_ns
def test_delay_line_adds_its_delay_each_way_and_zero_adds_nothing():
    # two hosts: the plain round trip, then 0.5 ms on each host's egress (+1 ms a round trip, plus the
    # relay's own wake-ups), then 0 again (the relays end, the round trip is back to the plain one)
    net = Network(f"gdd{os.getpid() % 0xfff:x}", 2)
    relays = []
    try:
        net.setup()
        ns, ips = net.namespaces, net.ips
        base = tcp_rtt_ms(ns[0], ns[1], ips[1])
        assert [net.set_delay(i, 0.5) for i in (0, 1)] == [{"delay_ms": 0.5, "delay_by": DELAY_BY}] * 2
        relays = [line.proc.pid for line in net.delay_lines.values() if line.proc is not None]
        assert len(relays) == 2
        delayed = tcp_rtt_ms(ns[0], ns[1], ips[1])
        back = tcp_rtt_ms(ns[1], ns[0], ips[0])                         # the other host's ping, the same
        assert 0.8 <= delayed - base <= 3.0, (base, delayed)
        assert 0.8 <= back - base <= 3.0, (base, back)
        assert [net.set_delay(i, 0) for i in (0, 1)] == [{"delay_ms": 0.0, "delay_by": None}] * 2
        assert not net.delay_lines and not any(os.path.exists(f"/proc/{p}") for p in relays)
        after = tcp_rtt_ms(ns[0], ns[1], ips[1])
        assert after - base < 0.3, (base, after)
    finally:
        net.teardown()
    assert not any(namespace_exists(n) for n in net.namespaces)
    assert not any(os.path.exists(f"/proc/{p}") for p in relays)

"""A testbed host's own CPU, memory and link (ggml_dist/testbed/cgroups.py, netns.py): a busy loop gets its
quota and no more over 10 ms windows, the group accounts its CPU and throttling, a memory limit holds,
a shaped link carries its rate, and a cluster's every process sits in its host's groups."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from ggml_dist.testbed.cgroups import HostGroup, cgroups_available
from ggml_dist.testbed.delay import DELAY_BY
from ggml_dist.testbed.netns import Network, namespace_exists, netem_available, netns_available

CG = cgroups_available()
NS = netns_available()
need_cg = pytest.mark.skipif(CG is not None, reason=f"no cgroups: {CG}")
need_ns = pytest.mark.skipif(NS is not None, reason=f"no network namespaces: {NS}")

# Spins for argv[1] seconds, noting every gap over 40 us between two reads of the clock: the times it
# was not running (throttled at its quota, or preempted).
BUSY = textwrap.dedent("""
    import json, sys, time
    end = (t0 := time.perf_counter()) + float(sys.argv[1])
    last, gaps = t0, []
    while (now := time.perf_counter()) < end:
        if now - last > 40e-6:
            gaps.append((last - t0, now - t0))
        last = now
    print(json.dumps({"dur": now - t0, "gaps": gaps}))
""")


def on_cpu_fractions(dur: float, gaps: list[tuple[float, float]], window: float = 0.010) -> list[float]:
    """Per whole window of the run: the share of it the loop was running."""
    n = int(dur / window)
    off = [0.0] * n
    for a, b in gaps:
        for w in range(int(a / window), min(n, int(b / window) + 1)):
            lo, hi = w * window, (w + 1) * window
            off[w] += max(0.0, min(b, hi) - max(a, lo))
    return [1 - o / window for o in off]


def _busy_in_group(seconds: float) -> tuple[list[float], float, object]:
    """A busy loop of `seconds` in a fresh 0.6-core group: its on-CPU share per 10 ms window (past the
    interpreter's start, sorted), the group's CPU seconds and its throttling over the run."""
    g = HostGroup.create(f"gd-t{os.getpid():x}-busy", cores=0.6, period_us=5000)
    try:
        c0, t0 = g.cpu_usage_s(), g.throttling()
        p = subprocess.run(g.wrap([sys.executable, "-c", BUSY, str(seconds)]), capture_output=True, text=True,
                           check=True, timeout=60)
        r = json.loads(p.stdout)
        used, thr = g.cpu_usage_s() - c0, g.throttling() - t0
    finally:
        assert g.remove() == []
    return sorted(on_cpu_fractions(r["dur"], r["gaps"])[5:]), used, thr


@need_cg
def test_busy_loop_gets_its_quota_and_no_more():
    # No run may get more than its quota on average. The rest is checked on one of up to three runs: a
    # window over its quota comes from the ticker waking late (a tick-long overrun, repaid in the next
    # periods), which an unticked group shows in every run and a ticked one only when the machine is so
    # loaded that the ticker waits for a CPU (a loaded CI machine once gave p90 0.753, mean 0.55); and on
    # such a machine the loop can also get less than its quota, through no fault of the group.
    runs = []
    for _ in range(3):
        fr, used, thr = _busy_in_group(1.5)
        mean, median, p90 = sum(fr) / len(fr), fr[len(fr) // 2], fr[int(len(fr) * 0.9)]
        assert mean <= 0.64, f"the loop got more than its quota: mean on-CPU share {mean:.2f} (quota 0.6)"
        runs.append(dict(mean=round(mean, 3), median=round(median, 3), p90=round(p90, 3), used=round(used, 3),
                         throttled=thr.nr_throttled, periods=thr.nr_periods, throttled_s=round(thr.throttled_s, 3)))
        # its share, within the period's quantisation (a 10 ms window holds two 5 ms periods' 3 ms, give or
        # take the ticker's 0.5 ms), and not the tick-long overruns that an unticked group gets
        if (p90 <= 0.75 and median >= 0.42
                and 0.6 * 1.5 * 0.75 <= used <= 0.6 * (1.5 + 0.5)    # ~0.6 core over ~1.6 s (loop, start, ticker)
                and thr.nr_throttled >= 0.5 * thr.nr_periods > 100 and thr.throttled_s > 0.3):  # hit its quota
            return
    pytest.fail(f"a 0.6-core group's busy loop, three runs (10 ms windows' on-CPU shares): {runs}")


@need_cg
def test_unlimited_group_still_accounts():
    g = HostGroup.create(f"gd-t{os.getpid():x}-acct", cores=None)
    try:
        subprocess.run(g.wrap([sys.executable, "-c", BUSY, "0.3"]), capture_output=True, check=True, timeout=60)
        assert g.cpu_usage_s() >= 0.25
        assert g.throttling().nr_throttled == 0
    finally:
        assert g.remove() == []
    assert not g.dirs


@need_cg
def test_memory_limit_holds():
    g = HostGroup.create(f"gd-t{os.getpid():x}-mem", memory_bytes=96 * 2**20)
    try:
        if "memory" not in g.dirs and g.kind == "v1":
            pytest.skip("no memory controller")
        p = subprocess.run(g.wrap([sys.executable, "-c", "b = bytearray(400 * 2**20); b[::4096] = b'x' * len(b[::4096])"]),
                           capture_output=True, timeout=60, check=False)
        assert p.returncode == -9, (p.returncode, p.stderr[-300:])      # the OOM killer, in the group only
        assert g.memory_oom_kills() == 1
        peak = g.memory_peak_bytes()
        assert peak is not None and peak <= 96 * 2**20
    finally:
        assert g.remove() == []


@need_cg
def test_remove_refuses_while_a_process_is_inside():
    g = HostGroup.create(f"gd-t{os.getpid():x}-busy2", cores=0.2)
    p = subprocess.Popen(g.wrap(["sleep", "30"]))
    try:
        deadline = time.monotonic() + 10
        while p.pid not in g.pids() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert p.pid in g.pids()                  # exec'd in place: the same pid, inside the group
        assert g.remove(timeout_s=0.2) == [p.pid]
        assert all(d.exists() for d in g.dirs.values())
    finally:
        p.kill()
        p.wait()
    assert g.remove() == []


SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 7777)); s.listen(1); print("ready", flush=True)
    c, _ = s.accept(); n = 0
    while (b := c.recv(1 << 16)):
        n += len(b)
    c.sendall(str(n).encode()); c.close()
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    c = socket.create_connection((sys.argv[1], 7777), timeout=30)
    t = time.perf_counter(); c.sendall(b"x" * int(sys.argv[2])); c.shutdown(socket.SHUT_WR)
    n = int(c.recv(64)); print(n, time.perf_counter() - t)
""")


def _transfer_s(net: Network, nbytes: int) -> float:
    srv = subprocess.Popen(["ip", "netns", "exec", net.namespaces[0], sys.executable, "-c", SERVER, net.ips[0]],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        out = subprocess.run(["ip", "netns", "exec", net.namespaces[1], sys.executable, "-c", CLIENT, net.ips[0],
                              str(nbytes)], capture_output=True, text=True, check=True, timeout=60).stdout.split()
        assert int(out[0]) == nbytes
        return float(out[1])
    finally:
        srv.kill()
        srv.wait()


@need_ns
def test_shaped_link_carries_its_rate():
    net = Network(f"gdt{os.getpid() % 0xfff:x}", 2)
    try:
        net.setup()
        fast = _transfer_s(net, 4 * 2**20)
        done = net.shape(1, rate="40mbit")
        assert done["rate"] == "40mbit"
        slow = _transfer_s(net, 4 * 2**20)            # 4 MiB at 40 Mbit/s: 0.84 s
        assert 0.7 <= slow <= 2.5, slow
        assert fast < slow / 3, (fast, slow)
        delayed = net.shape(0, delay_ms=2)
        assert delayed["delay_ms"] == 2                # netem's, or else the userspace delay line
        assert delayed["delay_by"] == ("netem" if netem_available() is None else DELAY_BY)
    finally:
        net.teardown()
    assert not any(namespace_exists(ns) for ns in net.namespaces)


@need_ns
@need_cg
def test_cluster_hosts_in_their_groups():
    pytest.importorskip("ray")
    from ggml_dist.testbed.cluster import HostSpec, NamespaceCluster
    hosts = [HostSpec(num_cpus=0, cpu=0.5), HostSpec(num_cpus=1, cpu=0.3, memory_limit_bytes=1 << 30,
                                                      link_rate="1gbit")]
    with NamespaceCluster(hosts) as c:
        groups = [g for g in c.groups if g is not None]
        assert len(groups) == 2
        for i, g in enumerate(groups):
            ray_pids = c.pids(i, commands=False)
            assert ray_pids and ray_pids <= g.pids(), f"host {i}: {ray_pids - g.pids()} outside its groups"
        busy = c.run_in(1, [sys.executable, "-c", BUSY, "0.5"], capture_output=True, text=True, check=True)
        assert json.loads(busy.stdout)["dur"] >= 0.5
        use = c.usage()
        assert [u["cpu"] for u in use] == [0.5, 0.3]
        assert use[1]["cpu_s"] >= 0.1 and use[1]["nr_throttled"] > 0
        assert use[1]["link"] == {"rate": "1gbit"}
        dirs = [d for g in groups for d in g.dirs.values()]
    assert dirs and not any(d.exists() for d in dirs)              # the groups went with the cluster

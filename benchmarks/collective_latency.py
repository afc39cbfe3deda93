"""Per-exchange latency of an all-gather among K Ray actors (issue 54 item 3): the mesh of persistent
links (workers/collective.py) against a Ray call per exchange and against ray.util.collective's CPU
backend (torch.distributed gloo). Prints one JSON object.

Each of K actors (one local, loopback-only Ray; every rank a process of its own) contributes a
C-contiguous float32 part of n_tokens x width (width = n_embd = 2048 by default: the brief's "2048 f32
per rank"; a tensor-parallel rank's own slice is n_embd / K, smaller still). An exchange ends when a rank
holds all K parts; rank 0 times each of `iters` back-to-back exchanges after a warm-up, and the JSON gives
their median and p90 in ms.

    mesh       MeshCollective.all_gather: one frame to every peer on links opened once, then read theirs
    ray_call   what the mesh must beat: each rank sends its part to every peer with an actor call
               (peer.deliver.remote(seq, rank, part), actor to actor, no driver), then waits for theirs
    gloo       ray.util.collective.allgather, backend "gloo" (ray/util/collective/collective_group/
               torch_gloo_collective_group.py: torch.distributed's gloo process group); needs torch,
               so run this script with an interpreter that has it (below). Equal shapes only.

    python -m venv --system-site-packages /root/.cache/ggml_dist-bench-venv
    /root/.cache/ggml_dist-bench-venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
        (here download.pytorch.org does not resolve; pip took torch 2.13.0+cpu from the machine's local
        wheel index, its configured find-links)
    PYTHONPATH=$PWD /root/.cache/ggml_dist-bench-venv/bin/python benchmarks/collective_latency.py
    PYTHONPATH=$PWD /root/.cache/ggml_dist-bench-venv/bin/python benchmarks/collective_latency.py \
        --where testbed --iters 200 --warmup 20 --link-delay-ms 0,0.1,0.5             # root: namespaces

Measured 2026-12-07 on this 2-core machine shared with other sessions (so K=4 runs four ranks on two
busy cores), torch 2.13.0+cpu, Ray 2.60.0, width 2048, 300 exchanges after 30 of warm-up (200 after 20
on the testbed); per-exchange median / p90 in ms.

--where ray (K actors of a local Ray, loopback; load average 4.5; the first run of the day, at load 4.3,
gave the same within 10% save ray_call's 32-token rows, 3.8 and 24.1 ms):

    K  tokens   mesh            ray_call        gloo
    2     1     0.101 / 0.139    1.703 / 2.294   0.379 / 2.109
    2    32     0.250 / 0.304    5.202 / 6.984   0.517 / 1.395
    4     1     0.514 / 0.763    6.523 / 9.163   3.236 / 6.639
    4    32     1.142 / 1.726   26.820 / 35.134  4.982 / 8.927

--where testbed (K plain processes on K namespace hosts, every link delayed one way by the testbed's
delay line, whose ping-pong added 0.28 and 1.05 ms a round trip for 0.1 and 0.5 ms; load average 2.1):

    delay  K  tokens   mesh            gloo
    0      2     1     0.107 / 0.146   0.321 / 2.805
    0      2    32     0.404 / 0.564   0.546 / 3.241
    0      4     1     0.509 / 0.781   3.893 / 7.693
    0      4    32     3.138 / 5.252   3.251 / 7.501
    0.1    2     1     0.236 / 0.414   0.658 / 0.845
    0.1    2    32     0.928 / 1.100   0.972 / 1.206
    0.1    4     1     0.663 / 0.915   4.494 / 8.056
    0.1    4    32     3.668 / 5.427   8.005 / 12.200
    0.5    2     1     0.723 / 1.256   1.467 / 1.595
    0.5    2    32     2.905 / 3.374   1.856 / 2.019
    0.5    4     1     1.022 / 1.399   5.003 / 6.066
    0.5    4    32     4.058 / 5.288   8.383 / 11.097

The mesh is the better one, and the one ggml_dist uses. A decode step's exchange (1 token) is 3.7-3.8x
under gloo and 17x under a Ray call at K=2, 6.3x and 13x at K=4 (local Ray); across hosts it pays a
link's delay about once (0.72 ms at 0.5 ms one way, K=2; 1.02 ms at K=4) where gloo pays it K-1 times
and more (1.47 and 5.0 ms). Why: an exchange on the mesh is K-1 framed writes and K-1 reads on sockets
that are already open, in the caller's thread: one step. gloo's all_gather passes the parts around a
ring (gloo's AllgatherRing and its successor in gloo/allgather.cc): K-1 dependent steps, each a send
and a receive handed to gloo's own threads, behind torch.distributed's and ray.util.collective's
checks. A Ray call per exchange pays an actor task each way (submission, the raylet's and the core
worker's queues, serialization) for every peer. The one row where gloo wins, K=2 with 32 tokens
(256 KiB a part) at 0.5 ms, is not understood yet: the mesh's median there ranged from 1.4 to 3.2 ms
between runs (1.37, 1.45, 1.62, 3.05, then 2.99, 3.20, 3.03, 3.13 at load ~4.5), gloo's 1.9. It is not
loss (2-7 retransmitted segments in 220 rounds, nstat in the hosts' namespaces); a candidate is the
delay line's own throughput on a loaded machine (~190 MB/s, so 256 KiB takes ~1.35 ms through it),
though gloo's parts cross the same relays. A decode step's exchange (1 token) is unaffected.
The mesh also keeps ggml_dist free of torch (gloo needs torch.distributed) and lets ranks' parts
differ in shape, which gloo's all_gather does not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time

import numpy as np


class BenchRank:
    """One rank: the three ways of gathering the same parts. Made a Ray actor in main()."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._cond = threading.Condition()
        self._inbox: dict[tuple[int, int], np.ndarray] = {}
        self.peers: list = []
        self.mesh = None
        self._listener = None

    def where(self) -> dict:
        import ggml_dist
        return {"pid": os.getpid(), "ggml_dist": ggml_dist.__file__}

    # -- the mesh
    def mesh_listen(self) -> str:
        from ggml_dist.workers.collective import MeshListener
        self._listener = MeshListener("127.0.0.1")
        return self._listener.address

    def mesh_connect(self, addresses: list[str], secret: bytes) -> None:
        from ggml_dist.workers.collective import mesh_connect
        self.mesh = mesh_connect(self.rank, addresses, secret, self._listener)

    def mesh_run(self, n_tokens: int, width: int, iters: int, warmup: int) -> list[float]:
        part = np.full((n_tokens, width), self.rank, np.float32)
        out = []
        for _ in range(warmup + iters):
            t0 = time.perf_counter()
            got = self.mesh.all_gather(part)
            out.append(time.perf_counter() - t0)
            assert all(g[0, 0] == j for j, g in enumerate(got)), "a part came back wrong"
        return out[warmup:]

    # -- a Ray call per exchange
    def set_peers(self, peers: list) -> None:
        self.peers = peers

    def deliver(self, seq: int, src: int, part: np.ndarray) -> None:
        with self._cond:
            self._inbox[(seq, src)] = part
            self._cond.notify_all()

    def ray_run(self, n_tokens: int, width: int, iters: int, warmup: int, seq0: int) -> list[float]:
        part = np.full((n_tokens, width), self.rank, np.float32)
        out = []
        for i in range(warmup + iters):
            seq = seq0 + i
            t0 = time.perf_counter()
            for j, peer in enumerate(self.peers):
                if j != self.rank:
                    peer.deliver.remote(seq, self.rank, part)
            with self._cond:
                self._cond.wait_for(lambda s=seq: sum(k[0] == s for k in self._inbox) == self.size - 1, timeout=60)
                got = [self._inbox.pop((seq, j)) if j != self.rank else part for j in range(self.size)]
            out.append(time.perf_counter() - t0)
            assert all(g[0, 0] == j for j, g in enumerate(got)), "a part came back wrong"
        return out[warmup:]

    # -- ray.util.collective, gloo
    def gloo_init(self, group: str) -> str:
        try:
            import ray.util.collective as col
            col.init_collective_group(self.size, self.rank, backend="gloo", group_name=group)
            return "ok"
        except Exception as e:  # noqa: BLE001 -- reported in the JSON as the reason gloo was not measured
            return f"{type(e).__name__}: {e}"

    def gloo_run(self, group: str, n_tokens: int, width: int, iters: int, warmup: int) -> list[float]:
        import ray.util.collective as col
        import torch
        part = torch.full((n_tokens, width), float(self.rank), dtype=torch.float32)
        out = []
        for _ in range(warmup + iters):
            t0 = time.perf_counter()
            got = [torch.empty_like(part) for _ in range(self.size)]
            col.allgather(got, part, group_name=group)
            out.append(time.perf_counter() - t0)
            assert all(float(g[0, 0]) == j for j, g in enumerate(got)), "a part came back wrong"
        return out[warmup:]


def _summary(times: list[float]) -> dict:
    ms = np.asarray(times) * 1e3
    return {"median_ms": round(float(np.median(ms)), 3), "p90_ms": round(float(np.percentile(ms, 90)), 3),
            "n": len(ms)}


def _bench_k(ray, size: int, tokens: list[int], width: int, iters: int, warmup: int) -> dict:
    actor_cls = ray.remote(num_cpus=0, max_concurrency=size + 2)(BenchRank)
    ranks = [actor_cls.remote(r, size) for r in range(size)]
    res: dict = {"where": ray.get(ranks[0].where.remote())}
    try:
        addrs = ray.get([a.mesh_listen.remote() for a in ranks])
        secret = os.urandom(16)
        ray.get([a.mesh_connect.remote(addrs, secret) for a in ranks])
        ray.get([a.set_peers.remote(ranks) for a in ranks])
        group = f"ag{size}_{os.getpid()}"
        gloo = ray.get([a.gloo_init.remote(group) for a in ranks], timeout=120)
        res["gloo_init"] = gloo[0] if any(g != "ok" for g in gloo) else "ok"
        for n_tokens in tokens:
            row = {}
            row["mesh"] = _summary(ray.get([a.mesh_run.remote(n_tokens, width, iters, warmup) for a in ranks])[0])
            seq0 = n_tokens * 1_000_000
            row["ray_call"] = _summary(ray.get([a.ray_run.remote(n_tokens, width, iters, warmup, seq0)
                                                for a in ranks])[0])
            if res["gloo_init"] == "ok":
                row["gloo"] = _summary(ray.get([a.gloo_run.remote(group, n_tokens, width, iters, warmup)
                                                for a in ranks])[0])
            res[f"tokens_{n_tokens}"] = row
    finally:
        for a in ranks:
            ray.kill(a)
    return res


# -- across testbed hosts: one plain process per namespace host, at each link delay, no Ray -----------------
_PORT_MESH, _PORT_GLOO = 29400, 29401


def _timed(fn, iters: int, warmup: int) -> dict:
    ts = []
    for _ in range(warmup + iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return _summary(ts[warmup:])


def _rank_process(spec: dict) -> None:
    """One rank on its host: the mesh on a fixed port of its own IP, then gloo (torch.distributed, as
    ray.util.collective's group runs it) where torch imports; rank 0 prints its times."""
    from ggml_dist.workers.collective import MeshListener, mesh_connect
    rank, size, ips, w = spec["rank"], spec["size"], spec["ips"], spec["width"]
    coll = mesh_connect(rank, [f"{ip}:{_PORT_MESH}" for ip in ips], bytes.fromhex(spec["secret"]),
                        MeshListener(ips[rank], _PORT_MESH), timeout_s=60)
    out: dict = {}
    for n in spec["tokens"]:
        part = np.full((n, w), rank, np.float32)
        out[f"tokens_{n}"] = {"mesh": _timed(lambda p=part: coll.all_gather(p), spec["iters"], spec["warmup"])}
    coll.close()
    if spec["gloo"]:
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
        dist.init_process_group("gloo", init_method=f"tcp://{ips[0]}:{_PORT_GLOO}", rank=rank, world_size=size,
                                timeout=timedelta(seconds=60))
        for n in spec["tokens"]:
            t = torch.full((n, w), float(rank))
            got = [torch.empty_like(t) for _ in range(size)]
            out[f"tokens_{n}"]["gloo"] = _timed(lambda t=t, g=got: dist.all_gather(g, t), spec["iters"], spec["warmup"])
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)


def _bench_testbed(ks: list[int], tokens: list[int], a: argparse.Namespace, gloo: bool) -> dict:
    """K ranks on K namespace hosts (ggml_dist/testbed/netns.py), every link delayed by each of
    --link-delay-ms one way (testbed/delay.py): the mesh's one step pays the delay once, a ring K-1 times."""
    import subprocess
    from pathlib import Path

    from ggml_dist.testbed.delay import delay_every_host, tcp_rtt_ms
    from ggml_dist.testbed.netns import Network
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    net = Network(f"gdc{os.getpid() % 0xfff:x}", max(ks))
    out: dict = {}
    try:
        net.setup()
        plain = tcp_rtt_ms(net.namespaces[0], net.namespaces[1], net.ips[1])
        for d in [float(x) for x in a.link_delay_ms.split(",")]:
            row: dict = {"link": delay_every_host(net, d, plain)}
            for k in ks:
                spec = {"size": k, "ips": net.ips[:k], "width": a.width, "tokens": tokens, "iters": a.iters,
                        "warmup": a.warmup, "secret": os.urandom(16).hex(), "gloo": gloo}
                procs = [subprocess.Popen(["ip", "netns", "exec", net.namespaces[r], sys.executable, __file__,
                                           "--rank-process", json.dumps({**spec, "rank": r})],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                         for r in range(k)]
                res = [p.communicate(timeout=600) for p in procs]
                if any(p.returncode for p in procs):
                    raise RuntimeError(f"K={k}, delay {d} ms: a rank failed: {[e[-800:] for _, e in res]}")
                row[f"K{k}"] = json.loads(res[0][0].strip().splitlines()[-1])
            out[f"delay_{d}_ms"] = row
    finally:
        net.teardown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4", help="K values, comma-separated")
    ap.add_argument("--tokens", default="1,32", help="tokens per part, comma-separated")
    ap.add_argument("--width", type=int, default=2048, help="floats per token per rank (n_embd)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--where", choices=["ray", "testbed"], default="ray", help="ray: K actors of a local Ray "
                    "(mesh, ray_call, gloo); testbed: K plain processes on K namespace hosts (root), mesh and "
                    "gloo, at each --link-delay-ms")
    ap.add_argument("--link-delay-ms", default="0,0.1,0.5", help="testbed: one-way delays added to every link")
    ap.add_argument("--rank-process", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.rank_process:
        _rank_process(json.loads(a.rank_process))
        return 0
    ks, tokens = [int(x) for x in a.ranks.split(",")], [int(x) for x in a.tokens.split(",")]
    try:
        import torch
        torch_version: str | None = torch.__version__
    except ImportError as e:
        torch_version = None
        why = f"not importable ({e}): gloo is not measured"
    head = {"bench": "collective_latency", "where": a.where, "width": a.width, "iters": a.iters,
            "python": platform.python_version(), "torch": torch_version or why, "cpus": os.cpu_count()}
    if a.where == "testbed":
        results = _bench_testbed(ks, tokens, a, torch_version is not None)
    else:
        import ray

        from ggml_dist.workers.local_ray import connect, shutdown_local
        connect(num_cpus=max(ks) + 1)
        try:
            results = {f"K{k}": _bench_k(ray, k, tokens, a.width, a.iters, a.warmup) for k in ks}
        finally:
            shutdown_local()
        head["ray"] = ray.__version__
    print(json.dumps({**head, "loadavg_1m": os.getloadavg()[0], "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

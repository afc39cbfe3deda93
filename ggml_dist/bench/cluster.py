"""The pipeline on separate hosts, next to llama.cpp's RPC on the same hosts: `ggml-dist bench cluster`.

    ggml-dist bench cluster [--model smollm2-135m,tinyllama] [--hosts 1,2,4] [--sequences 1,4,8]
        [--prompt 128,512] [--gen 64] [--host-cpu 0.6] [--head-cpu 0.3] [--link-delay-ms 0,0.1,0.5]
        [--serve-clients 8] [--json] [--plot cluster.png]

Every machine here has the same two cores, so the hosts are emulated (ggml_dist/testbed): a network
namespace each, with its own IP, a CPU of its own (a CFS quota of --host-cpu cores with a 5 ms period,
and a ticker so a host cannot overrun its quota between scheduler ticks), a memory limit and a shaped
link; the head (Ray's head node, where every driver and client runs) has --head-cpu. Host counts must
fit the machine: max(hosts) x host-cpu + head-cpu <= its cores, or a host would not get its quota.

For each model and host count k, ours: k = 1 is one process on host 1 (no Ray: what one machine runs);
k > 1 is a pipeline of k stages on hosts 1..k driven from the head (`run` / `run --parallel N`).
llama.cpp: `llama-batched-bench` on host 1 alone (k = 1), and over k `rpc-server`s on hosts 1..k from
the head (`--rpc ... -ngl 99`), when benchmarks/build_llama_rpc.sh has built it; the same prompt length,
sequences (a shared prompt, -pps) and generated tokens. With --serve-clients C: `ggml-dist serve` on one
host and over --serve-hosts hosts, C streaming clients from the head for --serve-duration seconds.

With --link-delay-ms 0,0.1,0.5 every multi-host point runs at each fixed delay added to every link,
each way (the testbed's userspace delay line: this kernel has no netem); each point says its
`link_delay_ms`, and `link_delays` gives each delay's ping-pong check (the round trip added, between
two hosts) and what it covers: every packet between two hosts, Ray's own included.

Per point: TTFT (the prompt), TPOT, the aggregate decode tok/s, each host's cores used and throttled
share of periods (from its cgroup, over the decode), the stages' busy shares. The bounds, from ours on
one host at the same per-host CPU: `linear_bound` = k x the one-host rate at N sequences (what k machines
would give if splitting a batch cost nothing); `pipeline_bound` = min(k, N) x the one-host rate at
N / min(k, N) sequences: a pipeline of k stages keeps every stage busy only with k micro-batches, so
each holds N/k of the sequences, and a batch of N/k reads the weights as often as a batch of N does
(on CPUs batched decode costs far less than N single steps: the one-host rates show by how much).
`efficiency` = rate / pipeline_bound. A model bigger than one host has no one-host rate: where it is a
synthetic shape, its bound comes from a slice of it that fits, the same shape with ceil(L/k) layers, on
one host at N / min(k, N) sequences (`slice_points`): a stage of k runs such a slice, and k slices in a row
take a token k times as long, so pipeline_bound = min(k, N) / k x the slice's rate (the slice carries the
embeddings and the head, which every stage does not: the bound is a little low, by their share). On a
mixture of experts the one-host rates fall less with N than a dense model's, since a batch's tokens read
different experts: the bound is measured, not assumed. A pipeline's greedy tokens of one sequence must
equal one process's (`tokens_mismatch` lists any that do not); with N sequences `tokens_match_one_process`
says whether they do (micro-batches of N/k rows against one batch of N: on some weight types a row's bits
depend on the batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..model.pull import resolve_model
from ..model.synthetic import SHAPES, cached_synthetic
from .cluster_report import bounds, check_tokens, check_tp_tokens, plot, summary

RPC_PORT = 50052


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _model_path(name: str) -> str:
    return str(cached_synthetic(SHAPES[name]) if name in SHAPES else resolve_model(name))


def _host_info() -> dict[str, Any]:
    flags = ""
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags") and not flags:
            flags = line.split(":", 1)[1]
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    simd = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f" {f}" in flags]
    return {"cpu": model, "cores": len(os.sched_getaffinity(0)), "simd_flags": simd,
            "load_avg": [round(x, 2) for x in os.getloadavg()]}


# -- ours -----------------------------------------------------------------------------------------------
def _ours(c: Any, sampler: Any, path: str, k: int, a: argparse.Namespace, sequences: list[int],
          mode: str) -> tuple[list[dict], list | None]:
    tensor = mode == "tensor"                       # rank 0 the driver on host 1, a rank on each of hosts 2..k
    spec = {"model": path, "prompts": _ints(a.prompt), "sequences": sequences, "gen": a.gen, "threads": a.threads,
            "address": c.gcs_address, "node_ips": c.ips[2 if tensor else 1:k + 1], "mode": mode, "stages": a.tp_stages}
    host = 1 if k == 1 or tensor else 0             # tensor-stages: the driver on the head, as a pipeline's
    for g in c.groups:
        if g is not None:
            g.reset_memory_peak()
    p = c.popen_in(host, [sys.executable, "-m", "ggml_dist.bench.cluster_point", json.dumps(spec)],
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=a.timeout)
    if p.returncode != 0:
        raise RuntimeError(f"ours on {k} host(s) failed ({p.returncode}): {err[-2000:]}")
    peaks = [g.memory_peak_bytes() if g is not None else None for g in c.groups]
    rows, plan = [], None
    for line in out.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if "plan" in r:
                plan = r["plan"]
                continue
            r.update(impl="ours-tp" if mode.startswith("tensor") else "ours", hosts=len(plan) if plan else k, mode=mode,
                     host_usage=sampler.window(*r.pop("window")))
            rows.append(r)
    if plan is not None:                  # each stage's planned need against its host's real peak (the
        for s in plan:                    # host's Ray daemons and the weights' page cache included)
            at = c.ips.index(s["node_ip"]) if s.get("node_ip") in c.ips else None
            s["host_memory_peak_bytes"] = peaks[at] if at is not None else None
    return rows, plan


# -- llama.cpp ------------------------------------------------------------------------------------------
def _llamacpp(c: Any, sampler: Any, build: Any, path: str, k: int, a: argparse.Namespace) -> list[dict]:
    from ..testbed.llamacpp_rpc import (
        batched_bench_argv,
        parse_batched_bench,
        parse_bench_log,
        rpc_server_argv,
        wait_rpc_ready,
    )
    prompts, seqs = _ints(a.prompt), _ints(a.sequences)
    ctx = max(prompts) + max(seqs) * a.gen + 64
    servers = []
    try:
        if k == 1:                            # one process on host 1, as one machine runs it
            argv = batched_bench_argv(build, path, ["x"], prompts, a.gen, seqs, a.threads, ctx, ["-pps"])
            i = argv.index("--rpc")
            argv = argv[:i] + argv[i + 2:]
            argv[argv.index("-ngl") + 1] = "0"
            host = 1
        else:
            for i in range(1, k + 1):
                servers.append(c.popen_in(i, rpc_server_argv(build, c.ips[i], RPC_PORT, a.threads),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for i, s in zip(range(1, k + 1), servers):
                wait_rpc_ready(c.ips[i], RPC_PORT, 60, s)
            argv = batched_bench_argv(build, path, [f"{ip}:{RPC_PORT}" for ip in c.ips[1:k + 1]], prompts, a.gen,
                                      seqs, a.threads, ctx, ["-pps"])
            host = 0
        t0 = time.time()
        r = c.run_in(host, argv, capture_output=True, text=True, timeout=a.timeout)
        t1 = time.time()
        if r.returncode != 0:
            raise RuntimeError(f"llama-batched-bench on {k} host(s) failed ({r.returncode}): {r.stderr[-1500:]}")
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                s.kill()
    log = parse_bench_log(r.stderr)
    usage = sampler.window(t0, t1)
    return [{"impl": "llama.cpp", "hosts": k, "mode": "local" if k == 1 else "rpc", "prompt": row["pp"],
             "sequences": row["b"], "gen": row["tg"], "ttft_s": round(row["t_pp_s"], 3),
             "tpot_ms": round(1e3 * row["t_tg_s"] / row["tg"], 2), "decode_tok_s": round(row["s_tg_tok_s"], 3),
             "host_usage_whole_run": usage, "flash_attn": log["flash_attn"],
             "pipeline_parallel": log["pipeline_parallel"]} for row in parse_batched_bench(r.stdout)]


# -- a model bigger than one host ----------------------------------------------------------------------
def _fits_one_host(path: str, a: argparse.Namespace) -> bool:
    return os.path.getsize(path) + (512 << 20) <= a.host_memory_mib << 20


def _logits_check(c: Any, path: str, a: argparse.Namespace, n: int = 16) -> dict[str, Any]:
    """Teacher-forced logits of n tokens: one process here (no testbed limit) against the pipeline placed by
    the nodes' memory (`--stages auto`), bit for bit."""
    import numpy as np
    toks = ",".join(str(t) for t in np.random.default_rng(5).integers(3, 32000, n))
    assert c.workdir is not None
    one, pipe = c.workdir / "logits-one.npz", c.workdir / "logits-pipeline.npz"
    base = ["ggml-dist", "logits", "--model", path, "--tokens", toks, "--threads", str(a.threads), "--ctx", "256"]
    subprocess.run([*base, "--out", str(one)], check=True, capture_output=True)
    r = c.run_in(0, [*base, "--out", str(pipe), "--address", c.gcs_address, "--stages", "auto"],
                 capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"the pipeline's logits failed: {r.stderr[-1500:]}")
    x, y = np.load(one)["logits"], np.load(pipe)["logits"]
    return {"positions": n, "bitwise_equal": bool(np.array_equal(x, y)),
            "max_abs_diff": float(np.max(np.abs(x - y))) if x.shape == y.shape else None,
            "argmax_equal": bool(np.array_equal(x.argmax(-1), y.argmax(-1)))}


def _slice_points(c: Any, sampler: Any, name: str, k: int, a: argparse.Namespace) -> list[dict]:
    """One host's rates on the shape `name` cut to s = ceil(L/k) layers (what one of k stages holds) and
    to s // 2 layers (cluster_report.slice_bound takes a layer's and the head's time from the two), at the
    sequences N / min(k, N) that a pipeline of k stages gives each micro-batch."""
    spec = SHAPES[name]
    s = -(-spec.n_layer // k)
    seqs = sorted({n // min(k, n) for n in _ints(a.sequences)})
    rows = []
    for n_layer in sorted({s, max(1, s // 2)}):
        path = str(cached_synthetic(dataclasses.replace(spec, n_layer=n_layer)))
        print(f"ggml-dist bench cluster: {Path(path).name} (a slice of {n_layer} layers), ours on 1 host",
              file=sys.stderr, flush=True)
        sliced, _ = _ours(c, sampler, path, 1, a, seqs, "local")
        rows += [{**r, "slice_layers": n_layer} for r in sliced]
    return rows


# -- serving --------------------------------------------------------------------------------------------
def _serve(c: Any, sampler: Any, path: str, k: int, a: argparse.Namespace) -> dict:
    import secrets
    port, key = 8080, secrets.token_hex(16)             # the server listens on the testbed bridge: keyed
    argv = ["ggml-dist", "serve", "--model", path, "--parallel", str(a.serve_clients), "--threads", str(a.threads),
            "--ctx", str(a.serve_clients * 512), "--port", str(port), "--api-key", key]
    if k == 1:
        host = 1
        argv += ["--host", c.ips[1]]
    else:
        host = 0
        argv += ["--host", c.ips[0], "--address", c.gcs_address, "--stages", str(k), *a.serve_args.split()]
    url = f"http://{c.ips[host]}:{port}"
    srv = c.popen_in(host, argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        probe = (f"import urllib.request, time\nfor _ in range(600):\n try:\n  urllib.request.urlopen('{url}/health', "
                 f"timeout=2).read(); break\n except Exception: time.sleep(1)\nelse: raise SystemExit(1)")
        if c.run_in(0, [sys.executable, "-c", probe], timeout=700).returncode != 0 or srv.poll() is not None:
            why = srv.stderr.read()[-1500:] if srv.stderr else ""
            raise RuntimeError(f"the {k}-host server did not come up: {why}")
        client = ("import json, sys\nfrom ggml_dist.bench.clients import run_clients\n"
                  f"print(json.dumps(run_clients('{url}', {a.serve_clients}, {a.serve_duration}, {a.serve_tokens}, "
                  f"'{key}')))")
        t0 = time.time()
        r = c.run_in(0, [sys.executable, "-c", client], capture_output=True, text=True, timeout=a.timeout)
        t1 = time.time()
        if r.returncode != 0:
            raise RuntimeError(f"the clients failed: {r.stderr[-1500:]}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    return {"impl": "ours", "hosts": k, **out, "host_usage": sampler.window(t0, t1)}


# -- the points of one model, over host counts and link delays -------------------------------------------
def _points(c: Any, sampler: Any, build: Any, path: str, ks: list[int], fits: bool, one_seqs: list[int],
            seqs: list[int], a: argparse.Namespace, m: dict[str, Any]) -> None:
    """Ours and llama.cpp at each host count; k > 1 at each link delay of --link-delay-ms (one host runs
    one process, no link: once, at delay 0). Each point says its link_delay_ms; m["link_delays"] has each
    delay's ping-pong check."""
    from ..testbed.delay import delay_every_host, tcp_rtt_ms
    delays = [float(x) for x in a.link_delay_ms.split(",") if x.strip()] or [0.0]
    i, j = (1, 2) if len(c.ips) > 2 else (0, 1)
    plain = tcp_rtt_ms(c.net.namespaces[i], c.net.namespaces[j], c.ips[j])
    m["link_delays"] = []
    for d in delays:
        m["link_delays"].append(delay_every_host(c.net, d, plain))
        for k in ks:
            if k == 1 and d != delays[0]:
                continue
            tag = {"link_delay_ms": d if k > 1 else 0.0}
            if "ours" not in a.skip:
                print(f"ggml-dist bench cluster: {Path(path).name}, ours on {k} host(s), link delay {d} ms",
                      file=sys.stderr, flush=True)
                rows, plan = _ours(c, sampler, path, k, a, one_seqs if k == 1 else seqs,
                                   "local" if k == 1 else "pipeline" if fits else "auto")
                m["points"] += [{**r, **tag} for r in rows]
                if plan is not None:
                    m.setdefault("plans", {})[str(k)] = plan
                mode = "tensor" if not a.tp_stages else "tensor-stages"   # S stages of k/S ranks: S divides k, k > S
                if a.tensor_parallel and k > 1 and (mode == "tensor" or k % a.tp_stages == 0 < k - a.tp_stages):
                    print(f"ggml-dist bench cluster: {Path(path).name}, ours {mode} on {k} host(s), "
                          f"link delay {d} ms", file=sys.stderr, flush=True)
                    m["points"] += [{**r, **tag} for r in _ours(c, sampler, path, k, a, seqs, mode)[0]]
            if build is not None and "llamacpp" not in a.skip:
                print(f"ggml-dist bench cluster: {Path(path).name}, llama.cpp on {k} host(s), link delay {d} ms",
                      file=sys.stderr, flush=True)
                m["points"] += [{**r, **tag} for r in _llamacpp(c, sampler, build, path, k, a)]
    if delays[-1]:
        delay_every_host(c.net, 0.0, plain)     # serving, after the points, on the plain link


def bench(a: argparse.Namespace) -> dict[str, Any]:
    from ..testbed.cgroups import cgroups_available
    from ..testbed.cluster import HostSpec, NamespaceCluster
    from ..testbed.llamacpp_rpc import find_rpc_build
    from ..testbed.netns import netns_available
    from ..testbed.usage import UsageSampler
    why = netns_available() or cgroups_available()
    if why:
        raise RuntimeError(f"the testbed needs network namespaces and cgroups: {why}")
    hosts_list = _ints(a.hosts)
    if a.head_cpu is None:
        a.head_cpu = round(min(a.host_cpu, len(os.sched_getaffinity(0)) - 0.05 - max(hosts_list) * a.host_cpu), 2)
    need = max(hosts_list) * a.host_cpu + a.head_cpu
    if need > len(os.sched_getaffinity(0)) - 0.05 + 1e-6 or a.head_cpu < 0.1:
        raise ValueError(f"{max(hosts_list)} hosts of {a.host_cpu} core and a head of {a.head_cpu} need {need:.2f} "
                         f"cores; this machine has {len(os.sched_getaffinity(0))}: lower --host-cpu or --hosts")
    build = None if a.llamacpp == "off" else find_rpc_build()
    seqs = _ints(a.sequences)
    # the one-host rates the pipeline bound needs: N / min(k, N) sequences
    one_seqs = sorted({*seqs, *(n // min(k, n) for k in hosts_list for n in seqs if n % min(k, n) == 0)})
    report: dict[str, Any] = {"host": _host_info(), "llamacpp_build": build.system_info if build else None,
                              "models": []}
    if build is None and a.llamacpp != "off":
        print("ggml-dist bench cluster: no llama.cpp RPC build (benchmarks/build_llama_rpc.sh)", file=sys.stderr)
    for name in a.model.split(","):
        path = _model_path(name)
        subprocess.run(["ggml-dist", "run", "--model", path, "--prompt", "warm", "-n", "2", "--threads", "1"],
                       check=True, capture_output=True, env={**os.environ, "GGML_DIST_NO_BACKGROUND_COMPILE": "1"})
        hosts = [HostSpec(num_cpus=0, cpu=a.head_cpu, cpu_period_us=a.period_us)] + [
            HostSpec(num_cpus=a.threads, cpu=a.host_cpu, cpu_period_us=a.period_us,
                     memory_bytes=a.host_memory_mib << 20, memory_limit_bytes=(a.host_memory_mib + 512) << 20,
                     link_rate=a.link_rate)
            for _ in range(max(hosts_list))]
        m: dict[str, Any] = {"model": path, "points": [], "serve": []}
        with NamespaceCluster(hosts, env={"GGML_DIST_NO_BACKGROUND_COMPILE": "1"}) as c, \
                UsageSampler(c.groups) as sampler:
            keys = ("host", "ip", "cpu", "cpus", "cpu_period_us", "memory_limit_bytes", "link")
            m["testbed"] = [{k: u[k] for k in keys} for u in c.usage()]
            fits = _fits_one_host(path, a)
            if not fits:                  # bigger than a host: placed by memory, checked against one process
                if a.drop_caches:         # so the page cache of its weights is charged to the stages' hosts
                    Path("/proc/sys/vm/drop_caches").write_text("1\n")
                m["logits_check"] = _logits_check(c, path, a)
                if name in SHAPES and "ours" not in a.skip:
                    m["slice_points"] = _slice_points(c, sampler, name, max(hosts_list), a)
            _points(c, sampler, build, path, hosts_list if fits else [max(hosts_list)], fits, one_seqs, seqs, a, m)
            m["host_memory_peak_bytes"] = [u.get("memory_peak_bytes") for u in c.usage()]
            m["host_oom_kills"] = [u.get("oom_kills") for u in c.usage()]
            if a.serve_clients and fits:
                for k in (1, a.serve_hosts):
                    print(f"ggml-dist bench cluster: serving on {k} host(s)", file=sys.stderr, flush=True)
                    m["serve"].append(_serve(c, sampler, path, k, a))
        ours = [r for r in m["points"] if r["impl"] == "ours"]
        tp = [r for r in m["points"] if r["impl"] == "ours-tp"]
        tp_bad = check_tp_tokens(ours, tp, fits)          # first: it reads copies of ours' tokens
        m["tokens_mismatch"] = check_tokens(ours) + [f"tensor-parallel, {b}" for b in tp_bad]
        bounds(ours, {max(hosts_list): m["slice_points"]} if m.get("slice_points") else None,
               SHAPES[name].n_layer if name in SHAPES else 0)
        bounds([r for r in m["points"] if r["impl"] == "llama.cpp"])
        bounds([dict(r) for r in ours if r["hosts"] == 1] + tp)   # x_one_host against the same one-host runs
        m["summary"] = summary(m)
        report["models"].append(m)
    if a.plot:
        plot(report["models"], a.plot)
        report["plot"] = a.plot
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ggml-dist bench cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m,tinyllama", help="comma list: known names, GGUF paths, "
                    "or a synthetic shape (model/synthetic.py SHAPES): tinyllama (the 1.1B TinyLlama-shape Q4_0), "
                    "llama2-7b (LLaMA-2-7B's shape, Q4_0, ~3.6 GiB), qwen3-30b-a3b[-q4_k] (4 layers of "
                    "Qwen3-30B-A3B, 1.4 GiB), qwen3-30b-a3b-16l (16 layers, 5.5 GiB), gpt-oss-20b (4 layers)")
    ap.add_argument("--hosts", default="1,2", help="comma list of host counts (default 1,2)")
    ap.add_argument("--sequences", default="1,4", help="comma list of sequences decoded together (default 1,4)")
    ap.add_argument("--prompt", default="128", help="comma list of prompt lengths (default 128)")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per sequence (default 64)")
    ap.add_argument("--threads", type=int, default=1, help="compute threads per host (default 1)")
    ap.add_argument("--host-cpu", type=float, default=0.6, help="each host's CPU in cores (default 0.6)")
    ap.add_argument("--head-cpu", type=float, default=None, help="the head's (drivers', clients') CPU in cores "
                    "(default: --host-cpu, or what the machine has left, if less)")
    ap.add_argument("--period-us", type=int, default=5000, help="the CFS quota period (default 5000 us)")
    ap.add_argument("--host-memory-mib", type=int, default=3072, help="each host's Ray memory; its cgroup limit "
                    "is 512 MiB more (default 3072)")
    ap.add_argument("--link-rate", default="1gbit", help="each host's link rate, tc units (default 1gbit)")
    ap.add_argument("--link-delay-ms", default="0", help="comma list of fixed delays added to every link, one "
                    "way, in ms (e.g. 0,0.1,0.5): each multi-host point runs at each (netem, or the testbed's "
                    "userspace delay line where the kernel lacks netem; default 0)")
    ap.add_argument("--llamacpp", choices=["auto", "off"], default="auto",
                    help="auto: measure llama.cpp's RPC too where benchmarks/build_llama_rpc.sh has built it")
    ap.add_argument("--serve-clients", type=int, default=0, help="also `serve` with this many clients (0: off)")
    ap.add_argument("--serve-hosts", type=int, default=2, help="hosts of the pipelined server (default 2)")
    ap.add_argument("--serve-duration", type=float, default=30.0)
    ap.add_argument("--serve-tokens", type=int, default=64, help="max_tokens of each client request")
    ap.add_argument("--serve-args", default="", help="more `serve` options for the pipelined server")
    ap.add_argument("--tensor-parallel", action="store_true", help="also tensor parallelism at each k > 1 (ours-tp"
                   " rows): rank 0 the driver on host 1, a rank on each other; --tp-stages S: S stages of k/S actors")
    ap.add_argument("--tp-stages", type=int, default=0, help="stages of rank actors (0: rank 0 the driver)")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: ours, llamacpp")
    ap.add_argument("--drop-caches", action="store_true", help="for a model bigger than a host: drop the page "
                    "cache first (root; machine-wide), so each host's cgroup is charged for the weights it maps")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--plot", default=None, help="write a PNG of tok/s against hosts")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.plot and importlib.util.find_spec("matplotlib") is None:     # before minutes of measurement
        ap.error("--plot needs matplotlib: pip install 'ggml-dist[bench]'")
    report = bench(a)
    if a.json:
        print(json.dumps(report))
    else:
        for m in report["models"]:
            print(Path(m["model"]).name)
            for row in m["summary"]:
                print("  ", row)
    return 0

"""Pipeline study: throughput against stages, micro-batches and n_copies, next to the GPipe bound.

    ggml-dist bench pipeline --model M [--stages 1,2,3] [--micro-batches 1,4] [--n-copies K]
                             [--ubatch 32,64] [--mode prefill|decode] [--calls compiled,plain]
                             [--lookahead 1,2] [--plot out.png] [--trace PREFIX] --json

Every (calls, ubatch, stages, micro-batches) point of the sweep is run (calls: a step as one execution of
the stages' Ray Compiled Graph, or as plain actor calls; each run reports which ran); decode runs report TTFT and the
inter-token latency (p50/p90/p99 ms) next to the throughput.

prefill: one prompt of micro_batches x ubatch tokens, decoded as micro_batches ubatches with up to
         n_copies of them in flight (only the last token's logits are read).
decode:  micro_batches sequences, one per micro-batch, decoding continuously: each sequence's next
         step is submitted as soon as its token is sampled, while the other sequences' steps are in
         flight (the pipeline is never drained between steps). --lookahead L keeps L steps of each
         sequence in flight: a step queued before its token is sampled takes it from the last stage
         (token feedback), so the driver is not between the last stage and the first.
The bound comes from the single-stage times t_k of one micro-batch on stage k, measured by the
actors' own clocks in a run of the same micro-batches with n_copies=1 (one in flight: no overlap,
so no contention between stages):
GPipe time = sum_k t_k + (M - 1) * max_k t_k over the M micro-batches of the run (in decode, every
step of every sequence: continuous decode is one long stream, so the bound tends to 1 / max_k t_k).
efficiency = tok_s / ideal_tok_s. ideal_inrun_tok_s uses the stage times measured during the run
itself (inflated by stages sharing cores). bubble_frac = 1 - (busy time summed over stages) / (stages x
wall time), next to the GPipe formula (p - 1) / (m + p - 1) for m micro-batches in flight; utilization is
each stage's busy time / wall time. decode also reports TPOT (tpot_ms: the mean time between a sequence's
tokens). --trace writes each run's Chrome/Perfetto trace.
cpu_ms_per_token: CPU time (all threads) of the driver, of each stage process and of every other process of
the local Ray (raylet, GCS, agents) per token; machine_cpu_share: their sum over the cores x the wall time
(near 1: the run is CPU-bound on this machine); with every stage on this host, cpu_bound_tok_s = the cores /
that total, given only where no waiter spins (plain or direct calls, one kernel thread per stage: a spinning
wait is CPU time that is not work, and no CPU figure can tell them apart).
bytes_per_hop: per token, driver -> each stage (its graph inputs) and each stage -> the next (the last:
-> the driver); bytes_per_token is their sum, each hop counted once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..model.context import ContextParams
from ..model.pull import resolve_model
from ..model.sampling import GREEDY
from ..model.ubatch import Batch


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run_one(path: str, stages: int, micro_batches: int, n_copies: int, ubatch: int, mode: str,
            n_steps: int, threads: int, trace: str | None = None, calls: str = "auto",
            lookahead: int = 1) -> dict[str, Any]:
    from ..runtime import RunConfig, local_ray_cpu_s, open_runtime
    n_tok = micro_batches * ubatch
    n_seq = micro_batches if mode == "decode" else 1
    params = ContextParams(n_ctx=max(512, n_tok + n_steps + 8), n_batch=max(n_tok, 8), n_ubatch=ubatch,
                           n_seq_max=n_seq)
    rt = open_runtime(RunConfig(path, params, stages, threads=threads, n_copies=n_copies, stage_calls=calls,
                                on_ray=True, show_plan=False))
    try:
        ctx, vocab = rt.ctx, rt.model.hp.n_vocab
        rng = np.random.default_rng(0)
        if mode == "prefill":
            toks = rng.integers(3, vocab, n_tok).tolist()
            ctx.decode(Batch.from_tokens(toks))                     # warm-up: plans, JIT, page cache
            ctx.clear()
            before = rt.stats()
            t0, c0, r0 = time.perf_counter(), time.process_time(), local_ray_cpu_s()
            ctx.decode(Batch.from_tokens(toks))
            wall, driver_cpu, r1 = time.perf_counter() - t0, time.process_time() - c0, local_ray_cpu_s()
            processed = n_tok
            latency: dict[str, Any] = {"ttft_ms": _pcts([wall])}
        else:
            last, ttft = [], []
            for s in range(n_seq):                                  # short prompts, then warm-up
                p = rng.integers(3, vocab, 4).tolist()
                t = time.perf_counter()
                last.append(int(np.argmax(ctx.decode(Batch.from_tokens(p, seq_id=s))[-1])))
                ttft.append(time.perf_counter() - t)
            pos = [4] * n_seq
            _decode_continuous(ctx, last, pos, n_seq * lookahead, lookahead)    # warm-up: the plans
            before = rt.stats()
            t0, c0, r0 = time.perf_counter(), time.process_time(), local_ray_cpu_s()
            itl = _decode_continuous(ctx, last, pos, n_steps * n_seq, lookahead)
            wall, driver_cpu, r1 = time.perf_counter() - t0, time.process_time() - c0, local_ray_cpu_s()
            processed = n_steps * n_seq
            latency = {"ttft_ms": _pcts(ttft), "itl_ms": _pcts(itl),
                       "tpot_ms": round(float(np.mean(itl)) * 1e3, 2) if itl else None}
        after = rt.stats()
        if trace:
            rt.write_trace(trace)
        same_host = all(i.node == os.uname().nodename for i in rt.stage_infos())
        stage_pids = {i.pid for i in rt.stage_infos()}
        ran = rt.calls_used()
    finally:
        rt.shutdown()
    n_calls = [a.n_calls - b.n_calls for a, b in zip(after, before)]
    busy = [a.compute_s - b.compute_s + a.decode_s - b.decode_s for a, b in zip(after, before)]
    t_k = [bz / max(c, 1) for bz, c in zip(busy, n_calls)]        # one micro-batch on stage k
    n_mb = max(n_calls) if n_calls else 0
    ideal = _gpipe(t_k, n_mb)
    hops = [a.bytes_in_host - b.bytes_in_host for a, b in zip(after, before)] + \
        [a.bytes_out - b.bytes_out for a, b in zip(after, before)]
    moved = sum(hops)
    tok_s = processed / wall
    cpu = [driver_cpu] + [a.cpu_s - b.cpu_s for a, b in zip(after, before)]
    # every other process of the local Ray (raylet, GCS, agents, idle workers) counts too
    ray_other = sum(c - r0.get(p, 0.0) for p, c in r1.items() if p not in stage_pids)
    total = sum(cpu) + ray_other
    # CPU time cannot tell work from waiting that spins: a compiled graph's channel readers spin, and so may
    # kernel threads between launches (OpenMP); then no CPU figure bounds the throughput
    spins = ran not in ("plain", "direct") or threads > 1
    cpu_bound = processed * len(os.sched_getaffinity(0)) / total if same_host and total > 0 and not spins else None
    ideal_tok_s = processed / ideal if ideal > 0 else 0.0
    return {"_t_k": t_k, "_n_mb": n_mb, "_processed": processed, "ideal_inrun_tok_s": round(ideal_tok_s, 3),
            "stages": stages, "micro_batches": micro_batches, "n_copies": n_copies, "ubatch": ubatch, "calls": ran,
            "lookahead": lookahead if mode == "decode" else None,
            "mode": mode, "tok_s": round(tok_s, 3), "ideal_tok_s": round(ideal_tok_s, 3),
            "efficiency": round(tok_s / ideal_tok_s, 3) if ideal_tok_s else None,
            "bubble_frac": round(1 - sum(busy) / (stages * wall), 3),
            "utilization": [round(bz / wall, 3) for bz in busy],
            "gpipe_bubble_frac": round((stages - 1) / (min(n_copies, micro_batches) + stages - 1), 3),
            "bytes_per_token": round(moved / processed, 1),
            "bytes_per_hop": {"driver_to_stage": [round(h / processed, 1) for h in hops[:stages]],
                              "stage_out": [round(h / processed, 1) for h in hops[stages:]]},
            "stage_ms": [round(t * 1e3, 2) for t in t_k], **latency,
            "cpu_ms_per_token": {"driver": round(cpu[0] / processed * 1e3, 2),
                                 "stages": [round(c / processed * 1e3, 2) for c in cpu[1:]],
                                 "ray_other": round(ray_other / processed * 1e3, 2)},
            # the share of this machine's cores the run's processes used (near 1: CPU-bound here)
            "machine_cpu_share": round(total / (len(os.sched_getaffinity(0)) * wall), 3) if same_host else None,
            "cpu_bound_tok_s": None if cpu_bound is None else round(cpu_bound, 1),
            "cpu_bound_note": ("spinning waiters (compiled-graph channel readers or kernel threads) count as CPU: "
                               "no bound" if spins else "this machine's cores over every process's CPU per token"),
            "wall_s": round(wall, 3)}


def _gpipe(t_k: list[float], n_mb: int) -> float:
    return sum(t_k) + (n_mb - 1) * max(t_k) if n_mb and t_k else 0.0


def _pcts(xs: list[float]) -> dict[str, float]:
    """p50/p90/p99 of durations in seconds, as milliseconds."""
    if not xs:
        return {}
    q = np.percentile(np.asarray(xs) * 1e3, [50, 90, 99])
    return {"p50": round(float(q[0]), 2), "p90": round(float(q[1]), 2), "p99": round(float(q[2]), 2)}


def _decode_continuous(ctx, last: list[int], pos: list[int], n_tokens: int, lookahead: int = 1) -> list[float]:
    """n_tokens decode steps over the sequences, each its own micro-batch: every sequence has `lookahead`
    steps in flight; the oldest is read (micro-batches finish in order), and that sequence's next step
    submitted at once. With lookahead > 1 a step is queued before the token it decodes is known: it
    takes the step before's token from the last stage (submit(tokens_from=)). `last` and `pos` are
    advanced in place. Returns the inter-token latencies: per sequence, the time between two of its
    tokens (TPOT's samples)."""
    assert n_tokens >= len(last), "at least one step per sequence"
    pending: deque = deque()
    newest: dict[int, Any] = {}                # per sequence, its newest step in flight

    def step(s: int) -> None:                 # greedy on the last stage: only the token comes back
        prev = newest.get(s) if lookahead > 1 else None
        b = Batch.from_tokens([last[s] if prev is None else 0], pos0=pos[s], seq_id=s)
        fed = {} if prev is None else {"tokens_from": prev}
        newest[s] = p = ctx.submit(b, sampling=[GREEDY], keep_logits=False, **fed)
        pending.append((s, p))
        pos[s] += 1
    submitted = 0
    for _ in range(lookahead):
        for s in range(len(last)):
            if submitted < n_tokens:
                step(s)
                submitted += 1
    seen: dict[int, float] = {}
    itl: list[float] = []
    for _ in range(n_tokens):
        s, p = pending.popleft()
        last[s] = p.tokens()[-1]
        now = time.perf_counter()
        if s in seen:
            itl.append(now - seen[s])
        seen[s] = now
        if submitted < n_tokens:                             # the sequence goes on at once
            step(s)
            submitted += 1
    return itl


def plot(runs: list[dict], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'ggml-dist[bench]'); no plot written"
    fig, ax = plt.subplots(figsize=(6, 4))
    for mb, ub in sorted({(r["micro_batches"], r["ubatch"]) for r in runs}):
        rs = sorted((r for r in runs if (r["micro_batches"], r["ubatch"]) == (mb, ub)), key=lambda r: r["stages"])
        ax.plot([r["stages"] for r in rs], [r["tok_s"] for r in rs], "o-", label=f"{mb} micro-batches, ub {ub}")
        ax.plot([r["stages"] for r in rs], [r["ideal_tok_s"] for r in rs], "x--", alpha=0.5,
                label=f"GPipe bound, {mb}, ub {ub}")
    ax.set_xlabel("stages")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{runs[0]['mode']} throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--micro-batches", default="1,4")
    ap.add_argument("--n-copies", default=None, help="comma list; default: 4, as llama.cpp")
    ap.add_argument("--ubatch", default="64", help="comma list: the sweep takes every value")
    ap.add_argument("--mode", choices=["prefill", "decode"], default="prefill")
    ap.add_argument("--steps", type=int, default=8, help="decode steps measured (decode mode)")
    ap.add_argument("--threads", type=int, default=1, help="threads per stage actor")
    ap.add_argument("--plot", default="pipeline.png", help="PNG of tok/s against stages ('' to skip)")
    ap.add_argument("--trace", default="", help="write each run's Chrome/Perfetto trace (a track per stage: "
                    "inputs, compute and outputs slices) as PREFIX-{calls}-s{stages}-mb{m}-nc{n}-ub{u}.json")
    ap.add_argument("--calls", default="auto", help="comma list of how the driver reaches the stages: "
                    "'direct' (frames on sockets, stage to stage), 'compiled' (one Ray Compiled Graph execution "
                    "per step), 'plain' (an actor call per stage) or 'auto' (direct, plain where it cannot connect)")
    ap.add_argument("--lookahead", default="1", help="comma list (decode): steps each sequence has in flight; "
                    "past 1, a step is queued before its token is known and the last stage feeds it to the first")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    calls = [c.strip() for c in a.calls.split(",") if c.strip()]
    if not calls or set(calls) - {"auto", "direct", "compiled", "plain"}:
        ap.error(f"--calls takes 'auto', 'direct', 'compiled' and/or 'plain', not {a.calls!r}")
    from ..runtime import connect, default_copies
    path = str(resolve_model(a.model))
    stages = _ints(a.stages)
    connect(num_cpus=max(2, max(stages) * a.threads))
    runs = []
    lookaheads = _ints(a.lookahead) if a.mode == "decode" else [1]
    if not lookaheads or min(lookaheads) < 1:
        ap.error(f"--lookahead takes positive integers, not {a.lookahead!r}")
    sweep = [(c, ub, k, mb, la) for c in calls for ub in _ints(a.ubatch) for k in stages
             for mb in _ints(a.micro_batches) for la in lookaheads]
    for c, ub, k, mb, la in sweep:
        # the single-stage times: the same micro-batches with one in flight (no overlap, no contention)
        def trace(nc: int, k: int = k, mb: int = mb, ub: int = ub, c: str = c, la: int = la) -> str | None:
            return f"{a.trace}-{c}-s{k}-mb{mb}-nc{nc}-ub{ub}-la{la}.json" if a.trace else None
        solo = run_one(path, k, mb, 1, ub, a.mode, a.steps, a.threads, trace(1), c)
        for nc in (_ints(a.n_copies) if a.n_copies else [default_copies(k)]):
            r = solo if nc == 1 else run_one(path, k, mb, nc, ub, a.mode, a.steps, a.threads, trace(nc), c, la)
            if a.trace:
                r["trace"] = trace(nc)
            r = dict(r)
            r.pop("_t_k")                     # the bound uses the solo run's stage times
            n_mb, processed = r.pop("_n_mb"), r.pop("_processed")
            ideal = _gpipe(solo["_t_k"], n_mb)
            r["ideal_tok_s"] = round(processed / ideal, 3) if ideal else 0.0
            r["efficiency"] = round(r["tok_s"] / r["ideal_tok_s"], 3) if r["ideal_tok_s"] else None
            r["solo_stage_ms"] = [round(t * 1e3, 2) for t in solo["_t_k"]]
            runs.append(r)
            if not a.json:
                print(r, file=sys.stderr)
    out: dict[str, Any] = {"model": a.model, "runs": runs}
    if a.plot:
        note = plot(runs, a.plot)
        out["plot"] = a.plot if note is None else note
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

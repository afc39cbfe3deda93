"""What `ggml-dist bench cluster` runs inside a testbed host: our generation at one host count, over every
(prompt, sequences) point, one JSON line each.

    python -m ggml_dist.bench.cluster_point '{"model": PATH, "mode": "local" | "pipeline", "address": GCS,
        "node_ips": [...], "prompts": [128], "sequences": [1, 4], "gen": 64, "threads": 1}'

local: one process, no Ray (the strongest one-host baseline: what a user runs on one machine). pipeline:
one stage per listed node (in that order), this process the driver. tensor: tensor parallelism, rank 0
this process (run on a host of its own), a rank per listed node. tensor-stages: "stages" S stages x K
ranks on the S x K listed nodes (workers/tp_stages.py), this process the driver. auto: as many stages as the
cluster's nodes need for the model, placed by their memory (`--stages auto`); its plan is printed first.
Each point is what `run` (one sequence) or `run --parallel N` does: one prompt of random tokens evaluated
once, N greedy continuations of `gen` tokens (no stop at an end token), after a short warm-up of the same
shapes (plans, first calls).
A line reports the wall-clock window of its decode (time.time(), for the testbed's cgroup sampler
outside), TTFT (the prompt: every sequence's first token comes from it), TPOT, the aggregate decode
rate, each stage's busy share of the window, and the first sequence's tokens (so runs can be checked
against each other).
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

from ..model.context import ContextParams, LlamaContext
from ..model.generate import generate, generate_parallel
from ..model.sampling import SamplingParams
from ..runtime import RunConfig, Runtime, connect, open_runtime

GREEDY = SamplingParams(temperature=0.0)


def _open(spec: dict[str, Any], params: ContextParams) -> Runtime:
    if spec["mode"] == "local":
        return open_runtime(RunConfig(spec["model"], params, 1, threads=spec["threads"], set_threads=True))
    import ray
    connect(spec["address"])
    node_ids = None
    if spec["mode"] != "auto":                      # auto: placed by the nodes' memory, as `run --stages auto`
        ids = {n["NodeManagerAddress"]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
        node_ids = [ids[ip] for ip in spec["node_ips"]]
    if spec["mode"] == "tensor":                    # rank 0 this process (on its host), the others there
        assert node_ids is not None
        return open_runtime(RunConfig(spec["model"], params, 1, spec["address"], threads=spec["threads"],
                                      on_ray=True, node_ids=node_ids, tensor_parallel=len(node_ids) + 1))
    if spec["mode"] == "tensor-stages":             # S stages x K ranks, stage s of rank r on node s * K + r
        assert node_ids is not None
        n = spec["stages"]
        return open_runtime(RunConfig(spec["model"], params, n, spec["address"], threads=spec["threads"],
                                      on_ray=True, node_ids=node_ids, tensor_parallel=len(node_ids) // n,
                                      stage_calls=spec.get("calls", "auto"), show_plan=False))
    rt = open_runtime(RunConfig(spec["model"], params, len(node_ids) if node_ids else None, spec["address"],
                                threads=spec["threads"], stage_calls=spec.get("calls", "auto"), on_ray=True,
                                node_ids=node_ids, show_plan=False))
    assert rt.placement is not None
    print(json.dumps({"plan": rt.placement.to_json()}), flush=True)
    return rt


def _generate(ctx: LlamaContext, tok: Any, prompt: list[int], gen: int, n_seq: int, pipelined: bool,
              on_token: Any) -> list[int]:
    if n_seq == 1:
        return generate(ctx, tok, prompt, gen, GREEDY, stop_at_eog=False,
                        on_token=lambda i, t: on_token(0, i, t)).tokens
    return generate_parallel(ctx, tok, prompt, gen, n_seq, GREEDY, stop_at_eog=False, on_token=on_token,
                             lookahead=2 if pipelined else 1)[0].tokens


def _stage_busy(rt: Runtime, t0: float, t1: float) -> list[float]:
    out = []
    for st in rt.stats():
        calls = [e for e in st.timeline if t0 <= e[0] <= t1]
        out.append(round(sum(e[3] - e[0] for e in calls) / (t1 - t0), 3))
    return out


def measure(ctx: LlamaContext, tok: Any, rt: Runtime, prompt: list[int], gen: int, n_seq: int) -> dict[str, Any]:
    pipelined = rt.distributed
    ctx.clear()
    _generate(ctx, tok, prompt, 3, n_seq, pipelined, lambda s, i, t: None)        # warm-up: the shapes
    ctx.clear()
    stamps: list[float] = []
    t0 = time.time()
    tokens = _generate(ctx, tok, prompt, gen, n_seq, pipelined, lambda s, i, t: stamps.append(time.time()))
    t1 = stamps[n_seq - 1]                       # every sequence's first token came from the prompt
    t2 = stamps[-1]
    n_dec = len(stamps) - n_seq
    out = {"prompt": len(prompt), "sequences": n_seq, "gen": gen, "window": [t1, t2],
           "ttft_s": round(t1 - t0, 3), "tpot_ms": round(1e3 * (t2 - t1) / max(1, gen - 1), 2),
           "decode_tok_s": round(n_dec / (t2 - t1), 3) if t2 > t1 else None, "tokens": tokens}
    if pipelined:
        out["stage_busy"] = _stage_busy(rt, t1, t2)
        out["stage_calls"] = rt.calls_used()
    ctx.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    spec = json.loads((argv if argv is not None else sys.argv[1:])[0])
    n_seq_max, p_max, gen = max(spec["sequences"]), max(spec["prompts"]), spec["gen"]
    params = ContextParams(n_ctx=p_max + n_seq_max * (gen + 4) + 16, n_batch=512, n_ubatch=512,
                           n_seq_max=n_seq_max)
    rt = _open(spec, params)
    model, ctx = rt.model, rt.ctx
    try:
        rng = np.random.default_rng(spec.get("seed", 0))
        for p in spec["prompts"]:
            prompt = [int(t) for t in rng.integers(3, model.hp.n_vocab, p)]
            for n in spec["sequences"]:
                print(json.dumps(measure(ctx, model.tokenizer, rt, prompt, gen, n)), flush=True)
    finally:
        rt.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

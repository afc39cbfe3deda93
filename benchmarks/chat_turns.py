"""A chat's next turn without re-reading it (issue 53): a four-turn conversation on a Qwen3.5-shaped file
served over pipeline stages, each turn ~500 new tokens, with the slots' state checkpoints (the cached
conversation goes back to the copy at the end of the last answer on every stage and evaluates only the new
turn) against a server that re-reads the whole conversation every turn (--no-cache-prompt: what
llama-server does for these models without checkpoints).

    python benchmarks/chat_turns.py [--model qwen3.5-0.8b] [--stages 2] [--turns 4] [--turn-tokens 500]
                                    [--reply 32] [--repeat 1]

The conversation is built at the token level, as a chat template would lay it out: turn k's prompt is
turn k-1's prompt, its answer's tokens and k's new tokens (fixed random ids, so both servers get the same
prompts), greedy, batch-invariant numerics (--deterministic) so the answers must be equal bit for bit.
A throwaway prompt first warms each server. Each turn is streamed from llama-server's /completion: TTFT is the wall time to the first streamed token,
cache_n the prompt tokens not evaluated again (its `timings`). Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx
import numpy as np

from ggml_dist.model.context import ContextParams
from ggml_dist.model.synthetic import model_path
from ggml_dist.runtime import RunConfig
from ggml_dist.serve import EngineConfig, ServerThread


def turn(url: str, prompt: list[int], n_reply: int) -> dict:
    """One streamed /completion: its answer's tokens, TTFT and llama-server's timings."""
    t0 = time.perf_counter()
    ttft, tokens, final = None, [], {}
    body = {"prompt": prompt, "n_predict": n_reply, "temperature": 0, "stream": True, "return_tokens": True,
            "cache_prompt": True}
    with httpx.stream("POST", url + "/completion", json=body, timeout=3600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/completion answered {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            ev = json.loads(line[6:])
            if ev.get("tokens") and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += ev.get("tokens", [])
            if ev.get("stop"):
                final = ev
    t = final["timings"]
    return {"tokens": tokens, "ttft_s": round(ttft or 0.0, 3), "cache_n": t["cache_n"], "prompt_n": t["prompt_n"],
            "prompt_ms": round(t["prompt_ms"], 1)}


def chat(path: str, stages: int, cached: bool, user_turns: list[list[int]], n_reply: int, n_ctx: int,
         answers: list[list[int]] | None) -> list[dict]:
    """The conversation on a fresh server; with answers (the other server's), the prompts are built from
    them, so a differing answer cannot change the next prompt."""
    params = ContextParams(n_ctx=n_ctx, batch_invariant=True)
    cfg = EngineConfig(RunConfig(path, params, stages, label="ggml-dist serve"), n_parallel=1, cache_prompt=cached)
    srv = ServerThread(cfg).start()
    try:
        warm = [int(t) for t in np.random.default_rng(1).integers(100, 30000, len(user_turns[0]))]
        turn(srv.url, warm, n_reply)            # kernels compiled, a prompt's plans made: not in turn 1
        history, out = [], []
        for k, user in enumerate(user_turns):
            prompt = history + user
            res = turn(srv.url, prompt, n_reply)
            out.append({"turn": k + 1, "prompt_tokens": len(prompt), **res})
            history = prompt + (answers[k] if answers else res["tokens"])
        return out
    finally:
        srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3.5-0.8b", help="a synthetic shape or a GGUF path")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=500)
    ap.add_argument("--reply", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="conversations per server kind, alternated")
    args = ap.parse_args()
    path = args.model if os.path.exists(args.model) else str(model_path(args.model))
    rng = np.random.default_rng(0)
    users = [[int(t) for t in rng.integers(100, 30000, args.turn_tokens)] for _ in range(args.turns)]
    n_ctx = args.turns * (args.turn_tokens + args.reply) + 64
    runs: dict[str, list] = {"checkpoints": [], "re_read": []}
    for _ in range(args.repeat):
        ck = chat(path, args.stages, True, users, args.reply, n_ctx, None)
        answers = [t["tokens"] for t in ck]
        rr = chat(path, args.stages, False, users, args.reply, n_ctx, answers)
        runs["checkpoints"].append(ck)
        runs["re_read"].append(rr)
        print(f"checkpoints TTFT {[t['ttft_s'] for t in ck]} s, cache_n {[t['cache_n'] for t in ck]}; "
              f"re-read TTFT {[t['ttft_s'] for t in rr]} s", file=sys.stderr)
    same = all(a["tokens"] == b["tokens"] for ck, rr in zip(runs["checkpoints"], runs["re_read"], strict=True)
               for a, b in zip(ck, rr, strict=True))
    best = {k: [min(r[i]["ttft_s"] for r in v) for i in range(args.turns)] for k, v in runs.items()}
    print(json.dumps({
        "model": os.path.basename(path), "stages": args.stages, "turns": args.turns,
        "turn_tokens": args.turn_tokens, "reply_tokens": args.reply, "repeat": args.repeat,
        "answers_equal": same,
        "cached_tokens": [t["cache_n"] for t in runs["checkpoints"][0]],
        "ttft_s": best, "ttft_ratio": [round(r / c, 2) for c, r in zip(best["checkpoints"], best["re_read"],
                                                                       strict=True)],
        "runs": {k: [[{x: t[x] for x in ("turn", "prompt_tokens", "ttft_s", "cache_n", "prompt_n", "prompt_ms")}
                      for t in r] for r in v] for k, v in runs.items()},
    }, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

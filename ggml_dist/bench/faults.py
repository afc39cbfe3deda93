"""Fault study: kill stage actors in the middle of generations and check that nothing is lost or wrong;
fuzz the GGUF loader. Prints one JSON object:

    {"kills", "recovered", "lost_requests", "wrong_tokens", "recovery_s_p50", "recovery_s_max",
     "fuzz_cases", "fuzz_failures", "unclear_errors"}

fuzz_failures: cases that ended in anything but a valid model or one of the project's own errors
(GGUFError, BatchError, ContextFullError); unclear_errors: such errors whose message does not name the
file (ggml_dist/bench/fuzz_gguf.py has the rules). Both are findings; neither hides in the other.

    ggml-dist bench faults [--model M] [--stages 2] [--runs 6] [--tokens 24] [--fuzz-cases 10000] --json
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np


def kill_study(path: str, stages: int, runs: int, n_tokens: int, seed: int = 0) -> dict:
    from ..model.context import ContextParams, LlamaContext
    from ..model.generate import generate
    from ..model.model import LlamaModel
    from ..workers.cluster import Pipeline, connect
    connect(num_cpus=max(2, stages))
    m = LlamaModel.load(path)
    rng = np.random.default_rng(seed)
    prompt = m.tokenizer.encode("The capital of France is")
    want = generate(LlamaContext(m, ContextParams(n_ctx=512)), m.tokenizer, prompt, n_tokens,
                    stop_at_eog=False).tokens
    pl = Pipeline.launch(path, stages, ContextParams(n_ctx=512))
    kills = lost = wrong = 0
    times: list[float] = []
    try:
        for _ in range(runs):
            pl.ctx.clear()
            stage, after = int(rng.integers(0, stages)), int(rng.integers(1, n_tokens))

            def on_token(i: int, tok: int, stage=stage, after=after) -> None:
                nonlocal kills
                if i == after:
                    kills += 1
                    pl.kill_stage(stage)
            n0 = len(pl.ctx.recovery_s)
            try:
                got = generate(pl.ctx, m.tokenizer, prompt, n_tokens, on_token=on_token, stop_at_eog=False).tokens
            except Exception as e:  # noqa: BLE001 - a lost request (any error): counted, never hidden
                print(f"lost: {type(e).__name__}: {e}", file=sys.stderr)
                lost += 1
                continue
            wrong += int(got != want)
            times.extend(pl.ctx.recovery_s[n0:])
    finally:
        pl.shutdown()
    return {"kills": kills, "recovered": len(times), "lost_requests": lost, "wrong_tokens": wrong,
            "recovery_s_p50": round(float(np.median(times)), 3) if times else None,
            "recovery_s_max": round(max(times), 3) if times else None}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--fuzz-cases", type=int, default=10000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from ..model.pull import resolve_model
    out = kill_study(str(resolve_model(a.model)), a.stages, a.runs, a.tokens)
    try:
        from .fuzz_gguf import run_fuzz  # the loader fuzzer
        fz = run_fuzz(a.fuzz_cases, jobs=2)
        out.update({"fuzz_cases": fz.fuzz_cases, "fuzz_failures": fz.fuzz_failures,
                    "unclear_errors": fz.unclear_errors})
    except ImportError as e:
        out.update({"fuzz_cases": 0, "fuzz_failures": None, "unclear_errors": None, "fuzz_note": str(e)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What constrained decoding costs per token: the grammar's mask and the masked sampling, on the driver.

    python benchmarks/grammar.py [--model smollm2-135m] [--tokens 64]

Builds the model's llguidance tokenizer (once per model), then walks a JSON schema's grammar for
`tokens` steps with random logits (each step: allowed() -> Sampler.sample(allowed=...) -> accept), and
times the same sampling without a grammar, greedy and at temperature 0.8. Prints one JSON object
(microseconds per token).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ggml_dist.model.model import LlamaModel
from ggml_dist.model.pull import resolve_model
from ggml_dist.model.sampling import Sampler, SamplingParams
from ggml_dist.serve import grammar as G

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags", "score"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
                         "score": {"type": "number"}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    tok = LlamaModel.load(resolve_model(a.model)).tokenizer
    t0 = time.perf_counter()
    lt = G.tokenizer_of(tok)
    build_s = time.perf_counter() - t0
    grammar = G.grammar_of(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    rng = np.random.default_rng(0)
    logits = [rng.standard_normal(tok.n_vocab).astype(np.float32) * 3 for _ in range(a.tokens)]
    runs = []
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=1)
        plain = Sampler(params)
        t0 = time.perf_counter()
        for x in logits:
            plain.sample(x)
        plain_us = (time.perf_counter() - t0) / len(logits) * 1e6
        c, s = G.Constraint(lt, grammar, tok.n_vocab), Sampler(params)
        n, mask_s, t0 = 0, 0.0, time.perf_counter()
        for x in logits:
            t1 = time.perf_counter()
            allowed = c.allowed()
            mask_s += time.perf_counter() - t1
            t = s.sample(x, allowed=allowed)
            if tok.is_eog(t) or c.done:
                break
            c.accept(t)
            n += 1
        total_us = (time.perf_counter() - t0) / max(n, 1) * 1e6
        runs.append({"temperature": temperature, "tokens": n,
                     "mask_us_per_token": round(mask_s / max(n, 1) * 1e6, 1),
                     "constrained_us_per_token": round(total_us, 1),
                     "unconstrained_sample_us_per_token": round(plain_us, 1)})
    print(json.dumps({"model": a.model, "n_vocab": tok.n_vocab, "tokenizer_build_s": round(build_s, 2),
                      "runs": runs}))


if __name__ == "__main__":
    main()

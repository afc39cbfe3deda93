"""What one layer costs beyond its weight bytes in a decode step: the figure behind
workers/placement.py's LAYER_DISPATCH_BYTES.

    python benchmarks/layer_cost.py [--model smollm2-135m] [--splits 8,15,22] [--steps 48]

For each split point k it runs a 2-stage pipeline (layers 0..k-1 | k..n-1 + head), decodes `steps`
tokens for 4 sequences with one micro-batch in flight (no overlap, no contention), and reads each stage's
own compute clock. A least-squares fit of stage time = a * (weight bytes read) + b * (layers) over all
stages of all splits gives the bytes a layer's fixed cost is worth, b / a. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from ggml_dist.bench.pipeline import _decode_continuous
from ggml_dist.model.context import ContextParams
from ggml_dist.model.pull import resolve_model
from ggml_dist.model.ubatch import Batch
from ggml_dist.workers.cluster import Pipeline
from ggml_dist.workers.local_ray import connect
from ggml_dist.workers.model_sizes import ModelSizes


def stage_ms(path: str, layers: list[tuple[int, int]], steps: int) -> list[float]:
    pl = Pipeline.launch(path, len(layers), ContextParams(n_ctx=512, n_batch=64, n_ubatch=64, n_seq_max=4),
                         n_copies=1, layers=layers)
    try:
        last = [int(np.argmax(pl.ctx.decode(Batch.from_tokens([5, 6, 7, 8], seq_id=s))[-1])) for s in range(4)]
        pos = [4] * 4
        _decode_continuous(pl.ctx, last, pos, 8)                  # warm-up
        before = pl.stats()
        _decode_continuous(pl.ctx, last, pos, steps)
        after = pl.stats()
    finally:
        pl.shutdown()
    return [(a.compute_s - b.compute_s) / (a.n_calls - b.n_calls) * 1e3 for a, b in zip(after, before)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--splits", default="8,15,22")
    ap.add_argument("--steps", type=int, default=48)
    a = ap.parse_args()
    from ggml_dist.model.model import LlamaModel
    path = str(resolve_model(a.model))
    model = LlamaModel.load(path)
    m = ModelSizes.of(model.file, model.hp, 512)
    n = model.hp.n_layer
    connect(num_cpus=2)
    rows, ys, points = [], [], []
    t0 = time.perf_counter()
    for k in (int(x) for x in a.splits.split(",")):
        ranges = [(0, k), (k, n)]
        ms = stage_ms(path, ranges, a.steps)
        for i, ((lo, hi), t) in enumerate(zip(ranges, ms)):
            rows.append([m.layer_bytes(lo, hi) + (m.last if i == 1 else 0), hi - lo])
            ys.append(t)
        points.append({"layers": ranges, "stage_ms": [round(t, 3) for t in ms]})
    (ms_per_byte, ms_per_layer), *_ = np.linalg.lstsq(np.array(rows, float), np.array(ys), rcond=None)
    print(json.dumps({"model": a.model, "points": points, "ms_per_mib": round(ms_per_byte * 2**20, 4),
                      "ms_per_layer_fixed": round(ms_per_layer, 4),
                      "layer_dispatch_mib": round(ms_per_layer / ms_per_byte / 2**20, 2),
                      "wall_s": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()

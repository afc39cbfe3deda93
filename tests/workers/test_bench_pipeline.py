"""The pipeline study's continuous decode: every sequence keeps a step in flight, and the tokens are the
ones a single process gives for the same steps; latency percentiles."""
from __future__ import annotations

import numpy as np

from ggml_dist.bench.pipeline import _decode_continuous, _pcts
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch

from .test_stage_local import local_pipeline


def _run(ctx, n_seq: int, n_tokens: int) -> tuple[list[int], list[float]]:
    last = [int(np.argmax(ctx.decode(Batch.from_tokens([1, 40 + s, 7], seq_id=s))[-1])) for s in range(n_seq)]
    pos = [3] * n_seq
    seqs: list[list[int]] = [[] for _ in range(n_seq)]
    itl = []
    for _ in range(n_tokens // n_seq):
        itl += _decode_continuous(ctx, last, pos, n_seq)
        for s in range(n_seq):
            seqs[s].append(last[s])
    itl += _decode_continuous(ctx, last, pos, 3 * n_seq)
    return [t for s in seqs for t in s] + last, itl


def test_continuous_decode_matches_one_process(tmp_path):
    path = write_synthetic(tmp_path / "m.gguf", SyntheticSpec(n_layer=3, seed=12))
    params = ContextParams(n_ctx=256, n_seq_max=3)
    _, ctx, _ = local_pipeline(path, 2, params)
    got, itl = _run(ctx, 3, 12)
    want, _ = _run(LlamaContext(LlamaModel.load(path), params), 3, 12)
    assert got == want and len(set(got)) >= 3
    assert len(itl) == 3 * 2                        # 3 steps per sequence in the last call: 2 gaps each


def test_percentiles():
    assert _pcts([]) == {}
    assert _pcts([0.001, 0.002, 0.003]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98}

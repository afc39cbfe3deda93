"""bench cluster's bounds (pure arithmetic over measured rates): the pipeline bound from one host's rates at
N / min(k, N) sequences, and for a model bigger than a host from a slice of its layers on one host."""
from __future__ import annotations

import pytest

from ggml_dist.bench.cluster_report import bounds as _bounds


def _row(hosts: int, seqs: int, tok_s: float) -> dict:
    return {"impl": "ours", "hosts": hosts, "prompt": 128, "sequences": seqs, "decode_tok_s": tok_s}


def test_pipeline_bound_from_one_host_rates():
    rows = [_row(1, 1, 10.0), _row(1, 2, 16.0), _row(1, 4, 24.0), _row(2, 4, 30.0), _row(2, 1, 9.5)]
    _bounds(rows)
    two4, two1 = rows[3], rows[4]
    assert two4["pipeline_bound"] == 32.0 and two4["efficiency"] == pytest.approx(30 / 32, abs=1e-3)
    assert two4["linear_bound"] == 48.0 and two4["x_one_host"] == 1.25
    assert two1["pipeline_bound"] == 10.0                        # one sequence cannot overlap: one host's rate


def test_pipeline_bound_of_a_model_bigger_than_a_host_from_its_slice():
    """4 stages: the slice (L/4 layers) runs at s(n); micro-batches of N/4 keep every stage busy, so the
    bound is s(N/4); one sequence passes the 4 stages in turn: s(1) / 4."""
    pipe = [_row(4, 1, 2.0), _row(4, 4, 7.0), _row(4, 8, 11.0)]
    slice_rows = [_row(1, 1, 9.0), _row(1, 2, 13.0)]
    _bounds(pipe, {4: slice_rows})
    assert [r["pipeline_bound"] for r in pipe] == [2.25, 9.0, 13.0]
    assert pipe[1]["efficiency"] == pytest.approx(7 / 9, abs=1e-3)
    assert "linear_bound" not in pipe[0]                         # no one-host rate of the whole model

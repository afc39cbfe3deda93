"""bench cluster's bounds (pure arithmetic over measured rates): the pipeline bound from one host's rates at
N / min(k, N) sequences, and for a model bigger than a host from a slice of its layers on one host."""
from __future__ import annotations

import pytest

from ggml_dist.bench.cluster_report import bounds as _bounds
from ggml_dist.bench.cluster_report import check_tokens, slice_bound


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
    """4 stages of 4 layers: micro-batches of N/4 keep every stage busy, and the last (its 4 layers and the
    head) is the busiest, so the bound is s4(N/4); one sequence passes the 16 layers and the head once."""
    pipe = [_row(4, 1, 2.0), _row(4, 4, 7.0), _row(4, 8, 11.0)]
    # t(n) per step of n sequences: 4 layers + head 1/8 + 1/8 s (rate 4); 2 layers + head 1/16 + 1/8 s
    slice_rows = [{**_row(1, 1, 4.0), "slice_layers": 4}, {**_row(1, 1, 1 / (1 / 16 + 1 / 8)), "slice_layers": 2},
                  {**_row(1, 2, 6.0), "slice_layers": 4}, {**_row(1, 2, 8.0), "slice_layers": 2}]
    _bounds(pipe, {4: slice_rows}, n_layer=16)
    # one sequence: t_layer 1/32 s, t_head 1/8 s, the whole model 16/32 + 1/8 = 5/8 s a token
    assert pipe[0]["pipeline_bound"] == pytest.approx(1.6, abs=1e-3)
    assert pipe[1]["pipeline_bound"] == pytest.approx(4.0, abs=1e-3)     # the busiest stage: s4(1)
    assert pipe[1]["efficiency"] == pytest.approx(7 / 4, abs=1e-3)
    assert pipe[2]["pipeline_bound"] == pytest.approx(6.0, abs=1e-3)     # s4(2)
    assert "linear_bound" not in pipe[0]                         # no one-host rate of the whole model


def test_slice_bound_takes_the_round_trip_where_it_binds():
    # the head costs nothing: t_full = 4 t_s, and 2 micro-batches of 1 cannot fill 4 stages: 2 / (4 t_s)
    rows = [{**_row(1, 1, 10.0), "slice_layers": 4}, {**_row(1, 1, 20.0), "slice_layers": 2}]
    assert slice_bound(rows, 16, 128, 2, 4) == pytest.approx(5.0)
    assert slice_bound(rows, 16, 128, 1, 4) == pytest.approx(2.5)
    assert slice_bound(rows, 16, 128, 3, 2) is None              # 3 sequences do not split into 2 micro-batches
    assert slice_bound(rows[:1], 16, 128, 1, 4) == pytest.approx(2.5)    # one slice: k x its step


def test_no_one_process_run_leaves_the_token_check_open():
    rows = [{**_row(4, 1, 2.0), "tokens": [1, 2]}, {**_row(2, 1, 2.0), "tokens": [1, 3]},
            {**_row(1, 1, 3.0), "tokens": [1, 2]}, {**_row(4, 4, 2.0), "tokens": [5]}]
    bad = check_tokens(rows)
    assert [r["tokens_match_one_process"] for r in rows] == [True, False, True, None]
    assert bad == ["2 hosts, prompt 128, 1 seq"]


def test_summary_keeps_each_link_delay_apart():
    # the same host count at two link delays: two summary rows, each bounded by the one-host rate
    from ggml_dist.bench.cluster_report import summary
    rows = [_row(1, 1, 10.0), {**_row(2, 1, 9.0), "link_delay_ms": 0.0}, {**_row(2, 1, 6.0), "link_delay_ms": 0.5}]
    _bounds(rows)
    got = {(r["hosts"], r["link_delay_ms"]): r for r in summary({"points": rows, "serve": []})}
    assert set(got) == {(1, 0.0), (2, 0.0), (2, 0.5)}
    assert got[(2, 0.0)]["ours_tok_s"] == 9.0 and got[(2, 0.5)]["ours_tok_s"] == 6.0
    assert got[(2, 0.5)]["ours_efficiency"] == 0.6


def test_summary_puts_tensor_parallel_beside_the_pipeline():
    # ours-tp rows: their own columns in the same summary row, x_one_host against the same one-host run
    from ggml_dist.bench.cluster_report import summary
    one = _row(1, 1, 10.0)
    tp = {**_row(2, 1, 17.0), "impl": "ours-tp"}
    rows = [one, _row(2, 1, 9.5), tp]
    _bounds(rows[:2])
    _bounds([dict(one), tp])
    got = {r["hosts"]: r for r in summary({"points": rows, "serve": []})}
    assert got[2]["ours_tok_s"] == 9.5 and got[2]["ours_tp_tok_s"] == 17.0 and got[2]["ours_tp_x_one_host"] == 1.7


# the tensor-parallel rows' tokens: against one process where the model fits a host; else against the
# pipeline at one sequence only (its micro-batches of N sequences are not the ranks' batches)
def test_tensor_parallel_tokens_against_one_process_or_the_pipeline():
    from ggml_dist.bench.cluster_report import check_tp_tokens

    def row(hosts, seqs, tokens, impl="ours"):
        return {"impl": impl, "hosts": hosts, "prompt": 32, "sequences": seqs, "tokens": tokens}
    ours = [row(1, 1, [1, 2]), row(2, 1, [1, 2])]
    tp = [row(2, 1, [1, 3], "ours-tp")]
    assert check_tp_tokens(ours, tp, True) == ["2 hosts, prompt 32, 1 seq"]
    assert tp[0]["tokens_match_one_process"] is False and "tokens" in ours[0]      # ours' own tokens untouched
    ours = [row(4, 1, [5, 6]), row(4, 4, [7, 8])]
    tp = [row(4, 1, [5, 6], "ours-tp"), row(4, 4, [7, 9], "ours-tp")]
    assert check_tp_tokens(ours, tp, False) == []
    assert [r["tokens_match_one_process"] for r in tp] == [True, None]
    assert all(r["tokens_compared_with"] == "pipeline" for r in tp)

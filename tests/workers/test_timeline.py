"""The pipeline trace: per hop between stages, queueing and transfer slices, and flow arrows."""
from __future__ import annotations

from ggml_dist.workers.timeline import trace_events


def test_hops_split_into_queued_and_transfer():
    # stage 0: two micro-batches back to back; stage 1 takes the first at 2.5 and is busy until 4.0,
    # so the second (sent at 3.0) waits until 4.0 and starts at 4.25
    s0 = [(0.0, 0.1, 0.9, 1.0, "p"), (1.0, 1.1, 2.9, 3.0, "p")]
    s1 = [(2.5, 2.6, 3.9, 4.0, "q"), (4.25, 4.3, 5.0, 5.1, "q")]
    ev = trace_events([s0, s1], ["a", "b"])
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert names == {0: "a", 1: "b", 2: "stage0 -> stage1"}
    hop = [(e["name"], e["ts"], e["dur"]) for e in ev if e["ph"] == "X" and e["tid"] == 2]
    assert hop == [("transfer", 1e6, 1.5e6), ("queued", 3e6, 1e6), ("transfer", 4e6, 0.25e6)]
    flows = [e for e in ev if e["ph"] in ("s", "f")]
    assert [(e["ph"], e["tid"]) for e in flows] == [("s", 0), ("f", 1)] * 2
    assert len({e["id"] for e in flows}) == 2
    assert sum(e["ph"] == "X" and e["tid"] < 2 for e in ev) == 12     # inputs, compute, outputs per call


def test_a_timeline_that_does_not_line_up_gets_no_hop():
    s0 = [(5.0, 5.1, 5.9, 6.0, "p")]
    s1 = [(1.0, 1.1, 1.9, 2.0, "q")]                                  # started before stage 0 sent
    assert not [e for e in trace_events([s0, s1], ["a", "b"]) if e.get("cat") in ("transfer", "queue", "flow")]

"""The live view's arithmetic over stage timelines (serve/live_probe.py): a stage's compute share of a window
and the micro-batches waiting before it, on hand-written timelines whose answers are known."""
from __future__ import annotations

import pytest

from ggml_dist.serve.live_probe import Lane, computing, queued


def lane(spans: list[tuple[float, float, float, float]], calls: int | None = None) -> Lane:
    tl = [(*s, "p") for s in spans]
    return Lane("stage", busy_s=0.0, calls=len(tl) if calls is None else calls, timeline=tl)


# compute counts where it ran: a call straddling the window's start counts its part inside only
def test_computing_counts_the_window_only():
    st = lane([(0.0, 0.1, 0.6, 0.7), (1.0, 1.1, 1.5, 1.6)])
    assert computing(st, 0.5, 1.5) == pytest.approx((0.1 + 0.4) / 1.0)
    assert computing(st, 2.0, 3.0) == 0.0


# stage 1 busy with micro-batch 0 until t=2 while micro-batch 1 left stage 0 at t=1: one micro-batch
# waited 1 s of the 2 s window; the windows start at different calls (calls - len(timeline) aligns them)
def test_queued_matches_calls_across_windows():
    up = lane([(0.0, 0.0, 0.4, 0.5), (0.5, 0.5, 0.9, 1.0)], calls=7)          # calls 5 and 6
    down = lane([(0.6, 0.6, 1.9, 2.0), (2.1, 2.1, 2.4, 2.5)], calls=7)        # calls 5 and 6
    assert queued(up, down, 0.5, 2.5) == pytest.approx(1.0 / 2.0)
    short = lane([(2.1, 2.1, 2.4, 2.5)], calls=7)                              # call 6 only: 5 unknown
    assert queued(up, short, 0.5, 2.5) == 0.0


# a restarted stage's timeline starts again: calls that cannot be one micro-batch are not matched
def test_queued_skips_a_restarted_stage():
    up = lane([(5.0, 5.0, 5.4, 5.5), (5.5, 5.5, 5.9, 6.0)], calls=40)
    down = lane([(1.0, 1.0, 1.2, 1.3), (1.3, 1.3, 1.5, 1.6)], calls=40)
    assert queued(up, down, 0.0, 10.0) == 0.0

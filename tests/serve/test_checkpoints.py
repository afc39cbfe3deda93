"""serve/checkpoints.py alone: where a prompt stops for a copy, which copy a cut goes back to, the budget."""
from __future__ import annotations

from ggml_dist.model.recurrent_state import StateSnapshot
from ggml_dist.serve.checkpoints import Checkpoints


def _snap(n_past: int, nbytes: int = 64) -> StateSnapshot:
    return StateSnapshot(n_past, n_past * 1000 + nbytes, nbytes)


def test_due_points():
    c = Checkpoints(2, every=16)
    assert c.due(41, 0) == (16, 32, 40)          # every 16, and the prompt but its last token
    assert c.due(41, 20) == (32, 40)             # none within what the slot already holds
    assert c.due(10, 0) == (9,)
    assert c.due(1, 0) == ()                     # a one-token prompt: nothing before its last token


def test_best_cut_and_move():
    c = Checkpoints(2)
    for n in (16, 32, 40):
        c.save(0, _snap(n))
    assert c.best(0, 37).n_past == 32 and c.best(0, 40).n_past == 40 and c.best(0, 15) is None
    assert (c.hits, c.misses) == (2, 1)
    c.cut(0, 33)
    assert [x.n_past for x in c.by_slot[0]] == [16, 32]
    c.move(0, 1)
    assert c.by_slot[0] == [] and [x.n_past for x in c.by_slot[1]] == [16, 32]
    c.save(1, _snap(32, 128))                     # a new copy at the same point replaces the old one
    assert [x.snap.nbytes for x in c.by_slot[1]] == [64, 128]


def test_budget_drops_the_oldest_first():
    c = Checkpoints(2, budget_bytes=3 * 64)
    c.save(0, _snap(8))
    c.save(1, _snap(8))
    c.save(0, _snap(16))
    assert c.evictions == 0 and c.nbytes() == 192
    c.save(1, _snap(16))                          # over: slot 0's copy at 8 was taken first
    assert c.evictions == 1 and [x.n_past for x in c.by_slot[0]] == [16]
    assert [x.n_past for x in c.by_slot[1]] == [8, 16]
    assert c.figures()["state_checkpoint_evictions_total"] == 1
    c.forget()
    assert c.nbytes() == 0

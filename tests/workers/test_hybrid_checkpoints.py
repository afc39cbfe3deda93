"""Checkpoints of a Qwen3.5 hybrid pipeline's recurrent state (model/recurrent_state.py): each stage keeps
the copies of its own layers' rows, taken and written back in the place of the sequence's timeline where
they were asked (row operations ride with the stages' next calls). Going back to a copy gives the bits of a
fresh evaluation of the same prefix; a copy released goes from the stages; a lost stage loses its copies,
so the older snapshots are refused, and a replay after a restore rebuilds the restored state.

In-process stages (tests/workers/test_hybrid_recovery.py's LocalStages) keep it cheap; the server over
Ray stages is tests/serve/test_hybrid_serve.py's.
"""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.recurrent_state import StateTrimError
from ggml_dist.model.ubatch import Batch

from . import test_hybrid_recovery as rec
from .test_hybrid_recovery import PROMPT, LocalStages

paths = rec.paths                   # its fixture: the synthetic files

TAIL_A = [5, 9, 13, 17, 21, 25]
TAIL_B = [6, 10, 14]


def _fresh(path: str, tokens: list[int]) -> np.ndarray:
    """The logits of tokens' last position, evaluated from position 0 in one process, a token at a time
    after the prompt as the pipeline does (batch-invariant numerics: the same bits either way)."""
    ctx = LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens(tokens[:len(PROMPT)]))
    out = None
    for p in range(len(PROMPT), len(tokens)):
        out = ctx.decode(Batch.from_tokens([tokens[p]], pos0=p))
    return out


def _kept(st: LocalStages) -> list[int]:
    """How many copies each stage with recurrent layers keeps."""
    return [len(w.rs.kept) for w in st.workers if w.rs is not None]


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_back_to_a_copy_on_the_stages(paths, arch):
    st = LocalStages(paths[arch], 2, ContextParams(n_ctx=256))
    ctx = st.ctx
    ctx.decode(Batch.from_tokens(PROMPT))
    snap = ctx.state_snapshot(0)                        # after the prompt: asked, taken with the next call
    for p, t in enumerate(TAIL_A, len(PROMPT)):
        ctx.decode(Batch.from_tokens([t], pos0=p))
    assert snap.n_past == len(PROMPT) and _kept(st) == [1, 1]
    assert snap.nbytes == ctx.rs.row_nbytes > 0
    ctx.seq_restore(0, snap)
    assert ctx.seq_pos_max(0) == len(PROMPT) - 1
    got = None
    for p, t in enumerate(TAIL_B, len(PROMPT)):
        got = ctx.decode(Batch.from_tokens([t], pos0=p))
    assert np.array_equal(got, _fresh(paths[arch], PROMPT + TAIL_B))
    ctx.state_release(snap)
    ctx.decode(Batch.from_tokens([7], pos0=len(PROMPT) + len(TAIL_B)))     # the drop rides with it
    assert _kept(st) == [0, 0]


def test_a_lost_stage_loses_the_copies(paths):
    st = LocalStages(paths["qwen35"], 2, ContextParams(n_ctx=256))
    ctx = st.ctx
    ctx.decode(Batch.from_tokens(PROMPT))
    snap = ctx.state_snapshot(0)
    ctx.decode(Batch.from_tokens([TAIL_A[0]], pos0=len(PROMPT)))
    st.lose(1)
    ctx.decode(Batch.from_tokens([TAIL_A[1]], pos0=len(PROMPT) + 1))    # recovered: replayed from 0
    assert ctx.recovery.n_recoveries == 1
    assert not ctx.state_restorable(snap) and _kept(st) == [0, 0]      # the survivors dropped theirs too
    with pytest.raises(StateTrimError, match="lost with a stage"):
        ctx.seq_restore(0, snap)
    assert ctx.seq_pos_max(0) == len(PROMPT) + 1                       # a refused restore changes nothing


def test_replay_after_a_restore(paths):
    """A stage lost after the sequence went back to a copy: the replay runs the prompt again (the
    ubatches past the copy are no longer the sequence's) and the tokens after it are the fresh run's."""
    path = paths["qwen35"]
    st = LocalStages(path, 2, ContextParams(n_ctx=256))
    ctx = st.ctx
    ctx.decode(Batch.from_tokens(PROMPT))
    snap = ctx.state_snapshot(0)
    for p, t in enumerate(TAIL_A, len(PROMPT)):
        ctx.decode(Batch.from_tokens([t], pos0=p))
    ctx.seq_restore(0, snap)
    ctx.decode(Batch.from_tokens([TAIL_B[0]], pos0=len(PROMPT)))
    st.lose(0)
    got = None
    for p, t in enumerate(TAIL_B[1:], len(PROMPT) + 1):
        got = ctx.decode(Batch.from_tokens([t], pos0=p))
    assert ctx.recovery.n_recoveries == 1
    # the prompt, TAIL_B[0] and the step the loss hit; nothing of TAIL_A
    assert ctx.recovery.n_replayed_tokens == len(PROMPT) + 2
    assert np.array_equal(got, _fresh(path, PROMPT + TAIL_B))


@pytest.mark.parametrize("rollback", [False, True])
def test_replay_of_ubatches_of_several_sequences(paths, rollback):
    """Two sequences decode in one ubatch (a state row each), then one of them goes (removed whole, or its
    last step taken back as token feedback does) while the other goes on; a stage lost after that replays
    the shared ubatches for the one that lives, and what it computes is a fresh run's."""
    params = ContextParams(n_ctx=256, n_seq_max=2, batch_invariant=True)
    path = paths["qwen35"]
    st = LocalStages(path, 2, params)
    ref = LlamaContext(LlamaModel.load(path), params)

    def both(ctx, toks, pos):
        b = Batch(np.array(toks, np.int32), np.array([pos, pos], np.int32), [frozenset({0}), frozenset({1})],
                  np.array([True, False]))              # not every token an output: one ubatch (split_equal)
        return ctx.decode(b)

    for ctx in (st.ctx, ref):
        ctx.decode(Batch.from_tokens(PROMPT, seq_id=0))
        ctx.decode(Batch.from_tokens(PROMPT[::-1], seq_id=1))
        for i, t in enumerate(TAIL_A[:3]):
            both(ctx, [t, t + 1], len(PROMPT) + i)
        if rollback:
            ctx.seq_rm(1, len(PROMPT) + 2)              # sequence 1's last step taken back
        else:
            ctx.seq_rm(1)
    assert st.ctx.gf_res_prev.key.n_seqs == 2 or rollback     # (a taken-back step leaves no graph behind)
    st.lose(1)
    pos = len(PROMPT) + 3
    for t in TAIL_B:
        got = st.ctx.decode(Batch.from_tokens([t], pos0=pos, seq_id=0))
        assert np.array_equal(got, ref.decode(Batch.from_tokens([t], pos0=pos, seq_id=0)))
        pos += 1
    assert st.ctx.recovery.n_recoveries == 1
    if rollback:                                        # and sequence 1 goes on from its kept state
        got = st.ctx.decode(Batch.from_tokens([9], pos0=len(PROMPT) + 2, seq_id=1))
        assert np.array_equal(got, ref.decode(Batch.from_tokens([9], pos0=len(PROMPT) + 2, seq_id=1)))

"""The decode loop every path shares (model/steps.py), on one process's context.

Under batch-invariant numerics a sequence's tokens do not depend on what shared its steps, so the loop
over several sequences of different prompt lengths (prefill chunks beside decodes, short prompts
trickling in, groups, lookahead with token feedback) must give each the tokens of a run alone; and the
steps it builds keep their invariants: a sequence in at most `lookahead` steps, its micro-batches in
position order, each batch in sequence order, nothing queued past max_tokens."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.sampling import Sampler, SamplingParams
from ggml_dist.model.steps import TRICKLE, Seq, Steps
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic

N = 4
PROMPTS = [list(range(3, 3 + n)) for n in (40, 5, TRICKLE + 3, 1)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> LlamaModel:
    spec = SyntheticSpec(n_embd=128, n_ff=256, n_head=4, n_head_kv=2, wtype="Q4_0", seed=5)
    return LlamaModel.load(write_synthetic(tmp_path_factory.mktemp("steps") / "m.gguf", spec))


def _ctx(model: LlamaModel, unified: bool = False) -> LlamaContext:
    return LlamaContext(model, ContextParams(n_ctx=N * 128, n_seq_max=N, n_batch=64, kv_unified=unified,
                                             batch_invariant=not unified))


def _loop(ctx: LlamaContext, steps: Steps, n_new: list[int], log: list) -> list[list[int]]:
    """The sequences through the loop, greedy, each to its own max_tokens; log: each submitted batch."""
    submit = ctx.submit

    def spy(batch, **kw):
        log.append((batch, kw.get("tokens_from") is not None))
        return submit(batch, **kw)
    ctx.submit = spy                                            # type: ignore[method-assign]
    seqs = [Seq(k, p, Sampler(SamplingParams()), list(p), n) for k, (p, n) in enumerate(zip(PROMPTS, n_new))]
    while not all(s.done for s in seqs):
        steps.fill(seqs)
        for s, tok, row in steps.rows(*steps.take()):
            tok = tok if tok is not None else int(np.argmax(row))
            s.history.append(tok)
            s.n_gen += 1
            s.done = s.n_gen >= s.max_tokens
    return [s.history[len(s.prompt):] for s in seqs]


@pytest.mark.parametrize("depth,groups,lookahead", [(1, 1, 1), (2, 2, 1), (4, 2, 2)])
def test_every_sequence_gets_its_solo_tokens(model, depth, groups, lookahead):
    n_new = [12, 20, 7, 15]
    want = [generate(_ctx(model), model.tokenizer, p, n, stop_at_eog=False).tokens for p, n in zip(PROMPTS, n_new)]
    ctx, log = _ctx(model), []
    steps = Steps(ctx, 64, 128, depth=depth, n_groups=groups, lookahead=lookahead)
    assert _loop(ctx, steps, n_new, log) == want
    assert (steps.n_fed > 0) == (lookahead > 1)
    top: dict[int, int] = {}
    for batch, _ in log:
        seqs = [min(s) for s in batch.seq_ids]
        assert seqs == sorted(seqs)                            # in sequence order
        assert batch.n_tokens <= 64
        for k in set(seqs):
            pos = batch.pos[np.array(seqs) == k]
            assert pos[0] == top.get(k, -1) + 1 and np.all(np.diff(pos) == 1)   # in position order
            top[k] = int(pos[-1])
    # nothing was queued past a sequence's last wanted token (its last token is never decoded)
    assert [top[k] for k in range(N)] == [len(p) + n - 2 for p, n in zip(PROMPTS, n_new)]


def test_short_prompts_trickle_beside_decodes(model):
    """With a stream per sequence a prompt of at most TRICKLE tokens joins decoding sequences one token a
    step (each step one ubatch); a longer one takes its chunk."""
    ctx, log = _ctx(model), []
    steps = Steps(ctx, 64, 128)
    _loop(ctx, steps, [6, 6, 6, 6], log)
    first = log[0][0]
    # the first step: no one decodes yet; the short prompts (5 and 1 tokens) go in equal chunks, the
    # shortest's length, the longer ones (40 and TRICKLE + 3) whole
    counts = {k: int(sum(min(s) == k for s in first.seq_ids)) for k in range(N)}
    assert counts == {0: 40, 1: 1, 2: TRICKLE + 3, 3: 1}
    # once a sequence decodes, the rest of the 5-token prompt goes in one token a step beside it
    later = [{k: int(sum(min(s) == k for s in b.seq_ids)) for k in range(N)} for b, _ in log[1:5]]
    assert all(c[1] == 1 for c in later)

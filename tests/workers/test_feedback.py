"""Token feedback: a decode step queued before the previous step's token is known takes that token
from the last stage where it was sampled (LlamaContext.submit(tokens_from=)); the driver never waits
for it, and the tokens are one process's."""
from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.sampling import GREEDY, RowSampling  # noqa: E402
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic  # noqa: E402
from ggml_dist.model.ubatch import Batch  # noqa: E402
from ggml_dist.workers.cluster import Pipeline  # noqa: E402

PROMPT = [1, 300, 17, 402]
N = 10


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_synthetic(tmp_path_factory.mktemp("feed") / "m.gguf",
                               SyntheticSpec(wtype="Q4_1", n_layer=4, tied=False, seed=21)))


def _chain(ctx: LlamaContext, rows: list[RowSampling]) -> list:
    """The prompt, then one step per row, each queued with the step before's token (none read yet)."""
    out = [ctx.submit(Batch.from_tokens(PROMPT), sampling=[rows[0]], keep_logits=False)]
    for i, rs in enumerate(rows[1:]):
        out.append(ctx.submit(Batch.from_tokens([0], pos0=len(PROMPT) + i), sampling=[rs],
                              keep_logits=False, tokens_from=out[-1]))
    return out


ROWS = [GREEDY] * 4 + [RowSampling(0.9, 40, 0.95, 0.05, 77, i) for i in range(4)]


@pytest.mark.parametrize("stages,calls", [(2, "plain"), (3, "plain"), (2, "direct"), (3, "direct")])
def test_steps_queued_ahead_give_one_process_tokens(local_ray, model_path, stages, calls):
    want = [p.tokens()[-1] for p in _chain(LlamaContext(LlamaModel.load(model_path), ContextParams(n_ctx=256)), ROWS)]
    pl = Pipeline.launch(model_path, stages, ContextParams(n_ctx=256), n_copies=4, calls=calls)
    try:
        pending = _chain(pl.ctx, ROWS)
        # every step was submitted before any result came back to the driver
        assert not any(rec.done for p in pending for rec in p._records)
        assert [p.tokens()[-1] for p in pending] == want
        assert pl.calls_used() == calls
    finally:
        pl.shutdown()


# over direct links the last stage's token goes to the first stage, not through the driver: of the
# chain's calls, the driver receives the tokens it reads and nothing of the other stages
def test_direct_feedback_skips_the_driver(local_ray, model_path):
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), n_copies=4, calls="direct")
    try:
        pending = _chain(pl.ctx, ROWS)
        assert pl.direct is not None and pl.direct.n_results == 0      # nothing came back yet
        toks = [p.tokens()[-1] for p in pending]
        assert len(toks) == len(ROWS) and pl.direct.n_results == len(ROWS)   # one per read, last stage only
        assert pl.direct.n_results_from == [0, len(ROWS)]
    finally:
        pl.shutdown()


# a compiled graph's executions take their inputs from the driver: the driver waits for each token
# (the chain is not broken into plain calls), same tokens
def test_compiled_graph_waits_for_the_token(local_ray, model_path):
    want = [p.tokens()[-1] for p in _chain(LlamaContext(LlamaModel.load(model_path), ContextParams(n_ctx=256)), ROWS)]
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), calls="compiled")
    try:
        assert [p.tokens()[-1] for p in _chain(pl.ctx, ROWS)] == want
        assert pl.chain is not None and pl.chain.enabled and pl.chain.n_executions == len(ROWS)
    finally:
        pl.shutdown()


# generate queues steps ahead; an end-of-generation token read while later steps are in flight takes
# them out of the cache again: same tokens, same cache, and the next decode has the same logits
@pytest.mark.parametrize("lookahead,calls", [(2, "plain"), (4, "plain"), (2, "direct")])
def test_generate_rolls_back_past_the_stop(local_ray, model_path, lookahead, calls):
    m = LlamaModel.load(model_path)
    full = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, PROMPT, N).tokens
    assert len(set(full)) == N                                   # a varied continuation
    stop = full[5]
    m.tokenizer.is_eog = lambda t: t == stop                      # type: ignore[method-assign]
    ref = LlamaContext(m, ContextParams(n_ctx=256))
    want = generate(ref, m.tokenizer, PROMPT, N)
    assert want.stop_reason == "eog" and want.tokens == full[:5]
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), calls=calls)
    try:
        got = generate(pl.ctx, m.tokenizer, PROMPT, N, lookahead=lookahead)
        assert (got.tokens, got.stop_reason) == (want.tokens, "eog")
        assert pl.ctx.seq_pos_max(0) == ref.seq_pos_max(0) == len(PROMPT) + len(want.tokens) - 1
        nxt = Batch.from_tokens([7], pos0=ref.seq_pos_max(0) + 1)
        assert np.array_equal(pl.ctx.decode(nxt), ref.decode(nxt))
    finally:
        pl.shutdown()


# run --parallel's loop: 4 sampled continuations in 2 micro-batches over 2 stages, 2 steps queued per
# group, one sequence stopping early: one process's tokens for the same schedule, and the same cache
@pytest.mark.parametrize("calls", ["plain", "direct"])
def test_parallel_continuations(local_ray, model_path, calls):
    from ggml_dist.model.generate import generate_parallel
    from ggml_dist.model.sampling import SamplingParams
    m = LlamaModel.load(model_path)
    params = ContextParams(n_ctx=256, n_seq_max=4)
    sp = SamplingParams(temperature=0.9, seed=11)
    free = generate_parallel(LlamaContext(m, params), m.tokenizer, PROMPT, N, 4, sp, groups=2, lookahead=2)
    stop = free[1].tokens[4]                                      # sequence 1 ends there (at least)
    m.tokenizer.is_eog = lambda t: t == stop                      # type: ignore[method-assign]
    ref = LlamaContext(m, params)
    want = generate_parallel(ref, m.tokenizer, PROMPT, N, 4, sp, groups=2, lookahead=2)
    assert want[1].stop_reason == "eog" and len(want[1].tokens) <= 4
    assert len({tuple(r.tokens) for r in want}) == 4             # seeds differ per sequence
    assert sorted(r.stop_reason for r in want) == ["eog", "eog", "length", "length"]
    pl = Pipeline.launch(model_path, 2, params, calls=calls)
    try:
        got = generate_parallel(pl.ctx, m.tokenizer, PROMPT, N, 4, sp, lookahead=2)   # a group per stage
        assert [(r.tokens, r.stop_reason) for r in got] == [(r.tokens, r.stop_reason) for r in want]
        for s, r in enumerate(want):
            last_fed = len(r.tokens) - (2 if r.stop_reason == "length" else 1)   # the last token is not fed
            assert pl.ctx.seq_pos_max(s) == ref.seq_pos_max(s) == len(PROMPT) + last_fed
    finally:
        pl.shutdown()

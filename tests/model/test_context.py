"""The model context: graph reuse per ubatch shape, n_kv padding, sequences, overflow, bad input."""
import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.kv_cache import ContextFullError
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch, BatchError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return LlamaModel.load(write_synthetic(tmp_path_factory.mktemp("ctx") / "m.gguf",
                                           SyntheticSpec(n_layer=1, seed=3)))


# one-token steps reuse the graph until n_kv crosses a multiple of 256, then rebuild once
def test_graph_reuse_counts(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=512))
    ctx.decode(Batch.from_tokens([1, 5, 6]))                  # prompt: one rebuild
    assert (ctx.n_rebuilt, ctx.n_reused) == (1, 0)
    for i in range(3, 300):
        ctx.decode(Batch.from_tokens([7], pos0=i))
    # steps 3..255 share n_kv=256 (one rebuild for the shape change), 256..299 have n_kv=512
    assert ctx.n_rebuilt == 3
    assert ctx.n_reused == 297 - 2


# two sequences in one batch see only their own tokens: same logits as decoding each alone
def test_two_sequences_isolated(model):
    a, b = [1, 20, 30, 40], [1, 50, 60]
    ctx = LlamaContext(model, ContextParams(n_ctx=256, n_seq_max=2))
    batch = Batch(np.array(a + b, np.int32), np.array(list(range(4)) + list(range(3)), np.int32),
                  [frozenset({0})] * 4 + [frozenset({1})] * 3, np.array([0, 0, 0, 1, 0, 0, 1], bool))
    both = ctx.decode(batch)
    single = LlamaContext(model, ContextParams(n_ctx=256))
    la = single.decode(Batch.from_tokens(a))
    single.clear()
    lb = single.decode(Batch.from_tokens(b))
    np.testing.assert_allclose(both[0], la[0], atol=1e-5)
    np.testing.assert_allclose(both[1], lb[0], atol=1e-5)


# removing a sequence frees its cells for the next prompt
def test_seq_rm_frees(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens(list(range(1, 201))))
    assert ctx.kv.cells.used == 200
    ctx.seq_rm(0)
    assert ctx.kv.cells.used == 0
    ctx.decode(Batch.from_tokens(list(range(1, 201))))


# more tokens than free cells: a clear error, and the cache is left as it was
def test_context_overflow(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens(list(range(1, 201))))
    with pytest.raises(ContextFullError, match="context full"):
        ctx.decode(Batch.from_tokens(list(range(1, 101)), pos0=200))
    assert ctx.kv.cells.used == 200


# token ids outside the vocabulary and oversize batches are refused before any work
def test_bad_batches(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=256, n_batch=16))
    with pytest.raises(BatchError, match="vocabulary"):
        ctx.decode(Batch.from_tokens([1, 10**6]))
    with pytest.raises(BatchError, match="n_batch"):
        ctx.decode(Batch.from_tokens(list(range(1, 40))))


# shapes seen before are recalled from the graph cache, not built again, with the same logits
def test_graph_cache_recalls_shapes(model, monkeypatch):
    steps = [[1, 5, 6], [7], [8, 9], [10], [11, 12], [13]]

    def run(ctx):
        out, pos = [], 0
        for toks in steps:
            out.append(ctx.decode(Batch.from_tokens(toks, pos0=pos)))
            pos += len(toks)
        return out

    ctx = LlamaContext(model, ContextParams(n_ctx=256))
    cached = run(ctx)
    assert (ctx.n_rebuilt, ctx.n_recalled) == (3, 3)          # shapes 3, 1, 2 built; 1, 2, 1 recalled
    assert ctx.n_plans_restored == 3                          # ... with their scheduler plans
    import ggml_dist.model.context as C
    monkeypatch.setattr(C, "MAX_GRAPHS", 0)
    fresh_ctx = LlamaContext(model, ContextParams(n_ctx=256))
    fresh = run(fresh_ctx)
    assert fresh_ctx.n_recalled == 0
    for a, b in zip(cached, fresh):
        np.testing.assert_array_equal(a, b)


# a KV stream per sequence: each sequence's decode steps give the bits of decoding it alone (its
# attention runs over its own cells, one query row per stream), whatever the other sequences do
def test_streams_match_solo_runs(model):
    prompts = [[1, 20, 30, 40], [1, 50], [1, 60, 70]]
    ctx = LlamaContext(model, ContextParams(n_ctx=768, n_seq_max=3, kv_unified=False))
    toks = sum(prompts, [])
    pos = sum((list(range(len(p))) for p in prompts), [])
    seqs = sum(([frozenset({s})] * len(p) for s, p in enumerate(prompts)), [])
    ctx.decode(Batch(np.array(toks, np.int32), np.array(pos, np.int32), seqs, np.ones(len(toks), bool)))
    steps = [ctx.decode(Batch(np.array([9 + k, 10 + k, 11 + k], np.int32),
                              np.array([len(p) + k for p in prompts], np.int32),
                              [frozenset({s}) for s in range(3)], np.ones(3, bool))) for k in range(4)]
    for s, p in enumerate(prompts):
        solo = LlamaContext(model, ContextParams(n_ctx=256))
        solo.decode(Batch.from_tokens(p))
        for k in range(4):
            lg = solo.decode(Batch.from_tokens([9 + k + s], pos0=len(p) + k))[0]
            assert np.array_equal(lg, steps[k][s])
    # the prompts take 3 ubatches (2 tokens of each, then seq 0 and seq 2 apart: not consecutive), then
    # every step is one ubatch of one shape
    assert ctx.n_rebuilt == 4 and ctx.n_reused == 3


# a ubatch without output rows (here seq 2's prompt token, split off from seq 0 since streams 0 and 2 are
# not consecutive) runs its graph with an empty output product; later steps match solo runs
def test_ubatch_without_outputs(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=768, n_seq_max=3, kv_unified=False))
    two = [frozenset({0}), frozenset({2})]
    ctx.decode(Batch(np.array([1, 1], np.int32), np.array([0, 0], np.int32), two, np.ones(2, bool)))
    first = ctx.decode(Batch(np.array([20, 60], np.int32), np.array([1, 1], np.int32), two,
                             np.array([True, False])))
    last = ctx.decode(Batch(np.array([21, 61], np.int32), np.array([2, 2], np.int32), two, np.ones(2, bool)))
    assert first.shape == (1, model.hp.n_vocab)
    for row, (a, b) in enumerate(((20, 21), (60, 61))):
        solo = LlamaContext(model, ContextParams(n_ctx=256))
        lg = solo.decode(Batch.from_tokens([1, a]))
        if row == 0:
            assert np.array_equal(lg[-1], first[0])
        assert np.array_equal(solo.decode(Batch.from_tokens([b], pos0=2))[0], last[row])


# a sequence moved to another stream (seq_cp across streams, then seq_rm) decodes on with the same bits
def test_sequence_moved_between_streams(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=768, n_seq_max=3, kv_unified=False))
    ctx.decode(Batch.from_tokens([1, 20, 30], seq_id=0))
    ctx.decode(Batch.from_tokens([1, 60, 70, 80], seq_id=2))
    ctx.seq_cp(2, 1)
    ctx.seq_rm(2)
    assert ctx.seq_pos_max(1) == 3 and ctx.seq_pos_max(2) == -1
    moved = ctx.decode(Batch(np.array([9, 90], np.int32), np.array([3, 4], np.int32),
                             [frozenset({0}), frozenset({1})], np.ones(2, bool)))
    solo = LlamaContext(model, ContextParams(n_ctx=256))
    solo.decode(Batch.from_tokens([1, 60, 70, 80]))
    assert np.array_equal(solo.decode(Batch.from_tokens([90], pos0=4))[0], moved[1])


# two sequences that trade KV streams (seq_swap) decode on with the same bits, each in the other's stream
def test_sequences_swap_streams(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=768, n_seq_max=3, kv_unified=False))
    ctx.decode(Batch.from_tokens([1, 20, 30], seq_id=0))
    ctx.decode(Batch.from_tokens([1, 60, 70, 80], seq_id=2))
    ctx.seq_swap(0, 2)
    assert ctx.seq_pos_max(0) == 3 and ctx.seq_pos_max(2) == 2
    both = ctx.decode(Batch(np.array([90, 9], np.int32), np.array([4, 3], np.int32),
                            [frozenset({0}), frozenset({2})], np.ones(2, bool)))
    for row, (prompt, nxt) in enumerate((([1, 60, 70, 80], 90), ([1, 20, 30], 9))):
        solo = LlamaContext(model, ContextParams(n_ctx=256))
        solo.decode(Batch.from_tokens(prompt))
        assert np.array_equal(solo.decode(Batch.from_tokens([nxt], pos0=len(prompt)))[0], both[row])


# with streams, each sequence has n_ctx / n_seq_max cells, and a token cannot belong to two streams
def test_streams_room_and_shared_tokens(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=512, n_seq_max=2, kv_unified=False))
    ctx.decode(Batch.from_tokens(list(range(1, 201)), seq_id=1))
    with pytest.raises(ContextFullError, match="sequence 1's 256 cells"):
        ctx.decode(Batch.from_tokens(list(range(1, 101)), pos0=200, seq_id=1))
    ctx.decode(Batch.from_tokens(list(range(1, 201)), seq_id=0))          # stream 0 is still free
    with pytest.raises(BatchError, match="unified KV cache"):
        ctx.decode(Batch(np.array([3], np.int32), np.array([200], np.int32), [frozenset({0, 1})],
                         np.ones(1, bool)))
    assert ctx.kv.cells.used == 400


# positions that do not continue a sequence, gaps, decreasing positions and diverged shared sequences are
# refused before anything is written (llama_batch_allocr's consistency checks)
def test_inconsistent_positions(model):
    ctx = LlamaContext(model, ContextParams(n_ctx=256, n_seq_max=3))
    ctx.decode(Batch.from_tokens([1, 5, 6]))
    bad = [(Batch.from_tokens([7], pos0=5), "inconsistent positions"),
           (Batch(np.array([7, 8], np.int32), np.array([3, 5], np.int32), [frozenset({0})] * 2,
                  np.ones(2, bool)), "not continuous"),
           (Batch(np.array([7, 8], np.int32), np.array([1, 0], np.int32), [frozenset({1})] * 2,
                  np.ones(2, bool)), "decrease"),
           (Batch(np.array([7], np.int32), np.array([3], np.int32), [frozenset({0, 1})],
                  np.ones(1, bool)), "diverged")]
    for batch, msg in bad:
        with pytest.raises(BatchError, match=msg):
            ctx.decode(batch)
    assert ctx.kv.cells.used == 3 and ctx.seq_pos_max(0) == 2
    ctx.decode(Batch.from_tokens([7], pos0=3))                    # the next position is fine


# submit(tokens_from=): a batch queued before its tokens are known takes the tokens an earlier batch
# chose, in order; the same logits as the same batch with the tokens written in
def test_tokens_from_an_earlier_batch(model):
    from ggml_dist.model.sampling import GREEDY
    params = ContextParams(n_ctx=128, n_seq_max=2)
    ref, ctx = LlamaContext(model, params), LlamaContext(model, params)
    prompt = Batch(np.array([1, 2, 3, 4], np.int32), np.array([0, 1, 0, 1], np.int32),
                   [frozenset({0}), frozenset({0}), frozenset({1}), frozenset({1})], np.array([0, 1, 0, 1], bool))
    first = ctx.submit(prompt, sampling=[GREEDY, GREEDY])
    nxt = Batch(np.zeros(2, np.int32), np.array([2, 2], np.int32), [frozenset({0}), frozenset({1})],
                np.ones(2, bool))
    second = ctx.submit(nxt, sampling=[GREEDY, GREEDY], tokens_from=first)   # queued, tokens unknown
    want_first = ref.submit(prompt, sampling=[GREEDY, GREEDY]).tokens()
    nxt_known = Batch(np.array(want_first, np.int32), nxt.pos, nxt.seq_ids, nxt.output)
    want_second = ref.decode(nxt_known)
    assert first.tokens() == want_first
    assert np.array_equal(second.result(), want_second)
    with pytest.raises(BatchError, match="without sampling"):
        ctx.submit(Batch.from_tokens([0], pos0=3), tokens_from=ctx.submit(Batch.from_tokens([5], pos0=3)))
    with pytest.raises(BatchError, match="chooses 2 tokens"):
        ctx.submit(Batch.from_tokens([0], pos0=4), tokens_from=second)

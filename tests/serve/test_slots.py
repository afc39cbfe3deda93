"""serve/slots.py on a real context (a KV stream per slot): which free slot a prompt takes and what its
cache keeps, what a finished sequence leaves behind, and compaction moving sequences (and caches) down."""
from __future__ import annotations

import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.sampling import SamplingParams
from ggml_dist.model.ubatch import Batch
from ggml_dist.serve.requests import Request
from ggml_dist.serve.slots import Sequence, Slots, common_prefix

P = 4


@pytest.fixture
def slots(serve_model):
    model = LlamaModel.load(serve_model)
    sl = Slots(P, cache_prompt=True)
    sl.ctx = LlamaContext(model, ContextParams(n_ctx=64 * P, n_batch=64, n_seq_max=P, kv_unified=False))
    sl.movable = True
    return sl, model.tokenizer


def run(slots, prompt: list[int], n_gen: int = 0, reuse: bool = True) -> Sequence:
    """A request's prompt through the slot it takes: evaluated past what the slot kept, then n_gen more."""
    sl, tok = slots
    slot, n_keep = sl.take(prompt, reuse)
    req = Request(prompt, 8, SamplingParams(), (), lambda e: None)
    s = sl.seqs[slot] = Sequence.start(req, slot, 0, None, n_keep, tok)
    s.n_cached = n_keep
    sl.ctx.decode(Batch.from_tokens(prompt[n_keep:] + [7] * n_gen, n_keep, slot))
    s.history, s.n_past = prompt + [7] * n_gen, len(prompt) + n_gen
    return s


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([3], [1]) == 0


def test_take_reuses_the_longest_prefix_and_never_the_last_token(slots):
    sl, _ = slots
    a, b = run(slots, [5, 6, 7, 8, 9], n_gen=2), run(slots, [5, 6, 10, 11])
    assert (a.slot, b.slot) == (0, 1)
    sl.release(a, keep=True)
    sl.release(b, keep=True)
    assert sl.cached == [[5, 6, 7, 8, 9, 7, 7], [5, 6, 10, 11], [], []] and sl.cached_cells() == 11
    # 4 tokens in common with slot 0's cache, 2 with slot 1's: slot 0, which keeps those 4
    c = run(slots, [5, 6, 7, 8, 12])
    assert (c.slot, c.n_cached) == (0, 4) and sl.cached[0] == [] and sl.ctx.seq_pos_max(0) == 4
    # the whole prompt cached: its last token is evaluated again (its logits start the generation)
    d = run(slots, [5, 6, 10, 11])
    assert (d.slot, d.n_cached) == (1, 3)
    # nothing in common: the lowest free slot with nothing cached; reuse=False (scoring) keeps nothing
    e = run(slots, [1, 2])
    assert (e.slot, e.n_cached) == (2, 0)
    sl.release(e, keep=True)
    f = run(slots, [1, 2, 3], reuse=False)
    assert (f.slot, f.n_cached) == (3, 0) and sl.cached[2] == [1, 2] and sl.n_free() == 1


def test_release_without_keep_and_take_blank(slots):
    sl, _ = slots
    a = run(slots, [5, 6, 7])
    sl.release(a, keep=False)
    assert sl.cached[0] == [] and sl.ctx.seq_pos_max(0) == -1 and sl.n_free() == P
    b = run(slots, [5, 6, 7])
    assert b.slot == 0 and b.n_cached == 0
    sl.release(b, keep=True)
    assert sl.take_blank() == 0 and sl.cached[0] == [] and sl.ctx.seq_pos_max(0) == -1


def test_compact_moves_the_highest_busy_slot_down(slots):
    sl, _ = slots
    seqs = [run(slots, [20 + k, 30 + k, 40 + k]) for k in range(P)]
    sl.release(seqs[0], keep=True)              # slot 0 free with a cache, slot 1 free without
    sl.release(seqs[1], keep=False)
    sl.compact()
    # slot 3's sequence swaps streams with slot 0 (whose cache goes up to 3); slot 2's moves to slot 1
    assert sl.seqs == [seqs[3], seqs[2], None, None] and (seqs[3].slot, seqs[2].slot) == (0, 1)
    assert sl.cached == [[], [], [], [20, 30, 40]]
    assert [sl.ctx.seq_pos_max(k) for k in range(P)] == [2, 2, -1, 2]


def test_compact_waits_for_a_sequence_in_flight(slots):
    sl, _ = slots
    a, b = run(slots, [1, 2, 3]), run(slots, [4, 5, 6])
    sl.release(a, keep=False)
    b.n_flight = 1
    sl.compact()
    assert sl.seqs[1] is b
    b.n_flight = 0
    sl.compact()
    assert sl.seqs[0] is b and b.slot == 0 and [sl.ctx.seq_pos_max(k) for k in (0, 1)] == [2, -1]
    sl.movable = False                          # a pipeline's slots: nothing moves
    c = run(slots, [7, 8])
    sl.release(b, keep=False)
    sl.compact()
    assert sl.seqs[1] is c

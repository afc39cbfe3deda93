"""model/tensor_parallel.py and model/tp_local.py: K ranks (threads) give one process's logits, bit for bit.

The files are small synthetic dense models with TinyLlama-1.1B's grouped-query heads (32 query heads, 4
kv heads), in the weight types whose products take different kernel paths (Q8_0; Q4_0 repacked; F16
by tinyBLAS for several rows; Q4_K), tied and untied heads, Qwen2's Q/K/V biases and Llama 3's rope factors.
"""
import time
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gquants

from ggml_dist.backends.base import tensor_get
from ggml_dist.backends.collective import CollectiveError
from ggml_dist.backends.cpu.ops import ComputeOptions, weights_mul_mat
from ggml_dist.core.types import GGMLType
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate
from ggml_dist.model.kv_cache import ContextFullError
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.tensor_parallel import Split, TensorParallelError, check_split, rank_weights, split_of
from ggml_dist.model.tp_local import TensorParallelContext
from ggml_dist.model.ubatch import Batch, BatchError

from .tp_check import ranks_equal_one_process

GQA = {"n_vocab": 512, "n_embd": 256, "n_layer": 2, "n_head": 32, "n_head_kv": 4, "n_ff": 512}
SPECS = {
    "q8_0-tied": SyntheticSpec(**GQA, seed=5),
    "q4_0-untied": SyntheticSpec(**GQA, wtype="Q4_0", embd_type="Q4_0", tied=False, seed=6),
    "f16-tied": SyntheticSpec(**GQA, wtype="F16", embd_type="F16", seed=7),
    "q4_k-tied": SyntheticSpec(**GQA, wtype="Q4_K", seed=8),
    "qwen2-q8_0": SyntheticSpec(arch="qwen2", **GQA, tied=False, seed=9),
    "llama3-rope": SyntheticSpec(**GQA, rope_scaling="llama3", seed=10),    # rope_freqs.weight, mirrored
}
PROMPT = [1, 5, 9, 33, 70, 100, 7, 300, 12]
N_STEPS = 4


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    return {name: write_synthetic(d / f"{name}.gguf", spec) for name, spec in SPECS.items()}


# K = 2 and 4 ranks give one process's logits bit for bit (whole prompt, then one token at a time) and
# its greedy tokens; a rank's KV cache holds its kv heads only
@pytest.mark.parametrize("name", list(SPECS))
def test_ranks_equal_one_process(files, name):
    model = LlamaModel.load(files[name])

    def kv_heads(size, ranks):
        assert [r.kv.n_embd_k_gqa for r in ranks] == [model.hp.n_embd_k_gqa // size] * size
    ranks_equal_one_process(model, ContextParams(n_ctx=256), PROMPT, N_STEPS, kv_heads)


# two sequences in one batch, then a step of each: the same logits as one process's
def test_two_sequences(files):
    model = LlamaModel.load(files["q8_0-tied"])
    params = ContextParams(n_ctx=256, n_seq_max=2)
    a, b = [1, 20, 30, 40], [1, 50, 60]
    batch = Batch(np.array(a + b, np.int32), np.array([0, 1, 2, 3, 0, 1, 2], np.int32),
                  [frozenset({0})] * 4 + [frozenset({1})] * 3, np.array([0, 0, 0, 1, 0, 0, 1], bool))
    step = Batch(np.array([7, 8], np.int32), np.array([4, 3], np.int32), [frozenset({0}), frozenset({1})],
                 np.ones(2, bool))
    ref = LlamaContext(model, params)
    want = [ref.decode(batch), ref.decode(step)]
    tp = TensorParallelContext(model, 4, params)
    try:
        got = [tp.decode(batch), tp.decode(step)]
    finally:
        tp.close()
    assert all(np.array_equal(w, g) for w, g in zip(want, got))


# ubatches without outputs (a prompt in ubatches of 4: the head's gather has no columns), a KV stream per
# sequence, and batch-invariant numerics (--deterministic): still one process's logits
@pytest.mark.parametrize("params", [ContextParams(n_ctx=256, n_ubatch=4),
                                    ContextParams(n_ctx=256, n_seq_max=2, kv_unified=False),
                                    ContextParams(n_ctx=256, batch_invariant=True)], ids=["ubatch4", "streams", "det"])
def test_context_params(files, params):
    model = LlamaModel.load(files["q4_k-tied"])
    two = Batch(np.array(PROMPT + PROMPT[:5], np.int32), np.array(list(range(9)) + list(range(5)), np.int32),
                [frozenset({0})] * 9 + [frozenset({1})] * 5, np.ones(14, bool))
    # in ubatches of 4 only the last of the prompt's 3 ubatches outputs (its last token)
    batches = [Batch.from_tokens(PROMPT, all_outputs=params.n_ubatch != 4), Batch.from_tokens([3], pos0=len(PROMPT))]
    if params.n_seq_max == 2:
        batches = [two, Batch(np.array([3, 4], np.int32), np.array([9, 5], np.int32),
                              [frozenset({0}), frozenset({1})], np.ones(2, bool))]
    ref = LlamaContext(model, params)
    want = [ref.decode(b) for b in batches]
    tp = TensorParallelContext(model, 4, params)
    try:
        got = [tp.decode(b) for b in batches]
    finally:
        tp.close()
    assert all(np.array_equal(w, g) for w, g in zip(want, got))


# the decode loop takes the group as its context: generate()'s greedy tokens are one process's, with
# one step in flight and with two (the next step's token taken from the previous one: tokens_from)
@pytest.mark.parametrize("lookahead", [1, 2])
def test_generate(files, lookahead):
    model = LlamaModel.load(files["q4_0-untied"])
    params = ContextParams(n_ctx=256)
    want = generate(LlamaContext(model, params), model.tokenizer, PROMPT, 12, stop_at_eog=False).tokens
    tp = TensorParallelContext(model, 2, params)
    try:
        got = generate(tp, model.tokenizer, PROMPT, 12, stop_at_eog=False, lookahead=lookahead).tokens
    finally:
        tp.close()
    assert got == want and len(got) == 12


# a call every rank refuses (a token outside the vocabulary, a full context) leaves the group usable;
# the group's sequence operations reach every rank (after seq_rm the same continuation gives the same logits)
def test_refusals_and_sequence_ops(files):
    model = LlamaModel.load(files["q8_0-tied"])
    tp = TensorParallelContext(model, 2, ContextParams(n_ctx=256))
    try:
        first = tp.decode(Batch.from_tokens(PROMPT))
        with pytest.raises(BatchError, match="vocabulary"):
            tp.decode(Batch.from_tokens([1, 10**6], pos0=len(PROMPT)))
        with pytest.raises(ContextFullError):
            tp.decode(Batch.from_tokens([5] * 250, pos0=len(PROMPT)))
        step = tp.decode(Batch.from_tokens([9], pos0=len(PROMPT)))
        tp.seq_rm(0, len(PROMPT))
        assert np.array_equal(tp.decode(Batch.from_tokens([9], pos0=len(PROMPT))), step)
        tp.clear()
        assert np.array_equal(tp.decode(Batch.from_tokens(PROMPT)), first)
    finally:
        tp.close()


# a rank that fails closes the group: the others stop at their exchange with the reason, within seconds,
# instead of waiting for the group's timeout
def test_failing_rank_closes_the_group(files):
    model = LlamaModel.load(files["q8_0-tied"])
    tp = TensorParallelContext(model, 2, ContextParams(n_ctx=256), timeout=600)
    follower = tp.followers[0].ctx.result()

    def fail(*args, **kw):
        raise MemoryError("rank 1 ran out")
    follower.submit = fail                          # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        with pytest.raises(CollectiveError, match="group broke"):
            tp.decode(Batch.from_tokens(PROMPT))
        assert time.perf_counter() - t0 < 60
    finally:
        tp.close()


# the table: Q/K/V by heads, Wo/Wdown/gate/up/head by rows, the rest whole on every rank
def test_split_table():
    assert split_of("blk.3.attn_q.weight") == split_of("blk.3.attn_q.bias") == Split.Q_HEADS
    assert split_of("blk.0.attn_k.weight") == split_of("blk.0.attn_v.bias") == Split.KV_HEADS
    for name in ("blk.1.attn_output.weight", "blk.1.ffn_gate.weight", "blk.1.ffn_up.weight",
                 "blk.1.ffn_down.weight", "output.weight"):
        assert split_of(name) == Split.ROWS, name
    for name in ("token_embd.weight", "output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight",
                 "rope_freqs.weight"):
        assert split_of(name) == Split.MIRRORED, name


# a rank's slices are the whole tensor's rows (bias elements), in rank order; mirrored tensors are whole;
# a tied head is token_embd's vocabulary rows under output.weight
def test_rank_weights_are_the_rows(files):
    model = LlamaModel.load(files["qwen2-q8_0"])
    tied = LlamaModel.load(files["q8_0-tied"])
    for m in (model, tied):
        ranks = [rank_weights(m.weights, m.hp, r, 4) for r in range(4)]
        for name, w in m.weights.items():
            whole = tensor_get(w)
            parts = [tensor_get(rw[name]) for rw in ranks]
            if split_of(name) == Split.MIRRORED:
                assert all(np.array_equal(p, whole) for p in parts), name
            else:
                axis = 2 if w.n_dims >= 2 else 3                 # numpy order: rows, or a bias's elements
                assert parts[0].shape[axis] == whole.shape[axis] // 4, name
                assert np.array_equal(np.concatenate(parts, axis=axis), whole), name
    head = [tensor_get(rank_weights(tied.weights, tied.hp, r, 2)["output.weight"]) for r in range(2)]
    assert np.array_equal(np.concatenate(head, axis=2), tensor_get(tied.weights["token_embd.weight"]))
    q = rank_weights(model.weights, model.hp, 1, 4)["blk.0.attn_q.weight"]
    assert q.ne[1] == model.hp.n_head // 4 * model.hp.n_embd_head_k        # rank 1's 8 query heads


# what cannot be split exactly is refused with the numbers
def test_refused_splits(files):
    hp = LlamaModel.load(files["q8_0-tied"]).hp
    with pytest.raises(TensorParallelError, match="head_count_kv 4 does not divide into 8 ranks"):
        check_split(hp, 8)
    with pytest.raises(TensorParallelError, match="head_count 32 does not divide into 3 ranks"):
        check_split(hp, 3)
    with pytest.raises(TensorParallelError, match="covers llama, qwen2, qwen2moe, qwen3, qwen3moe, not 'gemma3'"):
        check_split(replace(hp, arch="gemma3"), 2)


# a slice whose row count would take another kernel path than the whole matrix is refused: a Q4_0 head
# of 520 rows is repacked (520 % 8 == 0), halves of 260 rows would not be
def test_refused_path_change(tmp_path):
    spec = SyntheticSpec(n_vocab=520, n_embd=128, n_layer=1, n_head=16, n_head_kv=4, n_ff=256, wtype="Q4_0",
                         embd_type="Q8_0", tied=False, seed=2)
    model = LlamaModel.load(write_synthetic(tmp_path / "m.gguf", spec))
    with pytest.raises(TensorParallelError, match="520 rows have 260 rows each, not a multiple of 8"):
        rank_weights(model.weights, model.hp, 0, 2)


# why: the rows of a product depend on the matrix's row count where it picks the path (repacked Q4_0 from
# M % 8 == 0; F16 tinyBLAS from M % 4 == 0 for several activation rows); a slice of a multiple of 8
# rows keeps the whole's path and bits, a slice of 4 (Q4_0) or 2 (F16) rows does not
@pytest.mark.parametrize("wtype,bad_rows", [("Q4_0", 4), ("F16", 2)])
def test_path_rule_is_real(wtype, bad_rows):
    rng = np.random.default_rng(0)
    K, M, N = 64, 16, 3
    w = rng.standard_normal((M, K)).astype(np.float32)
    raw = w.astype(np.float16).view(np.uint8) if wtype == "F16" else gquants.quantize(w, GGMLQuantizationType.Q4_0)
    x = rng.standard_normal((N, K)).astype(np.float32)
    opts = ComputeOptions()
    whole = weights_mul_mat(GGMLType[wtype], raw, x, opts)
    assert np.array_equal(weights_mul_mat(GGMLType[wtype], raw[8:], x, opts), whole[:, 8:])
    assert not np.array_equal(weights_mul_mat(GGMLType[wtype], raw[:bad_rows], x, opts), whole[:, :bad_rows])

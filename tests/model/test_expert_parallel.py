"""Expert parallelism (model/tensor_parallel.py on a mixture of experts): K ranks (threads), each with a
range of whole experts and its heads of the attention, give one process's logits, bit for bit.

The files are synthetic qwen3moe, qwen2moe (with its shared expert, split by rows) and Mixtral-style
llama models in the expert types whose products take different kernel paths (Q8_0 and Q4_0 packed; Q4_K
packed, tiled from 8 rows an expert; F16 by the reference), with expert counts K divides and one it does
not (uneven ranges); and a dense qwen3 (a norm per head) split by rows.
"""
import numpy as np
import pytest

from ggml_dist.core.context import Context
from ggml_dist.core.ops_collective import expert_ids, gather_experts
from ggml_dist.core.tensor import Op
from ggml_dist.core.types import GGMLType
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.synthetic_moe import SyntheticMoESpec, write_moe
from ggml_dist.model.tensor_parallel import (
    Split,
    TensorParallelError,
    check_split,
    expert_bounds,
    rank_weights,
    split_of,
)
from ggml_dist.model.tp_local import TensorParallelContext
from ggml_dist.model.ubatch import Batch

from .tp_check import ranks_equal_one_process

HEADS = {"n_head": 8, "n_head_kv": 4, "n_vocab": 512}
SPECS = {
    "qwen3moe-q8_0": SyntheticMoESpec(arch="qwen3moe", n_embd=128, **HEADS, n_expert=8, n_expert_used=2, seed=41),
    "qwen3moe-q4_0-k4": SyntheticMoESpec(arch="qwen3moe", n_embd=128, **HEADS, head_dim=32, n_expert=16,
                                         n_expert_used=4, exp_type="Q4_0", tied=False, seed=42),
    "qwen3moe-q4_k-e6": SyntheticMoESpec(arch="qwen3moe", n_embd=256, **HEADS, n_expert=6, n_expert_used=2,
                                         n_ff_exp=256, exp_type="Q4_K", down_type="Q6_K", seed=43),
    "qwen3moe-f16": SyntheticMoESpec(arch="qwen3moe", n_embd=128, **HEADS, n_expert=8, n_expert_used=2,
                                     exp_type="F16", wtype="F16", seed=44),
    "qwen2moe-q4_1": SyntheticMoESpec(arch="qwen2moe", n_embd=128, **HEADS, n_expert=8, n_expert_used=2,
                                      exp_type="Q4_1", tied=False, seed=45),
    "mixtral-q5_0": SyntheticMoESpec(arch="llama", n_embd=128, **HEADS, n_expert=8, n_expert_used=2,
                                     exp_type="Q5_0", seed=46),
}
DENSE = {"qwen3-q8_0": SyntheticSpec(arch="qwen3", n_vocab=512, n_embd=256, n_layer=2, n_head=16, n_head_kv=4,
                                     n_ff=512, seed=47)}
PROMPT = [1, 5, 9, 33, 70, 100, 7, 300, 12, 40, 41, 42, 200, 201, 17, 18, 19, 90, 91, 92]   # 20: experts of 8+ rows
N_STEPS = 3


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ep")
    out = {name: write_moe(d / f"{name}.gguf", spec) for name, spec in SPECS.items()}
    out.update({name: write_synthetic(d / f"{name}.gguf", spec) for name, spec in DENSE.items()})
    return out


# K = 2 and 4 ranks give one process's logits bit for bit and its greedy tokens; each rank holds its
# range of the experts, and the ranges cover them all once
@pytest.mark.parametrize("name", [*SPECS, *DENSE])
def test_ranks_equal_one_process(files, name):
    model = LlamaModel.load(files[name])

    def experts_held(size, ranks):
        if model.hp.n_expert:
            held = [r.model.weights["blk.0.ffn_up_exps.weight"].ne[2] for r in ranks]
            assert held == np.diff(expert_bounds(model.hp.n_expert, size)).tolist()
            assert sum(held) == model.hp.n_expert
    ranks_equal_one_process(model, ContextParams(n_ctx=128), PROMPT, N_STEPS, experts_held)


# two sequences in one batch, then a step of each, over 4 ranks with uneven expert ranges
def test_two_sequences(files):
    model = LlamaModel.load(files["qwen3moe-q4_k-e6"])
    params = ContextParams(n_ctx=128, n_seq_max=2)
    a, b = PROMPT[:12], PROMPT[12:]
    batch = Batch(np.array(a + b, np.int32), np.array(list(range(12)) + list(range(8)), np.int32),
                  [frozenset({0})] * 12 + [frozenset({1})] * 8, np.ones(20, bool))
    step = Batch(np.array([7, 8], np.int32), np.array([12, 8], np.int32), [frozenset({0}), frozenset({1})],
                 np.ones(2, bool))
    ref = LlamaContext(model, params)
    want = [ref.decode(batch), ref.decode(step)]
    tp = TensorParallelContext(model, 4, params)
    try:
        got = [tp.decode(batch), tp.decode(step)]
    finally:
        tp.close()
    assert all(np.array_equal(w, g) for w, g in zip(want, got))


def test_expert_bounds_and_splits():
    assert expert_bounds(8, 4) == [0, 2, 4, 6, 8]
    assert expert_bounds(6, 4) == [0, 1, 3, 4, 6]
    assert expert_bounds(128, 1) == [0, 128]
    assert split_of("blk.3.ffn_down_exps.weight") == Split.EXPERTS
    assert split_of("blk.3.ffn_gate_inp.weight") == Split.MIRRORED            # the router: every rank
    assert split_of("blk.3.ffn_up_shexp.weight") == Split.ROWS
    assert split_of("blk.3.ffn_gate_inp_shexp.weight") == Split.MIRRORED


# a rank's experts are a byte range of the file's 3-D tensor (no copy), its routers whole
def test_rank_weights_are_expert_ranges(files):
    model = LlamaModel.load(files["qwen3moe-q4_k-e6"])
    w = model.weights["blk.1.ffn_down_exps.weight"]
    bounds = expert_bounds(6, 4)
    for rank in range(4):
        mine = rank_weights(model.weights, model.hp, rank, 4)
        t = mine["blk.1.ffn_down_exps.weight"]
        assert t.ne == (w.ne[0], w.ne[1], bounds[rank + 1] - bounds[rank], 1)
        assert t.buffer is w.buffer and t.data == w.data + bounds[rank] * w.nb[2]
        assert mine["blk.1.ffn_gate_inp.weight"].ne == model.weights["blk.1.ffn_gate_inp.weight"].ne


def test_refusals(files):
    hp = LlamaModel.load(files["qwen3moe-q8_0"]).hp
    with pytest.raises(TensorParallelError, match="8 experts cannot give each of 16 ranks one"):
        check_split(hp, 16)
    gpt_oss = LlamaModel.load(write_moe(files["qwen3moe-q8_0"].parent / "oss.gguf", SyntheticMoESpec(
        arch="gpt-oss", n_embd=96, n_head=4, n_head_kv=2, head_dim=32, n_expert=8, n_expert_used=2,
        tied=False, seed=48))).hp
    with pytest.raises(TensorParallelError, match="not 'gpt-oss'"):
        check_split(gpt_oss, 2)


def test_ops_shapes():
    ctx = Context(1 << 16, no_alloc=True)
    sel = ctx.new_tensor(GGMLType.I32, (4, 3))
    y = ctx.new_tensor(GGMLType.F32, (64, 4, 3))
    ids = expert_ids(ctx, sel, 2, 6)
    assert ids.op == Op.EXPERT_IDS and ids.ne[:2] == (4, 3) and ids.op_params == (2, 6) and ids.type == GGMLType.I32
    g = gather_experts(ctx, y, sel, [0, 2, 6, 8])
    assert g.op == Op.GATHER_EXPERTS and g.ne[:3] == (64, 4, 3) and g.src == [y, sel] and g.op_params == (0, 2, 6, 8)
    with pytest.raises(ValueError, match="bounds"):
        gather_experts(ctx, y, sel, [0, 4, 4, 8])
    with pytest.raises(ValueError, match="one selected id per slot"):
        gather_experts(ctx, y, ctx.new_tensor(GGMLType.I32, (2, 3)), [0, 8])

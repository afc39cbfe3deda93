"""Mixtures of experts: the expert keys read or refused by name, the tensors checked, and the graph's nodes
named as llama.cpp names them (the logits and the experts chosen are compared with llama.cpp's in
test_moe_refs.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from ggml_dist.core.tensor import Op
from ggml_dist.core.types import GGMLType
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.gguf import GGUFError, load_gguf
from ggml_dist.model.hparams import hparams_from_gguf
from ggml_dist.model.tensors import check_tensors
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import write_synthetic
from ggml_dist.model.synthetic_moe import write_moe
from ggml_dist.model.ubatch import Batch

from .refs import MOE_SPECS
from .test_hparams import write_model

E, K, F = 4, 2, 16                      # experts, top k, expert width of the small files below
MOE_KV = {"expert_count": E, "expert_used_count": K, "expert_feed_forward_length": F}
MOE_HP = {"n_expert": E, "n_expert_used": K, "n_ff_exp": F}


def _moe(tmp_path: Path, arch: str = "qwen3moe", kv: dict | None = None, **kw) -> Path:
    extra = dict(MOE_KV if arch != "llama" else {"expert_count": E, "expert_used_count": K})
    extra.update(kv or {})
    hp = dict(MOE_HP if arch != "llama" else {"n_expert": E, "n_expert_used": K, "n_ff_exp": 16})
    if arch == "qwen3moe":
        kw.setdefault("head_dim", 4)
    return write_model(tmp_path / "moe.gguf", arch=arch, extra_kv={k: v for k, v in extra.items() if v is not None},
                       hp_extra=hp, **kw)


def test_moe_hparams(tmp_path: Path) -> None:
    hp = hparams_from_gguf(load_gguf(_moe(tmp_path)))
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp) == (E, K, F) and hp.moe is not None
    assert hp.moe.norm_w and not hp.moe.shared_expert
    # Mixtral-style llama: the experts are feed_forward_length wide; a llama without experts is dense
    hp = hparams_from_gguf(load_gguf(_moe(tmp_path, "llama")))
    assert hp.moe is not None and hp.n_ff_exp == hp.n_ff == 16
    assert hparams_from_gguf(load_gguf(write_model(tmp_path / "d.gguf"))).moe is None


def test_moe_expert_width_falls_back_as_llama_cpp(tmp_path: Path) -> None:
    """qwen3moe without expert_feed_forward_length: n_ff / n_expert_used (llama_model_qwen3moe)."""
    p = write_model(tmp_path / "m.gguf", arch="qwen3moe", head_dim=4, n_ff=32,
                    extra_kv={"expert_count": E, "expert_used_count": K},
                    hp_extra={"n_expert": E, "n_expert_used": K, "n_ff_exp": 32 // K})
    assert hparams_from_gguf(load_gguf(p)).n_ff_exp == 16


@pytest.mark.parametrize("kv, match", [
    ({"expert_group_count": 2}, r"expert_group_count = 2 \(grouped expert routing"),
    ({"expert_gating_func": 2}, r"expert_gating_func = 2 \(sigmoid\).*gates with softmax"),
    ({"expert_weights_scale": 2.5}, r"expert_weights_scale = 2.5 \(a scale on the expert weights\)"),
    ({"expert_weights_norm": False}, r"expert_weights_norm = False.*uses True"),
    ({"expert_shared_count": 2}, r"expert_shared_count: shared experts beyond"),
    ({"expert_used_count": [2, 3]}, r"expert_used_count = \[2 values\]: a different value per layer"),
    ({"expert_used_count": 5}, r"expert_count = 4, .*expert_used_count = 5"),
    ({"expert_count": None}, r"missing metadata key 'qwen3moe.expert_count'"),
])
def test_moe_keys_refused_by_name(tmp_path: Path, kv: dict, match: str) -> None:
    with pytest.raises(GGUFError, match=match):
        hparams_from_gguf(load_gguf(_moe(tmp_path, kv=kv)))


def test_moe_keys_that_say_what_the_graph_does_are_read(tmp_path: Path) -> None:
    kv = {"expert_gating_func": 1, "expert_weights_norm": True, "expert_weights_scale": 1.0,
          "expert_used_count": [K, K]}
    assert hparams_from_gguf(load_gguf(_moe(tmp_path, kv=kv))).n_expert_used == K


@pytest.mark.parametrize("edit, match", [
    (dict(skip=("blk.1.ffn_up_exps.weight",)), r"missing tensor 'blk.1.ffn_up_exps.weight' \(expected ne=\[8, 16"),
    (dict(reshape={"blk.0.ffn_down_exps.weight": (16, 8, 3)}), r"'blk.0.ffn_down_exps.weight' has ne=\[16, 8, 3, 1\]"),
    (dict(extra_tensors={"blk.0.ffn_up_exps.scale": (E,)}), r"'blk.0.ffn_up_exps.scale' .* is not used"),
    (dict(extra_tensors={"blk.0.ffn_gate_shexp.weight": (8, 16)}), r"'blk.0.ffn_gate_shexp.weight' .* not used"),
])
def test_moe_tensors_checked_by_name(tmp_path: Path, edit: dict, match: str) -> None:
    f = load_gguf(_moe(tmp_path, **edit))
    with pytest.raises(GGUFError, match=match):
        check_tensors(f, hparams_from_gguf(f))


def test_moe_expert_type_without_kernel_refused(tmp_path: Path) -> None:
    """An expert type the CPU's MUL_MAT_ID does not compute is named, with the op, at load time."""
    f = load_gguf(_moe(tmp_path))
    hp = hparams_from_gguf(f)
    name = "blk.0.ffn_gate_exps.weight"
    f.tensors[name] = dataclasses.replace(f.tensors[name], type=GGMLType.IQ4_NL)
    with pytest.raises(GGUFError, match=r"'blk.0.ffn_gate_exps.weight' has type IQ4_NL, which MUL_MAT_ID"):
        check_tensors(f, hp)


def test_dense_arch_refuses_experts(tmp_path: Path) -> None:
    p = write_model(tmp_path / "q.gguf", arch="qwen3", head_dim=4, extra_kv={"expert_count": 4})
    with pytest.raises(GGUFError, match=r"qwen3.expert_count = 4 is not supported \(only 0 is\)"):
        hparams_from_gguf(load_gguf(p))


def test_moe_graph_names_and_ops(tmp_path: Path) -> None:
    """The graph of a qwen2moe ubatch has llama.cpp's MoE nodes, by name and op, in every layer."""
    spec = next(s for s in MOE_SPECS if s.arch == "qwen2moe")
    ctx = LlamaContext(LlamaModel.load(write_synthetic(tmp_path / "q2.gguf", spec)), ContextParams(n_ctx=64))
    seen: dict[str, Op] = {}

    def cb(t, ask: bool) -> bool:
        seen[t.name] = t.op
        return False
    ctx.sched.set_eval_callback(cb)
    ctx.decode(Batch.from_tokens([1, 5, 9]))
    for il in range(spec.n_layer):
        assert seen[f"ffn_moe_logits-{il}"] == Op.MUL_MAT and seen[f"ffn_moe_probs-{il}"] == Op.SOFT_MAX
        assert seen[f"ffn_moe_argsort-{il}"] == Op.ARGSORT and seen[f"ffn_moe_topk-{il}"] == Op.VIEW
        assert seen[f"ffn_moe_up-{il}"] == seen[f"ffn_moe_gate-{il}"] == seen[f"ffn_moe_down-{il}"] == Op.MUL_MAT_ID
        assert seen[f"ffn_moe_weighted-{il}"] == Op.MUL and seen[f"ffn_shexp_gate-{il}"] == Op.DIV
        assert seen[f"ffn_out-{il}"] == Op.ADD
        assert f"ffn_moe_weights_norm-{il}" not in seen             # qwen2moe does not normalise


def test_moe_rows_route_independently(tmp_path: Path) -> None:
    """A token's logits do not depend on the other tokens of its ubatch beyond attention: the same
    prompt as one batch and as a batch with a second sequence beside it give the first sequence's rows
    equal (Q8_0 experts: one row's vec_dot order whatever the expert's row count)."""
    spec = next(s for s in MOE_SPECS if s.arch == "qwen3moe" and s.exp_type == "Q8_0")
    model = LlamaModel.load(write_synthetic(tmp_path / "q3.gguf", spec))
    toks = [1, 300, 17, 402, 259, 260]
    alone = LlamaContext(model, ContextParams(n_ctx=64)).decode(Batch.from_tokens(toks, all_outputs=True))
    ctx = LlamaContext(model, ContextParams(n_ctx=128, n_seq_max=2))
    a, b = Batch.from_tokens(toks, all_outputs=True), Batch.from_tokens([1, 42, 43, 44], seq_id=1, all_outputs=True)
    both = Batch(np.concatenate([a.tokens, b.tokens]), np.concatenate([a.pos, b.pos]), a.seq_ids + b.seq_ids,
                 np.concatenate([a.output, b.output]))
    rows = ctx.decode(both)
    assert rows.shape[0] == len(toks) + 4
    assert np.array_equal(rows[: len(toks)], alone)


def test_a_token_reads_its_top_k_share_of_the_experts(tmp_path: Path) -> None:
    for spec in (MOE_SPECS[0], dataclasses.replace(MOE_SPECS[0], tied=False)):
        m = LlamaModel.load(write_moe(tmp_path / f"moe-{spec.tied}.gguf", spec))
        exps = sum(t.nbytes for n, t in m.weights.items() if "_exps." in n)
        assert exps > m.weight_bytes() // 3
        embd = m.weights["token_embd.weight"]
        unread = 0 if spec.tied else embd.nbytes - embd.nbytes // embd.ne[1]    # untied: one row of it
        want = m.weight_bytes() - unread - exps + exps * spec.n_expert_used // spec.n_expert
        assert m.bytes_read_per_token() == want
    dense = LlamaModel.load(write_synthetic(tmp_path / "d.gguf"))        # tied: the head reads all of it
    assert dense.bytes_read_per_token() == dense.weight_bytes()

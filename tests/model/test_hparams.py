"""model/hparams.py: hyperparameters from small GGUF files written with gguf.GGUFWriter, the tensor check
for every architecture, and the refusals: nothing in a file may be silently ignored."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from ggml_dist.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from ggml_dist.core.types import GGMLType
from ggml_dist.model.gguf import GGUFError, load_gguf
from ggml_dist.model.archs import ARCHS, LlamaHParams
from ggml_dist.model.hparams import hparams_from_gguf
from ggml_dist.model.tensors import check_tensors, expected_tensors
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, llama3_rope_factors, write_synthetic


def _add_kv(w: gguf.GGUFWriter, key: str, v) -> None:
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, list):
        w.add_array(key, v)
    else:
        w.add_float32(key, v)


def write_model(path: Path, arch: str = "llama", n_embd: int = 8, n_head: int = 2, n_head_kv: int = 1,
                n_ff: int = 16, n_layer: int = 2, n_vocab: int = 32, tied: bool = False,
                skip: tuple[str, ...] = (), reshape: dict[str, tuple[int, ...]] | None = None,
                extra_kv: dict | None = None, rope_scaling: tuple[str, float] | None = None,
                skip_kv: tuple[str, ...] = (), head_dim: int = 0, rope_freqs: bool = False,
                extra_tensors: dict[str, tuple[int, ...]] | None = None, hp_extra: dict | None = None) -> Path:
    """A model of zeros with exactly the tensors expected_tensors names, give or take the edits asked
    for (an architecture ARCHS does not know gets llama's tensors); hp_extra: more LlamaHParams fields
    the tensors follow (n_expert, n_ff_exp, ...: their keys go in extra_kv)."""
    w = gguf.GGUFWriter(str(path), arch)
    kv = {
        "context_length": 64, "embedding_length": n_embd, "block_count": n_layer,
        "feed_forward_length": n_ff, "attention.head_count": n_head, "attention.head_count_kv": n_head_kv,
    }
    if head_dim:
        kv |= {"attention.key_length": head_dim, "attention.value_length": head_dim}
    for k, v in kv.items():
        if k not in skip_kv:
            w.add_uint32(f"{arch}.{k}", v)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    for k, v in (extra_kv or {}).items():
        _add_kv(w, f"{arch}.{k}", v)
    if rope_scaling:
        w.add_string(f"{arch}.rope.scaling.type", rope_scaling[0])
        w.add_float32(f"{arch}.rope.scaling.factor", rope_scaling[1])
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    hd = head_dim or n_embd // n_head
    hp = LlamaHParams(arch=arch if arch in ARCHS else "llama", n_vocab=n_vocab, n_ctx_train=64, n_embd=n_embd,
                      n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_head_k=hd,
                      n_embd_head_v=hd, n_rot=hd, tie_word_embeddings=tied, rope_freqs=rope_freqs,
                      **(hp_extra or {}))
    for name, ne in (expected_tensors(hp) | (extra_tensors or {})).items():
        if name in skip:
            continue
        ne = (reshape or {}).get(name, ne)
        w.add_tensor(name, np.zeros(tuple(reversed(ne)), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_hparams_synthetic_llama(tmp_path: Path) -> None:
    f = load_gguf(write_model(tmp_path / "m.gguf"))
    hp = hparams_from_gguf(f)
    assert (hp.n_vocab, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_layer) == (32, 8, 2, 1, 16, 2)
    assert hp.n_rot == 4 and hp.rope_freq_base == 500000.0 and not hp.tie_word_embeddings
    assert hp.f_norm_rms_eps == pytest.approx(1e-6) and hp.n_ctx_orig_yarn == 64
    assert hp.spec.rope_type == ROPE_TYPE_NORM and not hp.rope_freqs
    check_tensors(f, hp)
    check_tensors(f, hp, supported_types={GGMLType.F32})
    with pytest.raises(GGUFError, match="unsupported type F32"):
        check_tensors(f, hp, supported_types={GGMLType.Q4_0})


def test_hparams_tied_and_qwen2_and_rope_scaling(tmp_path: Path) -> None:
    f = load_gguf(write_model(tmp_path / "t.gguf", tied=True))
    hp = hparams_from_gguf(f)
    assert hp.tie_word_embeddings
    check_tensors(f, hp)
    f = load_gguf(write_model(tmp_path / "q.gguf", arch="qwen2", rope_scaling=("linear", 4.0)))
    hp = hparams_from_gguf(f)
    assert hp.arch == "qwen2" and hp.spec.qkv_bias and hp.rope_freq_scale == 0.25
    check_tensors(f, hp)
    f = load_gguf(write_model(tmp_path / "q2.gguf", arch="qwen2", skip=("blk.1.attn_k.bias",)))
    with pytest.raises(GGUFError, match=r"missing tensor 'blk.1.attn_k.bias'"):
        check_tensors(f, hparams_from_gguf(f))


# rope scaling as llama.cpp reads it: the type defaults to linear, so a lone factor scales; 'none' never
# does; the older rope.scale_linear key; attn_factor and the original context are kept for ROPE
@pytest.mark.parametrize("kv, freq_scale", [
    ({"rope.scaling.factor": 2.0}, 0.5),
    ({"rope.scaling.type": "none", "rope.scaling.factor": 4.0}, 1.0),
    ({"rope.scaling.type": "linear", "rope.scale_linear": 8.0}, 0.125),
    ({"rope.scaling.type": "linear", "rope.scaling.factor": 3.0}, float(np.float32(1) / np.float32(3))),
    ({"rope.scaling.finetuned": True, "rope.scaling.attn_factor": 0.5,
      "rope.scaling.original_context_length": 32}, 1.0),
])
def test_rope_scaling_keys(tmp_path: Path, kv: dict, freq_scale: float) -> None:
    hp = hparams_from_gguf(load_gguf(write_model(tmp_path / "r.gguf", extra_kv=kv)))
    assert hp.rope_freq_scale == freq_scale
    assert hp.rope_attn_factor == kv.get("rope.scaling.attn_factor", 1.0)
    assert hp.n_ctx_orig_yarn == kv.get("rope.scaling.original_context_length", 64)
    assert hp.rope_ext_factor == 0.0


# YaRN (any arch, as llama.cpp): positions divided by the factor, ext_factor 1, and attn_factor times
# get_mscale(f) / (1 + 0.1 logf(f)) in f32: 1.0 or an ulp below (llama_context's cparams.yarn_attn_factor)
@pytest.mark.parametrize("factor", [4.0, 32.0])
def test_rope_scaling_yarn(tmp_path: Path, factor: float) -> None:
    kv = {"rope.scaling.type": "yarn", "rope.scaling.factor": factor, "rope.scaling.original_context_length": 32}
    hp = hparams_from_gguf(load_gguf(write_model(tmp_path / "y.gguf", extra_kv=kv)))
    assert hp.rope_freq_scale == 1.0 / factor and hp.rope_ext_factor == 1.0
    v = np.float32(np.float32(0.1) * np.float32(np.log(factor)) + np.float32(1))
    assert abs(hp.rope_attn_factor - 1.0) <= float(np.spacing(np.float32(1))) and \
        abs(hp.rope_attn_factor - float(np.float32(v * np.float32(1 / v)))) <= 1e-7


@pytest.mark.parametrize("kwargs, match", [
    (dict(skip_kv=("embedding_length",)), "missing metadata key 'llama.embedding_length'"),
    (dict(arch="gptneox"), "unsupported architecture 'gptneox'"),
    (dict(n_head=4, n_head_kv=3), "head_count_kv = 3"),
    # rope scaling that is not implemented is refused, naming the key
    (dict(rope_scaling=("longrope", 1.0)), r"llama.rope.scaling.type = 'longrope' is not supported"),
    (dict(extra_kv={"rope.scaling.yarn_beta_fast": 32.0}), r"'llama.rope.scaling.yarn_beta_fast'"),
    # keys that change the math and are not read
    (dict(extra_kv={"attention.scale": 0.125}), r"'llama.attention.scale' = 0.125 \(a KQ scale"),
    (dict(extra_kv={"final_logit_softcapping": 30.0}), r"'llama.final_logit_softcapping' = 30.0"),
    (dict(extra_kv={"attn_logit_softcapping": 50.0}), r"'llama.attn_logit_softcapping'"),
    (dict(extra_kv={"attention.sliding_window": 16}), r"'llama.attention.sliding_window' = 16 \(sliding"),
    (dict(extra_kv={"some.new_key": 1.0}), r"metadata key 'llama.some.new_key' = 1.0 is not implemented"),
    (dict(arch="qwen2", extra_kv={"expert_count": 8}), r"qwen2.expert_count = 8 is not supported \(only 0 is\)"),
    (dict(extra_kv={"attention.causal": False}), r"llama.attention.causal = False is not supported"),
    # the three graphs rope whole heads of one size
    (dict(extra_kv={"rope.dimension_count": 2}), r"rope.dimension_count = 2 must equal the head size 4"),
    (dict(head_dim=6, extra_kv={"attention.value_length": 4}), r"key_length = 6 and .*value_length = 4"),
    (dict(extra_kv={"vocab_size": "many"}), r"'llama.vocab_size' has value 'many' \(str\), expected int"),
])
def test_hparams_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    f = load_gguf(write_model(tmp_path / "e.gguf", **kwargs))
    with pytest.raises(GGUFError, match=match):
        hparams_from_gguf(f)


# neutral keys at their neutral values load
def test_neutral_keys(tmp_path: Path) -> None:
    kv = {"expert_count": 0, "expert_used_count": 0, "attention.causal": True, "pooling_type": 0}
    f = load_gguf(write_model(tmp_path / "n.gguf", extra_kv=kv))
    check_tensors(f, hparams_from_gguf(f))


@pytest.mark.parametrize("kwargs, match", [
    (dict(skip=("blk.1.ffn_up.weight",)), r"missing tensor 'blk.1.ffn_up.weight'"),
    (dict(reshape={"blk.0.attn_k.weight": (8, 8)}), r"'blk.0.attn_k.weight' has ne=\[8, 8, 1, 1\], "
                                                     r"expected \[8, 4, 1, 1\]"),
    (dict(reshape={"token_embd.weight": (8, 31)}), r"token_embd.weight"),
    # a tensor no graph reads is refused, named, never skipped
    (dict(extra_tensors={"blk.0.attn_q.bias": (8,)}), r"tensor 'blk.0.attn_q.bias' \(ne=\[8, 1, 1, 1\]\) is "
                                                       r"not used by the llama graph"),
    (dict(extra_tensors={"blk.1.mystery.weight": (3, 5)}), r"tensor 'blk.1.mystery.weight'"),
    (dict(arch="qwen3", extra_tensors={"rope_freqs.weight": (2,)}), r"'rope_freqs.weight' .* qwen3 graph"),
    (dict(rope_freqs=True, extra_tensors={"blk.1.rope_freqs.weight": (2,)}), r"'blk.1.rope_freqs.weight'"),
    (dict(arch="qwen2", extra_tensors={"blk.0.attn_q_norm.weight": (4,)}), r"'blk.0.attn_q_norm.weight'"),
    # llama3 rope factors: one per pair, F32 (ggml_rope_ext's third source)
    (dict(rope_freqs=True, reshape={"rope_freqs.weight": (4,)}), r"'rope_freqs.weight' has ne=\[4, 1, 1, 1\], "
                                                                  r"expected \[2, 1, 1, 1\]"),
    # qwen3's per-head norms are required, of head size
    (dict(arch="qwen3", head_dim=6, skip=("blk.1.attn_k_norm.weight",)), r"missing tensor 'blk.1.attn_k_norm"),
    (dict(arch="qwen3", head_dim=6, reshape={"blk.0.attn_q_norm.weight": (8,)}),
     r"attn_q_norm.weight' has ne=\[8"),
])
def test_check_tensors_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    f = load_gguf(write_model(tmp_path / "e.gguf", **kwargs))
    with pytest.raises(GGUFError, match=match):
        check_tensors(f, hparams_from_gguf(f))


# the known-unused list is per architecture and explicit: qwen3's rerank head loads, llama's does not
def test_known_unused_tensors(tmp_path: Path) -> None:
    f = load_gguf(write_model(tmp_path / "q.gguf", arch="qwen3", extra_tensors={"cls.output.weight": (8, 1)}))
    check_tensors(f, hparams_from_gguf(f))
    f = load_gguf(write_model(tmp_path / "l.gguf", extra_tensors={"cls.output.weight": (8, 1)}))
    with pytest.raises(GGUFError, match="'cls.output.weight'"):
        check_tensors(f, hparams_from_gguf(f))


# qwen3: head size from attention.key_length (Wq, Wo not square), per-head norms, NeoX rope, no biases
def test_qwen3_hparams(tmp_path: Path) -> None:
    f = load_gguf(write_model(tmp_path / "q3.gguf", arch="qwen3", n_embd=8, n_head=2, head_dim=6, tied=True))
    hp = hparams_from_gguf(f)
    assert (hp.n_embd_head_k, hp.n_embd_head_v, hp.n_rot, hp.n_embd_k_gqa) == (6, 6, 6, 6)
    assert hp.spec.rope_type == ROPE_TYPE_NEOX and hp.spec.qk_norm and not hp.spec.qkv_bias
    want = expected_tensors(hp)
    assert want["blk.0.attn_q.weight"] == (8, 12) and want["blk.0.attn_output.weight"] == (12, 8)
    assert want["blk.1.attn_k_norm.weight"] == (6,) and "output.weight" not in want
    check_tensors(f, hp)


# llama3 rope scaling: rope_freqs.weight is read (hp.rope_freqs), one factor per rotated pair
def test_llama3_rope_freqs(tmp_path: Path) -> None:
    f = load_gguf(write_model(tmp_path / "l3.gguf", rope_freqs=True))
    hp = hparams_from_gguf(f)
    assert hp.rope_freqs and expected_tensors(hp)["rope_freqs.weight"] == (2,)
    check_tensors(f, hp)
    assert not hparams_from_gguf(load_gguf(write_model(tmp_path / "l.gguf"))).rope_freqs


# the converter's factors for Llama 3.1 (factor 8, low 1, high 4, original context 8192), head 128:
# 1 for wavelengths under 8192/4, 8 over 8192/1, blended between (here in float64, to 1e-6)
def test_llama3_rope_factors() -> None:
    ff = llama3_rope_factors(128, 500000.0)
    assert ff.dtype == np.float32 and ff.shape == (64,)
    wavelen = 2 * np.pi * 500000.0 ** (np.arange(0, 128, 2) / 128)
    smooth = (8192 / wavelen - 1) / (4 - 1)
    want = np.where(wavelen < 2048, 1.0, np.where(wavelen > 8192, 8.0, 1 / ((1 - smooth) / 8 + smooth)))
    np.testing.assert_allclose(ff, want, rtol=1e-6)
    assert (ff[:29] == 1).all() and (ff[35:] == 8).all() and np.all(np.diff(ff[28:36]) > 0)


# a llama3 synthetic file loads with its factors as a model weight; qwen3's with its norms
def test_synthetic_new_archs_load(tmp_path: Path) -> None:
    spec = SyntheticSpec(rope_scaling="llama3", rope_freq_base=500000.0, n_ctx_train=131072)
    m = LlamaModel.load(write_synthetic(tmp_path / "l3.gguf", spec))
    assert m.hp.rope_freqs and m.weights["rope_freqs.weight"].ne == (8, 1, 1, 1)
    spec = SyntheticSpec(arch="qwen3", head_dim=24, n_head_kv=2)
    m = LlamaModel.load(write_synthetic(tmp_path / "q3.gguf", spec))
    assert m.hp.n_embd_head_k == 24 and m.weights["blk.0.attn_output.weight"].ne[:2] == (96, 64)
    with pytest.raises(ValueError, match="only llama3, on a llama model"):
        write_synthetic(tmp_path / "x.gguf", SyntheticSpec(arch="qwen3", rope_scaling="llama3"))

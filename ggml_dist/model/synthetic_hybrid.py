"""Synthetic Qwen3.5 GGUF files (architectures qwen35 and qwen35moe) with random weights, written with the
gguf package: Gated DeltaNet layers and every full_attention_interval-th a gated attention layer, a dense
SwiGLU FFN or routed experts with a shared expert. The bytes are a pure function of the spec, so
llama.cpp's references on them stay valid (tests/data/make_reference.py --only qwen35).

The tensors are the ones llama.cpp's converter writes for Qwen3.5: attn_qkv (the conv channels: query
heads, key heads, value heads), attn_gate (z), ssm_conv1d (F32 taps), ssm_dt.bias, ssm_a (-exp(A_log), so
each head's decay exp(softplus(.) * ssm_a) is in (0, 1)), ssm_alpha, ssm_beta, ssm_norm, ssm_out; attention
layers have attn_q twice as wide (each head's query, then its gate) and per-head q/k norms.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gquants

from ..core.types import GGMLType
from .synthetic_parts import spm_vocab


@dataclass(frozen=True)
class SyntheticHybridSpec:
    arch: str = "qwen35"            # or "qwen35moe"
    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 4
    full_attention_interval: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 16                 # rope over the first n_rot dims of a head (Qwen3.5: 64 of 256)
    sections: tuple[int, int, int, int] = (3, 3, 2, 0)
    n_ff: int = 128
    d_conv: int = 4
    d_state: int = 32               # the head size of the delta net's keys and values
    n_group: int = 2                # key heads
    dt_rank: int = 4                # value heads
    n_expert: int = 0               # qwen35moe: experts, top k, their width and the shared expert's
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    router_std: float = 1.0         # the router's weights (large: tokens take different experts)
    wtype: str = "Q8_0"             # the 2-d weights (and the experts')
    embd_type: str = "Q8_0"
    tied: bool = True
    rope_freq_base: float = 10000000.0
    n_ctx_train: int = 4096
    seed: int = 0

    @property
    def name(self) -> str:
        moe = f"-x{self.n_expert}k{self.n_expert_used}" if self.n_expert else ""
        return (f"{self.arch}-{self.wtype.lower()}-e{self.n_embd}-l{self.n_layer}-i{self.full_attention_interval}"
                f"-h{self.n_head}-kv{self.n_head_kv}-hd{self.head_dim}-r{self.n_rot}-s{self.d_state}"
                f"g{self.n_group}v{self.dt_rank}{moe}-{'tied' if self.tied else 'untied'}-s{self.seed}")


def _weight(rng: np.random.Generator, type_name: str, shape: tuple[int, ...], std: float):
    """(array, raw_dtype) for GGUFWriter.add_tensor: numpy shape is ne reversed."""
    t = GGMLType[type_name]
    x = (rng.standard_normal(shape) * std).astype(np.float32)
    if t == GGMLType.F32:
        return x, None
    if t == GGMLType.F16:
        return x.astype(np.float16), None
    return gquants.quantize(x, GGMLQuantizationType(t.value)), GGMLQuantizationType(t.value)


def write_hybrid(path: str | Path, s: SyntheticHybridSpec) -> Path:
    """Write the model described by s to path (overwriting)."""
    if s.arch not in ("qwen35", "qwen35moe") or (s.arch == "qwen35moe") != (s.n_expert > 0):
        raise ValueError(f"a synthetic hybrid model is qwen35 (no experts) or qwen35moe (experts), not "
                         f"'{s.arch}' with {s.n_expert} experts")
    rng = np.random.default_rng(s.seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), s.arch)
    _header(w, s)
    e, hd = s.n_embd, s.head_dim
    key_dim, value_dim = s.d_state * s.n_group, s.d_state * s.dt_rank
    conv_dim = 2 * key_dim + value_dim

    def add(name: str, shape: tuple[int, ...], std: float, type_name: str = s.wtype) -> None:
        arr, raw = _weight(rng, type_name, shape, std)
        w.add_tensor(name, arr, raw_dtype=raw)

    def add_f32(name: str, x: np.ndarray) -> None:
        w.add_tensor(name, x.astype(np.float32))

    def norm(n: int) -> np.ndarray:
        return 1.0 + 0.1 * rng.standard_normal(n)

    std = 1.0 / np.sqrt(e)
    add("token_embd.weight", (s.n_vocab, e), 1.0, s.embd_type)
    for il in range(s.n_layer):
        b = f"blk.{il}."
        add_f32(b + "attn_norm.weight", norm(e))
        if (il + 1) % s.full_attention_interval:            # a Gated DeltaNet layer
            add(b + "attn_qkv.weight", (conv_dim, e), std)
            add(b + "attn_gate.weight", (value_dim, e), std)
            add_f32(b + "ssm_conv1d.weight", rng.standard_normal((conv_dim, s.d_conv)) * 0.5)
            add_f32(b + "ssm_dt.bias", rng.uniform(-1.0, 1.0, s.dt_rank))
            add_f32(b + "ssm_a", -np.exp(rng.uniform(-1.0, 1.0, s.dt_rank)))
            add(b + "ssm_alpha.weight", (s.dt_rank, e), std)
            add(b + "ssm_beta.weight", (s.dt_rank, e), std)
            add_f32(b + "ssm_norm.weight", norm(s.d_state))
            add(b + "ssm_out.weight", (e, value_dim), 1.0 / np.sqrt(value_dim))
        else:
            add(b + "attn_q.weight", (2 * hd * s.n_head, e), std)
            add(b + "attn_k.weight", (hd * s.n_head_kv, e), std)
            add(b + "attn_v.weight", (hd * s.n_head_kv, e), std)
            add_f32(b + "attn_q_norm.weight", norm(hd))
            add_f32(b + "attn_k_norm.weight", norm(hd))
            add(b + "attn_output.weight", (e, hd * s.n_head), 1.0 / np.sqrt(hd * s.n_head))
        add_f32(b + "post_attention_norm.weight", norm(e))
        if s.n_expert:
            x, f, sh = s.n_expert, s.n_ff_exp, s.n_ff_shexp
            add(b + "ffn_gate_inp.weight", (x, e), s.router_std, "F32")
            add(b + "ffn_gate_exps.weight", (x, f, e), std)
            add(b + "ffn_up_exps.weight", (x, f, e), std)
            add(b + "ffn_down_exps.weight", (x, e, f), 1.0 / np.sqrt(f))
            add(b + "ffn_gate_inp_shexp.weight", (e,), std, "F32")
            add(b + "ffn_gate_shexp.weight", (sh, e), std)
            add(b + "ffn_up_shexp.weight", (sh, e), std)
            add(b + "ffn_down_shexp.weight", (e, sh), 1.0 / np.sqrt(sh))
        else:
            add(b + "ffn_gate.weight", (s.n_ff, e), std)
            add(b + "ffn_up.weight", (s.n_ff, e), std)
            add(b + "ffn_down.weight", (e, s.n_ff), 1.0 / np.sqrt(s.n_ff))
    add_f32("output_norm.weight", norm(e))
    if not s.tied:
        add("output.weight", (s.n_vocab, e), std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _header(w: GGUFWriter, s: SyntheticHybridSpec) -> None:
    """The metadata: llama.cpp's keys for the architecture, and an SPM vocabulary."""
    w.add_name(f"synthetic {s.name}")
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.n_rot)
    w.add_rope_dimension_sections(list(s.sections))
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_full_attention_interval(s.full_attention_interval)
    w.add_ssm_conv_kernel(s.d_conv)
    w.add_ssm_inner_size(s.d_state * s.dt_rank)
    w.add_ssm_state_size(s.d_state)
    w.add_ssm_time_step_rank(s.dt_rank)
    w.add_ssm_group_count(s.n_group)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
        w.add_expert_shared_feed_forward_length(s.n_ff_shexp)
    w.add_vocab_size(s.n_vocab)
    w.add_file_type(1)
    w.add_string("general.synthetic_spec", repr(asdict(s)))
    tokens, scores, types = spm_vocab(s.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)


QWEN35_SPECS = (
    SyntheticHybridSpec(seed=1),
    SyntheticHybridSpec(arch="qwen35moe", n_expert=8, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64,
                        router_std=1.0, tied=False, seed=2),
)


def qwen35_0_8b(n_layer: int = 8, n_vocab: int = 32000) -> SyntheticHybridSpec:
    """Qwen3.5-0.8B's layers, the smallest real Qwen3.5 (its config.json's text_config: hidden 1024, FFN
    3584; Gated DeltaNet with 16 key and 16 value heads of 128, conv kernel 4; every 4th layer gated
    attention with 8 query / 2 KV heads of 256, rope over 64 dims in IMRoPE sections 11/11/10, base 1e7;
    tied embeddings), Q8_0, with n_layer of its 24 layers (8: two of its [3 DeltaNet, 1 attention]
    groups). The vocabulary is 32000, not 248320: with few layers the 248320-row output matmul (254M MACs
    a token) would outweigh the layers (~21M each)."""
    return SyntheticHybridSpec(n_vocab=n_vocab, n_embd=1024, n_layer=n_layer, full_attention_interval=4,
                               n_head=8, n_head_kv=2, head_dim=256, n_rot=64, sections=(11, 11, 10, 0),
                               n_ff=3584, d_conv=4, d_state=128, n_group=16, dt_rank=16, wtype="Q8_0",
                               embd_type="Q8_0", tied=True, rope_freq_base=10000000.0, seed=35)


# registered in synthetic.SHAPES (bench decode / batched / cluster model names)
HYBRID_SHAPES: dict[str, SyntheticHybridSpec] = {"qwen3.5-0.8b": qwen35_0_8b(8)}

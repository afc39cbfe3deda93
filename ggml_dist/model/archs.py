"""The architectures this runtime builds (llama_model_rope_type, each model's load_arch_tensors and graph
reduced to what sets one apart), how a mixture of experts calls build_moe_ffn, and the hyperparameters
record a model's graph is built from (llama_hparams). hparams.py fills the record from a GGUF file.
"""
from __future__ import annotations

from dataclasses import dataclass

from ggml_dist.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from ggml_dist.core.ops_hybrid import ROPE_TYPE_IMROPE


@dataclass(frozen=True, slots=True)
class MoESpec:
    """How an architecture calls build_moe_ffn (llama.cpp passes these as literals in its graph)."""
    gating: int                 # EXPERT_GATING_*: probabilities from the router logits
    norm_w: bool                # the top-k weights divided by their sum (clamped at 6.103515625e-5)
    n_ff_exp_key: bool          # expert_feed_forward_length gives the expert width (else feed_forward_length)
    shared_expert: bool = False     # qwen2moe: a dense SwiGLU expert every token takes, gated by sigmoid
    oai: bool = False               # gpt-oss: biases on the router and every expert, SWIGLU_OAI activation
    shared_sigmoid: bool = False    # qwen35moe: the shared expert's gate is ggml_sigmoid (qwen2moe's: silu(g)/g)


# llama_expert_gating_func_type
EXPERT_GATING_SOFTMAX = 1
EXPERT_GATING_SIGMOID = 2
EXPERT_GATING_SOFTMAX_WEIGHT = 3    # softmax over the k selected logits (gpt-oss)
EXPERT_GATING_NAMES = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """What sets one architecture apart (llama_model_rope_type, load_arch_tensors, its graph)."""
    rope_type: int          # NORM rotates adjacent pairs (the converter permuted Q/K rows), NEOX halves
    qkv_bias: bool          # attn_q/k/v.bias: required if True, refused if False
    qk_norm: bool           # attn_q_norm/attn_k_norm: an RMS norm of every Q and K head before rope
    rope_freqs: bool        # may carry rope_freqs.weight (llama3 rope scaling's frequency factors)
    gemma: bool = False     # Gemma 3: embeddings * sqrt(n_embd), Q * attention scale, post-attention and
                            # post-FFN norms, GEGLU, sliding-window layers (il % 6 < 5) with their own rope
    moe: MoESpec | None = None  # the FFN is a mixture of experts (build_moe_ffn's arguments for the arch)
    moe_optional: bool = False  # dense unless {arch}.expert_count > 0 (llama: Mixtral's files are "llama")
    gpt_oss: bool = False   # gpt-oss: Wo bias, attention sinks, sliding-window layers il % 2 == 0 (same rope),
                            # the FFN norm is post_attention_norm, the output rows taken after the last layer
    hybrid: bool = False    # Qwen3.5: Gated DeltaNet layers (recurrent state) and gated attention layers
                            # (model/qwen35.py), IMRoPE over a partial rotary dimension


ARCHS: dict[str, ArchSpec] = {
    "gemma3": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=False, qk_norm=True, rope_freqs=False, gemma=True),
    "llama": ArchSpec(ROPE_TYPE_NORM, qkv_bias=False, qk_norm=False, rope_freqs=True,
                      moe=MoESpec(EXPERT_GATING_SOFTMAX, norm_w=True, n_ff_exp_key=False), moe_optional=True),
    "gpt-oss": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=True, qk_norm=False, rope_freqs=False, gpt_oss=True,
                        moe=MoESpec(EXPERT_GATING_SOFTMAX_WEIGHT, norm_w=False, n_ff_exp_key=True, oai=True)),
    "qwen2": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=True, qk_norm=False, rope_freqs=False),
    "qwen2moe": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=True, qk_norm=False, rope_freqs=False,
                         moe=MoESpec(EXPERT_GATING_SOFTMAX, norm_w=False, n_ff_exp_key=True, shared_expert=True)),
    "qwen3": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=False, qk_norm=True, rope_freqs=False),
    "qwen3moe": ArchSpec(ROPE_TYPE_NEOX, qkv_bias=False, qk_norm=True, rope_freqs=False,
                         moe=MoESpec(EXPERT_GATING_SOFTMAX, norm_w=True, n_ff_exp_key=True)),
    "qwen35": ArchSpec(ROPE_TYPE_IMROPE, qkv_bias=False, qk_norm=True, rope_freqs=False, hybrid=True),
    "qwen35moe": ArchSpec(ROPE_TYPE_IMROPE, qkv_bias=False, qk_norm=True, rope_freqs=False, hybrid=True,
                          moe=MoESpec(EXPERT_GATING_SOFTMAX, norm_w=True, n_ff_exp_key=True, shared_expert=True,
                                      shared_sigmoid=True)),
}
SUPPORTED_ARCHS = tuple(ARCHS)


@dataclass(slots=True)
class LlamaHParams:
    arch: str
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_embd_head_k: int          # attention.key_length, default n_embd / n_head
    n_embd_head_v: int          # attention.value_length, default n_embd / n_head
    n_rot: int                  # rope.dimension_count, default n_embd_head_k (must equal it)
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0    # 1 / rope.scaling.factor (linear and YaRN scaling)
    rope_attn_factor: float = 1.0   # ROPE's attn_factor: rope.scaling.attn_factor (times YaRN's correction)
    rope_ext_factor: float = 0.0    # YaRN's extrapolation mix: 1 where rope.scaling.type is yarn
    n_ctx_orig_yarn: int = 0        # rope.scaling.original_context_length; 0: n_ctx_train
    f_norm_rms_eps: float = 1e-5
    tie_word_embeddings: bool = False   # no output.weight: the output projection reuses token_embd
    rope_freqs: bool = False            # rope_freqs.weight: frequency factors for every layer's rope
    # Gemma 3 (zero / empty elsewhere)
    n_swa: int = 0                      # attention.sliding_window: a SWA layer's token sees n_swa positions
    swa_layers: tuple[bool, ...] = ()   # is_swa(il): il % pattern < pattern - 1 (pattern 6 by default)
    rope_freq_base_swa: float = 10000.0     # rope.freq_base_swa (llama.cpp's default 10000) on SWA layers
    rope_freq_scale_swa: float = 1.0        # Gemma 3's SWA layers do not scale; gpt-oss's scale as the others
    f_attention_scale: float = 0.0      # Q is scaled by it before attention (then kq_scale 1)
    # a mixture of experts (zero elsewhere)
    n_expert: int = 0                   # expert_count: the experts stacked in each ffn_*_exps weight
    n_expert_used: int = 0              # expert_used_count: the top k each token takes
    n_ff_exp: int = 0                   # an expert's FFN width
    n_ff_shexp: int = 0                 # the shared expert's FFN width (qwen2moe)
    # Qwen3.5's Gated DeltaNet layers (zero / empty elsewhere; arch_hparams.qwen35_hparams)
    rope_sections: tuple[int, ...] = ()     # rope.dimension_sections: IMRoPE's t, h, w, e pair counts
    recurrent_layers: tuple[bool, ...] = ()     # is_recr(il): a Gated DeltaNet layer (else gated attention)
    ssm_d_conv: int = 0                 # ssm.conv_kernel: the causal conv's taps
    ssm_d_inner: int = 0                # ssm.inner_size: value heads * head size
    ssm_d_state: int = 0                # ssm.state_size: the head size of keys and values
    ssm_dt_rank: int = 0                # ssm.time_step_rank: the value heads
    ssm_n_group: int = 0                # ssm.group_count: the key heads

    @property
    def moe(self) -> MoESpec | None:
        """The architecture's build_moe_ffn arguments where this model's FFNs are mixtures of experts."""
        return ARCHS[self.arch].moe if self.n_expert else None

    def is_recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers) and self.recurrent_layers[il]

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a KV cache: all but a hybrid model's recurrent ones."""
        return [il for il in range(self.n_layer) if not self.is_recurrent(il)]

    @property
    def n_embd_r(self) -> int:
        """A Gated DeltaNet layer's conv state per sequence: the last d_conv - 1 inputs of each channel."""
        return (self.ssm_d_conv - 1) * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    @property
    def n_embd_s(self) -> int:
        """A Gated DeltaNet layer's delta-rule state per sequence: a head size squared per value head."""
        return self.ssm_d_state * self.ssm_d_inner

    def is_swa(self, il: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[il]

    def __post_init__(self) -> None:
        self.n_ctx_orig_yarn = self.n_ctx_orig_yarn or self.n_ctx_train

    @property
    def spec(self) -> ArchSpec:
        return ARCHS[self.arch]

    @property
    def n_embd_k_gqa(self) -> int:
        return self.n_embd_head_k * self.n_head_kv

    @property
    def n_embd_v_gqa(self) -> int:
        return self.n_embd_head_v * self.n_head_kv

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv

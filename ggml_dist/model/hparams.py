"""Model hyperparameters from GGUF metadata, and a check that the tensors match them (llama, qwen2, qwen3).

Mirrors llama_model_base::load_hparams, the per-arch load_arch_hparams / load_arch_tensors and the
tensor-count check of llama_model_loader: keys are `{arch}.*`, and every tensor the graph builder will
use is checked for presence and shape up front, so a bad file fails at load time with a message naming
the tensor instead of deep inside a graph.

Nothing in a file is silently ignored, because an ignored key or tensor gives plausible but wrong logits
(a Llama 3.1 file run without its rope_freqs.weight does). Every `{arch}.*` key is read (ARCH_KEYS),
known to leave the forward pass unchanged at its value (NEUTRAL_KEYS), or refused; every tensor is one
the graph reads (expected_tensors) or is on KNOWN_UNUSED_TENSORS, or the file is refused. Keys outside
`{arch}.*` (general.*, tokenizer.*, quantize.*) do not describe the forward pass.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggml_dist.backends.host import MUL_MAT_TYPES as HOST_MUL_MAT_TYPES
from ggml_dist.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from ggml_dist.core.types import TYPE_TRAITS, GGMLType, is_quantized
from ggml_dist.model import layout
from ggml_dist.model.gguf import GGUFError, GGUFFile

LLAMA_MAX_LAYERS = 512      # llama.cpp's limit; also bounds the work check_tensors does per layer


# -- the architectures ------------------------------------------------------------------------------
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


@dataclass(frozen=True, slots=True)
class MoESpec:
    """How an architecture calls build_moe_ffn (llama.cpp passes these as literals in its graph)."""
    gating: int                 # EXPERT_GATING_*: probabilities from the router logits
    norm_w: bool                # the top-k weights divided by their sum (clamped at 6.103515625e-5)
    n_ff_exp_key: bool          # expert_feed_forward_length gives the expert width (else feed_forward_length)
    shared_expert: bool = False     # qwen2moe: a dense SwiGLU expert every token takes, gated by sigmoid
    oai: bool = False               # gpt-oss: biases on the router and every expert, SWIGLU_OAI activation


# llama_expert_gating_func_type
EXPERT_GATING_SOFTMAX = 1
EXPERT_GATING_SIGMOID = 2
EXPERT_GATING_SOFTMAX_WEIGHT = 3    # softmax over the k selected logits (gpt-oss)
EXPERT_GATING_NAMES = {0: "none", 1: "softmax", 2: "sigmoid", 3: "softmax_weight", 4: "sqrt_softplus"}

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
}
SUPPORTED_ARCHS = tuple(ARCHS)

# tensors llama.cpp loads for an architecture but never reads when it computes logits (each says why)
KNOWN_UNUSED_TENSORS: dict[str, frozenset[str]] = {
    "qwen3": frozenset({"cls.output.weight"}),   # a reranker's head: read only by rank pooling, and a
                                                 # qwen3.pooling_type other than none is refused
}


# -- the metadata keys ------------------------------------------------------------------------------
# `{arch}.` keys that hparams_from_gguf reads (llama_model_base::load_hparams, for these archs)
ARCH_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base", "rope.scaling.type",
    "rope.scaling.factor", "rope.scale_linear", "rope.scaling.attn_factor",
    "rope.scaling.original_context_length",
})

# `{arch}.` keys read for one architecture only (llama_model_gemma3::load_arch_hparams)
ARCH_EXTRA_KEYS: dict[str, frozenset[str]] = {
    "gemma3": frozenset({"attention.sliding_window", "attention.sliding_window_pattern",
                         "rope.freq_base_swa", "final_logit_softcapping"}),
    "gpt-oss": frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"}),
}

# `{arch}.` keys of a mixture of experts that hparams_from_gguf reads (llama_model_base::load_hparams and the
# MoE archs' load_arch_hparams); a dense architecture refuses a non-zero expert_count by name
MOE_KEYS = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                      "expert_shared_feed_forward_length", "expert_group_count", "expert_group_used_count",
                      "expert_weights_norm", "expert_weights_scale", "expert_gating_func",
                      "expert_shared_count"})

# `{arch}.` keys that leave the forward pass as it is at the value given (None: at any value)
NEUTRAL_KEYS: dict[str, Any] = {
    "rope.scaling.finetuned": None,    # a note for tools: llama.cpp stores it and never reads it
    "expert_count": 0,                 # a dense model: its architecture has no mixture-of-experts graph
    "expert_used_count": 0,
    "attention.causal": True,          # the causal mask, the only one built
    "pooling_type": 0,                 # LLAMA_POOLING_TYPE_NONE: logits, not pooled embeddings
}

# common `{arch}.` keys that change the math and are not implemented: what each would do
REFUSED_KEYS: dict[str, str] = {
    "attention.scale": "a KQ scale other than 1/sqrt(head size)",
    "attn_logit_softcapping": "a tanh cap on the attention scores",
    "final_logit_softcapping": "a tanh cap on the output logits",
    "attention.sliding_window": "sliding-window attention",
    "attention.sliding_window_pattern": "sliding-window attention",
    "attention.clamp_kqv": "clamping of Q, K and V",
    "logit_scale": "a scale on the output logits",
    "embedding_scale": "a scale on the token embeddings",
    "residual_scale": "a scale on the residual branches",
    "rope.freq_base_swa": "sliding-window attention",
    "rope.dimension_sections": "multimodal rope (mrope)",
}


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

    @property
    def moe(self) -> MoESpec | None:
        """The architecture's build_moe_ffn arguments where this model's FFNs are mixtures of experts."""
        return ARCHS[self.arch].moe if self.n_expert else None

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


def _key(f: GGUFFile, key: str, kind: type, default: Any = None, required: bool = True) -> Any:
    if key not in f.metadata:
        if required and default is None:
            raise GGUFError(f"{f.path}: missing metadata key '{key}'")
        return default
    v = f.metadata[key]
    if kind is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if kind is str and isinstance(v, str):
        return v
    if kind is bool and isinstance(v, bool):
        return v
    raise GGUFError(f"{f.path}: metadata key '{key}' has value {v!r} ({type(v).__name__}), "
                    f"expected {kind.__name__}")


def check_keys(f: GGUFFile, arch: str) -> None:
    """Every `{arch}.*` key is read, or neutral at its value; any other one may change the math."""
    a = arch + "."
    moe = ARCHS[arch].moe is not None
    for key, v in f.metadata.items():
        if not key.startswith(a) or key[len(a):] in ARCH_KEYS or key[len(a):] in ARCH_EXTRA_KEYS.get(arch, ()):
            continue
        k = key[len(a):]
        if moe and k in MOE_KEYS:
            continue                    # read, or refused by name, by _moe_hparams
        if k in NEUTRAL_KEYS and NEUTRAL_KEYS[k] in (None, v):
            continue
        if k in NEUTRAL_KEYS:
            raise GGUFError(f"{f.path}: {key} = {v!r} is not supported (only {NEUTRAL_KEYS[k]!r} is)")
        what = f" ({REFUSED_KEYS[k]})" if k in REFUSED_KEYS else ""
        raise GGUFError(f"{f.path}: metadata key '{key}' = {_short(v)}{what} is not implemented; the file "
                        f"is refused rather than run with it ignored")


def _short(v: Any) -> str:
    return f"[{len(v)} values]" if isinstance(v, (list, np.ndarray)) else repr(v)


def _head_sizes(f: GGUFFile, a: str, n_embd: int, n_head: int) -> tuple[int, int, int]:
    """(n_embd_head_k, n_embd_head_v, n_rot). The three graphs rotate whole heads of one size."""
    if n_embd % n_head and (a + "attention.key_length") not in f.metadata:
        raise GGUFError(f"{f.path}: embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_k = _key(f, a + "attention.key_length", int, default=n_embd // n_head)
    head_v = _key(f, a + "attention.value_length", int, default=n_embd // n_head)
    n_rot = _key(f, a + "rope.dimension_count", int, default=head_k)
    if head_k <= 0 or head_v != head_k:
        raise GGUFError(f"{f.path}: {a}attention.key_length = {head_k} and {a}attention.value_length = "
                        f"{head_v} must be equal and positive")
    if n_rot != head_k or n_rot % 2:
        raise GGUFError(f"{f.path}: {a}rope.dimension_count = {n_rot} must equal the head size {head_k} "
                        f"(an even number)")
    return head_k, head_v, n_rot


def _rope_freq_base(f: GGUFFile, key: str) -> float:
    """rope.freq_base (or _swa): pair i turns at base^(-2i/n_rot) of the position, which slows with i only
    for a base above 1; ROPE's yarn_corr_dims divides by log(base), so 1, 0, negatives and NaN cannot run."""
    base = _key(f, key, float, default=10000.0)
    if not (math.isfinite(base) and base > 1.0):
        raise GGUFError(f"{f.path}: {key} = {base!r} must be a finite number above 1")
    return base


def _rope_scaling(f: GGUFFile, a: str) -> tuple[float, float, float]:
    """(freq_scale, ext_factor, attn_factor) as load_hparams and llama_context set them: the scaling type
    defaults to linear; 'none' never scales; 'linear' and 'yarn' divide positions by rope.scaling.factor
    (or the older rope.scale_linear), f32 1.0f/factor. YaRN also mixes extrapolated and interpolated
    frequencies (ext_factor 1, the ramp over beta_fast 32 .. beta_slow 1) and multiplies attn_factor by
    get_mscale(factor) / (1 + 0.1 logf(factor)), which cancels the magnitude ROPE applies itself."""
    scaling = _key(f, a + "rope.scaling.type", str, default="linear")
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{f.path}: {a}rope.scaling.type = '{scaling}' is not supported (none, linear, yarn): "
                        f"longrope rope scaling is not implemented")
    factor = _key(f, a + "rope.scaling.factor", float, required=False)
    if factor is None:
        factor = _key(f, a + "rope.scale_linear", float, default=0.0)
    attn_factor = np.float32(_key(f, a + "rope.scaling.attn_factor", float, default=1.0))
    if scaling == "none" or factor == 0.0:
        return 1.0, 0.0, float(attn_factor)
    freq_scale = np.float32(1.0) / np.float32(factor)
    if scaling == "linear":
        return float(freq_scale), 0.0, float(attn_factor)
    f32, one = np.float32, np.float32(1.0)
    scale = one / freq_scale                        # factor = 1.0f / cparams.rope_freq_scale
    # get_mscale(factor, 1.0f) = 0.1f*1.0f*logf(factor) + 1.0f, and 1.0f + 0.1f*logf(factor): GCC fuses both
    # into fma(0.1f, logf(factor), 1.0f) (one rounding), so they are one value v and the product v * (1/v)
    mscale = one if scale <= one else _fma32(f32(0.1), _logf(scale), one)
    yarn = f32(mscale * f32(one / _fma32(f32(0.1), _logf(scale), one)))
    return float(freq_scale), 1.0, float(f32(yarn * attn_factor))


def _logf(x: np.float32) -> np.float32:
    """The C library's logf (correctly rounded): log in double, rounded once."""
    return np.float32(math.log(float(x)))


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fmaf: the exact product and sum, rounded once (double holds a product of two floats exactly)."""
    return np.float32(float(a) * float(b) + float(c))


def _n_vocab(f: GGUFFile, a: str) -> int:
    if a + "vocab_size" in f.metadata:
        return _key(f, a + "vocab_size", int)
    if "tokenizer.ggml.tokens" in f.metadata:
        return len(f.metadata["tokenizer.ggml.tokens"])
    if "token_embd.weight" in f.tensors:
        return f.tensors["token_embd.weight"].ne[1]
    raise GGUFError(f"{f.path}: cannot tell the vocabulary size (no {a}vocab_size, no tokens)")


def hparams_from_gguf(f: GGUFFile) -> LlamaHParams:
    arch = _key(f, "general.architecture", str)
    if arch not in ARCHS:
        raise GGUFError(f"{f.path}: unknown or unsupported architecture '{arch}'; "
                        f"supported: {', '.join(SUPPORTED_ARCHS)}")
    check_keys(f, arch)
    a = arch + "."
    n_embd = _key(f, a + "embedding_length", int)
    n_head = _key(f, a + "attention.head_count", int)
    n_layer = _key(f, a + "block_count", int)
    moe = ARCHS[arch].moe is not None and not ARCHS[arch].moe_optional
    n_ff = _key(f, a + "feed_forward_length", int, default=0 if moe else None)   # optional where every FFN is experts
    n_ctx_train = _key(f, a + "context_length", int)
    for k, v in (("embedding_length", n_embd), ("attention.head_count", n_head), ("block_count", n_layer),
                 ("feed_forward_length", n_ff if not moe else 1), ("context_length", n_ctx_train)):
        if v <= 0:
            raise GGUFError(f"{f.path}: {a}{k} = {v} must be positive")
    if n_layer > LLAMA_MAX_LAYERS:
        raise GGUFError(f"{f.path}: {a}block_count = {n_layer} exceeds the maximum of {LLAMA_MAX_LAYERS} "
                        f"layers")
    n_head_kv = _key(f, a + "attention.head_count_kv", int, default=n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {a}attention.head_count_kv = {n_head_kv} must be positive and divide "
                        f"head_count = {n_head}")
    head_k, head_v, n_rot = _head_sizes(f, a, n_embd, n_head)
    freq_scale, ext_factor, attn_factor = _rope_scaling(f, a)
    n_ctx_orig = _key(f, a + "rope.scaling.original_context_length", int, default=n_ctx_train)
    if n_ctx_orig <= 0:
        raise GGUFError(f"{f.path}: {a}rope.scaling.original_context_length = {n_ctx_orig} must be positive")
    hp = LlamaHParams(
        arch=arch, n_vocab=_n_vocab(f, a), n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_head_k=head_k, n_embd_head_v=head_v,
        n_rot=n_rot,
        rope_freq_base=_rope_freq_base(f, a + "rope.freq_base"),
        rope_freq_scale=freq_scale, rope_ext_factor=ext_factor, rope_attn_factor=attn_factor,
        n_ctx_orig_yarn=n_ctx_orig,
        f_norm_rms_eps=_key(f, a + "attention.layer_norm_rms_epsilon", float),
        tie_word_embeddings=layout.tied_head(f),
        rope_freqs=ARCHS[arch].rope_freqs and "rope_freqs.weight" in f.tensors,
    )
    if ARCHS[arch].gemma:
        _gemma3_hparams(f, a, hp)
    if ARCHS[arch].gpt_oss:
        _gpt_oss_hparams(f, a, hp)
    if ARCHS[arch].moe is not None:
        _moe_hparams(f, a, hp)
    return hp


def _moe_key_int(f: GGUFFile, key: str, n_layer: int, default: int | None = None) -> int:
    """An int key that llama.cpp also takes as a per-layer array (get_key_or_arr): one value for every
    layer is what the graphs here build; an array of differing values is refused by name."""
    v = f.metadata.get(key, default)
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, list):
        if len(v) != n_layer or len(set(v)) != 1:
            raise GGUFError(f"{f.path}: {key} = {_short(v)}: a different value per layer is not implemented")
        v = v[0]
    if v is None:
        raise GGUFError(f"{f.path}: missing metadata key '{key}'")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GGUFError(f"{f.path}: metadata key '{key}' = {v!r} must be a non-negative integer")
    return v


LLAMA_MAX_EXPERTS = 512             # llama.cpp's limit (llama-hparams.h)


def _moe_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """load_hparams' expert keys and the MoE archs' load_arch_hparams: the expert count and top k, each
    expert's width, the shared expert's; the keys llama.cpp's graphs for these archs do not read
    (weights norm, scale, gating function: the graph passes literals) are accepted where they say what the
    graph does and refused by name where they ask for something else; grouped routing is refused."""
    spec = ARCHS[hp.arch]
    moe = spec.moe
    assert moe is not None
    hp.n_expert = _moe_key_int(f, a + "expert_count", hp.n_layer, default=0 if spec.moe_optional else None)
    hp.n_expert_used = _moe_key_int(f, a + "expert_used_count", hp.n_layer, default=0)
    if hp.n_expert == 0:
        if hp.n_expert_used:
            raise GGUFError(f"{f.path}: {a}expert_used_count = {hp.n_expert_used} without experts")
        extra = sorted(k for k in f.metadata if k.startswith(a) and k[len(a):] in MOE_KEYS - {"expert_count",
                                                                                          "expert_used_count"})
        if extra:
            raise GGUFError(f"{f.path}: {extra[0]} in a dense model (expert_count 0)")
        return
    if hp.n_expert > LLAMA_MAX_EXPERTS or not 0 < hp.n_expert_used <= hp.n_expert:
        raise GGUFError(f"{f.path}: {a}expert_count = {hp.n_expert}, {a}expert_used_count = {hp.n_expert_used}: "
                        f"need 0 < used <= count <= {LLAMA_MAX_EXPERTS}")
    groups = _moe_key_int(f, a + "expert_group_count", hp.n_layer, default=0)
    if groups > 1:
        raise GGUFError(f"{f.path}: {a}expert_group_count = {groups} (grouped expert routing, as DeepSeek V3's) "
                        f"is not implemented")
    if _moe_key_int(f, a + "expert_group_used_count", hp.n_layer, default=0):
        raise GGUFError(f"{f.path}: {a}expert_group_used_count (grouped expert routing) is not implemented")
    if _moe_key_int(f, a + "expert_shared_count", hp.n_layer, default=0) > (1 if moe.shared_expert else 0):
        raise GGUFError(f"{f.path}: {a}expert_shared_count: shared experts beyond the {hp.arch} graph's "
                        f"{int(moe.shared_expert)} are not implemented")
    if moe.n_ff_exp_key:
        hp.n_ff_exp = _moe_key_int(f, a + "expert_feed_forward_length", hp.n_layer, default=0) or \
            hp.n_ff // hp.n_expert_used
    else:
        if a + "expert_feed_forward_length" in f.metadata:
            raise GGUFError(f"{f.path}: {a}expert_feed_forward_length: the {hp.arch} graph's experts are "
                            f"feed_forward_length wide; a separate expert width is not implemented")
        hp.n_ff_exp = hp.n_ff
    if hp.n_ff_exp <= 0:
        raise GGUFError(f"{f.path}: {a}expert_feed_forward_length must be positive")
    if moe.shared_expert:
        hp.n_ff_shexp = _moe_key_int(f, a + "expert_shared_feed_forward_length", hp.n_layer, default=0) or hp.n_ff
        if hp.n_ff_shexp <= 0:
            raise GGUFError(f"{f.path}: {a}expert_shared_feed_forward_length must be positive")
    elif a + "expert_shared_feed_forward_length" in f.metadata:
        raise GGUFError(f"{f.path}: {a}expert_shared_feed_forward_length: the {hp.arch} graph has no shared "
                        f"expert")
    _check_moe_literal(f, a + "expert_weights_norm", moe.norm_w, hp.arch)
    gating = f.metadata.get(a + "expert_gating_func", moe.gating)
    if gating != moe.gating:
        raise GGUFError(f"{f.path}: {a}expert_gating_func = {gating!r} "
                        f"({EXPERT_GATING_NAMES.get(gating, 'unknown')}): llama.cpp's {hp.arch} graph gates "
                        f"with {EXPERT_GATING_NAMES[moe.gating]}; another gating is not implemented for it")
    scale = f.metadata.get(a + "expert_weights_scale", 0.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or float(scale) not in (0.0, 1.0):
        raise GGUFError(f"{f.path}: {a}expert_weights_scale = {scale!r} (a scale on the expert weights) is "
                        f"not implemented")


def _check_moe_literal(f: GGUFFile, key: str, value: bool, arch: str) -> None:
    v = f.metadata.get(key, value)
    if v is not value:
        raise GGUFError(f"{f.path}: {key} = {v!r}: llama.cpp's {arch} graph uses {value}; the other choice is "
                        f"not implemented")


def _gemma3_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """llama_model_gemma3::load_arch_hparams: the sliding window and its layers, the SWA rope base, the
    attention scale (1/sqrtf(head size), or 1/sqrtf(n_embd / n_head) for the 62-layer 27B)."""
    softcap = _key(f, a + "final_logit_softcapping", float, default=0.0)
    if softcap != 0.0:
        raise GGUFError(f"{f.path}: {a}final_logit_softcapping = {softcap} (a tanh cap on the output "
                        f"logits) is not implemented")
    n_swa = _key(f, a + "attention.sliding_window", int, default=0)
    if n_swa < 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window = {n_swa} must not be negative")
    if n_swa > 0:
        pat = f.metadata.get(a + "attention.sliding_window_pattern", 6)
        if isinstance(pat, bool) or not isinstance(pat, int) or pat <= 0:
            raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {_short(pat)} is not supported "
                            f"(only a positive layer period is)")
        hp.n_swa = n_swa
        hp.swa_layers = tuple(il % pat < pat - 1 for il in range(hp.n_layer))   # set_swa_pattern
        hp.rope_freq_base_swa = _rope_freq_base(f, a + "rope.freq_base_swa")
    elif a + "attention.sliding_window_pattern" in f.metadata or a + "rope.freq_base_swa" in f.metadata:
        raise GGUFError(f"{f.path}: a sliding-window pattern or rope base without {a}attention.sliding_window")
    d = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k
    hp.f_attention_scale = float(np.float32(1.0) / np.sqrt(np.float32(d)))


def _gpt_oss_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """llama_model_openai_moe::load_arch_hparams: the sliding window (required), its layers
    (load_swa_pattern(ml, 2): il % 2 == 0 unless attention.sliding_window_pattern says otherwise), the SWA
    layers' rope base (rope.freq_base_swa, else the file's) at the same frequency scale."""
    hp.n_swa = _key(f, a + "attention.sliding_window", int)
    if hp.n_swa <= 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window = {hp.n_swa} must be positive")
    hp.swa_layers = _swa_pattern(f, a, hp.n_layer, 2)
    hp.rope_freq_base_swa = _rope_freq_base(f, a + "rope.freq_base_swa") \
        if a + "rope.freq_base_swa" in f.metadata else hp.rope_freq_base
    hp.rope_freq_scale_swa = hp.rope_freq_scale


def _swa_pattern(f: GGUFFile, a: str, n_layer: int, default: int) -> tuple[bool, ...]:
    """load_swa_pattern: attention.sliding_window_pattern is a layer period (il % n < n - 1 is SWA) or a
    bool per layer; absent, the architecture's period."""
    pat = f.metadata.get(a + "attention.sliding_window_pattern", default)
    if isinstance(pat, np.ndarray):
        pat = pat.tolist()
    if isinstance(pat, list):
        if len(pat) != n_layer or not all(isinstance(v, bool) for v in pat):
            raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {_short(pat)}: expected "
                            f"{n_layer} booleans")
        return tuple(pat)
    if isinstance(pat, bool) or not isinstance(pat, int) or pat <= 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {_short(pat)} is not supported "
                        f"(a positive layer period or a bool per layer)")
    return tuple(il % pat < pat - 1 for il in range(n_layer))


# -- the tensors ------------------------------------------------------------------------------------
# the weight types the CPU kernels compute for the op that reads a weight: a type with a block layout but
# no kernel (IQ*, MXFP4, Q8_1, the integers, F64 as a matmul weight) would otherwise load and fail deep in
# the first forward pass
MUL_MAT_TYPES = HOST_MUL_MAT_TYPES                       # the host backend's MUL_MAT: every 2-d weight
GET_ROWS_TYPES = MUL_MAT_TYPES | {GGMLType.Q8_K}        # backends/cpu/quants.py dequantize: token_embd


def _op_types(name: str, shape: tuple[int, ...],
              hp: LlamaHParams) -> tuple[str, Collection[GGMLType] | None]:
    """The op that reads weight `name` and the types it computes; None for the norms and biases, which
    MUL and ADD read in any type that is not quantized (cpu_supports_op)."""
    if name == "rope_freqs.weight":
        return "ROPE", frozenset({GGMLType.F32})        # the frequency factors are read as f32
    if name == "token_embd.weight":
        return ("GET_ROWS", GET_ROWS_TYPES) if not hp.tie_word_embeddings else ("MUL_MAT", MUL_MAT_TYPES)
    if len(shape) == 3:
        return "MUL_MAT_ID", MUL_MAT_TYPES              # the stacked experts
    if name.endswith(("_exps.bias", "attn_sinks.weight")):
        return ("ADD_ID" if name.endswith(".bias") else "SOFT_MAX"), frozenset({GGMLType.F32})
    if name.endswith("ffn_gate_inp_shexp.weight"):      # a 1-row matrix: the shared expert's gate logit
        return "MUL_MAT", MUL_MAT_TYPES
    return ("MUL_MAT", MUL_MAT_TYPES) if len(shape) == 2 else ("MUL", None)


def expected_tensors(hp: LlamaHParams) -> dict[str, tuple[int, ...]]:
    """Tensor name -> ne (ggml order, unpadded): every tensor the graph builder reads, and no other."""
    spec, n_embd, n_vocab = hp.spec, hp.n_embd, hp.n_vocab
    q_out = hp.n_embd_head_k * hp.n_head
    v_out = hp.n_embd_head_v * hp.n_head
    want: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_embd, n_vocab),
        "output_norm.weight": (n_embd,),
    }
    if not hp.tie_word_embeddings:
        want["output.weight"] = (n_embd, n_vocab)
    if hp.rope_freqs:                                 # one per-pair divisor, shared by all layers
        want["rope_freqs.weight"] = (hp.n_rot // 2,)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want[b + "attn_norm.weight"] = (n_embd,)
        want[b + "attn_q.weight"] = (n_embd, q_out)
        want[b + "attn_k.weight"] = (n_embd, hp.n_embd_k_gqa)
        want[b + "attn_v.weight"] = (n_embd, hp.n_embd_v_gqa)
        want[b + "attn_output.weight"] = (v_out, n_embd)
        if spec.qkv_bias:
            want[b + "attn_q.bias"] = (q_out,)
            want[b + "attn_k.bias"] = (hp.n_embd_k_gqa,)
            want[b + "attn_v.bias"] = (hp.n_embd_v_gqa,)
        if spec.qk_norm:
            want[b + "attn_q_norm.weight"] = (hp.n_embd_head_k,)
            want[b + "attn_k_norm.weight"] = (hp.n_embd_head_k,)
        if spec.gemma:
            want[b + "post_attention_norm.weight"] = (n_embd,)
            want[b + "post_ffw_norm.weight"] = (n_embd,)
        if spec.gpt_oss:
            want[b + "attn_output.bias"] = (n_embd,)
            want[b + "attn_sinks.weight"] = (hp.n_head,)
        want[b + ffn_norm_name(hp)] = (n_embd,)
        want.update(_ffn_tensors(hp, b))
    return want


def ffn_norm_name(hp: LlamaHParams) -> str:
    """The norm before a layer's FFN: ffn_norm.weight; gpt-oss calls it post_attention_norm.weight."""
    return "post_attention_norm.weight" if hp.spec.gpt_oss else "ffn_norm.weight"


def _ffn_tensors(hp: LlamaHParams, b: str) -> dict[str, tuple[int, ...]]:
    """One layer's FFN weights: the dense SwiGLU, or the router and the stacked experts (plus the shared
    expert and its gate where the architecture has one)."""
    n_embd = hp.n_embd
    if hp.moe is None:
        return {b + "ffn_gate.weight": (n_embd, hp.n_ff), b + "ffn_up.weight": (n_embd, hp.n_ff),
                b + "ffn_down.weight": (hp.n_ff, n_embd)}
    e, f = hp.n_expert, hp.n_ff_exp
    want = {b + "ffn_gate_inp.weight": (n_embd, e), b + "ffn_gate_exps.weight": (n_embd, f, e),
            b + "ffn_up_exps.weight": (n_embd, f, e), b + "ffn_down_exps.weight": (f, n_embd, e)}
    if hp.moe.oai:
        want.update({b + "ffn_gate_inp.bias": (e,), b + "ffn_gate_exps.bias": (f, e), b + "ffn_up_exps.bias": (f, e),
                     b + "ffn_down_exps.bias": (n_embd, e)})
    if hp.moe.shared_expert:
        s = hp.n_ff_shexp
        want.update({b + "ffn_gate_inp_shexp.weight": (n_embd,), b + "ffn_gate_shexp.weight": (n_embd, s),
                     b + "ffn_up_shexp.weight": (n_embd, s), b + "ffn_down_shexp.weight": (s, n_embd)})
    return want


def check_tensors(f: GGUFFile, hp: LlamaHParams,
                  supported_types: Collection[GGMLType] | None = None) -> None:
    """Every tensor the model needs exists with the expected shape and a supported type, and the file
    holds no tensor the graph would skip (llama_model_loader's "wrong number of tensors")."""
    want = expected_tensors(hp)
    for name, shape in want.items():
        ti = f.tensors.get(name)
        if ti is None:
            raise GGUFError(f"{f.path}: missing tensor '{name}' (expected ne={list(shape)})")
        ne = shape + (1,) * (4 - len(shape))
        if ti.ne != ne:
            raise GGUFError(f"{f.path}: tensor '{name}' has ne={list(ti.ne)}, expected {list(ne)}")
        ok = ti.type in TYPE_TRAITS if supported_types is None else ti.type in supported_types
        if not ok:
            raise GGUFError(f"{f.path}: tensor '{name}' has unsupported type {ti.type.name}")
        op, types = _op_types(name, shape, hp)
        if (ti.type not in types) if types is not None else is_quantized(ti.type):
            can = "any type not quantized" if types is None else ", ".join(t.name for t in sorted(types))
            raise GGUFError(f"{f.path}: tensor '{name}' has type {ti.type.name}, which {op} does not compute "
                            f"on the CPU backend (supported: {can})")
    unused = KNOWN_UNUSED_TENSORS.get(hp.arch, frozenset())
    for name, ti in f.tensors.items():
        if name not in want and name not in unused:
            raise GGUFError(f"{f.path}: tensor '{name}' (ne={list(ti.ne)}) is not used by the {hp.arch} "
                            f"graph; the file is refused rather than run with it ignored")

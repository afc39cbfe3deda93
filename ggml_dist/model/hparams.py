"""Model hyperparameters from GGUF metadata: the architectures this runtime builds and what sets each
apart, and the keys every one shares (llama_model_base::load_hparams). The per-arch keys (mixtures of
experts, sliding windows) are arch_hparams.py's; the tensors each graph reads, checked up front, are
tensors.py's; reading a key of a kind is gguf_keys.py's.

Nothing in a file is silently ignored, because an ignored key or tensor gives plausible but wrong logits
(a Llama 3.1 file run without its rope_freqs.weight does). Every `{arch}.*` key is read (ARCH_KEYS),
known to leave the forward pass unchanged at its value (NEUTRAL_KEYS), or refused; every tensor is one
the graph reads (expected_tensors) or is on KNOWN_UNUSED_TENSORS, or the file is refused. Keys outside
`{arch}.*` (general.*, tokenizer.*, quantize.*) do not describe the forward pass.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ggml_dist.model import layout
from ggml_dist.model.arch_hparams import (
    MOE_KEYS,
    QWEN35_KEYS,
    gemma3_hparams,
    gpt_oss_hparams,
    moe_hparams,
    qwen35_hparams,
)
from ggml_dist.model.archs import ARCHS, SUPPORTED_ARCHS, LlamaHParams
from ggml_dist.model.gguf import GGUFError, GGUFFile
from ggml_dist.model.gguf_keys import key, rope_freq_base, short

LLAMA_MAX_LAYERS = 512      # llama.cpp's limit; also bounds the work check_tensors does per layer


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
    "qwen35": QWEN35_KEYS,
    "qwen35moe": QWEN35_KEYS,
}

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


def check_keys(f: GGUFFile, arch: str) -> None:
    """Every `{arch}.*` key is read, or neutral at its value; any other one may change the math."""
    a = arch + "."
    moe = ARCHS[arch].moe is not None
    for name, v in f.metadata.items():
        if not name.startswith(a) or name[len(a):] in ARCH_KEYS or name[len(a):] in ARCH_EXTRA_KEYS.get(arch, ()):
            continue
        k = name[len(a):]
        if moe and k in MOE_KEYS:
            continue                    # read, or refused by name, by arch_hparams.moe_hparams
        if k in NEUTRAL_KEYS and NEUTRAL_KEYS[k] in (None, v):
            continue
        if k in NEUTRAL_KEYS:
            raise GGUFError(f"{f.path}: {name} = {v!r} is not supported (only {NEUTRAL_KEYS[k]!r} is)")
        what = f" ({REFUSED_KEYS[k]})" if k in REFUSED_KEYS else ""
        raise GGUFError(f"{f.path}: metadata key '{name}' = {short(v)}{what} is not implemented; the file "
                        f"is refused rather than run with it ignored")


def _head_sizes(f: GGUFFile, a: str, n_embd: int, n_head: int, partial: bool) -> tuple[int, int, int]:
    """(n_embd_head_k, n_embd_head_v, n_rot). The graphs rotate whole heads of one size; partial: the
    first n_rot dimensions of each (Qwen3.5's), the rest passed through."""
    if n_embd % n_head and (a + "attention.key_length") not in f.metadata:
        raise GGUFError(f"{f.path}: embedding_length {n_embd} is not a multiple of head_count {n_head}")
    head_k = key(f, a + "attention.key_length", int, default=n_embd // n_head)
    head_v = key(f, a + "attention.value_length", int, default=n_embd // n_head)
    n_rot = key(f, a + "rope.dimension_count", int, default=head_k)
    if head_k <= 0 or head_v != head_k:
        raise GGUFError(f"{f.path}: {a}attention.key_length = {head_k} and {a}attention.value_length = "
                        f"{head_v} must be equal and positive")
    if (n_rot != head_k and not (partial and 0 < n_rot < head_k)) or n_rot % 2:
        raise GGUFError(f"{f.path}: {a}rope.dimension_count = {n_rot} must equal the head size {head_k} "
                        f"(an even number)" + (" or be less than it" if partial else ""))
    return head_k, head_v, n_rot


def _rope_scaling(f: GGUFFile, a: str) -> tuple[float, float, float]:
    """(freq_scale, ext_factor, attn_factor) as load_hparams and llama_context set them: the scaling type
    defaults to linear; 'none' never scales; 'linear' and 'yarn' divide positions by rope.scaling.factor
    (or the older rope.scale_linear), f32 1.0f/factor. YaRN also mixes extrapolated and interpolated
    frequencies (ext_factor 1, the ramp over beta_fast 32 .. beta_slow 1) and multiplies attn_factor by
    get_mscale(factor) / (1 + 0.1 logf(factor)), which cancels the magnitude ROPE applies itself."""
    scaling = key(f, a + "rope.scaling.type", str, default="linear")
    if scaling not in ("none", "linear", "yarn"):
        raise GGUFError(f"{f.path}: {a}rope.scaling.type = '{scaling}' is not supported (none, linear, yarn): "
                        f"longrope rope scaling is not implemented")
    factor = key(f, a + "rope.scaling.factor", float, required=False)
    if factor is None:
        factor = key(f, a + "rope.scale_linear", float, default=0.0)
    attn_factor = np.float32(key(f, a + "rope.scaling.attn_factor", float, default=1.0))
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
        return key(f, a + "vocab_size", int)
    if "tokenizer.ggml.tokens" in f.metadata:
        return len(f.metadata["tokenizer.ggml.tokens"])
    if "token_embd.weight" in f.tensors:
        return f.tensors["token_embd.weight"].ne[1]
    raise GGUFError(f"{f.path}: cannot tell the vocabulary size (no {a}vocab_size, no tokens)")


def hparams_from_gguf(f: GGUFFile) -> LlamaHParams:
    arch = key(f, "general.architecture", str)
    if arch not in ARCHS:
        raise GGUFError(f"{f.path}: unknown or unsupported architecture '{arch}'; "
                        f"supported: {', '.join(SUPPORTED_ARCHS)}")
    check_keys(f, arch)
    a = arch + "."
    n_embd = key(f, a + "embedding_length", int)
    n_head = key(f, a + "attention.head_count", int)
    n_layer = key(f, a + "block_count", int)
    moe = ARCHS[arch].moe is not None and not ARCHS[arch].moe_optional
    n_ff = key(f, a + "feed_forward_length", int, default=0 if moe else None)   # optional where every FFN is experts
    n_ctx_train = key(f, a + "context_length", int)
    for k, v in (("embedding_length", n_embd), ("attention.head_count", n_head), ("block_count", n_layer),
                 ("feed_forward_length", n_ff if not moe else 1), ("context_length", n_ctx_train)):
        if v <= 0:
            raise GGUFError(f"{f.path}: {a}{k} = {v} must be positive")
    if n_layer > LLAMA_MAX_LAYERS:
        raise GGUFError(f"{f.path}: {a}block_count = {n_layer} exceeds the maximum of {LLAMA_MAX_LAYERS} "
                        f"layers")
    n_head_kv = key(f, a + "attention.head_count_kv", int, default=n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {a}attention.head_count_kv = {n_head_kv} must be positive and divide "
                        f"head_count = {n_head}")
    head_k, head_v, n_rot = _head_sizes(f, a, n_embd, n_head, ARCHS[arch].hybrid)
    freq_scale, ext_factor, attn_factor = _rope_scaling(f, a)
    n_ctx_orig = key(f, a + "rope.scaling.original_context_length", int, default=n_ctx_train)
    if n_ctx_orig <= 0:
        raise GGUFError(f"{f.path}: {a}rope.scaling.original_context_length = {n_ctx_orig} must be positive")
    hp = LlamaHParams(
        arch=arch, n_vocab=_n_vocab(f, a), n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_head_k=head_k, n_embd_head_v=head_v,
        n_rot=n_rot,
        rope_freq_base=rope_freq_base(f, a + "rope.freq_base"),
        rope_freq_scale=freq_scale, rope_ext_factor=ext_factor, rope_attn_factor=attn_factor,
        n_ctx_orig_yarn=n_ctx_orig,
        f_norm_rms_eps=key(f, a + "attention.layer_norm_rms_epsilon", float),
        tie_word_embeddings=layout.tied_head(f),
        rope_freqs=ARCHS[arch].rope_freqs and "rope_freqs.weight" in f.tensors,
    )
    if ARCHS[arch].gemma:
        gemma3_hparams(f, a, hp)
    if ARCHS[arch].gpt_oss:
        gpt_oss_hparams(f, a, hp)
    if ARCHS[arch].hybrid:
        qwen35_hparams(f, a, hp)
    if ARCHS[arch].moe is not None:
        moe_hparams(f, a, hp)
    return hp

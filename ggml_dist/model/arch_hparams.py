"""The per-architecture part of loading hyperparameters (llama.cpp's load_arch_hparams): a mixture of
experts' keys (read, or refused by name where they ask for what the arch's graph does not do), Gemma 3's
and gpt-oss's sliding windows. hparams.hparams_from_gguf calls these after the keys every arch shares.
"""
from __future__ import annotations

import numpy as np

from .archs import EXPERT_GATING_NAMES, LlamaHParams
from .gguf import GGUFError, GGUFFile
from .gguf_keys import key, key_int_per_layer, rope_freq_base, short

# `{arch}.` keys of a mixture of experts that hparams_from_gguf reads (llama_model_base::load_hparams and the
# MoE archs' load_arch_hparams); a dense architecture refuses a non-zero expert_count by name
MOE_KEYS = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length",
                      "expert_shared_feed_forward_length", "expert_group_count", "expert_group_used_count",
                      "expert_weights_norm", "expert_weights_scale", "expert_gating_func",
                      "expert_shared_count"})


LLAMA_MAX_EXPERTS = 512             # llama.cpp's limit (llama-hparams.h)


def moe_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """load_hparams' expert keys and the MoE archs' load_arch_hparams: the expert count and top k, each
    expert's width, the shared expert's; the keys llama.cpp's graphs for these archs do not read
    (weights norm, scale, gating function: the graph passes literals) are accepted where they say what the
    graph does and refused by name where they ask for something else; grouped routing is refused."""
    spec = hp.spec
    moe = spec.moe
    assert moe is not None
    hp.n_expert = key_int_per_layer(f, a + "expert_count", hp.n_layer, default=0 if spec.moe_optional else None)
    hp.n_expert_used = key_int_per_layer(f, a + "expert_used_count", hp.n_layer, default=0)
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
    groups = key_int_per_layer(f, a + "expert_group_count", hp.n_layer, default=0)
    if groups > 1:
        raise GGUFError(f"{f.path}: {a}expert_group_count = {groups} (grouped expert routing, as DeepSeek V3's) "
                        f"is not implemented")
    if key_int_per_layer(f, a + "expert_group_used_count", hp.n_layer, default=0):
        raise GGUFError(f"{f.path}: {a}expert_group_used_count (grouped expert routing) is not implemented")
    if key_int_per_layer(f, a + "expert_shared_count", hp.n_layer, default=0) > (1 if moe.shared_expert else 0):
        raise GGUFError(f"{f.path}: {a}expert_shared_count: shared experts beyond the {hp.arch} graph's "
                        f"{int(moe.shared_expert)} are not implemented")
    if moe.n_ff_exp_key:
        hp.n_ff_exp = key_int_per_layer(f, a + "expert_feed_forward_length", hp.n_layer, default=0) or \
            hp.n_ff // hp.n_expert_used
    else:
        if a + "expert_feed_forward_length" in f.metadata:
            raise GGUFError(f"{f.path}: {a}expert_feed_forward_length: the {hp.arch} graph's experts are "
                            f"feed_forward_length wide; a separate expert width is not implemented")
        hp.n_ff_exp = hp.n_ff
    if hp.n_ff_exp <= 0:
        raise GGUFError(f"{f.path}: {a}expert_feed_forward_length must be positive")
    if moe.shared_expert:
        hp.n_ff_shexp = key_int_per_layer(f, a + "expert_shared_feed_forward_length", hp.n_layer, default=0) or hp.n_ff
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


def _check_moe_literal(f: GGUFFile, name: str, value: bool, arch: str) -> None:
    v = f.metadata.get(name, value)
    if v is not value:
        raise GGUFError(f"{f.path}: {name} = {v!r}: llama.cpp's {arch} graph uses {value}; the other choice is "
                        f"not implemented")


def gemma3_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """llama_model_gemma3::load_arch_hparams: the sliding window and its layers, the SWA rope base, the
    attention scale (1/sqrtf(head size), or 1/sqrtf(n_embd / n_head) for the 62-layer 27B)."""
    softcap = key(f, a + "final_logit_softcapping", float, default=0.0)
    if softcap != 0.0:
        raise GGUFError(f"{f.path}: {a}final_logit_softcapping = {softcap} (a tanh cap on the output "
                        f"logits) is not implemented")
    n_swa = key(f, a + "attention.sliding_window", int, default=0)
    if n_swa < 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window = {n_swa} must not be negative")
    if n_swa > 0:
        pat = f.metadata.get(a + "attention.sliding_window_pattern", 6)
        if isinstance(pat, bool) or not isinstance(pat, int) or pat <= 0:
            raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {short(pat)} is not supported "
                            f"(only a positive layer period is)")
        hp.n_swa = n_swa
        hp.swa_layers = tuple(il % pat < pat - 1 for il in range(hp.n_layer))   # set_swa_pattern
        hp.rope_freq_base_swa = rope_freq_base(f, a + "rope.freq_base_swa")
    elif a + "attention.sliding_window_pattern" in f.metadata or a + "rope.freq_base_swa" in f.metadata:
        raise GGUFError(f"{f.path}: a sliding-window pattern or rope base without {a}attention.sliding_window")
    d = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.n_embd_head_k
    hp.f_attention_scale = float(np.float32(1.0) / np.sqrt(np.float32(d)))


def gpt_oss_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """llama_model_openai_moe::load_arch_hparams: the sliding window (required), its layers
    (loadswa_pattern(ml, 2): il % 2 == 0 unless attention.sliding_window_pattern says otherwise), the SWA
    layers' rope base (rope.freq_base_swa, else the file's) at the same frequency scale."""
    hp.n_swa = key(f, a + "attention.sliding_window", int)
    if hp.n_swa <= 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window = {hp.n_swa} must be positive")
    hp.swa_layers = swa_pattern(f, a, hp.n_layer, 2)
    hp.rope_freq_base_swa = rope_freq_base(f, a + "rope.freq_base_swa") \
        if a + "rope.freq_base_swa" in f.metadata else hp.rope_freq_base
    hp.rope_freq_scale_swa = hp.rope_freq_scale


def swa_pattern(f: GGUFFile, a: str, n_layer: int, default: int) -> tuple[bool, ...]:
    """load_swa_pattern: attention.sliding_window_pattern is a layer period (il % n < n - 1 is SWA) or a
    bool per layer; absent, the architecture's period."""
    pat = f.metadata.get(a + "attention.sliding_window_pattern", default)
    if isinstance(pat, np.ndarray):
        pat = pat.tolist()
    if isinstance(pat, list):
        if len(pat) != n_layer or not all(isinstance(v, bool) for v in pat):
            raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {short(pat)}: expected "
                            f"{n_layer} booleans")
        return tuple(pat)
    if isinstance(pat, bool) or not isinstance(pat, int) or pat <= 0:
        raise GGUFError(f"{f.path}: {a}attention.sliding_window_pattern = {short(pat)} is not supported "
                        f"(a positive layer period or a bool per layer)")
    return tuple(il % pat < pat - 1 for il in range(n_layer))


# `{arch}.` keys of Qwen3.5's hybrid layers that qwen35_hparams reads
QWEN35_KEYS = frozenset({"rope.dimension_sections", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
                         "ssm.time_step_rank", "ssm.group_count", "full_attention_interval",
                         "attention.recurrent_layers", "nextn_predict_layers"})


def qwen35_hparams(f: GGUFFile, a: str, hp: LlamaHParams) -> None:
    """llama_model_qwen35(moe)::load_arch_hparams: the IMRoPE sections, the Gated DeltaNet sizes (a key
    and a value head are ssm.state_size wide; ssm.group_count key heads, ssm.time_step_rank value heads,
    ssm.inner_size = their product), and which layers are recurrent: attention.recurrent_layers, else
    every layer but each full_attention_interval-th (4 by default). The multi-token-prediction layers
    (nextn_predict_layers) are not built: a file with them is refused."""
    sections = f.metadata.get(a + "rope.dimension_sections")
    sections = sections.tolist() if isinstance(sections, np.ndarray) else sections
    if not isinstance(sections, list) or len(sections) != 4 or not all(isinstance(v, int) and v >= 0
                                                                       for v in sections):
        raise GGUFError(f"{f.path}: {a}rope.dimension_sections = {short(sections)}: expected 4 section sizes")
    if not 0 < sum(sections) <= hp.n_rot // 2:
        raise GGUFError(f"{f.path}: {a}rope.dimension_sections = {sections} must cover 1..n_rot/2 = "
                        f"{hp.n_rot // 2} pairs")
    hp.rope_sections = tuple(sections)
    hp.ssm_d_conv = key(f, a + "ssm.conv_kernel", int)
    hp.ssm_d_inner = key(f, a + "ssm.inner_size", int)
    hp.ssm_d_state = key(f, a + "ssm.state_size", int)
    hp.ssm_dt_rank = key(f, a + "ssm.time_step_rank", int)
    hp.ssm_n_group = key(f, a + "ssm.group_count", int)
    if min(hp.ssm_d_conv - 1, hp.ssm_d_state, hp.ssm_dt_rank, hp.ssm_n_group) <= 0 \
            or hp.ssm_dt_rank % hp.ssm_n_group or hp.ssm_d_inner != hp.ssm_d_state * hp.ssm_dt_rank:
        raise GGUFError(f"{f.path}: {a}ssm.* = conv_kernel {hp.ssm_d_conv}, state_size {hp.ssm_d_state}, "
                        f"time_step_rank {hp.ssm_dt_rank}, group_count {hp.ssm_n_group}, inner_size "
                        f"{hp.ssm_d_inner}: need conv_kernel >= 2, value heads a multiple of key heads and "
                        f"inner_size = state_size * time_step_rank")
    if key(f, a + "nextn_predict_layers", int, default=0):
        raise GGUFError(f"{f.path}: {a}nextn_predict_layers: multi-token prediction layers are not implemented")
    layers = f.metadata.get(a + "attention.recurrent_layers")
    if layers is not None:
        layers = layers.tolist() if isinstance(layers, np.ndarray) else layers
        if not isinstance(layers, list) or len(layers) != hp.n_layer or not all(isinstance(v, bool) for v in layers):
            raise GGUFError(f"{f.path}: {a}attention.recurrent_layers = {short(layers)}: expected "
                            f"{hp.n_layer} booleans")
        hp.recurrent_layers = tuple(layers)
        return
    interval = key(f, a + "full_attention_interval", int, default=4)
    if interval <= 0:
        raise GGUFError(f"{f.path}: {a}full_attention_interval = {interval} must be positive")
    hp.recurrent_layers = tuple((il + 1) % interval != 0 for il in range(hp.n_layer))

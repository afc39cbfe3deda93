"""Synthetic LLaMA / Qwen2 / Qwen3 GGUF files with random weights, written with the gguf package.

Used by tests (small shapes, every weight type), by the reference-data script (llama.cpp's logits on the
same files) and by benchmarks (a TinyLlama-shaped 1.1B model). Output is a pure function of the spec:
the same SyntheticSpec always gives the same bytes, so references stay valid across machines.
Block types gguf cannot quantize (the K-quants) get random blocks with sane scales directly.
Options beyond the plain llama shape: a head size other than n_embd / n_head (attention.key_length, as
Qwen3 has), and llama3 rope scaling (rope_freqs.weight, computed as llama.cpp's converter does).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gquants

from ..core.types import GGMLType
from .synthetic_hybrid import HYBRID_SHAPES, SyntheticHybridSpec, write_hybrid
from .synthetic_moe import MOE_SHAPES, SyntheticMoESpec, write_moe
from .synthetic_parts import random_kquant, spm_vocab


@dataclass(frozen=True)
class SyntheticSpec:
    arch: str = "llama"
    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 128
    n_ctx_train: int = 2048
    wtype: str = "Q8_0"          # type of the 2-d layer weights
    embd_type: str = "Q8_0"      # type of token_embd (and the tied head)
    tied: bool = True
    rope_freq_base: float = 10000.0
    seed: int = 0
    head_dim: int = 0            # attention.key_length/value_length; 0: n_embd / n_head, keys not written
    rope_scaling: str = ""       # "llama3": write rope_freqs.weight (Llama 3.1's factor 8, 1, 4, 8192)

    @property
    def name(self) -> str:
        tie = "tied" if self.tied else "untied"
        extra = (f"-hd{self.head_dim}" if self.head_dim else "") + \
            (f"-{self.rope_scaling}" if self.rope_scaling else "")
        return (f"{self.arch}-{self.wtype.lower()}-e{self.n_embd}-l{self.n_layer}-h{self.n_head}"
                f"-kv{self.n_head_kv}-{tie}-s{self.seed}{extra}")

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head


# fields added after references were stored: left out of general.synthetic_spec at their defaults, so
# the files of older specs keep their bytes
_LATER_FIELDS = ("head_dim", "rope_scaling")


def _spec_repr(s: SyntheticSpec) -> str:
    defaults = {f.name: f.default for f in fields(SyntheticSpec)}
    return repr({k: v for k, v in asdict(s).items() if k not in _LATER_FIELDS or v != defaults[k]})


def llama3_rope_factors(n_embd_head: int, base: float, factor: float = 8.0, low_freq_factor: float = 1.0,
                        high_freq_factor: float = 4.0, old_context_len: int = 8192) -> np.ndarray:
    """rope_freqs.weight for rope_type llama3, as convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors
    computes it: pairs whose wavelength is below old_context_len / high_freq_factor keep their frequency
    (1), those above old_context_len / low_freq_factor are slowed by `factor`, the ones between are
    blended. Torch float32 there, numpy float32 step by step here (an ulp apart at most; the file holds
    the result, so llama.cpp and ggml_dist read the same factors)."""
    f32 = np.float32
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, n_embd_head, 2, dtype=f32) / f32(n_embd_head)))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = f32(2 * math.pi) / freq
        if wavelen < high_freq_wavelen:
            out.append(f32(1))
        elif wavelen > low_freq_wavelen:
            out.append(f32(factor))
        else:
            smooth = (f32(old_context_len) / wavelen - f32(low_freq_factor)) / \
                f32(high_freq_factor - low_freq_factor)
            out.append(f32(1) / ((f32(1) - smooth) / f32(factor) + smooth))
    return np.array(out, np.float32)


def _weight(rng: np.random.Generator, type_name: str, rows: int, ne0: int, std: float):
    """(array, raw_dtype) for GGUFWriter.add_tensor: numpy shape is ne reversed."""
    t = GGMLType[type_name]
    x = (rng.standard_normal((rows, ne0)) * std).astype(np.float32)
    if t == GGMLType.F32:
        return x, None
    if t == GGMLType.F16:
        return x.astype(np.float16), None
    if t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):
        return random_kquant(rng, t, rows, ne0), GGMLQuantizationType(t.value)
    return gquants.quantize(x, GGMLQuantizationType(t.value)), GGMLQuantizationType(t.value)


def write_synthetic(path: str | Path,
                    spec: SyntheticSpec | SyntheticMoESpec | SyntheticHybridSpec = SyntheticSpec()) -> Path:
    """Write the model described by spec to path (overwriting); a mixture of experts: synthetic_moe's; a
    Qwen3.5 (hybrid) model: synthetic_hybrid's."""
    if isinstance(spec, SyntheticHybridSpec):
        return write_hybrid(path, spec)
    if not isinstance(spec, SyntheticSpec):
        return write_moe(path, spec)
    return _write_dense(path, spec)


def _write_dense(path: str | Path, s: SyntheticSpec) -> Path:
    if s.arch not in ("llama", "qwen2", "qwen3"):
        raise ValueError(f"synthetic models are llama, qwen2 or qwen3, not '{s.arch}'")
    if s.rope_scaling not in ("", "llama3") or (s.rope_scaling and s.arch != "llama"):
        raise ValueError(f"rope_scaling '{s.rope_scaling}': only llama3, on a llama model")
    rng = np.random.default_rng(s.seed)
    head_dim = s.n_embd_head
    q_out = head_dim * s.n_head
    n_kv = head_dim * s.n_head_kv
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(str(path), s.arch)
    w.add_name(f"synthetic {s.name}")
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    if s.head_dim:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.n_vocab)
    w.add_file_type(1)
    w.add_string("general.synthetic_spec", _spec_repr(s))
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

    def add(name: str, rows: int, ne0: int, type_name: str, std: float) -> None:
        arr, raw = _weight(rng, type_name, rows, ne0, std)
        w.add_tensor(name, arr, raw_dtype=raw)

    def add_norm(name: str, n: int = s.n_embd) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    std = 1.0 / np.sqrt(s.n_embd)
    if s.rope_scaling == "llama3":                    # the converter's extra tensors come first
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, s.rope_freq_base))
    add("token_embd.weight", s.n_vocab, s.n_embd, s.embd_type, 1.0)
    for il in range(s.n_layer):
        b = f"blk.{il}."
        add_norm(b + "attn_norm.weight")
        add(b + "attn_q.weight", q_out, s.n_embd, s.wtype, std)
        add(b + "attn_k.weight", n_kv, s.n_embd, s.wtype, std)
        add(b + "attn_v.weight", n_kv, s.n_embd, s.wtype, std)
        if s.arch == "qwen2":
            for nm, n in (("attn_q", q_out), ("attn_k", n_kv), ("attn_v", n_kv)):
                w.add_tensor(b + nm + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        if s.arch == "qwen3":
            add_norm(b + "attn_q_norm.weight", head_dim)
            add_norm(b + "attn_k_norm.weight", head_dim)
        add(b + "attn_output.weight", s.n_embd, q_out, s.wtype, 1.0 / np.sqrt(q_out))
        add_norm(b + "ffn_norm.weight")
        add(b + "ffn_gate.weight", s.n_ff, s.n_embd, s.wtype, std)
        add(b + "ffn_up.weight", s.n_ff, s.n_embd, s.wtype, std)
        add(b + "ffn_down.weight", s.n_embd, s.n_ff, s.wtype, 1.0 / np.sqrt(s.n_ff))
    add_norm("output_norm.weight")
    if not s.tied:
        add("output.weight", s.n_vocab, s.n_embd, s.wtype, std)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


TINYLLAMA_Q4_0 = SyntheticSpec(n_vocab=32000, n_embd=2048, n_layer=22, n_head=32, n_head_kv=4, n_ff=5632,
                               wtype="Q4_0", embd_type="Q4_0", tied=False, seed=11)
# LLaMA-2-7B's dimensions (no GQA), Q4_0 throughout: ~3.6 GiB, a model bigger than one testbed host
LLAMA2_7B_Q4_0 = SyntheticSpec(n_vocab=32000, n_embd=4096, n_layer=32, n_head=32, n_head_kv=32, n_ff=11008,
                               n_ctx_train=4096, wtype="Q4_0", embd_type="Q4_0", tied=False, seed=7)
# and the mixtures of experts' (synthetic_moe.MOE_SHAPES): Qwen3-30B-A3B and gpt-oss-20b with few layers; the
# hybrid models' (synthetic_hybrid.HYBRID_SHAPES): Qwen3.5-0.8B with few layers
SHAPES: dict[str, SyntheticSpec | SyntheticMoESpec | SyntheticHybridSpec] = {
    "tinyllama": TINYLLAMA_Q4_0, "llama2-7b": LLAMA2_7B_Q4_0, **MOE_SHAPES, **HYBRID_SHAPES}


def cached_synthetic(spec: SyntheticSpec | SyntheticMoESpec | SyntheticHybridSpec, force: bool = False) -> Path:
    """The model of `spec` in the user cache, written once (via a .part file, so a killed run never
    leaves a truncated file under the final name)."""
    from .pull import cache_dir
    path = cache_dir() / f"synthetic-{spec.name}.gguf"
    if force or not path.is_file():
        tmp = path.with_suffix(".gguf.part")
        write_synthetic(tmp, spec)
        tmp.replace(path)
    return path


def model_path(name: str) -> Path:
    """A synthetic shape's file (SHAPES, written once into the cache), else model.pull.resolve_model's
    path: what a benchmark's --model names."""
    from .pull import resolve_model
    return cached_synthetic(SHAPES[name]) if name in SHAPES else resolve_model(name)

"""Synthetic mixture-of-experts GGUF files (qwen3moe, qwen2moe, Mixtral-style llama, gpt-oss) with random
weights, laid out exactly as llama.cpp loads them (load_arch_hparams / load_arch_tensors of each model).

The companion of synthetic.py (dense llama / qwen2 / qwen3): tests use tiny shapes of every expert weight
type, tests/data/make_reference.py stores llama.cpp's logits and chosen experts on the same files, and
benchmarks use files of real models' shapes (MOE_SHAPES: Qwen3-30B-A3B and gpt-oss-20b with few layers).
Output is a pure function of the spec: the same SyntheticMoESpec always gives the same bytes. Files are
written tensor by tensor (and experts one at a time), so a multi-GB file never sits in memory.

What each architecture's file holds is what its load_arch_hparams / load_arch_tensors read (the keys and
tensors hparams.py, arch_hparams.py and tensors.py check): qwen3moe with q/k norms and renormalised
softmax gating; qwen2moe with Q/K/V biases, no renormalisation and a shared expert behind a sigmoid gate
(never tied); Mixtral-style llama, whose experts are feed_forward_length wide; gpt-oss with Q/K/V/O
biases, attention sinks, post_attention_norm before the experts, the router's and every expert's biases,
sliding-window layers il % 2 == 0, YaRN rope scaling, SWIGLU_OAI and softmax over the top-k logits (never
tied). The vocabulary is the small SPM one synthetic.py writes (llama.cpp accepts it for any arch; the real
gpt-oss tokenizer is GPT-2-style BPE with pre-tokenizer "gpt-4o", tested on its own).

Expert weights come in F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 (quantized by gguf.quants) and Q2_K ..
Q6_K (random blocks, as synthetic.py writes them); quantize="Q4_K_M" writes the model in F16 and has
llama.cpp's own llama_model_quantize make a real Q4_K_M mix of it (dev only: needs llama-cpp-python).
"""
from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gquants

from ..core.types import TYPE_TRAITS, GGMLType
from .synthetic_parts import random_kquant, spm_vocab

MOE_ARCHS = ("qwen3moe", "qwen2moe", "llama", "gpt-oss")
_KQUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
_DIRECT = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")

# per-arch defaults where a spec field is 0 (the real models': Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B,
# Mixtral-8x7B, gpt-oss-20b)
_RMS_EPS = {"qwen3moe": 1e-6, "qwen2moe": 1e-6, "llama": 1e-5, "gpt-oss": 1e-5}
_FREQ_BASE = {"qwen3moe": 1e6, "qwen2moe": 1e6, "llama": 1e6, "gpt-oss": 150000.0}
_CTX = {"qwen3moe": 40960, "qwen2moe": 8192, "llama": 32768, "gpt-oss": 131072}


@dataclass(frozen=True)
class SyntheticMoESpec:
    """A synthetic MoE model. (Not arch_hparams.MoESpec, which describes how an arch calls build_moe_ffn.)"""
    arch: str = "qwen3moe"       # qwen3moe, qwen2moe, llama (Mixtral-style), gpt-oss
    n_vocab: int = 512
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 0            # attention.key_length/value_length; 0: n_embd / n_head (gpt-oss: always written)
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 64           # an expert's width (llama: written as feed_forward_length)
    n_ff_shexp: int = 0          # qwen2moe's shared expert; 0: 2 * n_ff_exp
    n_ff: int = 0                # feed_forward_length where it is not the experts' width; 0: as the real files
    n_ctx_train: int = 0         # 0: the real model's
    wtype: str = "Q8_0"          # attention weights (and qwen2moe's shared expert)
    exp_type: str = "Q8_0"       # ffn_{gate,up,down}_exps
    down_type: str = ""          # ffn_down_exps where it differs from exp_type (a K-quant mix: Q6_K)
    embd_type: str = "Q8_0"      # token_embd (and output.weight, untied)
    tied: bool = True            # no output.weight (qwen3moe, llama only)
    rope_freq_base: float = 0.0  # 0: the real model's
    router_std: float = 1.0      # std of the router logits (ffn_gate_inp . normed x)
    exp_std: float = 1.0         # gate/up experts' output std (direct types; K-quant blocks have their own)
    n_swa: int = 0               # gpt-oss: attention.sliding_window; 0: 128
    yarn_factor: float = 32.0    # gpt-oss only: rope.scaling.factor (type yarn), as gpt-oss-20b
    yarn_orig_ctx: int = 4096    # gpt-oss only: rope.scaling.original_context_length
    quantize: str = ""           # "Q4_K_M": write F16, then llama.cpp's llama_model_quantize (needs llama_cpp)
    seed: int = 0

    def __post_init__(self) -> None:
        a = self.arch
        if a not in MOE_ARCHS:
            raise ValueError(f"synthetic MoE models are {', '.join(MOE_ARCHS)}, not '{a}'")
        for f, t in (("wtype", self.wtype), ("exp_type", self.exp_type), ("embd_type", self.embd_type),
                     ("down_type", self.down_type or self.exp_type)):
            if t not in _DIRECT + _KQUANTS:
                raise ValueError(f"{f} {t}: not a type the writer makes")
        if self.tied and a in ("qwen2moe", "gpt-oss"):
            raise ValueError(f"{a}: llama.cpp requires output.weight (tied=False)")
        if a == "qwen2moe" and self.head_dim and self.head_dim * self.n_head != self.n_embd:
            raise ValueError("qwen2moe: attn_q is [n_embd, n_embd], so the head size is n_embd / n_head")
        if not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"expert_used_count {self.n_expert_used} must be in 1..{self.n_expert}")
        if self.quantize not in ("", "Q4_K_M"):
            raise ValueError(f"quantize '{self.quantize}': only Q4_K_M")
        if self.n_head % self.n_head_kv or (not self.head_dim and self.n_embd % self.n_head):
            raise ValueError("head counts do not divide")

    @property
    def name(self) -> str:
        """The main shape fields, then every other field that is not at its default."""
        hd = f"-hd{self.head_dim}" if self.head_dim else ""
        typ = self.quantize.lower() if self.quantize else self.exp_type.lower()
        core = {"arch", "n_embd", "n_layer", "n_head", "n_head_kv", "head_dim", "n_expert", "n_expert_used",
                "n_ff_exp", "n_vocab", "tied", "seed", "quantize", "exp_type"}
        extra = "".join(f"-{f.name}{getattr(self, f.name)}" for f in fields(self)
                        if f.name not in core and getattr(self, f.name) != f.default)
        return (f"{self.arch}-{typ}-e{self.n_embd}-l{self.n_layer}-h{self.n_head}-kv{self.n_head_kv}{hd}"
                f"-x{self.n_expert}k{self.n_expert_used}-f{self.n_ff_exp}-v{self.n_vocab}"
                f"-{'tied' if self.tied else 'untied'}-s{self.seed}{extra}")

    @property
    def n_embd_head(self) -> int:
        return self.head_dim or self.n_embd // self.n_head

    @property
    def ff_shexp(self) -> int:
        return self.n_ff_shexp or 2 * self.n_ff_exp

    @property
    def swa(self) -> int:
        return self.n_swa or 128

    def swa_layers(self) -> list[bool]:
        """gpt-oss: llama.cpp's load_swa_pattern(ml, 2) (dense_first false): layer il slides iff il % 2 < 1."""
        return [self.arch == "gpt-oss" and il % 2 < 1 for il in range(self.n_layer)]


# fields added after references were stored go here: left out of general.synthetic_spec at their defaults,
# so the files of older specs keep their bytes (and the sha256 that tests/model/test_moe_refs.py fixes)
_LATER_FIELDS: tuple[str, ...] = ()


def _spec_repr(s: SyntheticMoESpec) -> str:
    defaults = {f.name: f.default for f in fields(SyntheticMoESpec)}
    return repr({"kind": "moe", **{k: v for k, v in asdict(s).items()
                                   if k not in _LATER_FIELDS or v != defaults[k]}})


# -- tensor data ----------------------------------------------------------------------------------
def _row_bytes(type_name: str, ne0: int) -> int:
    tt = TYPE_TRAITS[GGMLType[type_name]]
    if ne0 % tt.blck_size:
        raise ValueError(f"{type_name}: row of {ne0} is not a multiple of its block ({tt.blck_size})")
    return ne0 // tt.blck_size * tt.type_size


def _matrix(rng: np.random.Generator, type_name: str, rows: int, ne0: int, std: float) -> np.ndarray:
    """rows x ne0 weights of the type, as the bytes / floats GGUFWriter writes (numpy shape: ne reversed)."""
    t = GGMLType[type_name]
    if type_name in _KQUANTS:
        return random_kquant(rng, t, rows, ne0)
    x = rng.standard_normal((rows, ne0), dtype=np.float32) * np.float32(std)
    if type_name == "F32":
        return x
    if type_name == "F16":
        return x.astype(np.float16)
    return gquants.quantize(x, GGMLQuantizationType(t.value))


@dataclass
class _Tensor:
    name: str
    ne: tuple[int, ...]                    # ggml order
    type_name: str
    chunks: Callable[[np.random.Generator], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return _row_bytes(self.type_name, self.ne[0]) * math.prod(self.ne[1:])


def _plan(s: SyntheticMoESpec) -> list[_Tensor]:
    """Every tensor of the file in write order, each with the generator of its data (drawn in this order
    from one numpy Generator seeded with spec.seed)."""
    a = s.arch
    E, k_hd = s.n_embd, s.n_embd_head
    q_out, kv_out = k_hd * s.n_head, k_hd * s.n_head_kv
    out: list[_Tensor] = []
    f32 = np.float32

    def mat(name: str, ne0: int, ne1: int, type_name: str, std: float, ne2: int = 0) -> None:
        """A 2-d weight [ne0, ne1], or ne2 experts of them (one chunk per expert; large 2-d ones in row
        chunks). ne0 is the input width."""
        step = max(1, (1 << 22) // max(1, ne0))                     # ~4M elements a chunk

        def gen(rng: np.random.Generator) -> Iterator[np.ndarray]:
            for _ in range(max(1, ne2)):
                for r0 in range(0, ne1, step):
                    yield _matrix(rng, type_name, min(step, ne1 - r0), ne0, std)
        out.append(_Tensor(name, (ne0, ne1, ne2) if ne2 else (ne0, ne1), type_name, gen))

    def vec(name: str, ne: tuple[int, ...], mean: float, std: float) -> None:
        n = math.prod(ne)

        def gen(rng: np.random.Generator) -> Iterator[np.ndarray]:
            yield (f32(mean) + f32(std) * rng.standard_normal(n, dtype=f32)).astype(f32)
        out.append(_Tensor(name, ne, "F32", gen))

    mat("token_embd.weight", E, s.n_vocab, s.embd_type, 1.0)
    for il in range(s.n_layer):
        b = f"blk.{il}."
        vec(b + "attn_norm.weight", (E,), 1.0, 0.1)
        mat(b + "attn_q.weight", E, q_out, s.wtype, 1 / math.sqrt(E))
        mat(b + "attn_k.weight", E, kv_out, s.wtype, 1 / math.sqrt(E))
        mat(b + "attn_v.weight", E, kv_out, s.wtype, 1 / math.sqrt(E))
        if a in ("qwen2moe", "gpt-oss"):
            vec(b + "attn_q.bias", (q_out,), 0.0, 0.1)
            vec(b + "attn_k.bias", (kv_out,), 0.0, 0.1)
            vec(b + "attn_v.bias", (kv_out,), 0.0, 0.1)
        if a == "qwen3moe":
            vec(b + "attn_q_norm.weight", (k_hd,), 1.0, 0.1)
            vec(b + "attn_k_norm.weight", (k_hd,), 1.0, 0.1)
        mat(b + "attn_output.weight", q_out, E, s.wtype, 1 / math.sqrt(q_out))
        if a == "gpt-oss":
            vec(b + "attn_output.bias", (E,), 0.0, 0.1)
            vec(b + "attn_sinks.weight", (s.n_head,), 0.0, 1.0)
            vec(b + "post_attention_norm.weight", (E,), 1.0, 0.1)
        else:
            vec(b + "ffn_norm.weight", (E,), 1.0, 0.1)
        mat(b + "ffn_gate_inp.weight", E, s.n_expert, "F32", s.router_std / math.sqrt(E))
        if a == "gpt-oss":
            vec(b + "ffn_gate_inp.bias", (s.n_expert,), 0.0, 0.1 * s.router_std)
        F, X = s.n_ff_exp, s.n_expert
        mat(b + "ffn_gate_exps.weight", E, F, s.exp_type, s.exp_std / math.sqrt(E), X)
        mat(b + "ffn_up_exps.weight", E, F, s.exp_type, s.exp_std / math.sqrt(E), X)
        mat(b + "ffn_down_exps.weight", F, E, s.down_type or s.exp_type, 1 / math.sqrt(F), X)
        if a == "gpt-oss":
            vec(b + "ffn_gate_exps.bias", (F, X), 0.0, 0.1 * s.exp_std)
            vec(b + "ffn_up_exps.bias", (F, X), 0.0, 0.1 * s.exp_std)
            vec(b + "ffn_down_exps.bias", (E, X), 0.0, 0.1)
        if a == "qwen2moe":
            S = s.ff_shexp
            vec(b + "ffn_gate_inp_shexp.weight", (E,), 0.0, 1 / math.sqrt(E))
            mat(b + "ffn_gate_shexp.weight", E, S, s.wtype, 1 / math.sqrt(E))
            mat(b + "ffn_up_shexp.weight", E, S, s.wtype, 1 / math.sqrt(E))
            mat(b + "ffn_down_shexp.weight", S, E, s.wtype, 1 / math.sqrt(S))
    vec("output_norm.weight", (E,), 1.0, 0.1)
    if not s.tied:
        mat("output.weight", E, s.n_vocab, s.embd_type, 1 / math.sqrt(E))
    return out


def tensor_types(spec: SyntheticMoESpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (ne, type) of every tensor the file holds (before any llama.cpp quantization)."""
    return {t.name: (t.ne, t.type_name) for t in _plan(spec)}


def moe_nbytes(spec: SyntheticMoESpec) -> int:
    """Bytes of tensor data the file holds (the header adds a few hundred KB for the vocabulary). For a
    quantize="Q4_K_M" spec, the size of the F16 file it is quantized from."""
    if spec.quantize:
        spec = _f16_of(spec)
    return sum(GGUFWriter.ggml_pad(t.nbytes, 32) for t in _plan(spec))


# -- the file -----------------------------------------------------------------------------------------
def _write_kv(w: GGUFWriter, s: SyntheticMoESpec, spec_repr: str) -> None:
    a = s.arch
    w.add_name(f"synthetic {s.name}")
    w.add_context_length(s.n_ctx_train or _CTX[a])
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    if s.n_ff:
        n_ff = s.n_ff
    elif a == "qwen3moe":
        n_ff = s.n_ff_exp * s.n_expert_used     # Qwen3-30B-A3B: 6144 = 768 * 8 (never read: the key below is)
    elif a == "qwen2moe":
        n_ff = s.ff_shexp                        # Qwen1.5-MoE: intermediate_size = the shared expert's
    else:
        n_ff = s.n_ff_exp                        # llama: the experts' width; gpt-oss: intermediate_size
    w.add_feed_forward_length(n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(s.n_embd_head)
    if s.head_dim or a == "gpt-oss":
        w.add_key_length(s.n_embd_head)
        w.add_value_length(s.n_embd_head)
    w.add_rope_freq_base(s.rope_freq_base or _FREQ_BASE[a])
    w.add_layer_norm_rms_eps(_RMS_EPS[a])
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    if a != "llama":
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if a == "qwen2moe":
        w.add_expert_shared_feed_forward_length(s.ff_shexp)
    if a == "gpt-oss":
        w.add_sliding_window(s.swa)
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_rope_scaling_factor(s.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    w.add_vocab_size(s.n_vocab)
    w.add_file_type(1)
    w.add_string("general.synthetic_spec", spec_repr)
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


def _write_direct(path: Path, s: SyntheticMoESpec, spec_repr: str) -> None:
    plan = _plan(s)
    w = GGUFWriter(str(path), s.arch)
    _write_kv(w, s, spec_repr)
    for t in plan:
        n_rows = math.prod(t.ne[1:])
        if t.type_name in ("F32", "F16"):
            w.add_tensor_info(t.name, tuple(reversed(t.ne)), np.dtype(np.float32 if t.type_name == "F32"
                                                                      else np.float16), t.nbytes)
        else:
            w.add_tensor_info(t.name, (*reversed(t.ne[1:]), _row_bytes(t.type_name, t.ne[0])), np.dtype(np.uint8),
                              t.nbytes, raw_dtype=GGMLQuantizationType(GGMLType[t.type_name].value))
        assert n_rows > 0
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fout = w.fout[0]
    rng = np.random.default_rng(s.seed)
    for t in plan:
        w.write_padding(fout, fout.tell())
        n = 0
        for chunk in t.chunks(rng):
            data = np.ascontiguousarray(chunk)
            data.tofile(fout)
            n += data.nbytes
        assert n == t.nbytes, f"{t.name}: wrote {n} bytes, expected {t.nbytes}"
        w.write_padding(fout, n)
    w.close()


def _f16_of(s: SyntheticMoESpec) -> SyntheticMoESpec:
    return replace(s, quantize="", wtype="F16", exp_type="F16", down_type="", embd_type="F16")


def quantize_with_llama_cpp(src: Path, dst: Path, ftype: str = "Q4_K_M", nthread: int = 2) -> None:
    """llama.cpp's llama_model_quantize (through llama-cpp-python): src (F16) to dst in the ftype's mix
    (Q4_K_M: Q4_K, with Q6_K for some ffn_down / attn_v and the output, Q5_K attn_output and Q8_0 attn_k /
    attn_v for 8-expert models; rows not a multiple of 256 fall back to Q5_0 / Q8_0). Dev only."""
    import llama_cpp
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = nthread
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), p)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {ftype}) failed: {rc}")


def write_moe(path: str | Path, spec: SyntheticMoESpec = SyntheticMoESpec()) -> Path:
    """Write the model described by spec to path (overwriting) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not spec.quantize:
        _write_direct(path, spec, _spec_repr(spec))
        return path
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        f16 = Path(tmp) / "f16.gguf"
        _write_direct(f16, _f16_of(spec), _spec_repr(spec))    # the F16 file names the spec it becomes
        quantize_with_llama_cpp(f16, path, spec.quantize, nthread=min(8, os.cpu_count() or 1))
    return path


# -- real models' shapes, for benchmarks ----------------------------------------------------------------
def qwen3_30b_a3b(n_layer: int = 4, exp_type: str = "Q4_0", n_vocab: int = 32000) -> SyntheticMoESpec:
    """Qwen3-30B-A3B's shapes (n_embd 2048, 32 heads / 4 KV heads of 128, 128 experts top-8 of width 768,
    rms eps 1e-6, rope base 1e6, untied) with n_layer of its 48 layers. The vocabulary is 32000, not
    151936: with few layers the 151936-row output matmul (311M MACs a token) would outweigh the layers
    (each ~38M expert + ~19M attention MACs a token)."""
    return SyntheticMoESpec(arch="qwen3moe", n_vocab=n_vocab, n_embd=2048, n_layer=n_layer, n_head=32,
                            n_head_kv=4, head_dim=128, n_expert=128, n_expert_used=8, n_ff_exp=768,
                            wtype="Q8_0", exp_type=exp_type, embd_type="Q8_0" if exp_type == "Q8_0" else "Q4_0",
                            tied=False, seed=30)


def gpt_oss_20b(n_layer: int = 4, n_vocab: int = 32000) -> SyntheticMoESpec:
    """gpt-oss-20b's shapes (n_embd 2880, 64 heads / 8 KV heads of 64, 32 experts top-4 of width 2880 in
    MXFP4, sliding window 128 on even layers, yarn factor 32 from 4096, rope base 150000) with n_layer of
    its 24 layers; vocabulary 32000 (not 201088, see qwen3_30b_a3b)."""
    return SyntheticMoESpec(arch="gpt-oss", n_vocab=n_vocab, n_embd=2880, n_layer=n_layer, n_head=64,
                            n_head_kv=8, head_dim=64, n_expert=32, n_expert_used=4, n_ff_exp=2880,
                            wtype="Q8_0", exp_type="MXFP4", embd_type="Q8_0", tied=False, n_swa=128, seed=20)


# registered in synthetic.SHAPES (benchmarks/make_synthetic.py --shape, bench cluster model names)
MOE_SHAPES: dict[str, SyntheticMoESpec] = {
    "qwen3-30b-a3b": qwen3_30b_a3b(4, "Q4_0"),
    "qwen3-30b-a3b-q4_k": qwen3_30b_a3b(4, "Q4_K"),
    "qwen3-30b-a3b-16l": qwen3_30b_a3b(16, "Q4_0"),
    "gpt-oss-20b": gpt_oss_20b(4),
}

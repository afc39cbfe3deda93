"""Synthetic LLaMA / Qwen2 GGUF files with random weights, written with the gguf package.

Used by tests (small shapes, every weight type), by the reference-data script (llama.cpp's logits on the
same files) and by benchmarks (a TinyLlama-shaped 1.1B model). Output is a pure function of the spec:
the same SyntheticSpec always gives the same bytes, so references stay valid across machines.
Block types gguf cannot quantize (the K-quants) get random blocks with sane scales directly.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType
from gguf import quants as gquants

from ..core.types import GGMLType, TYPE_TRAITS


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

    @property
    def name(self) -> str:
        tie = "tied" if self.tied else "untied"
        return (f"{self.arch}-{self.wtype.lower()}-e{self.n_embd}-l{self.n_layer}-h{self.n_head}"
                f"-kv{self.n_head_kv}-{tie}-s{self.seed}")


def _spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then filler pieces: a valid SPM vocabulary of any size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256          # UNKNOWN, CONTROL, CONTROL, BYTE
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        piece = "\u2581" + letters[i % 26] + (letters[(i // 26) % 26] if i >= 26 else "") + \
            (str(i // 676) if i >= 676 else "")
        tokens.append(piece)
        types.append(1)
        i += 1
    scores = [0.0] * 259 + [-float(j) for j in range(len(tokens) - 259)]
    return tokens[:n_vocab], scores[:n_vocab], types[:n_vocab]


def _random_kquant(rng: np.random.Generator, t: GGMLType, rows: int, ne0: int) -> np.ndarray:
    """Random K-quant blocks whose f16 super-block scales keep weights around +-0.1."""
    tt = TYPE_TRAITS[t]
    nb = ne0 // tt.blck_size
    blocks = rng.integers(0, 256, size=(rows, nb, tt.type_size), dtype=np.uint8)
    d = np.full((rows, nb), 1e-4, np.float16).view(np.uint8).reshape(rows, nb, 2)
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):          # d, dmin lead the block
        blocks[..., 0:2] = d
        blocks[..., 2:4] = d
    elif t == GGMLType.Q6_K:                          # d trails; int8 scales before it
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 2e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    elif t == GGMLType.Q2_K:                          # d, dmin trail
        blocks[..., tt.type_size - 4: tt.type_size - 2] = np.full((rows, nb), 5e-3, np.float16) \
            .view(np.uint8).reshape(rows, nb, 2)
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 5e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    elif t == GGMLType.Q3_K:                          # d trails
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 5e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    else:
        raise ValueError(f"no random-block writer for {t.name}")
    return blocks.reshape(rows, nb * tt.type_size)


def _weight(rng: np.random.Generator, type_name: str, rows: int, ne0: int, std: float):
    """(array, raw_dtype) for GGUFWriter.add_tensor: numpy shape is ne reversed."""
    t = GGMLType[type_name]
    x = (rng.standard_normal((rows, ne0)) * std).astype(np.float32)
    if t == GGMLType.F32:
        return x, None
    if t == GGMLType.F16:
        return x.astype(np.float16), None
    if t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K):
        return _random_kquant(rng, t, rows, ne0), GGMLQuantizationType(t.value)
    return gquants.quantize(x, GGMLQuantizationType(t.value)), GGMLQuantizationType(t.value)


def write_synthetic(path: str | Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Write the model described by spec to path (overwriting) and return the path."""
    s = spec
    if s.arch not in ("llama", "qwen2"):
        raise ValueError(f"synthetic models are llama or qwen2, not '{s.arch}'")
    rng = np.random.default_rng(s.seed)
    head_dim = s.n_embd // s.n_head
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
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.n_vocab)
    w.add_file_type(1)
    w.add_string("general.synthetic_spec", repr(asdict(s)))
    tokens, scores, types = _spm_vocab(s.n_vocab)
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

    def add_norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(s.n_embd)).astype(np.float32))

    std = 1.0 / np.sqrt(s.n_embd)
    add("token_embd.weight", s.n_vocab, s.n_embd, s.embd_type, 1.0)
    for il in range(s.n_layer):
        b = f"blk.{il}."
        add_norm(b + "attn_norm.weight")
        add(b + "attn_q.weight", s.n_embd, s.n_embd, s.wtype, std)
        add(b + "attn_k.weight", n_kv, s.n_embd, s.wtype, std)
        add(b + "attn_v.weight", n_kv, s.n_embd, s.wtype, std)
        if s.arch == "qwen2":
            for nm, n in (("attn_q", s.n_embd), ("attn_k", n_kv), ("attn_v", n_kv)):
                w.add_tensor(b + nm + ".bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        add(b + "attn_output.weight", s.n_embd, s.n_embd, s.wtype, std)
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


def cached_synthetic(spec: SyntheticSpec, force: bool = False) -> Path:
    """The model of `spec` in the user cache, written once (via a .part file, so a killed run never
    leaves a truncated file under the final name)."""
    from .pull import cache_dir
    path = cache_dir() / f"synthetic-{spec.name}.gguf"
    if force or not path.is_file():
        tmp = path.with_suffix(".gguf.part")
        write_synthetic(tmp, spec)
        tmp.replace(path)
    return path

"""Model hyperparameters from GGUF metadata, and a check that the tensors match them (llama, qwen2).

Mirrors llama_model::load_hparams and the tensor-creation checks of llama_model::load_tensors: keys are
`{arch}.*`, and every tensor the graph builder will use is checked for presence and shape up front, so a
bad file fails at load time with a message naming the tensor instead of deep inside a graph.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ggml_dist.core.types import TYPE_TRAITS, GGMLType
from ggml_dist.model.gguf import GGUFError, GGUFFile

SUPPORTED_ARCHS = ("llama", "qwen2")
LLAMA_MAX_LAYERS = 512      # llama.cpp's limit; also bounds the work check_tensors does per layer


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
    n_rot: int                  # rope.dimension_count, default n_embd_head_k
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0    # 1 / rope.scaling.factor for linear scaling
    f_norm_rms_eps: float = 1e-5
    tie_word_embeddings: bool = False   # no output.weight: the output projection reuses token_embd
    use_qkv_bias: bool = False          # qwen2: attn_q/k/v have biases

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
    raise GGUFError(f"{f.path}: metadata key '{key}' has value {v!r} ({type(v).__name__}), "
                    f"expected {kind.__name__}")


def hparams_from_gguf(f: GGUFFile) -> LlamaHParams:
    arch = _key(f, "general.architecture", str)
    if arch not in SUPPORTED_ARCHS:
        raise GGUFError(f"{f.path}: unknown or unsupported architecture '{arch}'; "
                        f"supported: {', '.join(SUPPORTED_ARCHS)}")
    a = arch + "."
    n_embd = _key(f, a + "embedding_length", int)
    n_head = _key(f, a + "attention.head_count", int)
    n_layer = _key(f, a + "block_count", int)
    n_ff = _key(f, a + "feed_forward_length", int)
    n_ctx_train = _key(f, a + "context_length", int)
    for k, v in (("embedding_length", n_embd), ("attention.head_count", n_head), ("block_count", n_layer),
                 ("feed_forward_length", n_ff), ("context_length", n_ctx_train)):
        if v <= 0:
            raise GGUFError(f"{f.path}: {a}{k} = {v} must be positive")
    if n_layer > LLAMA_MAX_LAYERS:
        raise GGUFError(f"{f.path}: {a}block_count = {n_layer} exceeds the maximum of {LLAMA_MAX_LAYERS} "
                        f"layers")
    n_head_kv = _key(f, a + "attention.head_count_kv", int, default=n_head)
    if n_head_kv <= 0 or n_head % n_head_kv:
        raise GGUFError(f"{f.path}: {a}attention.head_count_kv = {n_head_kv} must be positive and divide "
                        f"head_count = {n_head}")
    if n_embd % n_head and (a + "attention.key_length") not in f.metadata:
        raise GGUFError(f"{f.path}: embedding_length {n_embd} is not a multiple of head_count {n_head}")
    n_embd_head_k = _key(f, a + "attention.key_length", int, default=n_embd // n_head)
    n_embd_head_v = _key(f, a + "attention.value_length", int, default=n_embd // n_head)
    n_rot = _key(f, a + "rope.dimension_count", int, default=n_embd_head_k)
    if not 0 < n_rot <= n_embd_head_k or n_rot % 2:
        raise GGUFError(f"{f.path}: {a}rope.dimension_count = {n_rot} must be even and in "
                        f"1..{n_embd_head_k} (head size)")

    if a + "vocab_size" in f.metadata:
        n_vocab = _key(f, a + "vocab_size", int)
    elif "tokenizer.ggml.tokens" in f.metadata:
        n_vocab = len(f.metadata["tokenizer.ggml.tokens"])
    elif "token_embd.weight" in f.tensors:
        n_vocab = f.tensors["token_embd.weight"].ne[1]
    else:
        raise GGUFError(f"{f.path}: cannot tell the vocabulary size (no {a}vocab_size, no tokens)")

    freq_scale = 1.0
    scaling = _key(f, a + "rope.scaling.type", str, default="none", required=False)
    factor = _key(f, a + "rope.scaling.factor", float, default=0.0, required=False)
    if scaling == "linear" and factor:
        freq_scale = 1.0 / factor
    elif scaling not in ("none", "linear"):
        raise GGUFError(f"{f.path}: {a}rope.scaling.type '{scaling}' is not supported (none, linear)")

    return LlamaHParams(
        arch=arch, n_vocab=n_vocab, n_ctx_train=n_ctx_train, n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, n_head_kv=n_head_kv, n_ff=n_ff, n_embd_head_k=n_embd_head_k,
        n_embd_head_v=n_embd_head_v, n_rot=n_rot,
        rope_freq_base=_key(f, a + "rope.freq_base", float, default=10000.0),
        rope_freq_scale=freq_scale,
        f_norm_rms_eps=_key(f, a + "attention.layer_norm_rms_epsilon", float, default=1e-5),
        tie_word_embeddings="output.weight" not in f.tensors,
        use_qkv_bias=arch == "qwen2",
    )


def expected_tensors(hp: LlamaHParams) -> dict[str, tuple[int, ...]]:
    """Tensor name -> ne (ggml order, unpadded) that the graph builder needs."""
    n_embd, n_vocab = hp.n_embd, hp.n_vocab
    q_out = hp.n_embd_head_k * hp.n_head
    v_out = hp.n_embd_head_v * hp.n_head
    want: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (n_embd, n_vocab),
        "output_norm.weight": (n_embd,),
    }
    if not hp.tie_word_embeddings:
        want["output.weight"] = (n_embd, n_vocab)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        want[b + "attn_norm.weight"] = (n_embd,)
        want[b + "attn_q.weight"] = (n_embd, q_out)
        want[b + "attn_k.weight"] = (n_embd, hp.n_embd_k_gqa)
        want[b + "attn_v.weight"] = (n_embd, hp.n_embd_v_gqa)
        want[b + "attn_output.weight"] = (v_out, n_embd)
        if hp.use_qkv_bias:
            want[b + "attn_q.bias"] = (q_out,)
            want[b + "attn_k.bias"] = (hp.n_embd_k_gqa,)
            want[b + "attn_v.bias"] = (hp.n_embd_v_gqa,)
        want[b + "ffn_norm.weight"] = (n_embd,)
        want[b + "ffn_gate.weight"] = (n_embd, hp.n_ff)
        want[b + "ffn_up.weight"] = (n_embd, hp.n_ff)
        want[b + "ffn_down.weight"] = (hp.n_ff, n_embd)
    return want


def check_tensors(f: GGUFFile, hp: LlamaHParams,
                  supported_types: Collection[GGMLType] | None = None) -> None:
    """Every tensor the model needs exists with the expected shape and a supported type."""
    for name, shape in expected_tensors(hp).items():
        ti = f.tensors.get(name)
        if ti is None:
            raise GGUFError(f"{f.path}: missing tensor '{name}' (expected ne={list(shape)})")
        want = shape + (1,) * (4 - len(shape))
        if ti.ne != want:
            raise GGUFError(f"{f.path}: tensor '{name}' has ne={list(ti.ne)}, expected {list(want)}")
        ok = ti.type in TYPE_TRAITS if supported_types is None else ti.type in supported_types
        if not ok:
            raise GGUFError(f"{f.path}: tensor '{name}' has unsupported type {ti.type.name}")

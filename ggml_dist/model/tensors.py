"""Which tensors each architecture's graph reads, and the check that a file holds exactly those, with the
shapes and types the CPU kernels compute (llama_model_loader's create_tensor and its "wrong number of
tensors"): a bad file fails at load time with the tensor named, not deep inside a graph, and a file with a
tensor the graph would skip is refused rather than run with it ignored.
"""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from ggml_dist.backends.host import MUL_MAT_TYPES as HOST_MUL_MAT_TYPES
from ggml_dist.core.types import TYPE_TRAITS, GGMLType, is_quantized
from ggml_dist.model.gguf import GGUFError, GGUFFile

if TYPE_CHECKING:
    from ggml_dist.model.archs import LlamaHParams

# tensors llama.cpp loads for an architecture but never reads when it computes logits (each says why)
KNOWN_UNUSED_TENSORS: dict[str, frozenset[str]] = {
    "qwen3": frozenset({"cls.output.weight"}),   # a reranker's head: read only by rank pooling, and a
                                                 # qwen3.pooling_type other than none is refused
}



# the weight types the CPU kernels compute for the op that reads a weight: a type with a block layout but
# no kernel (IQ*, MXFP4, Q8_1, the integers, F64 as a matmul weight) would otherwise load and fail deep in
# the first forward pass
MUL_MAT_TYPES = HOST_MUL_MAT_TYPES                       # the host backend's MUL_MAT: every 2-d weight
GET_ROWS_TYPES = MUL_MAT_TYPES | {GGMLType.Q8_K}        # backends/cpu/quants.py dequantize: token_embd


def _op_types(name: str, shape: tuple[int, ...],
              hp: LlamaHParams) -> tuple[str, Collection[GGMLType] | None]:
    """The op that reads weight `name` and the types it computes; None for the norms and biases, which
    MUL and ADD read in any type that is not quantized (cpu_supports_op)."""
    if name.endswith("ssm_conv1d.weight"):
        return "SSM_CONV", frozenset({GGMLType.F32})     # the conv's taps, read as f32
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
        if spec.hybrid:
            want.update(_hybrid_layer_tensors(hp, b, hp.is_recurrent(i)))
            continue
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


def _hybrid_layer_tensors(hp: LlamaHParams, b: str, recurrent: bool) -> dict[str, tuple[int, ...]]:
    """A Qwen3.5 layer (load_arch_tensors): the norms before and after its mixer, a Gated DeltaNet
    (recurrent) or gated attention (Wq twice as wide: each head's query and its gate), then the FFN."""
    n_embd, S, H_v = hp.n_embd, hp.ssm_d_state, hp.ssm_dt_rank
    want: dict[str, tuple[int, ...]] = {b + "attn_norm.weight": (n_embd,), b + "post_attention_norm.weight": (n_embd,)}
    if recurrent:
        conv_dim = 2 * S * hp.ssm_n_group + S * H_v
        want.update({b + "attn_qkv.weight": (n_embd, conv_dim), b + "attn_gate.weight": (n_embd, S * H_v),
                     b + "ssm_conv1d.weight": (hp.ssm_d_conv, conv_dim), b + "ssm_dt.bias": (H_v,),
                     b + "ssm_a": (H_v,), b + "ssm_beta.weight": (n_embd, H_v),
                     b + "ssm_alpha.weight": (n_embd, H_v), b + "ssm_norm.weight": (S,),
                     b + "ssm_out.weight": (S * H_v, n_embd)})
    else:
        hd = hp.n_embd_head_k
        want.update({b + "attn_q.weight": (n_embd, 2 * hd * hp.n_head), b + "attn_k.weight": (n_embd, hp.n_embd_k_gqa),
                     b + "attn_v.weight": (n_embd, hp.n_embd_v_gqa), b + "attn_output.weight": (hd * hp.n_head, n_embd),
                     b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)})
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

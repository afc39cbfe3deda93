"""The LLaMA / Qwen2 graph, as llama.cpp builds it (src/models/llama.cpp, qwen2.cpp; ggml-numerics.md §3),
and LlamaGraphBuilder, which builds each LLaMA-family architecture's graph by its own builder.

    h = get_rows(tok_embd, tokens)
    per layer:  h = h + Wo · attn(rope(Wq·n(h) [+ bq]), rope(Wk·n(h) [+ bk]), Wv·n(h) [+ bv])
                h = h + Wdown · swiglu(Wgate·n(h), Wup·n(h))
    logits = Wout · n(h)            (Wout = tok_embd when the output weight is tied)

rope divides each pair's angle by rope_freqs.weight where the file has one (llama3 rope scaling, every
Llama 3.1/3.2 file); the biases are Qwen2's.
"""
from __future__ import annotations

from collections.abc import Callable

from .gemma3 import build_gemma3
from .gpt_oss import build_gpt_oss
from .graph_context import GraphContext, GraphInputs, GraphKey, GraphResult, graph_max_nodes
from .qwen3 import build_qwen3
from .qwen35 import build_qwen35

__all__ = ["GraphInputs", "GraphKey", "GraphResult", "LlamaGraphBuilder", "build_llama", "graph_max_nodes"]


def build_llama(g: GraphContext, key: GraphKey) -> GraphResult:
    """llama_model_llama::graph (also qwen2's: the same graph with Q/K/V biases and NeoX rope)."""
    hp, n = g.hp, key.n_tokens
    ctx, inp = g.new_context(key)
    h = g.build_inp_embd(ctx, inp)                                  # ne = (n_embd, n_tokens)
    gf = ctx.new_graph(g.max_nodes)
    for il in range(hp.n_layer):
        cur = g.build_norm(ctx, h, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        q, k, v = g.build_qkv(ctx, gf, cur, il, n)                  # ne = (head_dim, n_head(_kv), n_tokens)
        rope_factors = g.rope_factors(il)
        q = g.build_rope(ctx, q, inp.pos, rope_factors).set_name(f"Qcur-{il}")
        k = g.build_rope(ctx, k, inp.pos, rope_factors).set_name(f"Kcur-{il}")
        v.set_name(f"Vcur-{il}")
        cur = g.build_attn(ctx, gf, il, q, k, v, inp, key)          # ne = (n_embd, n_tokens)
        h = g.build_ffn_block(ctx, gf, il, cur, h, inp)                 # ne = (n_embd, n_tokens or n_outputs)
    return g.build_output(ctx, gf, h, inp, key)


# llama_model::build_graph's switch: each architecture's builder
ARCH_GRAPHS: dict[str, Callable[[GraphContext, GraphKey], GraphResult]] = {
    "gemma3": build_gemma3,
    "gpt-oss": build_gpt_oss,
    "llama": build_llama,
    "qwen2": build_llama,
    "qwen2moe": build_llama,        # qwen2's graph with the experts and the shared expert (model/moe.py)
    "qwen3": build_qwen3,
    "qwen3moe": build_qwen3,        # qwen3's graph with the experts
    "qwen35": build_qwen35,         # Gated DeltaNet and gated attention layers (model/qwen35.py)
    "qwen35moe": build_qwen35,      # the same with the experts and the shared expert
}


class LlamaGraphBuilder(GraphContext):
    """Builds the forward graph of one ubatch shape with the model's architecture's builder."""

    def build(self, key: GraphKey) -> GraphResult:
        return ARCH_GRAPHS[self.hp.arch](self, key)

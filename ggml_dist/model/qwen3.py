"""The Qwen3 graph, as llama.cpp builds it (src/models/qwen3.cpp).

    h = get_rows(tok_embd, tokens)
    per layer:  h = h + Wo · attn(rope(nq(Wq·n(h))), rope(nk(Wk·n(h))), Wv·n(h))
                h = h + Wdown · swiglu(Wgate·n(h), Wup·n(h))
    logits = Wout · n(h)            (Wout = tok_embd when the output weight is tied)

LLaMA's graph with NeoX rope, no biases, and an RMS norm over each head of Q and K (nq, nk: weights
attn_q_norm/attn_k_norm of head size) before rope. The head size is attention.key_length, not
n_embd / n_head (Qwen3-0.6B: 1024 / 16 heads, heads of 128), so Wq and Wo are not square.
"""
from __future__ import annotations

from .graph_context import GraphContext, GraphKey, GraphResult


def build_qwen3(g: GraphContext, key: GraphKey) -> GraphResult:
    """llama_model_qwen3::graph."""
    hp, n = g.hp, key.n_tokens
    ctx, inp = g.new_context(key)
    h = g.build_inp_embd(ctx, inp)                                  # ne = (n_embd, n_tokens)
    gf = ctx.new_graph(g.max_nodes)
    for il in range(hp.n_layer):
        cur = g.build_norm(ctx, h, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        q, k, v = g.build_qkv(ctx, gf, cur, il, n)                  # ne = (head_dim, n_head(_kv), n_tokens)
        q = g.build_norm(ctx, q, f"blk.{il}.attn_q_norm.weight", f"Qcur_normed-{il}")   # per head
        q = g.build_rope(ctx, q, inp.pos, None).set_name(f"Qcur-{il}")
        k = g.build_norm(ctx, k, f"blk.{il}.attn_k_norm.weight", f"Kcur_normed-{il}")
        k = g.build_rope(ctx, k, inp.pos, None).set_name(f"Kcur-{il}")
        v.set_name(f"Vcur-{il}")
        cur = g.build_attn(ctx, gf, il, q, k, v, inp, key)          # ne = (n_embd, n_tokens)
        h = g.build_ffn_block(ctx, gf, il, cur, h, inp)                 # ne = (n_embd, n_tokens or n_outputs)
    return g.build_output(ctx, gf, h, inp, key)

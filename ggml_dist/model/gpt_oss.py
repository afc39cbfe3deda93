"""The gpt-oss graph, as llama.cpp builds it (src/models/openai-moe.cpp, graph with the iSWA KV cache).

    h = get_rows(tok_embd, tokens)
    per layer:  q, k, v = Wq·n(h) + bq, Wk·n(h) + bk, Wv·n(h) + bv;  q, k = rope_l(q), rope_l(k)
                h = h + Wo · attn_l(q, k, v; sinks) + bo
                h = h + moe(n_post(h))                  (softmax over the top-k router logits, SWIGLU_OAI)
    logits = Wout · n(h[out_ids])

Layers il % 2 == 0 attend through the sliding-window mask (n_swa cells back) with rope.freq_base_swa (or
the file's base); every layer ropes with the file's YaRN scaling. Each head's softmax takes its sink as one
more logit (attn_sinks). The norm before the experts is post_attention_norm (there is no ffn_norm). The
output rows are taken after the last layer, not before its FFN as llama's graph does: gpt-oss's last
layer runs its experts on every token of the ubatch (the rows' values are the same either way).
"""
from __future__ import annotations

from ..core import ops
from .graph_context import GraphContext, GraphKey, GraphResult
from .moe import build_moe_ffn
from .tensors import ffn_norm_name


def build_gpt_oss(g: GraphContext, key: GraphKey) -> GraphResult:
    """llama_model_openai_moe::graph."""
    hp, n = g.hp, key.n_tokens
    ctx, inp = g.new_context(key)
    h = g.build_inp_embd(ctx, inp)                                  # ne = (n_embd, n_tokens)
    gf = ctx.new_graph(g.max_nodes)
    for il in range(hp.n_layer):
        cur = g.build_norm(ctx, h, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        q, k, v = g.build_qkv(ctx, gf, cur, il, n)                  # ne = (head_dim, n_head(_kv), n_tokens)
        q = g.build_rope(ctx, q, inp.pos, None, il).set_name(f"Qcur-{il}")
        k = g.build_rope(ctx, k, inp.pos, None, il).set_name(f"Kcur-{il}")
        v.set_name(f"Vcur-{il}")
        cur = g.build_attn(ctx, gf, il, q, k, v, inp, key)          # with the sinks and Wo's bias
        ffn_inp = ops.add(ctx, cur, h).set_name(f"ffn_inp-{il}")
        cur = g.build_norm(ctx, ffn_inp, f"blk.{il}.{ffn_norm_name(hp)}", f"attn_post_norm-{il}")
        cur = build_moe_ffn(g, ctx, gf, cur, il)
        h = ops.add(ctx, cur, ffn_inp).set_name(f"l_out-{il}")
    if inp.out_ids is not None:                                     # ne = (n_embd, n_outputs) from here
        h = ops.get_rows(ctx, h, inp.out_ids)
    return g.build_output(ctx, gf, h, inp, key)

"""The Gemma 3 graph, as llama.cpp builds it (src/models/gemma3.cpp, graph<iswa>).

    h = get_rows(tok_embd, tokens) * sqrtf(n_embd)
    per layer:  q, k = rope_l(nq(Wq·n(h))), rope_l(nk(Wk·n(h)));  q = q * attention_scale
                h = h + n_post(Wo · attn_l(q, k, Wv·n(h)))           (kq_scale 1)
                h = h + n_post(Wdown · geglu(Wgate·n(h), Wup·n(h)))
    logits = tok_embd · n(h)

A sliding-window layer (il % 6 < 5) ropes with rope.freq_base_swa (10000 by default) at scale 1, and
attends through the SWA mask: a token at p1 sees the cells at p0 with p1 - p0 < n_swa (llama.cpp's iSWA
KV cache with swa_full, its default: both caches hold the same cells, so one cache and two masks give
the same attention). The global layers use the file's rope base and the full causal mask. The GGUF's
norm weights already hold Gemma's (1 + w) (the converter adds the 1), so build_norm multiplies by them
as is. GEGLU is ggml's CPU GELU: the f16 lookup table (numerics.gelu).
"""
from __future__ import annotations

import numpy as np

from ..core import ops
from .graph_context import GraphContext, GraphKey, GraphResult


def build_gemma3(g: GraphContext, key: GraphKey) -> GraphResult:
    """llama_model_gemma3::graph."""
    hp, n = g.hp, key.n_tokens
    ctx, inp = g.new_context(key)
    h = g.build_inp_embd(ctx, inp)                                  # ne = (n_embd, n_tokens)
    h = ops.scale(ctx, h, float(np.sqrt(np.float32(hp.n_embd)))).set_name("inp_scaled")
    gf = ctx.new_graph(g.max_nodes)
    for il in range(hp.n_layer):
        cur = g.build_norm(ctx, h, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        q, k, v = g.build_qkv(ctx, gf, cur, il, n)                  # ne = (head_dim, n_head(_kv), n_tokens)
        q = g.build_norm(ctx, q, f"blk.{il}.attn_q_norm.weight", f"Qcur_normed-{il}")   # per head
        q = g.build_rope(ctx, q, inp.pos, None, il).set_name(f"Qcur-{il}")
        k = g.build_norm(ctx, k, f"blk.{il}.attn_k_norm.weight", f"Kcur_normed-{il}")
        k = g.build_rope(ctx, k, inp.pos, None, il).set_name(f"Kcur-{il}")
        v.set_name(f"Vcur-{il}")
        q = ops.scale(ctx, q, hp.f_attention_scale)
        cur = g.build_attn(ctx, gf, il, q, k, v, inp, key, scale=1.0)   # ne = (n_embd, n_tokens)
        if il == hp.n_layer - 1 and inp.out_ids is not None:         # ne = (n_embd, n_outputs) from here
            cur = ops.get_rows(ctx, cur, inp.out_ids)
            h = ops.get_rows(ctx, h, inp.out_ids)
        cur = g.build_norm(ctx, cur, f"blk.{il}.post_attention_norm.weight", f"attn_post_norm-{il}")
        sa_out = ops.add(ctx, cur, h).set_name(f"sa_out-{il}")
        cur = g.build_norm(ctx, sa_out, f"blk.{il}.ffn_norm.weight", f"ffn_norm-{il}")
        cur = g.build_ffn(ctx, cur, il, gelu=True)
        cur = g.build_norm(ctx, cur, f"blk.{il}.post_ffw_norm.weight", f"ffn_post_norm-{il}")
        h = ops.add(ctx, cur, sa_out).set_name(f"l_out-{il}")
    return g.build_output(ctx, gf, h, inp, key)

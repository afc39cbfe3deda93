"""The Qwen3.5 / 3.6 graphs, as llama.cpp builds them (src/models/qwen35.cpp, qwen35moe.cpp and
delta-net-base.cpp's fused path): three of every four layers are Gated DeltaNet linear attention over a
recurrent state, the fourth gated full attention over the KV cache.

    h = get_rows(tok_embd, tokens)
    per layer:  h = h + (recurrent(il) ? delta_net(n(h)) : gated_attn(n(h)))
                h = h + ffn(n_post(h))                 (qwen35: SwiGLU; qwen35moe: experts + shared expert)
    logits = Wout · n(h[out_ids])

gated_attn: Wq gives each head's query and, beside it, an output gate; q and k are RMS-normed per head
and roped with IMRoPE over the first n_rot dims (text positions: four equal streams but the last);
attention's output is multiplied by sigmoid(gate) before Wo.

delta_net (per sequence of the ubatch, its n_st tokens):
    qkv = Wqkv · x (conv channels: q heads, k heads, v heads), z = Wgate · x
    beta = sigmoid(Wbeta · x), g = softplus(Walpha · x + dt_bias) * ssm_a      (per value head)
    conv_in = [conv state | qkv^T]; the last d_conv - 1 columns are the next conv state
    q, k, v = views of silu(ssm_conv(conv_in, w_conv)); q, k = l2_norm(q), l2_norm(k)
    o, state' = gated_delta_net(q, k, v, g, beta, state)
    out = Wout_ssm · (n_ssm(o) * silu(z))
The states are read with GET_ROWS at the ubatch's state row (s_copy) and written with SET_ROWS into the
sequence's other row (s_dst: model/recurrent_state.py), the values llama.cpp's GET_ROWS and CPY give.
"""
from __future__ import annotations

from ..core import ops
from ..core import ops_hybrid as oh
from ..core.context import Context
from ..core.graph import Graph
from ..core.tensor import Tensor
from ..core.types import row_size
from .graph_context import GraphContext, GraphInputs, GraphKey, GraphResult
from .moe import build_moe_ffn


def build_qwen35(g: GraphContext, key: GraphKey) -> GraphResult:
    """llama_model_qwen35::graph and llama_model_qwen35moe::graph."""
    hp = g.hp
    ctx, inp = g.new_context(key)
    h = g.build_inp_embd(ctx, inp)                                  # ne = (n_embd, n_tokens)
    gf = ctx.new_graph(g.max_nodes)
    for il in range(hp.n_layer):
        cur = g.build_norm(ctx, h, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        gf.build_forward_expand(cur)
        if hp.is_recurrent(il):
            cur = build_delta_net_layer(g, ctx, gf, cur, inp, il)
        else:
            cur = build_gated_attn(g, ctx, gf, cur, inp, key, il)
        h = ops.add(ctx, cur, h).set_name(f"attn_residual-{il}")
        cur = g.build_norm(ctx, h, f"blk.{il}.post_attention_norm.weight", f"attn_post_norm-{il}")
        cur = build_moe_ffn(g, ctx, gf, cur, il) if hp.moe is not None else g.build_ffn(ctx, cur, il)
        h = ops.add(ctx, cur, h).set_name(f"l_out-{il}")
    if inp.out_ids is not None:             # llama.cpp takes the rows after the final norm: the same values
        h = ops.get_rows(ctx, h, inp.out_ids)
    return g.build_output(ctx, gf, h, inp, key)


def build_gated_attn(g: GraphContext, ctx: Context, gf: Graph, x: Tensor, inp: GraphInputs, key: GraphKey,
                     il: int) -> Tensor:
    """build_layer_attn: ne = (n_embd, n_tokens)."""
    hp, w, n = g.hp, g.w, key.n_tokens
    hd, b = hp.n_embd_head_k, f"blk.{il}."
    q_full = ops.mul_mat(ctx, w[b + "attn_q.weight"], x).set_name(f"Qcur_full-{il}")   # (2 hd n_head, n)
    es = row_size(q_full.type, 1)
    q = ops.view_3d(ctx, q_full, hd, hp.n_head, n, es * hd * 2, es * hd * 2 * hp.n_head, 0)
    q = g.build_norm(ctx, q, b + "attn_q_norm.weight", f"Qcur_normed-{il}")
    k = ops.mul_mat(ctx, w[b + "attn_k.weight"], x).set_name(f"Kcur-{il}")
    v = ops.mul_mat(ctx, w[b + "attn_v.weight"], x).set_name(f"Vcur-{il}")
    k = ops.reshape(ctx, k, hd, hp.n_head_kv, n)
    k = g.build_norm(ctx, k, b + "attn_k_norm.weight", f"Kcur_normed-{il}")
    gate = ops.view_3d(ctx, q_full, hd, hp.n_head, n, es * hd * 2, es * hd * 2 * hp.n_head, es * hd)
    gate = ops.cont(ctx, gate, (hd * hp.n_head, n)).set_name(f"gate_reshaped-{il}")
    v = ops.reshape(ctx, v, hp.n_embd_head_v, hp.n_head_kv, n)
    q = _rope(g, ctx, q, inp.pos).set_name(f"Qcur-{il}")
    k = _rope(g, ctx, k, inp.pos).set_name(f"Kcur_roped-{il}")
    cur = g.build_attn(ctx, gf, il, q, k, v, inp, key, wo=False).set_name(f"attn_pregate-{il}")
    cur = ops.mul(ctx, cur, ops.sigmoid(ctx, gate)).set_name(f"attn_gated-{il}")
    return ops.mul_mat(ctx, w[b + "attn_output.weight"], cur).set_name(f"attn_output-{il}")


def _rope(g: GraphContext, ctx: Context, x: Tensor, pos: Tensor) -> Tensor:
    hp = g.hp
    return oh.rope_multi(ctx, x, pos, hp.n_rot, hp.rope_sections, hp.spec.rope_type, hp.n_ctx_orig_yarn,
                         hp.rope_freq_base, hp.rope_freq_scale, hp.rope_ext_factor, hp.rope_attn_factor,
                         32.0, 1.0)


def build_delta_net_layer(g: GraphContext, ctx: Context, gf: Graph, x: Tensor, inp: GraphInputs,
                          il: int) -> Tensor:
    """build_layer_attn_linear for a ubatch of n_seqs sequences of n_st tokens each (split_equal: each
    sequence's tokens together, in the order of its state rows in s_copy): ne = (n_embd, n_tokens)."""
    hp, w, rs, s_copy, s_dst = g.hp, g.w, g.rs, inp.s_copy, inp.s_dst
    assert rs is not None and s_copy is not None and s_dst is not None, "a hybrid model's graph needs its state"
    b, n, n_seqs = f"blk.{il}.", x.ne[1], s_copy.ne[0]
    n_st = n // n_seqs
    S, H_k, H_v = hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank
    d_conv, channels = hp.ssm_d_conv, hp.ssm_d_inner + 2 * H_k * S

    qkv = ops.mul_mat(ctx, w[b + "attn_qkv.weight"], x).set_name(f"linear_attn_qkv_mixed-{il}")
    qkv = ops.reshape(ctx, qkv, channels, n_st, n_seqs)
    z = ops.mul_mat(ctx, w[b + "attn_gate.weight"], x).set_name(f"z-{il}")
    beta = ops.mul_mat(ctx, w[b + "ssm_beta.weight"], x)
    beta = ops.sigmoid(ctx, ops.reshape(ctx, beta, 1, H_v, n_st, n_seqs)).set_name(f"beta_sigmoid-{il}")
    alpha = ops.reshape(ctx, ops.mul_mat(ctx, w[b + "ssm_alpha.weight"], x), H_v, n_st, n_seqs)
    alpha = oh.softplus(ctx, ops.add(ctx, alpha, w[b + "ssm_dt.bias"])).set_name(f"a_softplus-{il}")
    gate = ops.mul(ctx, alpha, w[b + "ssm_a"]).set_name(f"gate-{il}")           # -exp(A_log) * softplus
    gate = ops.reshape(ctx, gate, 1, H_v, n_st, n_seqs)

    # per sequence the conv state's columns, then its tokens'; the last d_conv - 1 columns are the next state
    conv_states = ops.reshape(ctx, rs.get_r(ctx, il, s_copy), d_conv - 1, channels, n_seqs)
    conv_states.set_name(f"conv_states-{il}")
    conv_input = ops.concat(ctx, conv_states, ops.transpose(ctx, qkv), 0).set_name(f"conv_input-{il}")
    last = ops.view_3d(ctx, conv_input, d_conv - 1, channels, n_seqs, conv_input.nb[1], conv_input.nb[2],
                       row_size(conv_input.type, n_st))
    last = ops.cont(ctx, last, (hp.n_embd_r, n_seqs))
    gf.build_forward_expand(rs.cpy_r(ctx, il, last, s_dst))

    state = ops.reshape(ctx, rs.get_s(ctx, il, s_copy), S, S, H_v, n_seqs).set_name(f"state_predelta-{il}")
    conv = ops.silu(ctx, oh.ssm_conv(ctx, conv_input, w[b + "ssm_conv1d.weight"])).set_name(f"conv_output_silu-{il}")
    nb1 = row_size(conv.type, channels)
    es = row_size(conv.type, 1)
    q = ops.view_4d(ctx, conv, S, H_k, n_st, n_seqs, es * S, nb1, nb1 * n_st, 0)
    k = ops.view_4d(ctx, conv, S, H_k, n_st, n_seqs, es * S, nb1, nb1 * n_st, es * S * H_k)
    v = ops.view_4d(ctx, conv, S, H_v, n_st, n_seqs, es * S, nb1, nb1 * n_st, es * 2 * S * H_k)
    q = oh.l2_norm(ctx, q, hp.f_norm_rms_eps)
    k = oh.l2_norm(ctx, k, hp.f_norm_rms_eps)

    res = oh.gated_delta_net(ctx, q, k, v, gate, beta, state).set_name(f"gdn_out-{il}")
    out = ops.view_4d(ctx, res, S, H_v, n_st, n_seqs, es * S, es * S * H_v, es * S * H_v * n_st, 0)
    new_state = ops.view_2d(ctx, res, hp.n_embd_s, n_seqs, es * hp.n_embd_s, es * S * H_v * n)
    gf.build_forward_expand(rs.cpy_s(ctx, il, new_state, s_dst))

    # the gated norm: n_ssm(o) * silu(z), per value head
    z = ops.reshape(ctx, z, S, H_v, n_st, n_seqs)
    out = ops.mul(ctx, g.build_norm(ctx, out, b + "ssm_norm.weight", f"ssm_normed-{il}"), ops.silu(ctx, z))
    out = ops.reshape(ctx, out, S * H_v, n)
    return ops.mul_mat(ctx, w[b + "ssm_out.weight"], out).set_name(f"linear_attn_out-{il}")

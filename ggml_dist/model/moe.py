"""The mixture-of-experts FFN block, as llama.cpp builds it (llm_graph_context::build_moe_ffn, and qwen2moe's
shared expert, src/models/qwen2moe.cpp).

    logits  = Wrouter · x  [+ brouter]                          ne = (n_expert, n_tokens)
    probs   = softmax(logits) | sigmoid(logits) | logits        (gating; the last: gpt-oss's softmax_weight)
    top     = argsort(probs, desc)[:k]                          ne = (k, n_tokens), I32 (ffn_moe_topk)
    w       = probs[top]  [softmax over the k (softmax_weight)] [/ max(sum(w), 6.103515625e-5) (norm_w)]
    y_e     = Wdown_e · act(Wgate_e · x [+ b], Wup_e · x [+ b]) [+ b]     for the k experts e, MUL_MAT_ID
    out     = y_top0 * w0 + y_top1 * w1 + ...                   added in top-k order
    (qwen2moe) out += (silu(g) / g) * Wdown_s · swiglu(Wgate_s · x, Wup_s · x),  g = w_gs · x

The weights come from the unbiased probabilities; the k expert outputs are weighted, then viewed one slot
at a time and added left to right, which is the order that decides llama.cpp's bits. Every tensor keeps
llama.cpp's name (ffn_moe_logits-{il}, ffn_moe_topk-{il}, ...), so a graph can be compared with
llama.cpp's node by node.
"""
from __future__ import annotations

from typing import Protocol

from ..core import ops
from ..core.context import Context
from ..core.graph import Graph
from ..core.tensor import Tensor
from .archs import EXPERT_GATING_SIGMOID, EXPERT_GATING_SOFTMAX, EXPERT_GATING_SOFTMAX_WEIGHT, LlamaHParams


class GraphContext(Protocol):
    """What the MoE block reads of graph_context.GraphContext (which calls it): the hyperparameters, the
    weights, and the dense FFN (qwen2moe's shared expert is one)."""
    hp: LlamaHParams
    w: dict[str, Tensor]

    def build_ffn(self, ctx: Context, x: Tensor, il: int, gelu: bool = False, suffix: str = "") -> Tensor: ...
    def expert_ids(self, ctx: Context, selected: Tensor, il: int) -> Tensor: ...
    def expert_outputs(self, ctx: Context, y: Tensor, selected: Tensor, il: int) -> Tensor: ...

WEIGHTS_SUM_MIN = 6.103515625e-5        # the smallest normal f16: build_moe_ffn's clamp of the weights' sum
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def build_moe_ffn(g: GraphContext, ctx: Context, gf: Graph, cur: Tensor, il: int) -> Tensor:
    """build_moe_ffn with the architecture's arguments (arch_hparams.MoESpec). cur: ne = (n_embd, n_tokens)."""
    hp, w, b = g.hp, g.w, f"blk.{il}."
    moe = hp.moe
    assert moe is not None
    n_embd, n_tokens = cur.ne[0], cur.ne[1]
    k, n_expert = hp.n_expert_used, hp.n_expert

    logits = ops.mul_mat(ctx, w[b + "ffn_gate_inp.weight"], cur).set_name(f"ffn_moe_logits-{il}")
    if b + "ffn_gate_inp.bias" in w:
        logits = ops.add(ctx, logits, w[b + "ffn_gate_inp.bias"]).set_name(f"ffn_moe_logits_biased-{il}")
    if moe.gating == EXPERT_GATING_SOFTMAX:
        probs = ops.soft_max_ext(ctx, logits, None)
    elif moe.gating == EXPERT_GATING_SIGMOID:
        probs = ops.sigmoid(ctx, logits)
    else:
        assert moe.gating == EXPERT_GATING_SOFTMAX_WEIGHT
        probs = logits
    probs.set_name(f"ffn_moe_probs-{il}")                             # ne = (n_expert, n_tokens)

    selected = ops.argsort_top_k(ctx, probs, k)                       # ne = (k, n_tokens), a view
    assert selected.src[0] is not None
    selected.src[0].set_name(f"ffn_moe_argsort-{il}")
    selected.set_name(f"ffn_moe_topk-{il}")

    weights = ops.get_rows(ctx, ops.reshape(ctx, probs, 1, n_expert, n_tokens), selected) \
        .set_name(f"ffn_moe_weights-{il}")                            # ne = (1, k, n_tokens)
    if moe.gating == EXPERT_GATING_SOFTMAX_WEIGHT:
        weights = ops.soft_max_ext(ctx, ops.reshape(ctx, weights, k, n_tokens), None)
        weights = ops.reshape(ctx, weights, 1, k, n_tokens).set_name(f"ffn_moe_weights_softmax-{il}")
    if moe.norm_w:
        weights = ops.reshape(ctx, weights, k, n_tokens)
        total = ops.sum_rows(ctx, weights).set_name(f"ffn_moe_weights_sum-{il}")      # ne = (1, n_tokens)
        total = ops.clamp(ctx, total, WEIGHTS_SUM_MIN, float("inf")).set_name(f"ffn_moe_weights_sum_clamped-{il}")
        weights = ops.div(ctx, weights, total).set_name(f"ffn_moe_weights_norm-{il}")
        weights = ops.reshape(ctx, weights, 1, k, n_tokens)
    gf.build_forward_expand(weights)

    x = ops.reshape(ctx, cur, n_embd, 1, n_tokens)
    ids = g.expert_ids(ctx, selected, il)          # the experts computed here (a rank of a group: its own)
    up = _experts(ctx, w, b, "ffn_up_exps", x, ids, f"ffn_moe_up-{il}")           # ne = (n_ff, k, n_tokens)
    gate = _experts(ctx, w, b, "ffn_gate_exps", x, ids, f"ffn_moe_gate-{il}")
    if moe.oai:                                                       # gpt-oss: LLM_FFN_SWIGLU_OAI_MOE
        act = ops.swiglu_oai(ctx, gate, up, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT).set_name(f"ffn_moe_swiglu_oai-{il}")
    else:
        act = ops.swiglu(ctx, gate, up).set_name(f"ffn_moe_swiglu-{il}")
    experts = _experts(ctx, w, b, "ffn_down_exps", act, ids, f"ffn_moe_down-{il}")        # (n_embd, k, n_tok)
    experts = g.expert_outputs(ctx, experts, selected, il)          # a group's ranks: every slot's output
    experts = ops.mul(ctx, experts, weights).set_name(f"ffn_moe_weighted-{il}")
    gf.build_forward_expand(experts)

    slots = [ops.view_2d(ctx, experts, n_embd, n_tokens, experts.nb[2], i * experts.nb[1]) for i in range(k)]
    for v in slots:                                                   # the views before the adds
        gf.build_forward_expand(v)
    out = slots[0]
    for v in slots[1:]:
        out = ops.add(ctx, out, v)
        gf.build_forward_expand(out)
    if k == 1:
        out = ops.cont(ctx, out)                                      # not a strided view
    out.set_name(f"ffn_moe_out-{il}")
    if moe.shared_expert:
        out = ops.add(ctx, out, build_shared_expert(g, ctx, cur, il)).set_name(f"ffn_out-{il}")
    return out


def _experts(ctx: Context, w: dict[str, Tensor], b: str, what: str, x: Tensor, selected: Tensor,
             name: str) -> Tensor:
    """MUL_MAT_ID of the stacked experts `what` for the selected ids, plus each expert's bias (ADD_ID)
    where the file has them (gpt-oss)."""
    y = ops.mul_mat_id(ctx, w[f"{b}{what}.weight"], x, selected).set_name(name)
    bias = w.get(f"{b}{what}.bias")
    return y if bias is None else ops.add_id(ctx, y, bias, selected).set_name(f"{name.rsplit('-', 1)[0]}_biased-"
                                                                             f"{name.rsplit('-', 1)[1]}")


def build_shared_expert(g: GraphContext, ctx: Context, cur: Tensor, il: int) -> Tensor:
    """qwen2moe's shared expert: a dense SwiGLU FFN every token takes, scaled by sigmoid of a one-row gate,
    computed as llama.cpp's qwen2moe does, silu(g) / g (qwen35moe's calls ggml_sigmoid: other bits)."""
    b = f"blk.{il}."
    gate_inp = ops.mul_mat(ctx, g.w[b + "ffn_gate_inp_shexp.weight"], cur).set_name(f"ffn_shexp_gate_inp-{il}")
    moe = g.hp.moe
    if moe is not None and moe.shared_sigmoid:                        # qwen35moe: ggml_sigmoid
        gate = ops.sigmoid(ctx, gate_inp).set_name(f"ffn_shexp_gate-{il}")
    else:
        gate = ops.div(ctx, ops.silu(ctx, gate_inp), gate_inp).set_name(f"ffn_shexp_gate-{il}")   # (1, n_tokens)
    ffn = g.build_ffn(ctx, cur, il, suffix="_shexp").set_name(f"ffn_shexp-{il}")
    return ops.mul(ctx, ffn, gate).set_name(f"ffn_shexp_out-{il}")

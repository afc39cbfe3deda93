"""The LLaMA / Qwen2 graph, as llama.cpp builds it (src/models/llama.cpp; ggml-numerics.md §3).

    h = get_rows(tok_embd, tokens)
    per layer:  h = h + Wo · attn(rope(Wq·n(h)), rope(Wk·n(h)), Wv·n(h))
                h = h + Wdown · swiglu(Wgate·n(h), Wup·n(h))
    logits = Wout · n(h)            (Wout = tok_embd when the output weight is tied)

Only core ops are used. The builder depends on data only through its input tensors (tokens, positions,
KQ mask, K/V write indices, output rows), so the topology is a function of the GraphKey: the premise of
graph reuse (ggml-mechanisms.md §4.8).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..core import ops
from ..core.context import Context, graph_overhead, tensor_overhead
from ..core.graph import Graph
from ..core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from ..core.tensor import Tensor
from ..core.types import GGMLType
from .hparams import LlamaHParams
from .kv_cache import KVCache


@dataclass(frozen=True, slots=True)
class GraphKey:
    """The topology-determining parameters (llm_graph_params::allow_reuse plus the input shapes). Without
    a unified KV cache the ubatch's tokens are n_stream equal groups, one per stream s0 .. s0+n_stream-1,
    and the stream range is baked into the K/V views."""
    n_tokens: int
    n_outputs: int
    n_kv: int
    n_stream: int = 1
    s0: int = 0


@dataclass
class GraphInputs:
    """The graph's input tensors (llm_graph_input_*), set from each ubatch before compute."""
    tokens: Tensor
    pos: Tensor
    kq_mask: Tensor
    k_idxs: Tensor
    v_idxs: Tensor
    out_ids: Tensor | None = None


@dataclass
class GraphResult:
    """llm_graph_result: the graph, its inputs and its logits, kept for reuse."""
    key: GraphKey
    graph: Graph
    inputs: GraphInputs
    logits: Tensor
    ctx: Context = field(repr=False, default=None)  # type: ignore[assignment]
    plan: Any = field(repr=False, default=None)     # Sched.save_plan() after its last allocation


def graph_max_nodes(n_tensors: int) -> int:
    """graph_max_nodes: max(1024, 8 * n_model_tensors)."""
    return max(1024, 8 * n_tensors)


def rope_type(hp: LlamaHParams) -> int:
    """LLaMA rotates adjacent pairs (the converter permuted Q/K); Qwen2 uses NeoX halves."""
    return ROPE_TYPE_NEOX if hp.arch == "qwen2" else ROPE_TYPE_NORM


class LlamaGraphBuilder:
    """Builds the forward graph of one ubatch shape from the model's weight tensors."""

    def __init__(self, hp: LlamaHParams, weights: dict[str, Tensor], kv: KVCache) -> None:
        self.hp = hp
        self.w = weights
        self.kv = kv
        self.max_nodes = graph_max_nodes(len(weights))

    def build(self, key: GraphKey) -> GraphResult:
        hp = self.hp
        ctx = Context(tensor_overhead() * self.max_nodes + graph_overhead(self.max_nodes), no_alloc=True,
                      name="graph")
        inp = self._inputs(ctx, key)
        h = ops.get_rows(ctx, self.w["token_embd.weight"], inp.tokens).set_name("inp_embd")
        gf = ctx.new_graph(self.max_nodes)
        for il in range(hp.n_layer):
            h = self._layer(ctx, gf, il, h, inp, key)
        cur = self._norm(ctx, h, "output_norm.weight", "result_norm")
        w_out = self.w.get("output.weight", self.w["token_embd.weight"])
        logits = ops.mul_mat(ctx, w_out, cur).set_name("result_output")
        logits.set_output()
        gf.build_forward_expand(logits)
        return GraphResult(key, gf, inp, logits, ctx)

    def _inputs(self, ctx: Context, key: GraphKey) -> GraphInputs:
        n = key.n_tokens
        tokens = ctx.new_tensor(GGMLType.I32, (n,)).set_name("inp_tokens").set_input()
        pos = ctx.new_tensor(GGMLType.I32, (n,)).set_name("inp_pos").set_input()
        ns = key.n_stream
        mask_ne = (key.n_kv, n) if ns == 1 else (key.n_kv, n // ns, 1, ns)
        mask = ctx.new_tensor(GGMLType.F32, mask_ne).set_name("kq_mask").set_input()
        k_idxs = ctx.new_tensor(GGMLType.I64, (n,)).set_name("k_idxs").set_input()
        v_idxs = ctx.new_tensor(GGMLType.I64, (n * self.kv.n_embd_v_gqa,)).set_name("v_idxs").set_input()
        out_ids = None
        if key.n_outputs < n:
            out_ids = ctx.new_tensor(GGMLType.I32, (key.n_outputs,)).set_name("inp_out_ids").set_input()
        return GraphInputs(tokens, pos, mask, k_idxs, v_idxs, out_ids)

    def _norm(self, ctx: Context, x: Tensor, weight: str, name: str) -> Tensor:
        cur = ops.rms_norm(ctx, x, self.hp.f_norm_rms_eps)
        return ops.mul(ctx, cur, self.w[weight]).set_name(name)

    def _proj(self, ctx: Context, x: Tensor, il: int, what: str) -> Tensor:
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.{what}.weight"], x)
        bias = self.w.get(f"blk.{il}.{what}.bias")
        return ops.add(ctx, cur, bias) if bias is not None else cur

    def _layer(self, ctx: Context, gf: Graph, il: int, inp_l: Tensor, inp: GraphInputs,
               key: GraphKey) -> Tensor:
        hp, n = self.hp, key.n_tokens
        cur = self._norm(ctx, inp_l, f"blk.{il}.attn_norm.weight", f"attn_norm-{il}")
        q = ops.reshape(ctx, self._proj(ctx, cur, il, "attn_q"), hp.n_embd_head_k, hp.n_head, n)
        k = ops.reshape(ctx, self._proj(ctx, cur, il, "attn_k"), hp.n_embd_head_k, hp.n_head_kv, n)
        v = ops.reshape(ctx, self._proj(ctx, cur, il, "attn_v"), hp.n_embd_head_v, hp.n_head_kv, n)
        q = self._rope(ctx, q, inp.pos).set_name(f"Qcur-{il}")     # ne = (head_dim, n_head, n_tokens)
        k = self._rope(ctx, k, inp.pos).set_name(f"Kcur-{il}")
        v.set_name(f"Vcur-{il}")
        cur = self._attn(ctx, gf, il, q, k, v, inp, key)
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.attn_output.weight"], cur).set_name(f"attn_out-{il}")
        if il == hp.n_layer - 1 and inp.out_ids is not None:      # keep only the rows with outputs
            cur = ops.get_rows(ctx, cur, inp.out_ids)
            inp_l = ops.get_rows(ctx, inp_l, inp.out_ids)
        ffn_inp = ops.add(ctx, cur, inp_l).set_name(f"ffn_inp-{il}")
        cur = self._norm(ctx, ffn_inp, f"blk.{il}.ffn_norm.weight", f"ffn_norm-{il}")
        gate = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_gate.weight"], cur)
        up = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_up.weight"], cur)
        cur = ops.swiglu(ctx, gate, up).set_name(f"ffn_swiglu-{il}")
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_down.weight"], cur)
        return ops.add(ctx, cur, ffn_inp).set_name(f"l_out-{il}")

    def _rope(self, ctx: Context, x: Tensor, pos: Tensor) -> Tensor:
        hp = self.hp
        return ops.rope_ext(ctx, x, pos, None, hp.n_rot, rope_type(hp), hp.n_ctx_train,
                            hp.rope_freq_base, hp.rope_freq_scale, 0.0, 1.0, 32.0, 1.0)

    def _attn(self, ctx: Context, gf: Graph, il: int, q: Tensor, k_cur: Tensor, v_cur: Tensor,
              inp: GraphInputs, key: GraphKey) -> Tensor:
        """build_attn with a KV cache, flash attention off (llama-graph.cpp build_attn_mha)."""
        hp = self.hp
        # K/V rows go into the cache first; attention then reads them back from the (f16) cache
        gf.build_forward_expand(self.kv.cpy_k(ctx, il, k_cur, inp.k_idxs))
        gf.build_forward_expand(self.kv.cpy_v(ctx, il, v_cur, inp.v_idxs))
        ns, s0, n = key.n_stream, key.s0, key.n_tokens
        k = self.kv.get_k(ctx, il, key.n_kv, hp.n_head_kv, s0, ns)  # ne = (head_dim, n_kv, n_head_kv, ns)
        v = self.kv.get_v(ctx, il, key.n_kv, hp.n_head_kv, s0, ns)  # ne = (n_kv, head_dim, n_head_kv, ns)
        if ns > 1:                                                  # one group of tokens per stream
            q = ops.reshape(ctx, q, hp.n_embd_head_k, hp.n_head, n // ns, ns)
        q = ops.permute(ctx, q, 0, 2, 1, 3)                         # ne = (head_dim, n_tokens/ns, n_head, ns)
        kq = ops.mul_mat(ctx, k, q).set_name(f"kq-{il}")            # ne = (n_kv, n_tokens/ns, n_head, ns)
        kq_scale = float(1.0 / math.sqrt(float(hp.n_embd_head_k)))
        kq = ops.soft_max_ext(ctx, kq, inp.kq_mask, kq_scale, 0.0).set_name(f"kq_soft_max-{il}")
        kqv = ops.mul_mat(ctx, v, kq)                               # ne = (head_dim, n_tokens/ns, n_head, ns)
        cur = ops.permute(ctx, kqv, 0, 2, 1, 3)                     # ne = (head_dim, n_head, n_tokens/ns, ns)
        return ops.cont(ctx, cur, (hp.n_embd_head_v * hp.n_head, n)).set_name(f"kqv_out-{il}")

"""The blocks every architecture's graph is made of (llm_graph_context, src/llama-graph.cpp).

Each architecture's builder (model/llama.py, model/qwen3.py) is one function that reads top to bottom
in these blocks: the graph inputs, token embeddings, RMS norm, the Q/K/V projections, rope, attention
over the KV cache (flash attention off), the SwiGLU FFN and the output head. Only core ops are used.
A builder depends on data only through its input tensors (tokens, positions, KQ mask, K/V write indices,
output rows), so the topology is a function of the GraphKey: the premise of graph reuse
(ggml-mechanisms.md §4.8).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core import ops
from ..core.context import Context, graph_overhead, tensor_overhead
from ..core.graph import Graph
from ..core.tensor import GLUOp, Tensor
from ..core.types import GGMLType
from .archs import LlamaHParams
from .kv_cache import KVCache
from .moe import build_moe_ffn
from .recurrent_state import RecurrentState


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
    embd: bool = False         # the output is the final norm's rows (embeddings), not the head's logits
    n_seqs: int = 1            # a hybrid model's ubatch: its sequences (split_equal), a state row each


@dataclass
class GraphInputs:
    """The graph's input tensors (llm_graph_input_*), set from each ubatch before compute."""
    tokens: Tensor
    pos: Tensor
    kq_mask: Tensor
    k_idxs: Tensor
    v_idxs: Tensor
    out_ids: Tensor | None = None
    kq_mask_swa: Tensor | None = None     # the sliding-window layers' mask (llm_graph_input_attn_kv_iswa)
    s_copy: Tensor | None = None          # I32 [n_seqs]: the state row of each of the ubatch's sequences
    s_dst: Tensor | None = None           # I32 [n_seqs]: the rows their new states go to (the others are kept)


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


class GraphContext:
    """The model's hyperparameters, weights and KV cache, and the blocks of one ubatch's graph."""

    def __init__(self, hp: LlamaHParams, weights: dict[str, Tensor], kv: KVCache,
                 rs: RecurrentState | None = None) -> None:
        self.hp = hp
        self.w = weights
        self.kv = kv
        self.rs = rs                # the recurrent layers' state (hybrid models)
        self.max_nodes = graph_max_nodes(len(weights))

    # -- inputs and embeddings ------------------------------------------------------------------------
    def new_context(self, key: GraphKey) -> tuple[Context, GraphInputs]:
        """A metadata arena for one graph, and the graph's input tensors in it."""
        ctx = Context(tensor_overhead() * self.max_nodes + graph_overhead(self.max_nodes), no_alloc=True,
                      name="graph")
        return ctx, self._inputs(ctx, key)

    def _inputs(self, ctx: Context, key: GraphKey) -> GraphInputs:
        n = key.n_tokens
        tokens = ctx.new_tensor(GGMLType.I32, (n,)).set_name("inp_tokens").set_input()
        # multi-section rope reads four position streams (text: t = h = w = the position, e = 0)
        n_pos = 4 * n if self.hp.spec.hybrid else n
        pos = ctx.new_tensor(GGMLType.I32, (n_pos,)).set_name("inp_pos").set_input()
        ns = key.n_stream
        mask_ne = (key.n_kv, n) if ns == 1 else (key.n_kv, n // ns, 1, ns)
        mask = ctx.new_tensor(GGMLType.F32, mask_ne).set_name("kq_mask").set_input()
        k_idxs = ctx.new_tensor(GGMLType.I64, (n,)).set_name("k_idxs").set_input()
        v_idxs = ctx.new_tensor(GGMLType.I64, (n * self.kv.n_embd_v_gqa,)).set_name("v_idxs").set_input()
        out_ids = None
        if key.n_outputs < n:
            out_ids = ctx.new_tensor(GGMLType.I32, (key.n_outputs,)).set_name("inp_out_ids").set_input()
        mask_swa = None
        if self.hp.n_swa:
            mask_swa = ctx.new_tensor(GGMLType.F32, mask_ne).set_name("kq_mask_swa").set_input()
        s_copy = s_dst = None
        if self.rs is not None:
            s_copy = ctx.new_tensor(GGMLType.I32, (key.n_seqs,)).set_name("inp_s_copy").set_input()
            s_dst = ctx.new_tensor(GGMLType.I32, (key.n_seqs,)).set_name("inp_s_dst").set_input()
        return GraphInputs(tokens, pos, mask, k_idxs, v_idxs, out_ids, mask_swa, s_copy, s_dst)

    def build_inp_embd(self, ctx: Context, inp: GraphInputs) -> Tensor:
        return ops.get_rows(ctx, self.w["token_embd.weight"], inp.tokens).set_name("inp_embd")

    # -- the blocks of a layer ------------------------------------------------------------------------
    def build_norm(self, ctx: Context, x: Tensor, weight: str, name: str) -> Tensor:
        """RMS norm over ne[0], then the weight (build_norm, LLM_NORM_RMS): also per head on 3-D Q/K."""
        cur = ops.rms_norm(ctx, x, self.hp.f_norm_rms_eps)
        return ops.mul(ctx, cur, self.w[weight]).set_name(name)

    def build_qkv(self, ctx: Context, gf: Graph, x: Tensor, il: int, n_tokens: int
                  ) -> tuple[Tensor, Tensor, Tensor]:
        """The separate Q/K/V projections (build_qkv), each with its bias where the arch has them.
        Returns ne = (head_dim, n_head, n_tokens), (head_dim, n_head_kv, n_tokens) twice.
        The three products go into the graph first, one after another (llama.cpp's graph has K's rope
        and cache store between them): the allocator then places them side by side, and a CPU
        backend computes them as one call (backends/cpu/fusion.py). The same nodes and values."""
        hp = self.hp
        products = [ops.mul_mat(ctx, self.w[f"blk.{il}.{what}.weight"], x) for what in ("attn_q", "attn_k", "attn_v")]
        for mm in products:
            gf.build_forward_expand(mm)

        def proj(what: str, mm: Tensor) -> Tensor:
            return ops.add(ctx, mm, self.w[f"blk.{il}.{what}.bias"]) if hp.spec.qkv_bias else mm

        q, k, v = (proj(what, mm) for what, mm in zip(("attn_q", "attn_k", "attn_v"), products))
        q = ops.reshape(ctx, q, hp.n_embd_head_k, hp.n_head, n_tokens)
        k = ops.reshape(ctx, k, hp.n_embd_head_k, hp.n_head_kv, n_tokens)
        v = ops.reshape(ctx, v, hp.n_embd_head_v, hp.n_head_kv, n_tokens)
        return q, k, v

    def rope_factors(self, il: int) -> Tensor | None:
        """get_rope_factors(cparams, il): rope_freqs.weight where the file has it (llama3 scaling), else
        none. llama.cpp gives every layer its own duplicate of the tensor, so that each layer's copy lives
        with that layer's backend; a pipeline's weights may do the same under blk.{il}.rope_freqs.weight
        (no file can: check_tensors refuses the name)."""
        if not self.hp.rope_freqs:
            return None
        return self.w.get(f"blk.{il}.rope_freqs.weight", self.w["rope_freqs.weight"])

    def build_rope(self, ctx: Context, x: Tensor, pos: Tensor, freq_factors: Tensor | None,
                   il: int | None = None) -> Tensor:
        """ggml_rope_ext with the model's rope (YaRN's ext_factor and attn_factor where the file scales
        with yarn: hparams._rope_scaling). With il, a sliding-window layer's base and scale
        (get_rope_freq_base/scale: rope.freq_base_swa; Gemma 3 does not scale there, gpt-oss does)."""
        hp = self.hp
        base, scale = hp.rope_freq_base, hp.rope_freq_scale
        if il is not None and hp.is_swa(il):
            base, scale = hp.rope_freq_base_swa, hp.rope_freq_scale_swa
        return ops.rope_ext(ctx, x, pos, freq_factors, hp.n_rot, hp.spec.rope_type, hp.n_ctx_orig_yarn,
                            base, scale, hp.rope_ext_factor, hp.rope_attn_factor, 32.0, 1.0)

    def build_attn(self, ctx: Context, gf: Graph, il: int, q: Tensor, k_cur: Tensor, v_cur: Tensor,
                   inp: GraphInputs, key: GraphKey, scale: float | None = None, wo: bool = True) -> Tensor:
        """build_attn with a KV cache, flash attention off (build_attn_mha), then Wo (not with wo=False:
        ne = (n_embd_head_v * n_head, n_tokens) then). ne = (n_embd, n_tokens)
        scale: kq_scale (default 1/sqrtf(head size)); a sliding-window layer uses the SWA mask."""
        hp = self.hp
        mask = inp.kq_mask_swa if hp.is_swa(il) else inp.kq_mask
        scale = kq_scale(hp.n_embd_head_k) if scale is None else scale
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
        kq = ops.soft_max_ext(ctx, kq, mask, scale, 0.0)
        sinks = self.w.get(f"blk.{il}.attn_sinks.weight")
        if sinks is not None:                                       # gpt-oss
            ops.soft_max_add_sinks(kq, sinks)
        kq.set_name(f"kq_soft_max-{il}")
        kqv = ops.mul_mat(ctx, v, kq)                               # ne = (head_dim, n_tokens/ns, n_head, ns)
        cur = ops.permute(ctx, kqv, 0, 2, 1, 3)                     # ne = (head_dim, n_head, n_tokens/ns, ns)
        cur = ops.cont(ctx, cur, (hp.n_embd_head_v * hp.n_head, n)).set_name(f"kqv_out-{il}")
        if not wo:
            return cur
        cur = ops.mul_mat(ctx, self.w[f"blk.{il}.attn_output.weight"], cur)
        bias = self.w.get(f"blk.{il}.attn_output.bias")              # gpt-oss
        return (cur if bias is None else ops.add(ctx, cur, bias)).set_name(f"attn_out-{il}")

    def build_ffn(self, ctx: Context, x: Tensor, il: int, gelu: bool = False, suffix: str = "") -> Tensor:
        """build_ffn, LLM_FFN_SILU (or LLM_FFN_GELU) + LLM_FFN_PAR: Wdown · swiglu/geglu(Wgate·x, Wup·x).
        suffix picks the weights (qwen2moe's shared expert: ffn_gate_shexp, ...)."""
        gate = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_gate{suffix}.weight"], x)
        up = ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_up{suffix}.weight"], x)
        if gelu:
            cur = ops.glu(ctx, gate, up, GLUOp.GEGLU).set_name(f"ffn_geglu-{il}")
        else:
            cur = ops.swiglu(ctx, gate, up).set_name(f"ffn_swiglu-{il}")
        return ops.mul_mat(ctx, self.w[f"blk.{il}.ffn_down{suffix}.weight"], cur)

    def expert_ids(self, ctx: Context, selected: Tensor, il: int) -> Tensor:
        """The expert ids layer il's MUL_MAT_IDs take (model/moe.py): the router's top-k, all computed here
        (a tensor-parallel rank computes only its own experts' slots: model/tensor_parallel.py)."""
        return selected

    def expert_outputs(self, ctx: Context, y: Tensor, selected: Tensor, il: int) -> Tensor:
        """Every slot's expert output of layer il, from y, the down projection computed here."""
        return y

    def build_ffn_block(self, ctx: Context, gf: Graph, il: int, attn_out: Tensor, inp_l: Tensor,
                        inp: GraphInputs) -> Tensor:
        """h = attn_out + inp_l, then h + FFN(norm(h)), the FFN a mixture of experts where the model's is
        (model/moe.py). The last layer keeps only the rows that are output (inp_out_ids), before the
        residual as llama.cpp does."""
        if il == self.hp.n_layer - 1 and inp.out_ids is not None:   # ne = (n_embd, n_outputs) from here
            attn_out = ops.get_rows(ctx, attn_out, inp.out_ids)
            inp_l = ops.get_rows(ctx, inp_l, inp.out_ids)
        ffn_inp = ops.add(ctx, attn_out, inp_l).set_name(f"ffn_inp-{il}")
        cur = self.build_norm(ctx, ffn_inp, f"blk.{il}.ffn_norm.weight", f"ffn_norm-{il}")
        cur = build_moe_ffn(self, ctx, gf, cur, il) if self.hp.moe is not None else self.build_ffn(ctx, cur, il)
        return ops.add(ctx, cur, ffn_inp).set_name(f"l_out-{il}")

    # -- the head -------------------------------------------------------------------------------------
    def build_output(self, ctx: Context, gf: Graph, h: Tensor, inp: GraphInputs, key: GraphKey) -> GraphResult:
        """logits = Wout · norm(h), Wout = token_embd when the file has no output.weight (tied)."""
        cur = self.build_norm(ctx, h, "output_norm.weight", "result_norm")
        if key.embd:                        # llama.cpp's t_embd: pooled by the caller
            cur.set_output()
            gf.build_forward_expand(cur)
            return GraphResult(key, gf, inp, cur, ctx)
        # a pipeline's driver binds output.weight to the last stage even when tied (workers/driver.py)
        w_out = self.w.get("output.weight", self.w["token_embd.weight"])
        logits = ops.mul_mat(ctx, w_out, cur).set_name("result_output")   # ne = (n_vocab, n_outputs)
        logits.set_output()
        gf.build_forward_expand(logits)
        return GraphResult(key, gf, inp, logits, ctx)


def kq_scale(n_embd_head: int) -> float:
    """1.0f/sqrtf(float(n_embd_head)), in f32 as llama.cpp computes it (a double 1/sqrt rounded to f32
    differs for head sizes such as 24, 72 and 96)."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n_embd_head)))

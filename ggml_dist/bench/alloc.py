"""Graph-allocator benchmark: planned compute-buffer size vs. the lifetime lower bound, on llama graphs.

Builds llama.cpp-style graphs (SmolLM2-135M shapes by default) for prefill (n_ubatch tokens) and decode
(1 token) with weights and the KV cache pre-allocated, plans them with Gallocr, and prints one JSON object:
{"graphs": [{"name", "n_nodes", "planned_bytes", "lower_bound_bytes", "naive_bytes", "reserve_ms",
"replay_ms", ...}]}. planned_bytes_ggml is the plan with ggml's exact rules (no in-place through views).

    ggml-dist bench alloc --model smollm2-135m --ctx 4096 --ubatch 512 --json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ggml_dist.alloc.gallocr import INPLACE_OPS, Gallocr
from ggml_dist.alloc.lifetimes import lower_bound_bytes, lower_bound_inplace_bytes, naive_bytes
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import Tensor
from ggml_dist.core.types import GGMLType

F32, I32, I64 = GGMLType.F32, GGMLType.I32, GGMLType.I64
KQ_MASK_PAD = 64
SIZE_MAX = 2**64 - 1


@dataclass
class LlamaShape:
    n_embd: int = 576
    n_head: int = 9
    n_head_kv: int = 3
    n_ff: int = 1536
    n_vocab: int = 49152
    n_layer: int = 30
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_gqa(self) -> int:
        return self.head_dim * self.n_head_kv


class PlanOnlyBuffer:
    """A buffer that is only a size: the benchmark measures planning, not memory."""

    def __init__(self, size: int) -> None:
        self.size = size


class PlanOnlyBufferType:
    name = "plan-only"

    def __init__(self, alignment: int = 32, max_size: int = SIZE_MAX) -> None:
        self.alignment = alignment
        self.max_size = max_size

    def get_alloc_size(self, t: Tensor) -> int:
        return t.nbytes

    def alloc_buffer(self, size: int) -> PlanOnlyBuffer:
        return PlanOnlyBuffer(size)


class _Bump:
    """Places pre-allocated tensors (weights, KV cache) at increasing offsets of one fake buffer."""

    def __init__(self) -> None:
        self.buffer = PlanOnlyBuffer(0)
        self.offset = 0

    def bind(self, t: Tensor) -> Tensor:
        t.buffer, t.data = self.buffer, self.offset
        self.offset += (t.nbytes + 31) // 32 * 32
        self.buffer.size = self.offset
        return t


def build_llama_graph(hp: LlamaShape, n_tokens: int, n_kv: int, n_outputs: int = 1) -> Graph:
    """llama.cpp's build_llama (no flash attention, transposed V cache), metadata only."""
    ctx = Context(1 << 26, no_alloc=True, name="llama")
    wb = _Bump()

    def weight(name: str, *ne: int) -> Tensor:
        return wb.bind(ctx.new_tensor(F32, ne).set_name(name))

    def inp(name: str, type: GGMLType, *ne: int) -> Tensor:
        return ctx.new_tensor(type, ne).set_name(name).set_input()

    gf = Graph(8192)
    hd, nh, nkv, gqa = hp.head_dim, hp.n_head, hp.n_head_kv, hp.n_embd_gqa
    kv_size = n_kv
    tok_embd = weight("token_embd", hp.n_embd, hp.n_vocab)
    inp_tokens = inp("inp_tokens", I32, n_tokens)
    inp_pos = inp("inp_pos", I32, n_tokens)
    kq_mask = inp("kq_mask", F32, n_kv, (n_tokens + KQ_MASK_PAD - 1) // KQ_MASK_PAD * KQ_MASK_PAD)
    k_idxs = inp("k_idxs", I64, n_tokens)
    v_idxs = inp("v_idxs", I64, n_tokens * gqa)
    inpL = ops.get_rows(ctx, tok_embd, inp_tokens)                      # ne = (n_embd, n_tokens)
    for il in range(hp.n_layer):
        k_cache = wb.bind(ctx.new_tensor(F32, (gqa, kv_size)).set_name(f"cache_k_l{il}"))
        v_cache = wb.bind(ctx.new_tensor(F32, (kv_size, gqa)).set_name(f"cache_v_l{il}"))  # transposed
        cur = ops.rms_norm(ctx, inpL, hp.rms_eps)
        cur = ops.mul(ctx, cur, weight(f"blk.{il}.attn_norm", hp.n_embd))
        q = ops.mul_mat(ctx, weight(f"blk.{il}.attn_q", hp.n_embd, hp.n_embd), cur)
        k = ops.mul_mat(ctx, weight(f"blk.{il}.attn_k", hp.n_embd, gqa), cur)
        v = ops.mul_mat(ctx, weight(f"blk.{il}.attn_v", hp.n_embd, gqa), cur)
        q = ops.reshape(ctx, q, hd, nh, n_tokens)                       # ne = (hd, n_head, n_tokens)
        k = ops.reshape(ctx, k, hd, nkv, n_tokens)
        q = ops.rope_ext(ctx, q, inp_pos, None, hd, 0, 8192, 100000.0)
        k = ops.rope_ext(ctx, k, inp_pos, None, hd, 0, 8192, 100000.0)
        # store K and V into the cache (views of pre-allocated tensors)
        gf.build_forward_expand(ops.set_rows(ctx, k_cache, ops.reshape(ctx, k, gqa, n_tokens), k_idxs))
        v_flat = ops.reshape(ctx, v_cache, 1, kv_size * gqa)
        gf.build_forward_expand(ops.set_rows(ctx, v_flat, ops.reshape(ctx, v, 1, gqa * n_tokens), v_idxs))
        # attention over the cache
        qp = ops.permute(ctx, q, 0, 2, 1, 3)                            # ne = (hd, n_tokens, n_head)
        kc = ops.view_3d(ctx, k_cache, hd, n_kv, nkv, k_cache.nb[1], hd * 4, 0)
        kq = ops.mul_mat(ctx, kc, qp)                                   # ne = (n_kv, n_tokens, n_head)
        kq = ops.soft_max_ext(ctx, kq, kq_mask, hd ** -0.5)
        vc = ops.view_3d(ctx, v_cache, n_kv, hd, nkv, v_cache.nb[1], v_cache.nb[1] * hd, 0)
        kqv = ops.mul_mat(ctx, vc, kq)                                  # ne = (hd, n_tokens, n_head)
        cur = ops.cont(ctx, ops.permute(ctx, kqv, 0, 2, 1, 3), (hp.n_embd, n_tokens))
        cur = ops.mul_mat(ctx, weight(f"blk.{il}.attn_output", hp.n_embd, hp.n_embd), cur)
        if il == hp.n_layer - 1 and n_outputs < n_tokens:              # only the rows that are output
            out_ids = inp("inp_out_ids", I32, n_outputs)
            cur = ops.get_rows(ctx, cur, out_ids)
            inpL = ops.get_rows(ctx, inpL, out_ids)
        ffn_inp = ops.add(ctx, cur, inpL)
        cur = ops.rms_norm(ctx, ffn_inp, hp.rms_eps)
        cur = ops.mul(ctx, cur, weight(f"blk.{il}.ffn_norm", hp.n_embd))
        gate = ops.mul_mat(ctx, weight(f"blk.{il}.ffn_gate", hp.n_embd, hp.n_ff), cur)
        up = ops.mul_mat(ctx, weight(f"blk.{il}.ffn_up", hp.n_embd, hp.n_ff), cur)
        cur = ops.mul(ctx, ops.silu(ctx, gate), up)                     # swiglu as silu * mul
        cur = ops.mul_mat(ctx, weight(f"blk.{il}.ffn_down", hp.n_ff, hp.n_embd), cur)
        inpL = ops.add(ctx, cur, ffn_inp)
    cur = ops.rms_norm(ctx, inpL, hp.rms_eps)
    cur = ops.mul(ctx, cur, weight("output_norm", hp.n_embd))
    logits = ops.mul_mat(ctx, tok_embd, cur).set_name("result_output").set_output()   # tied embeddings
    gf.build_forward_expand(logits)
    return gf


def measure(name: str, build: Any, alignment: int = 32) -> dict[str, Any]:
    buft = PlanOnlyBufferType(alignment)
    size_of = lambda t: (buft.get_alloc_size(t) + alignment - 1) // alignment * alignment  # noqa: E731
    g1, g2 = build(), build()
    lb, naive = lower_bound_bytes(g1, size_of), naive_bytes(g1, size_of)
    lb_inplace = lower_bound_inplace_bytes(g1, size_of, INPLACE_OPS)
    ggml = Gallocr([buft], inplace_through_views=False)
    ggml.reserve(build())
    galloc = Gallocr([buft])
    t0 = time.perf_counter()
    galloc.reserve(g1)
    t1 = time.perf_counter()
    galloc.alloc_graph(g1)
    t2 = time.perf_counter()
    assert galloc.alloc_graph(g2) and galloc.n_plans == 1, "replay must not re-plan"
    t3 = time.perf_counter()
    planned = galloc.get_buffer_size(0)
    return {
        "name": name,
        "n_nodes": g1.n_nodes,
        "planned_bytes": planned,
        "lower_bound_bytes": lb,
        "naive_bytes": naive,
        "reserve_ms": round((t1 - t0) * 1e3, 3),
        "replay_ms": round((t3 - t2) * 1e3, 3),
        "planned_over_lower_bound": round(planned / lb, 4) if lb else None,
        "lower_bound_inplace_bytes": lb_inplace,
        "planned_over_lower_bound_inplace": round(planned / lb_inplace, 4) if lb_inplace else None,
        "planned_bytes_ggml": ggml.get_buffer_size(0),
        "n_inplace": galloc.n_inplace,
        "n_inplace_views": galloc.n_inplace_views,
    }


def model_builders(model: str, ctx: int, ubatch: int):
    """Prefill and decode graph builders of a real GGUF model (weights mapped, KV cache allocated)."""
    from ggml_dist.backends.cpu.backend import CPUBufferType
    from ggml_dist.model.kv_cache import KVCache
    from ggml_dist.model.llama import GraphKey, LlamaGraphBuilder
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.pull import resolve_model
    m = LlamaModel.load(resolve_model(model))
    hp = m.hp
    kv = KVCache(hp.n_embd_k_gqa, hp.n_embd_v_gqa, ctx, range(hp.n_layer))
    kv.allocate(CPUBufferType())
    b = LlamaGraphBuilder(hp, m.weights, kv)
    n_kv = kv.kv_size
    return {f"prefill_ub{ubatch}_ctx{n_kv}": lambda: b.build(GraphKey(ubatch, 1, n_kv)).graph,
            f"decode_ctx{n_kv}": lambda: b.build(GraphKey(1, 1, n_kv)).graph}


def run(ctx: int = 4096, ubatch: int = 512, n_layer: int = 30, model: str | None = None) -> dict[str, Any]:
    """The model's graphs when a model is given, else synthetic SmolLM2-shaped ones."""
    if model is not None:
        return {"model": model, "graphs": [measure(n, f) for n, f in model_builders(model, ctx, ubatch).items()]}
    hp = LlamaShape(n_layer=n_layer)
    return {"graphs": [
        measure(f"prefill_ub{ubatch}_ctx{ctx}", lambda: build_llama_graph(hp, ubatch, ctx)),
        measure(f"decode_ctx{ctx}", lambda: build_llama_graph(hp, 1, ctx)),
    ]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=4096, help="KV cache size = n_kv of the reserved graphs")
    ap.add_argument("--ubatch", type=int, default=512, help="tokens per prefill ubatch")
    ap.add_argument("--n-layer", type=int, default=30, help="layers of the synthetic graphs (no --model)")
    ap.add_argument("--model", default=None, help="GGUF path or known name: measure that model's graphs")
    ap.add_argument("--json", action="store_true", help="print only the JSON object (no summary on stderr)")
    args = ap.parse_args(argv)
    result = run(args.ctx, args.ubatch, args.n_layer, args.model)
    if not args.json:
        for g in result["graphs"]:
            print(f"{g['name']}: {g['n_nodes']} nodes, planned {g['planned_bytes'] / 2**20:.2f} MiB, "
                  f"lower bound {g['lower_bound_bytes'] / 2**20:.2f} MiB "
                  f"(in-place aware {g['lower_bound_inplace_bytes'] / 2**20:.2f} MiB), "
                  f"naive {g['naive_bytes'] / 2**20:.2f} MiB, "
                  f"ggml rules {g['planned_bytes_ggml'] / 2**20:.2f} MiB", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

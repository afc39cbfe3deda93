"""Shared fixtures for the scheduler tests: weight buffers, the llama-like graph of §5.3, checkers."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ggml_dist.alloc.tallocr import aligned_size
from ggml_dist.backends.base import BufferUsage, tensor_alloc, tensor_array
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import Tensor
from ggml_dist.core.types import GGMLType
from ggml_dist.scheduler.assign import root_buffer, tensor_backend_id

F32 = GGMLType.F32


def alloc_weights(buft: Any, tensors: Sequence[Tensor], rng: np.random.Generator | None = None,
                  usage: BufferUsage = BufferUsage.WEIGHTS) -> Any:
    """Place tensors back to back (aligned) in one buffer of buft, flagged WEIGHTS, filled at random."""
    offs, size = [], 0
    for t in tensors:
        offs.append(size)
        size += aligned_size(t.nbytes, buft.alignment)
    buf = buft.alloc_buffer(max(size, 1))
    buf.usage = usage
    rng = rng or np.random.default_rng(0)
    for t, o in zip(tensors, offs):
        tensor_alloc(buf, t, o)
        a = tensor_array(t)
        if a.dtype == np.float32:
            a[...] = rng.standard_normal(a.shape).astype(np.float32) * 0.5
    return buf


N_EMBD, N_TOK, N_VOCAB = 8, 4, 16


def build_llama_like(ctx: Context, place: dict[str, Any], rng: np.random.Generator | None = None
                     ) -> tuple[Graph, dict[str, Tensor]]:
    """The test graph of ggml-mechanisms.md §5.3. place maps 'tok_embd', 'L0', 'L1', 'out' to the
    buffer type that holds those weights. Node indices 0..19, transposes at 3 and 12."""
    rng = rng or np.random.default_rng(0)
    T: dict[str, Tensor] = {}
    tok_embd = ctx.new_tensor(F32, (N_EMBD, N_VOCAB)).set_name("tok_embd")
    alloc_weights(place["tok_embd"], [tok_embd], rng)
    inp = ctx.new_tensor(GGMLType.I32, (N_TOK,)).set_name("inp_tokens").set_input()
    x = ops.get_rows(ctx, tok_embd, inp).set_name("x_embd")
    T.update(tok_embd=tok_embd, inp_tokens=inp, x_embd=x)
    for L in (0, 1):
        normw = ctx.new_tensor(F32, (N_EMBD,)).set_name(f"normw-{L}")
        w = ctx.new_tensor(F32, (N_EMBD, N_EMBD)).set_name(f"w{L}")
        alloc_weights(place[f"L{L}"], [normw, w], rng)
        norm = ops.rms_norm(ctx, x, 1e-5).set_name(f"norm-{L}")
        an = ops.mul(ctx, norm, normw).set_name(f"attn_norm-{L}")
        tr = ops.transpose(ctx, an)
        c = ops.cont(ctx, tr).set_name(f"cont-{L}")
        q = ops.mul_mat(ctx, w, an).set_name(f"q-{L}")
        kq = ops.mul_mat(ctx, q, an).set_name(f"kq-{L}")
        kqs = ops.soft_max_ext(ctx, kq, None).set_name(f"kq_soft-{L}")
        kqv = ops.mul_mat(ctx, c, kqs).set_name(f"kqv-{L}")
        x = ops.add(ctx, kqv, x).set_name(f"l_out-{L}")
        for t in (normw, w, norm, an, tr, c, q, kq, kqs, kqv, x):
            T[t.name] = t
    w_out = ctx.new_tensor(F32, (N_EMBD, N_VOCAB)).set_name("w_out")
    alloc_weights(place["out"], [w_out], rng)
    logits = ops.mul_mat(ctx, w_out, x).set_name("logits").set_output()
    T.update(w_out=w_out, logits=logits)
    g = Graph(256)
    g.build_forward_expand(logits)
    return g, T


def token_ids() -> np.ndarray:
    return np.array([3, 1, 4, 15], dtype=np.int32)


def splits_summary(sched: Any) -> list[tuple[str, int, int, list[str]]]:
    """(backend, first node, last node, input names) per split, as the spec writes them."""
    return [(sched.backends[sp.backend_id].name, sp.i_start, sp.i_end - 1, [s.name for s in sp.inputs])
            for sp in sched.splits]


def check_invariants(sched: Any, graph: Graph) -> None:
    """§5.1 invariants 22-25: coverage, no split starts with a view op, one backend per split,
    operand locality through copies."""
    splits = sched.splits
    assert splits[0].i_start == 0 and splits[-1].i_end == graph.n_nodes
    for a, b in zip(splits, splits[1:]):
        assert a.i_end == b.i_start
    seen_inputs: dict[tuple[int, int], int] = {}
    copies_on: dict[int, set[int]] = {}
    for per_backend in sched.hv_tensor_copies.values():
        for b, slot in enumerate(per_backend):
            copies_on.setdefault(b, set()).update(id(c) for c in slot if c is not None)
    for k, sp in enumerate(splits):
        if k > 0:
            assert not graph.nodes[sp.i_start].is_view_op, f"split #{k} starts with a view op"
        for s in sp.inputs:
            key = (id(s), sp.backend_id)
            assert key not in seen_inputs, f"'{s.name}' listed twice as input of backend {sp.backend_id}"
            seen_inputs[key] = k
        for node in graph.nodes[sp.i_start:sp.i_end]:
            assert tensor_backend_id(sched, node) != -1
            if node.is_view_op:
                continue
            B = sp.backend_id
            assert tensor_backend_id(sched, node) == B, f"'{node.name}' not on its split's backend"
            dev = sched.backends[B].device
            assert dev.supports_op(node), f"'{node.name}' ({node.op.name}) on a backend that lacks it"
            for s in node.src:
                if s is None:
                    continue
                if id(s) in copies_on.get(B, ()):
                    continue                                  # reached through this backend's copy
                sb = tensor_backend_id(sched, s)
                buf = root_buffer(s)
                buft = buf.buft if buf is not None else sched.bufts[sb]
                assert sb != -1 and (sb == B or dev.supports_buft(buft)), \
                    f"'{node.name}' on {sched.backends[B].name} reads '{s.name}' from backend {sb}"

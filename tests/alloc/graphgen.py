"""Random computable DAGs for allocator (and later executor) tests.

`random_graph(rng)` builds a graph from core op builders: INPUT leafs, constant leafs, pre-allocated
weight leafs (bound by a Tallocr into a host buffer), element-wise ops (in-place capable and not),
reshapes, views, permutes, mul_mat, soft_max, write-into ops (the *_inplace variants and cpy), and
OUTPUT flags. The same seed gives the same structure, so a second call is a "same-shape" graph.

Value semantics stay unambiguous: an in-place variant or a cpy writes into a root only when that root
has not been read yet and is never read again except through the returned view.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from ggml_dist.alloc.tallocr import Tallocr
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import Op, Tensor, TensorFlag, is_contiguous
from ggml_dist.core.types import GGMLType

from .fakes import FakeBufferType

F32 = GGMLType.F32
_NE0 = (4, 8, 16)
_NE1 = (1, 2, 3, 5)


@dataclass
class GenGraph:
    ctx: Context
    graph: Graph
    inputs: list[Tensor] = field(default_factory=list)      # INPUT leafs (set their values before compute)
    consts: list[Tensor] = field(default_factory=list)      # leafs placed by the graph allocator
    weights: list[Tensor] = field(default_factory=list)     # pre-allocated leafs (in weight_buffer)
    outputs: list[Tensor] = field(default_factory=list)     # tensors flagged OUTPUT
    weight_buffer: Any = None


class _Builder:
    def __init__(self, rng: random.Random, weight_buffer: Any) -> None:
        self.rng = rng
        self.ctx = Context(1 << 24, no_alloc=True, name="gen")
        self.g = GenGraph(self.ctx, Graph(4096), weight_buffer=weight_buffer)
        self.talloc = Tallocr(weight_buffer, alignment=32)
        self.pool: list[Tensor] = []             # tensors that may be read by new nodes
        self.created: list[Tensor] = []          # every non-leaf result, in creation order
        self.read: set[int] = set()              # ids of tensors (and roots) read so far

    # -- operands ------------------------------------------------------------------------------
    def leaf(self, ne: tuple[int, ...], kind: str | None = None) -> Tensor:
        kind = kind or self.rng.choice(("input", "const", "weight"))
        t = self.ctx.new_tensor(F32, ne)
        if kind == "input":
            t.set_input()
            self.g.inputs.append(t)
        elif kind == "weight":
            self.talloc.alloc(t)
            self.g.weights.append(t)
        else:
            self.g.consts.append(t)
        t.set_name(f"{kind}_{len(self.ctx.tensors)}")
        self.pool.append(t)
        return t

    def pick(self, pred=lambda t: True) -> Tensor | None:
        cands = [t for t in self.pool if pred(t)]
        return self.rng.choice(cands) if cands else None

    def use(self, *ts: Tensor) -> None:
        for t in ts:
            self.read.add(id(t))
            self.read.add(id(t.view_src if t.view_src is not None else t))

    def fresh(self, t: Tensor) -> bool:
        """Not read yet, owns its memory, and nothing reads it through a view."""
        return (t.view_src is None and id(t) not in self.read and t.op != Op.NONE
                and not any(v.view_src is t for v in self.pool))

    def add(self, t: Tensor, *srcs: Tensor) -> Tensor:
        self.use(*srcs)
        self.pool.append(t)
        self.created.append(t)
        return t

    def retire_root(self, r: Tensor) -> None:
        self.pool = [t for t in self.pool if t is not r and t.view_src is not r]

    # -- one random op ---------------------------------------------------------------------------
    def step(self) -> None:
        rng, ctx = self.rng, self.ctx
        kind = rng.choice(("cont", "scale", "binary", "binary", "norm", "unary", "reshape", "view",
                           "permute", "mul_mat", "soft_max", "inplace", "cpy", "leaf"))
        a = self.pick()
        if a is None or kind == "leaf":
            self.leaf((rng.choice(_NE0), rng.choice(_NE1)))
            return
        if kind == "cont":
            self.add(ops.cont(ctx, a), a)
        elif kind == "scale":
            self.add(ops.scale(ctx, a, rng.choice((0.5, 2.0))), a)
        elif kind == "binary":
            bcast = rng.random() < 0.3
            ne_b = (a.ne[0], 1, 1, 1) if bcast else a.ne
            b = self.pick(lambda t: t.ne == ne_b and t is not a) if rng.random() < 0.7 else None
            if b is None:
                b = self.leaf(ne_b[:2])
            op = ops.add if rng.random() < 0.6 else ops.mul
            self.add(op(ctx, a, b), a, b)
        elif kind in ("norm", "unary", "soft_max"):
            a = self.pick(is_contiguous)
            if a is None:
                return
            if kind == "norm":
                t = ops.rms_norm(ctx, a, 1e-5)
            elif kind == "unary":
                t = ops.silu(ctx, a)
            else:
                t = ops.soft_max_ext(ctx, a, None, 0.5)
            self.add(t, a)
        elif kind == "reshape":
            a = self.pick(is_contiguous)
            if a is None:
                return
            if a.ne[1] > 1:
                self.add(ops.reshape(ctx, a, a.nelements), a)
            else:
                ne0 = rng.choice([n for n in _NE0 if a.ne[0] % n == 0 and a.ne[0] // n in _NE1] or [a.ne[0]])
                self.add(ops.reshape(ctx, a, ne0, a.ne[0] // ne0), a)
        elif kind == "view":
            a = self.pick(lambda t: is_contiguous(t) and t.ne[1] > 1)
            if a is None:
                return
            row = rng.randrange(a.ne[1])
            if rng.random() < 0.5:
                self.add(ops.view_1d(ctx, a, a.ne[0], row * a.nb[1]), a)
            else:
                self.add(ops.view_2d(ctx, a, a.ne[0], a.ne[1] - row, a.nb[1], row * a.nb[1]), a)
        elif kind == "permute":
            t = ops.transpose(ctx, a)
            self.add(t, a)
            if rng.random() < 0.7:
                self.add(ops.cont(ctx, t), t)
        elif kind == "mul_mat":
            k = a.ne[0]
            m = rng.choice(_NE0)
            w = self.pick(lambda t: t.ne[0] == k and t.ne[1] == m and t.ne[2] == 1 and t.nb[0] <= t.nb[1]
                          and t is not a) if rng.random() < 0.3 else None
            if w is None:
                w = self.leaf((k, m), rng.choice(("weight", "weight", "const")))
            self.add(ops.mul_mat(ctx, w, a), w, a)
        elif kind == "inplace":
            a = self.pick(self.fresh)
            if a is None:
                return
            self.retire_root(a)
            if rng.random() < 0.5:
                t = ops.scale(ctx, a, 3.0, inplace=True)
                self.add(t, a)
            else:
                b = self.pick(lambda t: t.ne == a.ne) or self.leaf(a.ne[:2])
                t = ops.add(ctx, a, b, inplace=True)
                self.add(t, a, b)
        elif kind == "cpy":
            b = self.pick(lambda t: self.fresh(t) and t.nelements == a.nelements and t is not a
                          and t is not a.view_src)
            if b is None:
                return
            self.retire_root(b)
            t = ops.cpy(ctx, a, b)
            self.add(t, a, b)
            if self.rng.random() < 0.5:          # a write with no reader pins its root (E7)
                self.pool.remove(t)

    def finish(self, p_output: float) -> GenGraph:
        for t in self.created:
            if self.rng.random() < p_output:
                t.set_output()
        self.g.outputs = [t for t in self.created if t.flags & TensorFlag.OUTPUT]
        consumed = {id(s) for t in self.created for s in t.src if s is not None}
        for t in self.created:
            if id(t) not in consumed or t.flags & TensorFlag.OUTPUT:
                self.g.graph.build_forward_expand(t)
        for t in self.g.inputs + self.g.consts:          # unread leafs are still allocated
            if t not in self.g.graph:
                self.g.graph.build_forward_expand(t)
        return self.g


def random_graph(rng: random.Random, n_ops: int = 24, weight_buffer: Any = None,
                 p_output: float = 0.1) -> GenGraph:
    """Build a random graph; weights go into `weight_buffer` (a fresh host buffer if None)."""
    if weight_buffer is None:
        weight_buffer = FakeBufferType(name="weights").alloc_buffer(1 << 20)
    b = _Builder(rng, weight_buffer)
    for _ in range(rng.randint(1, 3)):
        b.leaf((rng.choice(_NE0), rng.choice(_NE1)), "input")
    for _ in range(n_ops):
        b.step()
    if not b.created:
        a = b.pool[0]
        b.add(ops.cont(b.ctx, a), a)
    return b.finish(p_output)

"""Split plans: a split's subgraph as plain data, sent once per graph shape to the actor that runs it.

    describe(nodes, resolve)  driver side: every tensor the split touches becomes a record
        {"id", "kind", "key", "type", "ne", "nb", "op", "op_params", "flags", "src", "view_src",
         "view_offs", "name"}
      kind "node"   computed by the split (its data lives in the actor's compute buffer)
      kind "weight" a model weight, named by its GGUF name (the actor has it mapped)
      kind "kv"     a KV-cache tensor, named (the actor owns that layer's cache)
      kind "input"  arrives with every call under `key` (a graph input or another stage's output)
    rebuild(desc, weights, kv)  actor side: the same tensors in a fresh Context, leafs bound to the
        actor's weights and cache, ready for its Gallocr.

The plan id is a hash of the description, so a reused graph shape costs only the id on the wire.
"""
from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..core.context import TENSOR_OVERHEAD, Context
from ..core.graph import Graph
from ..core.tensor import Op, Tensor, TensorFlag
from ..core.types import GGMLType

Resolve = Callable[[Tensor], "tuple[str, str] | None"]   # leaf -> (kind, key), or None for a node
_COPY = re.compile(r"#\d+$")


def plan_name(t: Tensor) -> str:
    """A tensor's name in a plan: without the scheduler's copy index. With n_copies > 1 the driver's
    scheduler gives each graph input and cross-stage operand a slot per copy, named
    "<backend>#<name>#<copy>" (ggml_backend_sched's input copies); a stage takes its inputs by value,
    so the slot is the driver's affair, and the same split on copy 0 and copy 3 is one plan, not four
    (which the stage would rebuild and bind on first use, ~0.3 s a plan on a host of 0.6 core)."""
    return _COPY.sub("", t.name)


class PlanError(ValueError):
    """A plan description that does not rebuild into a valid graph."""


def describe(nodes: list[Tensor], resolve: Resolve, exports: list[tuple[Tensor, str]]) -> dict[str, Any]:
    """The split's nodes (in order) and every tensor they reach, as msgpack-able data."""
    ids: dict[Tensor, int] = {}
    recs: list[dict[str, Any]] = []
    node_set = set(nodes)

    def visit(t: Tensor) -> int:
        if t in ids:
            return ids[t]
        kind, key = ("node", "")
        if t not in node_set:
            r = resolve(t)
            if r is None:
                raise PlanError(f"'{t.name}' ({t.op.name}) is neither computed by the split nor a "
                                f"weight, cache tensor or input")
            kind, key = r
        src = [visit(s) if s is not None else -1 for s in t.src] if kind == "node" else []
        vsrc = visit(t.view_src) if (t.view_src is not None and kind == "node") else -1
        ids[t] = len(recs)
        recs.append({"kind": kind, "key": key, "type": int(t.type), "ne": list(t.ne), "nb": list(t.nb),
                     "op": int(t.op) if kind == "node" else 0, "op_params": list(t.op_params),
                     "flags": int(t.flags), "src": src, "view_src": vsrc, "view_offs": t.view_offs,
                     "name": plan_name(t)})
        return ids[t]

    order = [visit(t) for t in nodes]
    return {"tensors": recs, "nodes": order, "exports": [[ids[t], key] for t, key in exports]}


def plan_id(desc: dict[str, Any]) -> str:
    return hashlib.blake2b(msgpack.packb(desc, use_bin_type=True), digest_size=12).hexdigest()


@dataclass
class RebuiltPlan:
    graph: Graph
    inputs: dict[str, Tensor]          # key -> input tensor (filled per call)
    exports: list[tuple[str, Tensor]]  # key -> tensor returned after compute
    ctx: Context


def rebuild(desc: dict[str, Any], weights: dict[str, Tensor], kv: dict[str, Tensor]) -> RebuiltPlan:
    recs = desc.get("tensors")
    if not isinstance(recs, list) or not isinstance(desc.get("nodes"), list):
        raise PlanError("plan has no tensor or node list")
    ctx = Context(TENSOR_OVERHEAD * (len(recs) + 16), no_alloc=True, name="stage-plan")
    ts: list[Tensor] = []
    inputs: dict[str, Tensor] = {}
    for i, r in enumerate(recs):
        kind = r["kind"]
        if kind == "weight" or kind == "kv":
            table = weights if kind == "weight" else kv
            if r["key"] not in table:
                raise PlanError(f"plan needs {kind} '{r['key']}', which this stage does not hold")
            t = table[r["key"]]
            if list(t.ne) != r["ne"] or int(t.type) != r["type"]:
                raise PlanError(f"{kind} '{r['key']}' is {t.type.name}{list(t.ne)} here, "
                                f"{GGMLType(r['type']).name}{r['ne']} in the plan")
            ts.append(t)
            continue
        vsrc = r["view_src"]
        if vsrc >= i or any(s >= i for s in r["src"]):
            raise PlanError(f"tensor {i} refers forward; plans list operands first")
        t = ctx.new_tensor(GGMLType(r["type"]), r["ne"], ts[vsrc] if vsrc >= 0 else None, r["view_offs"])
        t.nb = tuple(r["nb"])
        t.op, t.op_params = Op(r["op"]), tuple(r["op_params"])
        t.flags = TensorFlag(r["flags"])
        t.src = [ts[s] if s >= 0 else None for s in r["src"]]
        t.name = r["name"]
        if kind == "input":
            t.op, t.src = Op.NONE, []
            t.flags |= TensorFlag.INPUT
            inputs[r["key"]] = t
        elif kind != "node":
            raise PlanError(f"unknown tensor kind '{kind}'")
        ts.append(t)
    g = Graph(max(len(desc["nodes"]), len(recs)) + 16)
    for i in desc["nodes"]:
        g.build_forward_expand(ts[i])
    exports = []
    for i, key in desc.get("exports", []):
        ts[i].flags |= TensorFlag.OUTPUT         # never overwritten before it is sent
        exports.append((key, ts[i]))
    return RebuiltPlan(g, inputs, exports, ctx)

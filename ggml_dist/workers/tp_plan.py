"""The memory account of a tensor-parallel group (`plan --tensor-parallel K`): per rank the weights it maps
(its rows of every matrix and its range of the experts: model/tensor_parallel.py's rank_weights, summed
from the tensors' sizes, nothing read) and its KV cache (its kv heads' share of every attention layer's
cells), beside one process's. The compute buffer (a rank's graph is one process's, with narrower
products) and the process are not counted here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace

from ..core.tensor import nbytes
from ..model import layout
from ..model.context import ContextParams
from ..model.model import LlamaModel
from ..model.tensor_parallel import check_split, expert_bounds, rank_weights
from .driver import kv_plan, plan_stages
from .model_sizes import MIB
from .placement import Placement


@dataclass(frozen=True)
class RankAccount:
    rank: int
    weights: int                    # bytes of the weights it maps
    kv: int                         # bytes of its KV cache
    experts: tuple[int, int] | None     # the experts it holds, lo..hi-1 (a mixture of experts)


def rank_plan(model: LlamaModel, size: int, params: ContextParams) -> list[RankAccount]:
    """Each rank's account; refuses (TensorParallelError) a model that K ranks cannot split exactly."""
    check_split(model.hp, size)
    hp = model.hp
    kv = kv_bytes(model, params) // size
    bounds = expert_bounds(hp.n_expert, size)

    def mapped(r: int) -> int:          # a tied head is rows of token_embd, which every rank maps whole
        return sum(nbytes(t) for name, t in rank_weights(model.weights, hp, r, size).items() if name in model.weights)
    return [RankAccount(r, mapped(r), kv, (bounds[r], bounds[r + 1]) if hp.n_expert else None) for r in range(size)]


def rank_placement(placement: Placement, model: LlamaModel, rank: int, size: int) -> Placement:
    """A pipeline's placement for the whole model made rank `rank`'s (workers/tp_stages.py): each stage's
    weights as the rank maps them (its rows of the stage's tensors), and its kv heads' share of the cache.
    The compute buffer stays one process's (a rank's graph has the same gathers, narrower products)."""
    mine = rank_weights(model.weights, model.hp, rank, size)
    tied = layout.tied_head(model.file)
    n = len(placement.stages)
    stages = []
    for s in placement.stages:
        names = layout.stage_tensors(model.weights, s.layers, s.stage == 0, s.stage == n - 1, tied)
        if tied and s.stage == n - 1 and s.stage > 0:     # the head's rows of token_embd, not all of it
            names = [layout.HEAD if name == layout.EMBD else name for name in names]
        stages.append(replace(s, weight_bytes=sum(nbytes(mine[name]) for name in names), kv_bytes=s.kv_bytes // size))
    return replace(placement, stages=stages)


def kv_bytes(model: LlamaModel, params: ContextParams) -> int:
    """One process's KV cache: every attention layer's cells (K divides the kv heads, so the rows too)."""
    hp = model.hp
    n_kv, kv_size = kv_plan(params)
    n_attn = sum(not hp.is_recurrent(il) for il in range(hp.n_layer))
    return (hp.n_embd_k_gqa + hp.n_embd_v_gqa) * n_kv * kv_size * n_attn


def table(model: LlamaModel, accounts: list[RankAccount], params: ContextParams) -> str:
    whole = sum(nbytes(t) for t in model.weights.values())
    head = (f"tensor-parallel group of {len(accounts)} ranks, {params.n_ctx}-token context (one process: weights "
            f"{whole / MIB:.1f} MiB, KV {kv_bytes(model, params) / MIB:.1f} MiB)")
    rows = [head, f"{'rank':>4}  {'weights MiB':>11}  {'KV MiB':>7}  experts"]
    for a in accounts:
        ex = f"{a.experts[0]}..{a.experts[1] - 1}" if a.experts else "-"
        rows.append(f"{a.rank:>4}  {a.weights / MIB:>11.1f}  {a.kv / MIB:>7.1f}  {ex}")
    return "\n".join(rows)


def to_json(accounts: list[RankAccount]) -> list[dict]:
    return [{"rank": a.rank, "weights_bytes": a.weights, "kv_bytes": a.kv,
             "experts": list(a.experts) if a.experts else None} for a in accounts]


def report(model: LlamaModel, size: int, params: ContextParams, as_json: bool, n_stages: int | str | None = 1,
           layers: list[tuple[int, int]] | None = None) -> str:
    """`plan --tensor-parallel K`'s output: the table, or one JSON object {"ranks": [...]}; with --stages S,
    each rank's pipeline (workers/tp_stages.py): its stages' placement, or {"ranks": [{"rank", "stages"}]}."""
    accounts = rank_plan(model, size, params)
    if n_stages in (None, 1):
        return json.dumps({"ranks": to_json(accounts)}) if as_json else table(model, accounts, params)
    if not isinstance(n_stages, int):
        raise ValueError(f"--tensor-parallel {size} with --stages {n_stages}: give the number of stages")
    whole = plan_stages(model, params, n_stages, layers=layers)
    plans = [rank_placement(whole, model, r, size) for r in range(size)]
    if as_json:
        return json.dumps({"ranks": [{"rank": r, "stages": p.to_json()} for r, p in enumerate(plans)]})
    return "\n".join(f"tensor-parallel rank {r} of {size}, its pipeline of {n_stages} stages:\n{p.table()}"
                     for r, p in enumerate(plans))

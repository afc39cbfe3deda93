"""Placement: contiguous layer ranges per stage, sized by each stage's memory budget.

A stage's need = its weights (the first also holds the token embeddings, the last the output norm and
head) + its layers' KV cache + its compute buffer x n_copies. The compute buffer is the allocator's
reserve of the whole model's worst-case graph, an upper bound for any one stage's share. Layers are
split to balance the bytes each stage reads per token (its layers, plus the head on the last stage:
the embeddings are only gathered from), then checked against the budgets.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.gguf import GGUFFile
from ..model.hparams import LlamaHParams


class PlacementError(RuntimeError):
    """The model does not fit the stages' budgets."""


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]        # [first, last)
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int
    budget_bytes: int | None
    node: str = ""

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.compute_bytes


@dataclass(frozen=True)
class Placement:
    stages: list[StagePlan]

    def table(self) -> str:
        rows = [f"{'stage':>5} {'node':<12} {'layers':<9} {'weights MiB':>12} {'KV MiB':>8} "
                f"{'compute MiB':>12} {'total MiB':>10} {'budget MiB':>11}"]
        for s in self.stages:
            b = f"{s.budget_bytes / 2**20:11.1f}" if s.budget_bytes else f"{'-':>11}"
            rows.append(f"{s.stage:>5} {s.node or '-':<12} {s.layers[0]:>3}..{s.layers[1] - 1:<4} "
                        f"{s.weight_bytes / 2**20:12.1f} {s.kv_bytes / 2**20:8.1f} "
                        f"{s.compute_bytes / 2**20:12.1f} {s.total_bytes / 2**20:10.1f} {b}")
        return "\n".join(rows)

    def to_json(self) -> list[dict]:
        return [{"stage": s.stage, "node": s.node, "layers": list(s.layers), "weight_bytes": s.weight_bytes,
                 "kv_bytes": s.kv_bytes, "compute_bytes": s.compute_bytes, "budget_bytes": s.budget_bytes}
                for s in self.stages]


def layer_weight_bytes(f: GGUFFile, n_layer: int) -> tuple[list[int], int, int]:
    """Bytes per layer, of the first stage's extras (embeddings), of the last's (norm + head)."""
    per = [0] * n_layer
    first = last = 0
    tied = "output.weight" not in f.tensors
    for name, info in f.tensors.items():
        if name.startswith("blk."):
            per[int(name.split(".")[1])] += info.nbytes
        elif name == "token_embd.weight":
            first += info.nbytes
            if tied:
                last += info.nbytes        # the last stage maps the embeddings too, as its head
        else:
            last += info.nbytes
    return per, first, last


def place(f: GGUFFile, hp: LlamaHParams, n_stages: int, n_ctx: int, kv_type_size: int = 2,
          compute_bytes: int = 0, n_copies: int = 1, budgets: list[int] | None = None,
          layers: list[tuple[int, int]] | None = None, nodes: list[str] | None = None) -> Placement:
    """Split hp.n_layer layers over n_stages (or take explicit `layers`) and check the budgets."""
    if n_stages < 1:
        raise PlacementError(f"need at least one stage, got {n_stages}")
    if n_stages > hp.n_layer:
        raise PlacementError(f"{n_stages} stages for {hp.n_layer} layers: every stage needs a layer")
    if budgets is not None and len(budgets) not in (1, n_stages):
        raise PlacementError(f"give one budget or one per stage ({n_stages}), got {len(budgets)}")
    per, first, last = layer_weight_bytes(f, hp.n_layer)
    kv_per_layer = (hp.n_embd_k_gqa + hp.n_embd_v_gqa) * n_ctx * kv_type_size
    # balance the work: get_rows reads a few embedding rows, while the head reads all of its weight
    ranges = layers if layers is not None else _balance(per, 0, last, n_stages)
    _check_ranges(ranges, hp.n_layer, n_stages)
    out = []
    for k, (lo, hi) in enumerate(ranges):
        w = sum(per[lo:hi]) + (first if k == 0 else 0) + (last if k == n_stages - 1 else 0)
        if n_stages == 1 and "output.weight" not in f.tensors:
            w -= first                               # one stage maps the tied embeddings once
        budget = None if budgets is None else (budgets[k] if len(budgets) > 1 else budgets[0])
        out.append(StagePlan(k, (lo, hi), w, kv_per_layer * (hi - lo), compute_bytes * n_copies, budget,
                             nodes[k] if nodes and k < len(nodes) else ""))
    for s in out:
        if s.budget_bytes is not None and s.total_bytes > s.budget_bytes:
            raise PlacementError(
                f"stage {s.stage} (layers {s.layers[0]}..{s.layers[1] - 1}) needs "
                f"{s.total_bytes / 2**20:.1f} MiB (weights {s.weight_bytes / 2**20:.1f}, KV "
                f"{s.kv_bytes / 2**20:.1f}, compute {s.compute_bytes / 2**20:.1f}) but its budget is "
                f"{s.budget_bytes / 2**20:.1f} MiB; add stages, shorten --ctx, or raise the budget")
    return Placement(out)


def _balance(per: list[int], first: int, last: int, k: int) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest stage's weight bytes (binary search on the bound)."""
    n = len(per)
    cost = list(per)
    cost[0] += first
    cost[-1] += last

    def fits(limit: int) -> list[tuple[int, int]] | None:
        """Greedy packing under `limit`; None if it needs more than k ranges."""
        ranges, lo, acc = [], 0, 0
        for i, c in enumerate(cost):
            if c > limit:
                return None
            if acc + c > limit:
                ranges.append((lo, i))
                lo, acc = i, 0
            acc += c
        ranges.append((lo, n))
        return ranges if len(ranges) <= k else None

    lo_b, hi_b = max(cost), sum(cost)
    while lo_b < hi_b:
        mid = (lo_b + hi_b) // 2
        if fits(mid) is not None:
            hi_b = mid
        else:
            lo_b = mid + 1
    ranges = fits(lo_b)
    assert ranges is not None
    while len(ranges) < k:                       # split the widest range until there are k
        i = max(range(len(ranges)), key=lambda j: ranges[j][1] - ranges[j][0])
        a, b = ranges[i]
        m = (a + b) // 2
        ranges[i:i + 1] = [(a, m), (m, b)]
    return ranges


def _check_ranges(ranges: list[tuple[int, int]], n_layer: int, k: int) -> None:
    if len(ranges) != k:
        raise PlacementError(f"{len(ranges)} layer ranges for {k} stages")
    expect = 0
    for lo, hi in ranges:
        if lo != expect or hi <= lo:
            raise PlacementError(f"layer ranges {ranges} must be contiguous, non-empty and start at 0")
        expect = hi
    if expect != n_layer:
        raise PlacementError(f"layer ranges {ranges} cover {expect} of {n_layer} layers")

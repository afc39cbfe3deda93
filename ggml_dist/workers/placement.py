"""Placement: contiguous layer ranges per stage, sized by each stage's memory and put on nodes.

A stage's need = its weights (the first also holds the token embeddings, the last the output norm and
head) + its layers' KV cache + its compute buffer (the largest plan of its splits, as the driver's
scheduler plans it, which is what the stage allocates: its plans share one buffer, and the n_copies
input copies live in the driver's plan only) + the fixed overhead of a stage process
(STAGE_OVERHEAD_BYTES).

    place(...)           K stages against optional per-stage budgets (`plan --budget-gib`, one machine)
    place_on_nodes(...)  K stages (or the fewest that fit: `--stages auto`) on a cluster's nodes, one
                         stage per node, each range sized to fit its node; among the splits that fit,
                         the one whose largest stage reads the fewest bytes per token

Bytes read per token are a stage's layer weights plus, on the last stage, the head: the embeddings
are only gathered from.

Layer ranges are written one way everywhere a user reads or writes them: `first:end`, end exclusive, as
Python's slices and as the `[first, end]` pairs of the JSON (`0:17` is layers 0 to 16). `--layers`
takes them comma-separated (`0:15,15:30`), and still takes the older inclusive `0-14,15-29`
(parse_layers; layers_text writes one).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..model.archs import LlamaHParams
from ..model.gguf import GGUFFile
from .model_sizes import MIB, ModelSizes

# The private (anonymous) memory of a stage actor's process besides its weights, KV cache and compute
# buffer: the Ray core worker (~50 MiB), numpy and numba/llvmlite (~30 MiB), the compiled kernels and
# the interpreter's heap after decoding. Measured by `python benchmarks/stage_overhead.py` (a 2-layer
# model, so weights, KV and compute are < 2 MiB): 115-116 MiB on x86-64 Linux, Python 3.11, Ray 2.60.
# Shared library pages (~120 MiB, file-backed and shared by every process on a node) are not counted.
STAGE_OVERHEAD_BYTES = 120 * MIB



class PlacementError(RuntimeError):
    """The model does not fit the stages' budgets or the cluster's nodes."""


def layers_text(layers: tuple[int, int]) -> str:
    """A layer range [first, end) as the user sees it: "first:end"."""
    return f"{layers[0]}:{layers[1]}"


def parse_layers(spec: str) -> list[tuple[int, int]]:
    """`--layers`: comma-separated ranges `first:end` (end exclusive), or the older inclusive
    `first-last`; [(first, end)] half-open. Whether they cover the model is checked by the placement."""
    out = []
    for part in spec.split(","):
        try:
            if ":" in part:
                a, b = part.split(":")
                out.append((int(a), int(b)))
            else:
                a, b = part.split("-")
                out.append((int(a), int(b) + 1))
        except ValueError:
            raise PlacementError(f"--layers takes ranges first:end (end exclusive), comma-separated, e.g. "
                                 f"0:15,15:30 (or the inclusive 0-14,15-29), got '{spec}'") from None
    return out


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node as the placement sees it (workers/resources.py reads them from Ray)."""
    node_id: str
    ip: str
    memory_bytes: int
    cpus: float
    gpus: float = 0.0


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layers: tuple[int, int]        # [first, last)
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int
    budget_bytes: int | None
    overhead_bytes: int = 0
    node_ip: str = ""
    node_id: str = ""
    node_memory_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.compute_bytes + self.overhead_bytes


@dataclass(frozen=True)
class Placement:
    stages: list[StagePlan]

    def table(self) -> str:
        rows = [(f"{'stage':>5} {'node':<15} {'layers':<9} {'weights MiB':>12} {'KV MiB':>8} "
                 f"{'compute MiB':>12} {'overhead MiB':>13} {'total MiB':>10} {'node/budget MiB':>16}")]
        for s in self.stages:
            cap = s.node_memory_bytes if s.node_memory_bytes is not None else s.budget_bytes
            c = f"{cap / MIB:16.1f}" if cap else f"{'-':>16}"
            rows.append(f"{s.stage:>5} {s.node_ip or '-':<15} {layers_text(s.layers):<9} "
                        f"{s.weight_bytes / MIB:12.1f} {s.kv_bytes / MIB:8.1f} "
                        f"{s.compute_bytes / MIB:12.1f} {s.overhead_bytes / MIB:13.1f} "
                        f"{s.total_bytes / MIB:10.1f} {c}")
        return "\n".join(rows)

    def to_json(self) -> list[dict]:
        return [{"stage": s.stage, "node_ip": s.node_ip, "node_id": s.node_id, "layers": list(s.layers),
                 "weight_bytes": s.weight_bytes, "kv_bytes": s.kv_bytes, "compute_bytes": s.compute_bytes,
                 "overhead_bytes": s.overhead_bytes, "total_bytes": s.total_bytes,
                 "node_memory_bytes": s.node_memory_bytes, "budget_bytes": s.budget_bytes}
                for s in self.stages]


def _stage(m: ModelSizes, k: int, n: int, rng: tuple[int, int], compute: int, overhead: int,
           budget: int | None = None, node: NodeInfo | None = None) -> StagePlan:
    return StagePlan(k, rng, m.weights(*rng, k == 0, k == n - 1), m.cache_bytes(*rng),
                     compute, budget, overhead, node.ip if node else "", node.node_id if node else "",
                     node.memory_bytes if node else None)


def _need_text(s: StagePlan) -> str:
    return (f"stage {s.stage} (layers {layers_text(s.layers)}) needs {s.total_bytes / MIB:.1f} MiB "
            f"(weights {s.weight_bytes / MIB:.1f}, KV {s.kv_bytes / MIB:.1f}, compute "
            f"{s.compute_bytes / MIB:.1f}, process {s.overhead_bytes / MIB:.1f})")


def place(f: GGUFFile, hp: LlamaHParams, n_stages: int, n_ctx: int, kv_type_size: int = 2,
          compute_bytes: int | Sequence[int] = 0, n_copies: int = 1, budgets: list[int] | None = None,
          layers: list[tuple[int, int]] | None = None, overhead_bytes: int = 0, n_seq: int = 1) -> Placement:
    """Split hp.n_layer layers over n_stages (or take explicit `layers`) and check the budgets.
    compute_bytes: one figure for every stage (times n_copies), or the planned one per stage; n_seq:
    the sequences a hybrid model's recurrent layers keep rows for."""
    if n_stages < 1:
        raise PlacementError(f"need at least one stage, got {n_stages}")
    if n_stages > hp.n_layer:
        raise PlacementError(f"{n_stages} stages for {hp.n_layer} layers: every stage needs a layer")
    if budgets is not None and len(budgets) not in (1, n_stages):
        raise PlacementError(f"give one budget or one per stage ({n_stages}), got {len(budgets)}")
    m = ModelSizes.of(f, hp, n_ctx, kv_type_size, n_seq)
    compute = _per_stage(compute_bytes, n_stages, n_copies)
    ranges = layers if layers is not None else _balance(m, n_stages)
    _check_ranges(ranges, hp.n_layer, n_stages)
    out = [_stage(m, k, n_stages, r, compute[k], overhead_bytes,
                  None if budgets is None else budgets[k if len(budgets) > 1 else 0])
           for k, r in enumerate(ranges)]
    for s in out:
        if s.budget_bytes is not None and s.total_bytes > s.budget_bytes:
            raise PlacementError(f"{_need_text(s)} but its budget is {s.budget_bytes / MIB:.1f} MiB; add "
                                 f"stages, shorten --ctx, or raise the budget")
    return Placement(out)


def _per_stage(compute: int | Sequence[int], n: int, n_copies: int = 1) -> list[int]:
    if isinstance(compute, int):
        return [compute * n_copies] * n
    if len(compute) != n:
        raise PlacementError(f"{len(compute)} compute sizes for {n} stages")
    return list(compute)


# -- on a cluster -------------------------------------------------------------------------------------
ComputeOf = Callable[[int], Sequence[int]]          # n_stages -> planned compute bytes per stage


def place_on_nodes(m: ModelSizes, nodes: Sequence[NodeInfo], n_stages: int | None, compute_of: ComputeOf,
                   overhead_bytes: int = STAGE_OVERHEAD_BYTES, threads: int = 1,
                   layers: list[tuple[int, int]] | None = None) -> Placement:
    """One stage per node. n_stages None: the fewest stages that fit. Nodes need `threads` CPUs."""
    fit = sorted((n for n in nodes if n.cpus >= threads and n.memory_bytes > 0),
                 key=lambda n: (-n.memory_bytes, n.ip, n.node_id))
    if not fit:
        raise PlacementError(f"no alive node has {threads} CPU{'s' if threads > 1 else ''} and memory for a "
                             f"stage (nodes: {_nodes_text(nodes)})")
    if layers is not None:
        _check_ranges(layers, m.n_layer, len(layers))
        return _assign_ranges(m, fit, layers, compute_of(len(layers)), overhead_bytes)
    if n_stages is not None:
        if n_stages < 1 or n_stages > m.n_layer:
            raise PlacementError(f"{n_stages} stages for {m.n_layer} layers: every stage needs a layer")
        if n_stages > len(fit):
            raise PlacementError(f"{n_stages} stages need {n_stages} nodes with {threads} CPU(s); the cluster "
                                 f"has {len(fit)} ({_nodes_text(nodes)})")
        got = _fit_k(m, fit[:n_stages], compute_of(n_stages), overhead_bytes)
        if got is None:
            raise PlacementError(_no_fit_text(m, fit, n_stages, compute_of, overhead_bytes))
        return got
    for k in range(1, min(len(fit), m.n_layer) + 1):
        got = _fit_k(m, fit[:k], compute_of(k), overhead_bytes)
        if got is not None:
            return got
    raise PlacementError(_no_fit_text(m, fit, None, compute_of, overhead_bytes))


def _fit_k(m: ModelSizes, nodes: Sequence[NodeInfo], compute: Sequence[int],
           overhead: int) -> Placement | None:
    """The best split over these k nodes (one stage each): for every order of up to 5 nodes (the first
    stage holds the embeddings, the last the head, so the order matters), else for descending memory,
    the largest last and ascending."""
    k = len(nodes)
    if k <= 5:
        orders = set(itertools.permutations(nodes))
    else:
        orders = {tuple(nodes), (*nodes[1:], nodes[0]), tuple(reversed(nodes))}
    best: tuple[int, Placement] | None = None
    for order in sorted(orders, key=lambda o: [n.node_id for n in o]):      # deterministic ties
        caps = [n.memory_bytes - overhead - compute[i] for i, n in enumerate(order)]
        ranges = _fit_ranges(m, caps)
        if ranges is None:
            continue
        bound = max(m.read_per_token(lo, hi, i == k - 1) for i, (lo, hi) in enumerate(ranges))
        if best is None or bound < best[0]:
            best = (bound, Placement([_stage(m, i, k, r, compute[i], overhead, node=order[i])
                                      for i, r in enumerate(ranges)]))
    return None if best is None else best[1]


def _fit_ranges(m: ModelSizes, caps: list[int]) -> list[tuple[int, int]] | None:
    """Contiguous ranges, one per cap (bytes left for weights + KV), minimising the largest stage's
    bytes read per token; None if no split fits the caps."""
    k, n = len(caps), m.n_layer
    if k > n:
        return None

    def solve(bound: int | None) -> list[tuple[int, int]] | None:
        """Which ends each stage can reach, stage by stage (O(k n)): stage i can end at e iff the
        largest reachable start j < e gives a range [j, e) that fits (a smaller j only adds layers)."""
        starts = [True] + [False] * n
        parents = []
        for i, cap in enumerate(caps):
            limit = n if i == k - 1 else n - (k - 1 - i)      # leave a layer for each stage after it
            ends, par, j = [False] * (n + 1), [-1] * (n + 1), -1
            for e in range(1, limit + 1):
                if starts[e - 1]:
                    j = e - 1
                if j >= 0 and _fits(m, j, e, i, k, cap, bound):
                    ends[e], par[e] = True, j
            parents.append(par)
            starts = ends
        if not starts[n]:
            return None
        ranges, e = [], n
        for par in reversed(parents):
            ranges.append((par[e], e))
            e = par[e]
        return ranges[::-1]

    if solve(None) is None:
        return None
    lo_b, hi_b = 0, m.read_per_token(0, n, True)
    while lo_b < hi_b:                            # the smallest bound under which the caps still fit
        mid = (lo_b + hi_b) // 2
        if solve(mid) is not None:
            hi_b = mid
        else:
            lo_b = mid + 1
    return solve(lo_b)


def _fits(m: ModelSizes, lo: int, hi: int, i: int, k: int, cap: int, bound: int | None) -> bool:
    if m.weights(lo, hi, i == 0, i == k - 1) + m.cache_bytes(lo, hi) > cap:
        return False
    return bound is None or m.read_per_token(lo, hi, i == k - 1) <= bound


def _assign_ranges(m: ModelSizes, nodes: Sequence[NodeInfo], ranges: list[tuple[int, int]],
                   compute: Sequence[int], overhead: int) -> Placement:
    """Explicit --layers: the neediest stage on the largest node, and so on down (the sorted pairing
    fits whenever any pairing does)."""
    k = len(ranges)
    if k > len(nodes):
        raise PlacementError(f"{k} layer ranges need {k} nodes; the cluster has {len(nodes)} that can "
                             f"run a stage ({_nodes_text(nodes)})")
    stages = [_stage(m, i, k, r, compute[i], overhead) for i, r in enumerate(ranges)]
    by_need = sorted(stages, key=lambda s: -s.total_bytes)
    placed = {}
    for s, node in zip(by_need, nodes):
        if s.total_bytes > node.memory_bytes:
            raise PlacementError(f"{_need_text(s)} but the largest node left ({node.ip}) has "
                                 f"{node.memory_bytes / MIB:.1f} MiB; choose other --layers or add memory")
        placed[s.stage] = replace(s, node_ip=node.ip, node_id=node.node_id,
                                  node_memory_bytes=node.memory_bytes)
    return Placement([placed[i] for i in range(k)])


def _no_fit_text(m: ModelSizes, fit: Sequence[NodeInfo], n_stages: int | None, compute_of: ComputeOf,
                 overhead: int) -> str:
    """One line: what the largest stage of the best split needs, the largest node, what would fit."""
    largest = fit[0].memory_bytes
    k0 = n_stages or min(len(fit), m.n_layer)
    ranges = _balance(m, k0)
    comp = compute_of(k0)
    worst = max((_stage(m, i, k0, r, comp[i], overhead) for i, r in enumerate(ranges)),
                key=lambda s: s.total_bytes)
    head = f"--stages {n_stages}" if n_stages else "--stages auto"
    want = ""
    for k in range(k0 + 1, m.n_layer + 1):        # equal nodes: how many, of what size, would hold it
        comp = compute_of(k)
        need = max(_stage(m, i, k, r, comp[i], overhead).total_bytes for i, r in enumerate(_balance(m, k)))
        if need <= largest or k == m.n_layer:
            want = f"; needs {k} nodes of >= {need / MIB:.0f} MiB"
            break
    return (f"{head}: the model does not fit: {_need_text(worst)}, the largest node has "
            f"{largest / MIB:.1f} MiB{want}; the cluster has {len(fit)} node{'s' if len(fit) != 1 else ''} "
            f"that can run a stage ({_nodes_text(fit)})")


def _nodes_text(nodes: Sequence[NodeInfo]) -> str:
    return ", ".join(f"{n.ip} {n.memory_bytes / MIB:.0f} MiB {n.cpus:g} CPU" for n in nodes) or "none"


def _balance(m: ModelSizes, k: int) -> list[tuple[int, int]]:
    """Contiguous ranges minimising the largest stage's bytes read per token (no memory caps)."""
    ranges = _fit_ranges(m, [2**62] * k)
    if ranges is None:
        raise PlacementError(f"{k} stages for {m.n_layer} layers: every stage needs a layer")
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

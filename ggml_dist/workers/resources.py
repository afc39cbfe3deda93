"""What the cluster has: every alive node's Ray resources (memory, CPU, GPU) and IP.

    cluster_nodes(available=True)  the alive nodes; with `available`, what each has left now (what
                                   other actors and tasks reserve is taken off), else its totals
    stage_options(plan, threads)   the Ray options of a stage actor: it reserves `memory=` its need
                                   and `num_cpus=` its threads, pinned to its planned node; soft, so
                                   that a restart after the node is lost goes to another node, which
                                   Ray chooses only among nodes with that much memory left

Ray's `memory` resource is logical: Ray places by it and does not measure the process. A node started
with `ray start --memory BYTES` offers BYTES; otherwise Ray offers ~70% of the machine's free memory.
"""
from __future__ import annotations

from typing import Any

from .placement import NodeInfo, StagePlan


def cluster_nodes(available: bool = True) -> list[NodeInfo]:
    import ray
    left: dict[str, dict[str, float]] = {}
    if available:
        try:
            from ray._private.state import available_resources_per_node
            left = available_resources_per_node()
        except (ImportError, AttributeError):    # an older or newer Ray without it: use the totals
            left = {}
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = left.get(n["NodeID"], n.get("Resources", {})) if available else n.get("Resources", {})
        out.append(NodeInfo(n["NodeID"], n["NodeManagerAddress"], int(res.get("memory", 0)),
                            float(res.get("CPU", 0.0)), float(res.get("GPU", 0.0))))
    return out


def stage_options(plan: StagePlan, threads: int) -> dict[str, Any]:
    opts: dict[str, Any] = {"num_cpus": threads}
    if plan.node_id:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        opts["memory"] = plan.total_bytes
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=plan.node_id, soft=True)
    else:
        opts["scheduling_strategy"] = "SPREAD"
    return opts

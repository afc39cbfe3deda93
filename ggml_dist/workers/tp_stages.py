"""Tensor-parallel groups beside a pipeline (issue 54): `--stages S --tensor-parallel K`, S x K stage actors.

    launch_stage_group(model_path, S, K, params, ...) -> (model, TensorParallelContext, [Pipeline] * K)

Rank r's pipeline is S stage actors (workers/cluster.py's Pipeline.launch with rank=(r, K)): stage s holds
rank r's rows of stage s's layers (StageSpec.tp_*: model/tensor_parallel.py's rank_weights) and its kv
heads' cache, and computes rank r's graph of those layers, whose ALL_GATHER nodes exchange on a mesh of
stage s's K actors (workers/collective.py; opened here once every actor holds its weights). Every layer
ends in a gather, so each rank's stage s ends a ubatch with the whole activations, which it sends to stage
s + 1 of its own rank: the K pipelines run side by side, K links between consecutive stages, and meet only
in their stages' exchanges.

On the driver, each rank's context is a RankContext over its pipeline (model/tp_local.py): rank 0's is the
TensorParallelContext the caller uses, the others follow it on threads of this process, each building its
rank's graphs and sending its own stage calls. Every rank's last stage computes the whole logits (the
head's gather), the same bits on each, so each chooses the same tokens and feeds them to its own first
stage (followers that choose their tokens): no step waits for the driver.

The layers are split alike for every rank (rank 0's placement); stage s of rank r goes on node_ids[s * K + r]
where given. A stage whose node cannot read the model file is sent its rank's rows only (quantized rows
and whole experts are contiguous in the file: workers/shipping.py sends each slice as it lies). A lost
stage actor is not replaced (its stage's mesh would have to be remade): the group fails with the error.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial

import numpy as np

from ..model.context import ContextParams
from ..model.model import LlamaModel
from ..model.tensor_parallel import check_split
from ..model.tp_local import Follower, RankContext, TensorParallelContext, ThreadFollower
from .cluster import Pipeline
from .placement import Placement

MESH_TIMEOUT_S = 120.0      # how long a stage's ranks wait for each other to connect, and at each exchange


class DriverRank:
    """The collective of a rank's context on the driver: its rank and the group's size. Its stages
    exchange; the driver's graphs run there, so nothing here calls all_gather."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        raise RuntimeError("a tensor-parallel stage group exchanges in its stage actors, not on the driver")

    def close(self) -> None:
        pass


class PipelineFollower(ThreadFollower):
    """Rank r > 0's context over its own pipeline, on a thread of the driver; it chooses its own tokens."""
    chooses_tokens = True

    def __init__(self, model: LlamaModel, params: ContextParams, pipeline: Pipeline, rank: int, size: int) -> None:
        self.pipeline = pipeline
        slot = DriverRank(rank, size)
        super().__init__(model, params, slot, make=partial(RankContext, model, params, slot, pipeline.hooks))

    def close(self) -> None:
        super().close()
        self.pipeline.shutdown()


def launch_stage_group(model_path: str, n_stages: int, size: int, params: ContextParams | None = None, *,
                       node_ids: list[str] | None = None, threads_per_stage: int = 1, n_copies: int | None = None,
                       layers: list[tuple[int, int]] | None = None, calls: str = "auto",
                       on_plan: Callable[[Placement], None] | None = None, stage_model_path: str | None = None,
                       ) -> tuple[LlamaModel, TensorParallelContext, list[Pipeline]]:
    """K pipelines of S stages, their stages' meshes, and the driver's contexts over them (module
    docstring); on_plan sees rank 0's placement (every rank's layers) before its actors start. A stage
    that cannot read the model (at stage_model_path, default model_path) is sent its rank's rows only."""
    import ray
    params = params or ContextParams()
    model = LlamaModel.load(model_path)
    check_split(model.hp, size)
    if node_ids is not None and len(node_ids) != n_stages * size:
        raise ValueError(f"{len(node_ids)} nodes for {n_stages} stages x {size} tensor-parallel ranks")
    pipelines: list[Pipeline] = []
    try:
        for r in range(size):
            pl = Pipeline.launch(model_path, n_stages, params, n_copies=n_copies, layers=layers,
                                 threads_per_stage=threads_per_stage, calls=calls, rank=(r, size),
                                 stage_model_path=stage_model_path,
                                 node_ids=None if node_ids is None else node_ids[r::size],
                                 on_plan=on_plan if r == 0 else None)
            layers = [s.layers for s in pl.placement.stages]          # every rank's, as rank 0's
            pipelines.append(pl)
        secret = os.urandom(16)
        for s in range(n_stages):
            actors = [pl.actors[s] for pl in pipelines]
            addresses = ray.get([a.tp_listen.remote() for a in actors])
            ray.get([a.tp_connect.remote(addresses, secret, MESH_TIMEOUT_S, MESH_TIMEOUT_S) for a in actors])
    except BaseException:
        for pl in pipelines:
            pl.shutdown()
        raise

    def ranks(model: LlamaModel, params: ContextParams) -> tuple[DriverRank, list[Follower]]:
        return DriverRank(0, size), [PipelineFollower(model, params, pl, r, size)
                                     for r, pl in enumerate(pipelines[1:], start=1)]
    try:
        ctx = TensorParallelContext(model, size, params, ranks=ranks, pipeline=pipelines[0].hooks)
    except BaseException:
        for pl in pipelines:
            pl.shutdown()
        raise
    return model, ctx, pipelines

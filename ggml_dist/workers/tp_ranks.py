"""Tensor-parallel ranks 1..K-1 as Ray actors (issue 54), rank 0 the driver's own context
(model/tp_local.py's TensorParallelContext, with ray_ranks as its RankGroup).

    ctx = TensorParallelContext(model, K, params, ranks=ray_ranks(model_path, K))

Each rank actor maps the model file, listens for the group's mesh (workers/collective.py), and once
every rank's address is known connects and builds its RankContext (its rows of every matrix, its heads'
KV cache). The exchanges inside a ubatch go over the mesh's persistent links, rank to rank; Ray carries
only the context calls (one per submit, seq_rm, ...: what every rank must do the same), each run on the
actor's one thread in the order sent. A rank that fails otherwise than by refusing a call closes its
mesh, so the other ranks fail at their next exchange instead of waiting.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..model.context import ContextParams
from ..model.model import LlamaModel
from ..model.tp_local import REFUSALS, Follower, RankContext, RankGroup
from .collective import Collective, MeshCollective, MeshListener, mesh_connect


def _reachable_ip(gcs_address: str) -> str:
    """This process's IP on the route to the cluster's head (a driver in a host of its own, e.g. a testbed
    namespace, is not on the node Ray says it joined through)."""
    ip = gcs_address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 1))                                     # a route is chosen; nothing is sent
        return str(s.getsockname()[0])


class RankActor:
    """One rank r > 0 of a group (made a Ray actor by ray_ranks)."""

    def __init__(self, model_path: str, params: ContextParams, rank: int, threads: int) -> None:
        import ray

        from ..backends.host import kernel_threads
        kernel_threads.set_threads(threads)                    # its share of the node, as a stage's
        if not os.path.exists(model_path):
            raise FileNotFoundError(f"tensor-parallel rank {rank} cannot read {model_path} on its node")
        self.model_path, self.params, self.rank = model_path, params, rank
        host = ray.util.get_node_ip_address()                  # where the other ranks reach this one
        self.listener = MeshListener(host, advertise=host)
        self.collective: MeshCollective | None = None
        self.ctx: RankContext | None = None

    def address(self) -> str:
        return self.listener.address

    def connect(self, addresses: list[str], secret: bytes, timeout_s: float) -> int:
        """Join the mesh, then build this rank's context; its pid."""
        self.collective = mesh_connect(self.rank, addresses, secret, self.listener, timeout_s)
        self.ctx = RankContext(LlamaModel.load(self.model_path), self.params, self.collective)
        return os.getpid()

    def call(self, fn: Callable[[RankContext], Any]) -> None:
        """fn(this rank's context); nothing comes back (rank 0's result is the group's)."""
        assert self.ctx is not None and self.collective is not None, "connect() first"
        try:
            fn(self.ctx)
        except REFUSALS:
            raise
        except BaseException:
            self.collective.close()
            raise


class RayFollower:
    """The driver's handle on a rank actor (the Follower protocol)."""

    def __init__(self, actor: Any, connected: Any) -> None:
        self.actor, self._connected = actor, connected

    def call(self, fn: Callable[[RankContext], Any]) -> Future:
        return self.actor.call.remote(fn).future()

    def ready(self) -> None:
        import ray
        ray.get(self._connected)

    def close(self) -> None:
        import ray
        ray.kill(self.actor)


def ray_ranks(model_path: str, size: int, timeout_s: float = 300.0, threads: int = 1,
              num_cpus: float | None = None, node_ids: list[str] | None = None) -> RankGroup:
    """Ranks 1..size-1 as Ray actors (Ray connected already) of `threads` kernel threads each (asking Ray
    for num_cpus, default threads), rank r on node_ids[r - 1] where given (else where Ray puts it), rank 0
    here: the RankGroup for TensorParallelContext."""
    if node_ids is not None and len(node_ids) != size - 1:
        raise ValueError(f"{len(node_ids)} nodes for the {size - 1} rank actors of --tensor-parallel {size}")
    def make(model: LlamaModel, params: ContextParams) -> tuple[Collective, list[Follower]]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        host = _reachable_ip(ray.get_runtime_context().gcs_address)
        actor_cls: Any = ray.remote(num_cpus=threads if num_cpus is None else num_cpus)(RankActor)  # calls in order
        actors: list[Any] = []
        for r in range(1, size):
            where = {} if node_ids is None else {"scheduling_strategy": NodeAffinitySchedulingStrategy(
                node_ids[r - 1], soft=False)}
            actors.append(actor_cls.options(**where).remote(os.path.abspath(model_path), params, r, threads))
        own = MeshListener(host, advertise=host)
        addresses = [own.address, *ray.get([a.address.remote() for a in actors], timeout=timeout_s)]
        secret = os.urandom(16)
        connected = [a.connect.remote(addresses, secret, timeout_s) for a in actors]
        try:
            coll = mesh_connect(0, addresses, secret, own, timeout_s)
        except BaseException:
            for a in actors:
                ray.kill(a)
            raise
        return coll, [RayFollower(a, c) for a, c in zip(actors, connected, strict=True)]
    return make

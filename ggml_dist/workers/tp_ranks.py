"""Tensor-parallel ranks 1..K-1 as Ray actors (issue 54), rank 0 the driver's own context
(model/tp_local.py's TensorParallelContext, with ray_ranks as its RankGroup).

    ctx = TensorParallelContext(model, K, params, ranks=ray_ranks(model_path, K))

Each rank actor maps the model file, listens for the group's mesh (workers/collective.py), and once
every rank's address is known connects and builds its RankContext (its rows of every matrix, its heads'
KV cache). Ray sets the group up and tears it down; everything between goes over the mesh's persistent
links. The exchanges inside a ubatch go rank to rank; the context calls (one per submit, seq_rm, ...:
what every rank must do the same) go from rank 0 to each rank on their link as a "call" frame (the
function, cloudpickled) that the rank's loop thread runs in the order sent, answering with a "done"
frame once its exchanges of that call are sent. On each link the frames then come in one order: a call,
its exchanges, its answer, the next call. A Ray call per step cost 1-2 ms of latency (the other ranks
started their ubatch that much later, and rank 0 waited for them at its first exchange) and the
driver's CPU; a frame costs tens of microseconds. A rank that fails otherwise than by refusing a call
answers with its error and closes its mesh, so the other ranks fail at their next exchange instead of
waiting.
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..model.context import ContextParams
from ..model.model import LlamaModel
from ..model.tp_local import REFUSALS, Follower, RankContext, RankGroup
from .collective import Collective, CollectiveError, MeshCollective, MeshListener, mesh_connect
from .links import Link, LinkClosed


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
        """Join the mesh, build this rank's context, then serve rank 0's calls on a thread; its pid."""
        self.collective = mesh_connect(self.rank, addresses, secret, self.listener, timeout_s)
        self.ctx = RankContext(LlamaModel.load(self.model_path), self.params, self.collective)
        threading.Thread(target=self._serve, name=f"tp-rank{self.rank}", daemon=True).start()
        return os.getpid()

    def _serve(self) -> None:
        """Rank 0's call frames, run in order, each answered by a done frame (None, or the error); ends
        when rank 0 closes the link (the group is closed) or a call fails otherwise than by refusing."""
        from ray import cloudpickle
        assert self.ctx is not None and self.collective is not None
        link = self.collective.links[0]
        assert link is not None
        while True:
            try:
                header, body = link.recv()
            except LinkClosed:
                return
            if header["t"] != "call" or body is None:
                self.collective.close()                        # not the protocol: nothing after it can be trusted
                return
            error: BaseException | None = None
            try:
                cloudpickle.loads(body)(self.ctx)
            except BaseException as e:  # noqa: BLE001 -- answered to rank 0, which raises it
                error = e
            try:
                link.send({"t": "done"}, cloudpickle.dumps(error))
            except LinkClosed:
                return
            if error is not None and not isinstance(error, REFUSALS):
                self.collective.close()
                return


class _Answer(Future):
    """A call's answer: read from the rank's link by whoever asks for it (rank 0's thread, after its
    own part of the call, so that the rank's exchanges of the call were read before)."""

    def __init__(self, link: Link, rank: int) -> None:
        super().__init__()
        self.link, self.rank = link, rank

    def _read(self) -> None:
        from ray import cloudpickle
        if self.done():
            return
        try:
            header, body = self.link.recv()
            if header["t"] != "done" or body is None:
                raise CollectiveError(f"tensor-parallel rank {self.rank} answered a call with a '{header['t']}' frame")
            error = cloudpickle.loads(body)
        except LinkClosed as e:
            error = CollectiveError(f"tensor-parallel rank {self.rank} closed its link ({e})")
        except BaseException as e:  # noqa: BLE001 -- the call's outcome
            error = e
        if error is None:
            self.set_result(None)
        else:
            self.set_exception(error)

    def result(self, timeout: float | None = None) -> Any:
        self._read()
        return super().result(0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._read()
        return super().exception(0)


class RayFollower:
    """The driver's handle on a rank actor (the Follower protocol): calls as frames on the rank's link."""
    chooses_tokens = False

    def __init__(self, actor: Any, connected: Any, link: Link, rank: int) -> None:
        self.actor, self._connected, self.link, self.rank = actor, connected, link, rank

    def call(self, fn: Callable[[RankContext], Any]) -> Future:
        from ray import cloudpickle
        answer = _Answer(self.link, self.rank)
        try:
            self.link.send({"t": "call"}, cloudpickle.dumps(fn))
        except LinkClosed as e:
            answer.set_exception(CollectiveError(f"tensor-parallel rank {self.rank}: the call was not sent ({e})"))
        return answer

    def ready(self) -> None:
        import ray
        ray.get(self._connected)

    def close(self) -> None:
        import ray
        ray.kill(self.actor)


def ray_ranks(model_path: str, size: int, timeout_s: float = 300.0, threads: int = 1,
              num_cpus: float | None = None, node_ids: list[str] | None = None,
              memory: list[int] | None = None) -> RankGroup:
    """Ranks 1..size-1 as Ray actors (Ray connected already) of `threads` kernel threads each (asking Ray
    for num_cpus, default threads), rank r on node_ids[r - 1] where given (else spread over the nodes),
    rank 0 here: the RankGroup for TensorParallelContext. memory: the bytes each rank actor holds (asked
    of Ray, so a rank goes where they fit; refused at once where no node has them)."""
    if node_ids is not None and len(node_ids) != size - 1:
        raise ValueError(f"{len(node_ids)} nodes for the {size - 1} rank actors of --tensor-parallel {size}")
    def make(model: LlamaModel, params: ContextParams) -> tuple[Collective, list[Follower]]:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        if memory is not None:
            _check_memory(memory)
        host = _reachable_ip(ray.get_runtime_context().gcs_address)
        actor_cls: Any = ray.remote(num_cpus=threads if num_cpus is None else num_cpus)(RankActor)  # calls in order
        actors: list[Any] = []
        for r in range(1, size):
            where: dict[str, Any] = {"scheduling_strategy": "SPREAD"} if node_ids is None else {
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node_ids[r - 1], soft=False)}
            if memory is not None:
                where["memory"] = memory[r - 1]
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
        return coll, [RayFollower(a, c, coll.links[r], r)                 # type: ignore[arg-type]
                      for r, (a, c) in enumerate(zip(actors, connected, strict=True), start=1)]
    return make


def _check_memory(memory: list[int]) -> None:
    """Refuse, with the numbers, rank actors that no set of the cluster's nodes can hold (Ray would leave
    them pending): the largest rank above the roomiest node, or all of them above every node together."""
    from .placement import MIB
    from .resources import cluster_nodes
    free = sorted((n.memory_bytes for n in cluster_nodes()), reverse=True)
    if not free or max(memory) > free[0] or sum(memory) > sum(free):
        have = ", ".join(f"{b / MIB:.0f}" for b in free) or "none"
        raise MemoryError(f"tensor-parallel rank actors need {', '.join(f'{b / MIB:.0f}' for b in memory)} MiB; "
                          f"the cluster's nodes have {have} MiB free")

"""A stage actor on Ray: StageActor, the Ray face of a StageWorker (workers/stage.py knows nothing of
Ray), and the plain actor calls that reach it (a Call for its proxy), with Ray's errors turned into the
driver's: StageLostError where the stage's state is gone, a RuntimeError naming the stage otherwise.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends.base import StageLostError
from .health import HealthServer, StageWatch
from .proxy import Call
from .stage import PlanMissingError, StageWorker
from .stage_data import StageInfo, StageSpec, StageStats
from .stage_loop import StageLoop
from .wire import Message, ray_payload


class StageActor:
    """The Ray face of a StageWorker: messages in and out are wire.ray_payload's (bytes or arrays). A
    health port on the node's IP answers while the stage's calls queue (workers/health.py)."""

    def __init__(self, spec: StageSpec) -> None:
        import ray

        from ..backends.host import compile_progress
        compile_progress.install(f"stage {spec.stage_id}")   # its compiles reach the driver's log (log_to_driver)
        self.worker = StageWorker(spec)
        self.health = HealthServer(ray.util.get_node_ip_address(), self.worker.progress)
        self.loop: StageLoop | None = None

    def info(self) -> StageInfo:
        import ray
        return dataclasses.replace(self.worker.info(), health=self.health.address,
                                   node_ip=ray.util.get_node_ip_address())

    def open_weights(self, m: dict) -> bool:
        return self.worker.open_weights(m)

    def weights_chunk(self, offset: int, data: np.ndarray) -> int:
        return self.worker.weights_chunk(offset, data)

    def finish_weights(self) -> int:
        return self.worker.finish_weights()

    def stats(self, since: float = 0.0) -> StageStats:
        return self.worker.get_stats(since)

    def ping(self) -> int:
        return self.worker.ping()

    def wedge(self) -> None:
        self.worker.wedge()

    def tp_listen(self) -> str:
        import ray
        return self.worker.tp_listen(ray.util.get_node_ip_address())

    def tp_connect(self, addresses: list[str], secret: bytes, timeout_s: float, exchange_timeout_s: float) -> None:
        self.worker.tp_connect(addresses, secret, timeout_s, exchange_timeout_s)

    def direct_open(self, secret: str) -> str:
        """The direct transport's loop (workers/stage_loop.py): started once, reset on later opens (after a
        recovery: what was in flight is gone); returns where it listens."""
        import ray
        if self.loop is None:
            self.loop = StageLoop(self.worker, ray.util.get_node_ip_address(), bytes.fromhex(secret))
        else:
            self.loop.secret = bytes.fromhex(secret)
            self.loop.reset()
        return self.loop.address

    def direct_peers(self, addresses: list[str]) -> None:
        assert self.loop is not None
        self.loop.set_peers(addresses)

    def compute(self, pid: str, desc: dict | None, inputs: Message, incarnation: str | None,
                *upstream: Message) -> bytes | np.ndarray:
        """StageWorker.compute; every argument positional (a keyword costs Ray ~0.1 ms per call)."""
        return ray_payload(self.worker.compute(pid, desc, inputs, *upstream, incarnation=incarnation))

    def compute_chained(self, args: tuple, up: bytes | None = None) -> bytes:
        """compute() as a node of the compiled graph (workers/compiled.py): args are the driver's
        (pid, desc, inputs, incarnation) for this stage, up the stage before's result. Messages travel
        as bytes, which the channels pickle without a lookup per message."""
        pid, desc, inputs, incarnation = args
        ups = () if up is None else (up,)
        return bytes(self.worker.compute(pid, desc, inputs, *ups, incarnation=incarnation))


def _lost(e: BaseException) -> bool:
    """Does this Ray error mean a stage's state is gone (actor died or restarted, objects lost, the compiled
    graph's channels closed by a dead actor)?"""
    import ray.exceptions as rex
    lost_types = tuple(t for t in (getattr(rex, n, None) for n in (
        "RayActorError", "ActorDiedError", "ActorUnavailableError", "ObjectLostError", "OwnerDiedError",
        "ObjectReconstructionFailedError", "NodeDiedError", "WorkerCrashedError",
        "ActorUnschedulableError", "RayChannelError")) if t is not None)
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, (*lost_types, PlanMissingError)):
            return True
        cur = getattr(cur, "cause", None) or cur.__cause__    # RayTaskError keeps the original in .cause
    return False


def _stage_error(e: BaseException, what: str, stage: int = -1) -> BaseException:
    """The error a failed stage result raises on the driver: StageLostError (the context recovers)
    where the stage's state is gone, else a RuntimeError naming the stage; e is its cause."""
    if isinstance(e, StageLostError):
        return e
    err: BaseException
    if _lost(e):
        err = StageLostError(f"{what} lost its state: {type(e).__name__}", stage)
    else:
        err = RuntimeError(f"{what} failed: {e}")
    err.__cause__ = e
    return err


def _ray_call(actor: Any, stage: int, layers: tuple[int, int], watch: StageWatch,
              incarnation: Callable[[], str | None]) -> Call:
    def submit(pid: str, desc: dict | None, inputs: bytearray, *ups: Any) -> Any:
        return actor.compute.remote(pid, desc, ray_payload(inputs), incarnation(), *ups)

    def guarded(handles: list) -> list:
        try:
            return watch.wait(handles)
        except Exception as e:
            err = _stage_error(e, f"stage {stage} (layers {layers[0]}..{layers[1] - 1})", stage)
            if err is e:
                raise
            raise err from e

    return Call(submit, guarded, guarded)

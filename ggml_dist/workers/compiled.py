"""A pipeline step as one execution of a Ray Compiled Graph over the stage actors.

Why: a plain actor call costs about a millisecond of Ray's task machinery (submission, scheduling,
the object store, the reply) on the driver and again on the actor, and a step over k stages pays it k
times: on a 2-core host that overhead, not the kernels, bounded what two stages could gain over one.
Ray's Compiled Graph (beta since Ray 2.44; vLLM's pipeline runs on it) sets the channels up once: per
execution the driver writes every stage's arguments into one channel, stage k reads them and stage k-1's
result from channels, and the last stage's result comes back in a third, for tens of microseconds a hop.
Micro-batches still overlap: each stage runs its own loop, so stage 0 computes execution i+1 while stage
1 computes i.

    CompiledChain(n, actors, plain, watch, incarnation, lost)
        .call(k)    the Call stage k's proxy submits through
        .reset()    tear the graph down (recovery, shutdown); the next chain compiles a new one

The scheduler still calls the stage proxies one after the other. A chain is stage 0's call with no
upstream result, then stage k's with exactly stage k-1's: the calls collect their arguments, and the
last one executes the graph. Results are read in execution order, each once, and kept in its step; the
driver reads all of them (an unread one would hold the graph's output channel), at the latest when
MAX_INFLIGHT executions are out. Only the last stage's result reaches the driver (reading another
stage's export is an error). A call that does not continue the chain, or a graph that does not compile,
makes the pipeline fall back to plain actor calls for good (one stderr line says why); calls not yet
executed then go the plain way, so nothing is lost. So does a lost stage (see reset). Waits past the
deadline probe the stages' health ports as plain waits do (workers/health.py).
"""
from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .health import StageWatch
from .proxy import Call

MAX_INFLIGHT = 16                 # executions out before the oldest result is read first


@dataclass(eq=False)
class Step:
    """One execution: stage k's arguments (pid, desc, inputs, incarnation) in args[k]."""
    args: list[tuple] = field(default_factory=list)
    handles: list[ChainHandle] = field(default_factory=list)
    ref: Any = None               # its CompiledDAGRef once executed, until read
    msg: np.ndarray | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass(eq=False)
class ChainHandle:
    """What a proxy holds for one stage call: its place in a step, or the plain ObjectRef of a call
    that went the plain way."""
    step: Step
    stage: int
    ref: Any = None


class CompiledChain:
    """The stage calls of one pipeline, executed as a compiled graph where they form a chain.

    actors() -> the current actors; plain(k) -> stage k's plain Call (workers/actor.py); lost(e) ->
    the error to raise for a failed result (StageLostError where the stage's state is gone)."""

    def __init__(self, n: int, actors: Callable[[], list], plain: Callable[[int], Call], watch: StageWatch,
                 incarnation: Callable[[int], str | None], lost: Callable[[BaseException], BaseException]) -> None:
        self.n, self.actors, self.plain, self.watch = n, actors, plain, watch
        self.incarnation, self.lost = incarnation, lost
        self.dag: Any = None
        self.pending: Step | None = None          # a chain whose last stage has not submitted yet
        self.inflight: deque[Step] = deque()      # executed, not read yet (in execution order)
        self.enabled = True
        self.n_executions = 0

    def call(self, k: int) -> Call:
        return Call(lambda *a: self.submit(k, *a), self.get, self.wait, lambda: not self.enabled)

    # -- submission -----------------------------------------------------------------------------------
    def submit(self, k: int, pid: str, desc: dict | None, inputs: bytearray, *ups: Any) -> ChainHandle:
        if self.enabled and not self._continues(k, ups):
            self.fall_back(f"stage {k}'s call does not continue the chain of stage calls")
        if not self.enabled:
            refs = [self._plain_arg(u) for u in ups]
            return ChainHandle(Step(done=True), k, self.plain(k).submit(pid, desc, inputs, *refs))
        step = self.pending if k else Step()
        assert step is not None
        # bytes: pickled as they are (an array's pickling looks its reconstructor up, each time)
        step.args.append((pid, desc, bytes(inputs), self.incarnation(k)))
        h = ChainHandle(step, k)
        step.handles.append(h)
        self.pending = step
        if k == self.n - 1:
            self.pending = None
            self._execute(step)
        return h

    def _continues(self, k: int, ups: tuple) -> bool:
        if k == 0:
            return not ups and self.pending is None
        p = self.pending
        return p is not None and len(p.args) == k and len(ups) == 1 and ups[0] is p.handles[-1]

    def _execute(self, step: Step) -> None:
        if self.dag is None:
            try:
                self.dag = self._compile()
            except Exception as e:  # noqa: BLE001 - whatever stops it compiling, plain calls still work
                self.fall_back(f"the compiled graph did not compile ({type(e).__name__}: {e})", step)
                return
        while len(self.inflight) >= MAX_INFLIGHT:
            self._read(self.inflight[0])
        try:
            step.ref = self.dag.execute(*step.args)
        except Exception as e:  # noqa: BLE001 - the graph is closed (an actor died): raised when read
            step.done, step.error = True, self.lost(e)
            return
        self.inflight.append(step)
        self.n_executions += 1

    def _compile(self) -> Any:
        from ray.dag import InputNode
        with InputNode() as inp:
            node = None
            for k, actor in enumerate(self.actors()):
                node = actor.compute_chained.bind(inp[k]) if node is None else actor.compute_chained.bind(inp[k], node)
        assert node is not None
        with _quiet_ray_dag():
            return node.experimental_compile(_max_inflight_executions=MAX_INFLIGHT + 1)

    # -- results --------------------------------------------------------------------------------------
    def get(self, handles: list) -> list:
        out = []
        for h in handles:
            if h.ref is None and h.step is not self.pending and h.stage != self.n - 1:
                raise RuntimeError(f"stage {h.stage}'s result stayed on the stages: only the last stage's "
                                   f"result reaches the driver in a compiled chain")
            out.append(self._result(h))
        return out

    def wait(self, handles: list) -> None:
        for h in handles:
            if h.ref is not None or h.step is self.pending or h.stage == self.n - 1:
                self._result(h)
            else:
                self._finish(h.step)                # the step's last stage ran after this one

    def _result(self, h: ChainHandle) -> Any:
        if h.ref is None and h.step is self.pending:
            self.fall_back("a result was asked for before its chain of stage calls was complete")
        if h.ref is not None:
            return self.plain(h.stage).get([h.ref])[0]
        self._finish(h.step)
        return h.step.msg

    def _finish(self, step: Step) -> None:
        while not step.done:
            self._read(self.inflight[0])
        if step.error is not None:
            raise step.error

    def _read(self, step: Step) -> None:
        """The oldest execution's result into its step (or its error)."""
        from ray.exceptions import RayChannelTimeoutError
        ref, dag = step.ref, self.dag

        def ready(timeout: float) -> bool:
            try:
                dag._execute_until(ref._execution_index, ref._channel_index, timeout)
                return True
            except RayChannelTimeoutError:
                return False
        try:
            msg = self.watch.await_result(ready, ref.get)
            step.msg = np.frombuffer(bytes(msg), np.uint8)  # a copy, if the channel's buffer is reused
        except Exception as e:  # noqa: BLE001 - kept in the step, raised where its result is asked for
            step.error = self.lost(e)
        finally:
            step.done, step.ref = True, None
            self.inflight.popleft()

    # -- falling back, tearing down -------------------------------------------------------------------
    def _plain_arg(self, h: ChainHandle) -> Any:
        """A handle as an argument of a plain call: its ObjectRef, or the last stage's message."""
        if h.ref is not None:
            return h.ref
        if h.stage != self.n - 1:
            raise RuntimeError(f"stage {h.stage}'s result of a compiled execution is gone: it cannot feed a "
                               f"plain call")
        self._finish(h.step)
        return h.step.msg

    def fall_back(self, why: str, unexecuted: Step | None = None) -> None:
        """Plain actor calls from now on: read what is in flight, tear the graph down, and submit the
        calls of the chains not executed yet the plain way."""
        if not self.enabled:
            return
        print(f"ggml-dist: stage calls go as plain Ray calls from now on: {why}", file=sys.stderr, flush=True)
        for s in list(self.inflight):
            if not s.done:
                self._read(s)
        self._teardown()
        self.enabled = False
        for step in (self.pending, unexecuted):
            if step is not None:
                prev = None
                for h, (pid, desc, inputs, _) in zip(step.handles, step.args):
                    ups = () if prev is None else (prev,)
                    h.ref = self.plain(h.stage).submit(pid, desc, inputs, *ups)
                    prev = h.ref
        self.pending = None

    def reset(self, lost: bool = False) -> None:
        """Forget the graph and what is in it (a stage was lost, or the pipeline ends): its results in
        flight are lost. After a loss the calls go the plain way for good: a surviving actor's graph
        loop can stay blocked in a write to the dead stage's channel, which tearing down does not
        interrupt, and an actor runs one graph at a time (its plain calls still run beside it)."""
        from ..backends.base import StageLostError
        if lost and self.enabled:
            print("ggml-dist: stage calls go as plain Ray calls from now on: a stage was lost", file=sys.stderr,
                  flush=True)
            self.enabled = False
        for s in (*self.inflight, *([self.pending] if self.pending is not None else [])):
            s.done, s.ref = True, None
            s.error = StageLostError("the stages were restored: this result was lost with them")
        self.inflight.clear()
        self.pending = None
        self._teardown()

    def _teardown(self) -> None:
        dag, self.dag = self.dag, None
        if dag is not None:
            with _quiet_ray_dag():
                try:
                    dag.teardown()
                except Exception:  # noqa: BLE001 - an actor already gone: nothing left to stop there
                    pass


@contextmanager
def _quiet_ray_dag() -> Iterator[None]:
    """Ray logs compiling and tearing down a graph at INFO, and a dead actor's cancel at ERROR with a
    traceback: the pipeline reports what matters itself."""
    log = logging.getLogger("ray.dag.compiled_dag_node")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)

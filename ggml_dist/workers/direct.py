"""The driver's side of the direct transport: stage calls as frames on sockets, results passed from
stage to stage without the driver (workers/stage_loop.py has the stage's side and the why).

    chain = DirectChain(n, actors, watch, incarnation, describe)
    chain.connect()            each actor opens its loop (a Ray call), learns the others' addresses, and
                               the driver opens a link to each
    chain.call(k)              the Call stage k's proxy submits through (workers/proxy.py)
    chain.reset()              close the links and forget what is in flight (recovery, shutdown); the next
                               connect() starts over with the same actors or their replacements

A call is sent at once; its handle is (stage, seq). A later call that takes it as an upstream input
first sends its producer a "route" to the consumer, so the result goes from stage to stage (or from the
last stage to the first: token feedback) as soon as it exists. The driver receives a result only when
it asks for it (a route to -1), and a "done" for every call (waits, liveness). A handle's result is
dropped at its stage once the handle is gone. A link that breaks, or a call that fails because the
stage lost its state, raises StageLostError where a result is waited for; the pipeline recovers as
with plain calls.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from ..backends.base import StageLostError
from .health import StageWatch
from .links import Link, LinkClosed
from .proxy import Call
from .stage_loop import DRIVER, Failure


class DirectHandle:
    """One stage call: its result is read (get) or routed to a later call (an upstream input)."""
    __slots__ = ("__weakref__", "_drops", "msg", "seq", "stage", "to_driver")

    def __init__(self, stage: int, seq: int, drops: deque) -> None:
        self.stage, self.seq, self._drops = stage, seq, drops
        self.msg: bytearray | None = None
        self.to_driver = False

    def __del__(self) -> None:
        self._drops.append(self.seq)          # its stage may forget the result (sent with a later call)


class DirectChain:
    def __init__(self, n: int, actors: Callable[[], list], watch: StageWatch,
                 incarnation: Callable[[int], str | None], describe: Callable[[int], str]) -> None:
        self.n, self.actors, self.watch = n, actors, watch
        self.incarnation, self.describe = incarnation, describe
        self.secret = os.urandom(16)
        self.links: list[Link | None] = [None] * n
        self.addresses: list[str] = []
        self._cond = threading.Condition()
        self._results: dict[tuple[int, int], bytearray | Failure] = {}
        self._done: list[int] = [-1] * n                 # per stage, the newest call done (in order)
        self._failed: dict[tuple[int, int], Failure] = {}
        self._broken: tuple[int, str] | None = None      # a link that closed: (stage, why)
        self._drops: list[deque] = [deque() for _ in range(n)]
        self._seq = itertools.count()
        self.n_calls = 0
        self.n_results = 0                               # results the driver received (it asked for them)
        self.n_results_from = [0] * n

    @property
    def connected(self) -> bool:
        return all(link is not None for link in self.links)

    def connect(self, timeout_s: float = 60.0) -> None:
        import ray
        actors = self.actors()
        self.addresses = ray.get([a.direct_open.remote(self.secret.hex()) for a in actors], timeout=timeout_s)
        ray.get([a.direct_peers.remote(self.addresses) for a in actors], timeout=timeout_s)
        with self._cond:
            self._results.clear()
            self._failed.clear()
            self._done = [-1] * self.n
            self._broken = None
            self._drops = [deque() for _ in range(self.n)]
        for k, addr in enumerate(self.addresses):
            link = Link.connect(addr, self.secret, "driver", timeout=timeout_s)
            self.links[k] = link
            threading.Thread(target=self._read, args=(k, link), name=f"direct-{k}", daemon=True).start()

    def call(self, k: int) -> Call:
        return Call(lambda *a: self.submit(k, *a), self.get, self.wait)

    # -- submission -----------------------------------------------------------------------------------
    def submit(self, k: int, pid: str, desc: dict | None, inputs: bytearray, *ups: Any) -> DirectHandle:
        seq = next(self._seq)
        try:
            for u in ups:
                if not isinstance(u, DirectHandle):
                    raise TypeError(f"stage {k}'s call takes a {type(u).__name__}, not a direct call's handle")
                self._link(u.stage).send({"t": "route", "seq": u.seq, "to": k})
            drops = self._drain(k)
            self._link(k).send({"t": "call", "seq": seq, "pid": pid, "desc": desc, "inc": self.incarnation(k),
                                "ups": [[u.stage, u.seq] for u in ups], "drop": drops}, inputs)
        except LinkClosed as e:
            raise self._lost(k, f"its link broke ({e})") from e
        self.n_calls += 1
        return DirectHandle(k, seq, self._drops[k])

    def _link(self, k: int) -> Link:
        link = self.links[k]
        if link is None:
            raise LinkClosed(f"no link to stage {k} (the pipeline is recovering)")
        return link

    def _drain(self, k: int) -> list[int]:
        q, out = self._drops[k], []
        while q:
            out.append(q.popleft())
        return out

    # -- results --------------------------------------------------------------------------------------
    def get(self, handles: list) -> list:
        out = []
        for h in handles:
            if h.msg is None:
                if not h.to_driver:
                    try:
                        self._link(h.stage).send({"t": "route", "seq": h.seq, "to": DRIVER})
                    except LinkClosed as e:
                        raise self._lost(h.stage, f"its link broke ({e})") from e
                    h.to_driver = True
                h.msg = self.watch.await_result(partial(self._arrived, (h.stage, h.seq)),
                                                partial(self._take, (h.stage, h.seq)))
            out.append(h.msg)
        return out

    def wait(self, handles: list) -> None:
        for h in handles:
            self.watch.await_result(partial(self._finished, h), partial(self._check_done, h))

    def _arrived(self, key: tuple[int, int], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: key in self._results or self._broken is not None, timeout=timeout)

    def _finished(self, h: DirectHandle, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._done[h.stage] >= h.seq or self._broken is not None,
                                       timeout=timeout)

    def _take(self, key: tuple[int, int]) -> bytearray:
        with self._cond:
            res = self._results.pop(key, None)
            broken = self._broken
        if res is None:
            assert broken is not None
            raise self._lost(broken[0], broken[1])
        if isinstance(res, Failure):
            raise self._failure(key[0], res)
        return res

    def _check_done(self, h: DirectHandle) -> None:
        with self._cond:
            done, broken = self._done[h.stage] >= h.seq, self._broken
            failed = self._failed.get((h.stage, h.seq))
        if failed is not None:
            raise self._failure(h.stage, failed)
        if not done:
            assert broken is not None
            raise self._lost(broken[0], broken[1])

    def _read(self, k: int, link: Link) -> None:
        """Stage k's frames to the driver, into the state the waits look at."""
        try:
            while True:
                h, body = link.recv()
                t, seq = h["t"], int(h.get("seq", -1))
                with self._cond:
                    if t == "done":
                        self._done[k] = max(self._done[k], seq)
                        if not h.get("ok", True):
                            self._failed[(k, seq)] = Failure(str(h.get("kind")), str(h.get("msg")),
                                                             bool(h.get("lost")))
                            while len(self._failed) > 64:
                                self._failed.pop(next(iter(self._failed)))
                    elif t == "result":
                        self._results[(k, seq)] = body if body is not None else bytearray()
                        self.n_results += 1
                        self.n_results_from[k] += 1
                    elif t == "error":
                        self._results[(k, seq)] = Failure(str(h.get("kind")), str(h.get("msg")), bool(h.get("lost")))
                    self._cond.notify_all()
        except LinkClosed as e:
            why = f"its link closed ({e})"
        except Exception as e:  # noqa: BLE001 - a frame the driver cannot read: the link is useless
            why = f"its link sent what the driver cannot read ({type(e).__name__}: {e})"
        if self.links[k] is link:
            with self._cond:
                self._broken = self._broken or (k, why)
                self._cond.notify_all()

    def _lost(self, k: int, why: str) -> StageLostError:
        return StageLostError(f"{self.describe(k)}: {why}", k)

    def _failure(self, k: int, f: Failure) -> BaseException:
        if f.lost:
            return StageLostError(f"{self.describe(k)} lost its state: {f.kind}: {f.msg}", k)
        return RuntimeError(f"{self.describe(k)} failed: {f.kind}: {f.msg}")

    # -- tearing down ---------------------------------------------------------------------------------
    def reset(self) -> None:
        links, self.links = self.links, [None] * self.n
        for link in links:
            if link is not None:
                link.close()
        with self._cond:
            self._broken = (-1, "the pipeline was reset")
            self._results.clear()
            self._cond.notify_all()


def fall_back_line(why: str) -> None:
    print(f"ggml-dist: stage calls go as plain Ray calls: {why}", file=sys.stderr, flush=True)

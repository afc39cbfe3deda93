"""The stage's side of the direct transport: its calls arrive on a socket, its results go straight to the
stages (and the driver) that take them, without a Ray task per call.

Why: a Ray actor call costs the stage ~2-3 ms of CPU (task execution, the reply to its owner, the
owner's hand-on of the result to the next stage) and the driver ~1 ms; on a host with 0.6 of a core
that is ~5 ms a hop, ~9% of a 1.1B decode step over two stages. A frame on a socket costs tens of
microseconds. Ray still starts, places and restarts the actors, and carries the control calls.

    loop = StageLoop(worker, host, secret)      a server socket on the node's IP, an accept thread
    loop.set_peers(addresses)                   where the other stages listen (index = stage id)
    loop.reset()                                forget every call, result and route (a recovery)

Frames (workers/links.py) from the driver: "call" {seq, pid, desc, inc, ups: [[stage, seq]...], drop}
with the inputs as body, and "route" {seq, to}: send call seq's result to stage `to` (-1: the driver) as
soon as it exists. From other stages: "result" {frm, seq} with the message as body. To the driver: "done"
{seq} after each call, "result", and "error" {frm, seq, kind, msg, lost} for a call that failed.

One compute thread runs the calls in the order they came, each once its upstream results are in (the
same StageWorker.compute as a Ray call); results are kept until the driver drops them (its handle died,
"drop" rides on a later call) or, past KEEP of them, oldest first.
"""
from __future__ import annotations

import socket
import sys
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from .links import Link, LinkClosed
from .stage import PlanMissingError, StageWorker

KEEP = 512                    # results kept at most (the driver drops its own long before)
DRIVER = -1


@dataclass(frozen=True, slots=True)
class Failure:
    """A call that failed: sent in place of its result, to whoever takes it."""
    kind: str
    msg: str
    lost: bool                # the stage's state is gone (restarted, plan unknown): the driver recovers

    def header(self, frm: int, seq: int) -> dict[str, Any]:
        return {"t": "error", "frm": frm, "seq": seq, "kind": self.kind, "msg": self.msg, "lost": self.lost}


class StageLoop:
    def __init__(self, worker: StageWorker, host: str, secret: bytes) -> None:
        self.worker = worker
        self.stage = worker.spec.stage_id
        self.secret = secret
        self._server = socket.create_server((host, 0))
        self.address = f"{host}:{self._server.getsockname()[1]}"
        self._cond = threading.Condition()
        self._calls: deque[tuple[dict, bytearray]] = deque()
        self._inbox: dict[tuple[int, int], bytearray | Failure] = {}
        self._results: OrderedDict[int, bytearray | Failure] = OrderedDict()
        self._routes: dict[int, list[int]] = {}
        self._driver: Link | None = None
        self._peer_addrs: list[str] = []
        self._peers: dict[int, Link] = {}
        self._gen = 0                              # bumped by reset(): a call begun before it is dropped
        self._done = -1                            # the newest call finished (calls finish in order)
        self.n_calls = 0
        threading.Thread(target=self._accept, name="stage-accept", daemon=True).start()
        threading.Thread(target=self._compute, name="stage-compute", daemon=True).start()

    # -- control (Ray calls on the actor's main thread) --------------------------------------------------
    def set_peers(self, addresses: list[str]) -> None:
        with self._cond:
            self._peer_addrs = list(addresses)
            old, self._peers = self._peers, {}
        for link in old.values():
            link.close()

    def reset(self) -> None:
        with self._cond:
            self._gen += 1
            self._calls.clear()
            self._inbox.clear()
            self._results.clear()
            self._routes.clear()
            old, self._peers = self._peers, {}
            self._cond.notify_all()
        for link in old.values():
            link.close()

    # -- connections ----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(Link(sock, f"{addr[0]}:{addr[1]}"),),
                             name="stage-link", daemon=True).start()

    def _serve(self, link: Link) -> None:
        try:
            who = link.accept_hello(self.secret)
        except LinkClosed:
            return
        if who == "driver":
            with self._cond:
                old, self._driver = self._driver, link
            if old is not None:
                old.close()
        try:
            while True:
                header, body = link.recv()
                self._on_frame(header, body)
        except LinkClosed:
            pass
        except Exception as e:  # noqa: BLE001 - a frame this stage cannot take: say so, drop the link
            print(f"ggml-dist stage {self.stage}: dropping link {link.name}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        link.close()

    def _on_frame(self, h: dict[str, Any], body: bytearray | None) -> None:
        t = h["t"]
        if t == "call":
            with self._cond:
                for s in h.get("drop") or ():
                    self._results.pop(s, None)
                self._calls.append((h, body if body is not None else bytearray()))
                self._cond.notify_all()
        elif t == "route":
            seq, to = int(h["seq"]), int(h["to"])
            with self._cond:
                res = self._results.get(seq)
                if res is None and seq <= self._done:        # finished, and dropped since
                    res = Failure("ResultGone", f"stage {self.stage} no longer keeps call {seq}'s result", True)
                if res is None:
                    self._routes.setdefault(seq, []).append(to)
                    return
            self._send(to, seq, res)
        elif t in ("result", "error"):
            key = (int(h["frm"]), int(h["seq"]))
            val: bytearray | Failure = body if t == "result" and body is not None else \
                Failure(str(h.get("kind")), str(h.get("msg")), bool(h.get("lost")))
            with self._cond:
                self._inbox[key] = val
                self._cond.notify_all()
        else:
            raise ValueError(f"a '{t}' frame")

    def _link_to(self, to: int) -> Link | None:
        if to == DRIVER:
            return self._driver
        with self._cond:
            link = self._peers.get(to)
            addrs = self._peer_addrs
        if link is None or link.closed:
            link = Link.connect(addrs[to], self.secret, self.stage)
            with self._cond:
                self._peers[to] = link
        return link

    def _send(self, to: int, seq: int, res: bytearray | Failure) -> None:
        """A result (or its failure) to stage `to`, or to the driver; a link that broke is left to the
        driver's recovery (the peer is gone)."""
        if to == self.stage:                                # this stage takes its own result
            with self._cond:
                self._inbox[(self.stage, seq)] = res
                self._cond.notify_all()
            return
        try:
            link = self._link_to(to)
            if link is None:
                return
            if isinstance(res, Failure):
                link.send(res.header(self.stage, seq))
            else:
                link.send({"t": "result", "frm": self.stage, "seq": seq}, res)
        except (LinkClosed, OSError, IndexError):
            pass

    # -- compute --------------------------------------------------------------------------------------
    def _next(self) -> tuple[int, dict, bytearray, list]:
        """Wait for the oldest call whose upstream results are all in; take it and them."""
        with self._cond:
            while True:
                if self._calls:
                    h, body = self._calls[0]
                    ups = [(int(j), int(s)) for j, s in h.get("ups") or ()]
                    if all(u in self._inbox for u in ups):
                        self._calls.popleft()
                        return self._gen, h, body, [self._inbox.pop(u) for u in ups]
                self._cond.wait()

    def _compute(self) -> None:
        while True:
            gen, h, inputs, ups = self._next()
            seq = int(h["seq"])
            res: bytearray | Failure
            failed = next((u for u in ups if isinstance(u, Failure)), None)
            if failed is not None:
                res = failed                               # what failed upstream fails here too
            else:
                try:
                    res = self.worker.compute(h["pid"], h.get("desc"), inputs, *ups, incarnation=h.get("inc"))
                except Exception as e:  # noqa: BLE001 - sent to whoever takes this result, raised there
                    res = Failure(type(e).__name__, str(e), isinstance(e, PlanMissingError))
            with self._cond:
                if gen != self._gen:                       # reset meanwhile: nobody waits for it
                    continue
                self.n_calls += 1
                self._done = seq
                self._results[seq] = res
                while len(self._results) > KEEP:
                    self._results.popitem(last=False)
                dests = self._routes.pop(seq, [])
                driver = self._driver
            for to in dests:
                self._send(to, seq, res)
            if driver is not None:
                try:
                    driver.send(res.header(self.stage, seq) | {"t": "done", "ok": False} if isinstance(res, Failure)
                                else {"t": "done", "seq": seq, "ok": True})
                except LinkClosed:
                    pass

"""The live view's one data source, for the page and for scripts: samples of the pipeline at work.

    Live.snapshot()      GET /live: the latest sample, the last minutes' series, the events so far
    Live.subscribe()     GET /live/events: a sample a second, as server-sent events (routes_page.py)

A sample is two readings (live_probe.probe: what the engine, its metrics and the stages measure anyway)
turned into rates over the interval between them: each lane's busy and CPU share, the micro-batches
waiting before it, tok/s, the mean TTFT of the requests that got their first token. Events are what
changed between them: a stage that stops answering is `lost`, one that answers from a new process
`replaced`, a finished recovery `recovered` with the tokens it replayed.

Cheap when nobody looks: the sampling thread runs only while a stream is open (and stops one interval
after the last closes); a snapshot with none open takes one reading then, on the caller's thread. The
engine's own loop does nothing for the view.
"""
from __future__ import annotations

import asyncio
import collections
import sys
import threading
import time
from typing import Any

from .engine import ServingEngine
from .live_probe import Lane, Reading, computing, probe, queued

INTERVAL_S = 1.0                 # between samples while a stream is open
HISTORY = 180                    # samples kept: the last three minutes at INTERVAL_S
MAX_EVENTS = 200


class Live:
    """The samples of one server (AppState.live): taken by a thread while streams are open, or by a
    snapshot's caller; one lock orders them."""

    def __init__(self, engine: ServingEngine, model_name: str, interval_s: float = INTERVAL_S) -> None:
        self.engine, self.model_name, self.interval_s = engine, model_name, interval_s
        self.series: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_EVENTS)
        self._lock = threading.Lock()
        self._prev: Reading | None = None
        self._lost: set[int] = set()                 # lanes seen lost and not back yet
        self._incarnations: dict[int, str] = {}      # each lane's process, as last seen
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
        self._thread: threading.Thread | None = None
        self.n_samples = 0                           # taken since the server started (tests: cheap when idle)

    # -- samples -----------------------------------------------------------------------------------------
    def sample(self) -> dict[str, Any]:
        """A reading now, made a sample against the previous one (rates are null for the first)."""
        with self._lock:
            prev = self._prev
            since = prev.t - self.interval_s if prev is not None else time.time() - 5 * self.interval_s
            now = probe(self.engine, since)
            out = self._derive(prev, now)
            self._prev = now
            self.series.append(out)
            self.n_samples += 1
            return out

    def snapshot(self) -> dict[str, Any]:
        """GET /live: a fresh sample, unless a stream's thread is sampling and took one within the interval."""
        with self._lock:
            latest = self.series[-1] if self.series and self._thread is not None else None
        if latest is None or time.time() - latest["t"] > self.interval_s:
            latest = self.sample()
        with self._lock:
            return {"model": self.model_name, "interval_s": self.interval_s, "watching": len(self._subscribers),
                    "latest": latest, "series": list(self.series), "events": list(self.events)}

    def _derive(self, prev: Reading | None, now: Reading) -> dict[str, Any]:
        dt = now.t - prev.t if prev is not None else 0.0
        pl = dict(enumerate(prev.lanes)) if prev is not None and prev.mode == now.mode else {}
        changes: list[tuple[str, int, str]] = []
        lanes = [self._lane(k, pl.get(k), lane, prev, now, changes) for k, lane in enumerate(now.lanes)]
        c, pc = now.counts, prev.counts if prev is not None else None
        n_ttft = c.ttft_n - pc.ttft_n if pc is not None else 0
        out = {"t": now.t, "dt": round(dt, 3), "mode": now.mode, "lanes": lanes, "in_flight": now.in_flight,
               "depth": now.depth, "slots": {"total": c.slots, "running": c.running, "queued": c.queue},
               "tok_s": round((c.generated - pc.generated) / dt, 2) if pc is not None and dt > 0 else None,
               "ttft_s": round((c.ttft_sum - pc.ttft_sum) / n_ttft, 4) if pc is not None and n_ttft > 0 else None,
               "generated": c.generated, "prompt_tokens": c.prompt_tokens, "recovering": c.recovering,
               "recoveries": c.recoveries, "replayed_tokens": c.replayed_tokens, "events": []}
        for kind, k, text in changes:
            self._event(out, kind, k, text)
        if pc is not None and c.recoveries > pc.recoveries:
            took = f" in {c.recovery_s[-1]:.1f} s" if c.recovery_s else ""
            self._event(out, "recovered", None, f"recovered{took}: {c.replayed_tokens - pc.replayed_tokens} "
                        "tokens replayed into the new stage's KV cache")
        elif c.recovering and (pc is None or not pc.recovering):
            self._event(out, "recovering", None, "recovering a lost stage: requests wait, none is lost")
        return out

    def _lane(self, k: int, p: Lane | None, lane: Lane, prev: Reading | None, now: Reading,
              changes: list[tuple[str, int, str]]) -> dict[str, Any]:
        """Lane k of a sample: what it is, its state, its shares since the previous reading."""
        lo = prev.t if prev is not None else now.t
        same = p is not None and _same(p, lane)
        queue = round(queued(now.lanes[k - 1], lane, lo, now.t), 3) if k and now.mode == "pipeline" else None
        return {"name": lane.name, "node": lane.node, "layers": lane.layers, "device": lane.device,
                "planned": lane.planned, "planned_bytes": sum(lane.planned.values()), "rss_bytes": lane.rss_bytes,
                "calls": lane.calls, "state": self._state(k, lane, now, changes),
                "busy": self._busy(p, lane, lo, now) if same else None,
                "cpu": _rate(p.cpu_s, lane.cpu_s, now.t - lo, same) if p is not None else None,
                "queue": queue if prev is not None else None}

    @staticmethod
    def _busy(p: Lane | None, lane: Lane, lo: float, now: Reading) -> float | None:
        """A stage's compute share since the previous reading, from its timeline; this process's or a
        replica's from its compute seconds (their steps are short)."""
        if p is None or not _same(p, lane):
            return None
        if now.mode == "pipeline":
            return round(min(1.0, computing(lane, lo, now.t)), 4)
        rate = _rate(p.busy_s, lane.busy_s, now.t - lo, True)
        return None if rate is None else min(1.0, rate)

    def _state(self, k: int, lane: Lane, now: Reading, changes: list[tuple[str, int, str]]) -> str:
        """A lane's state, with the events its change makes: lost (it does not answer while the engine
        recovers), replaced (it answers from another process than before: lost first, if no reading saw
        it gone), silent (it did not answer within the reading's second, the engine recovering nothing:
        a plain Ray call waits behind the stage's computes), ok."""
        if now.mode != "pipeline":
            return "ok"
        if lane.busy_s is None:
            if not now.counts.recovering and k not in self._lost:
                return "silent"
            if k not in self._lost:
                self._lost.add(k)
                changes.append(("lost", k, f"{lane.name} lost: it does not answer"))
            return "lost"
        known = self._incarnations.get(k)
        self._incarnations[k] = lane.incarnation
        if known is not None and known != lane.incarnation:
            if k not in self._lost:
                changes.append(("lost", k, f"{lane.name} lost: its process ended"))
            changes.append(("replaced", k, f"{lane.name} replaced: a new process on {lane.node or 'its node'}"))
        self._lost.discard(k)
        return "ok"

    def _event(self, out: dict[str, Any], kind: str, lane: int | None, text: str) -> None:
        ev = {"t": out["t"], "kind": kind, "lane": lane, "text": text}
        out["events"].append(ev)
        self.events.append(ev)

    # -- the stream's thread -----------------------------------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        """A queue of samples for one stream (on the calling event loop); the thread starts if idle."""
        q: asyncio.Queue = asyncio.Queue(maxsize=8)
        with self._lock:
            self._subscribers.append((asyncio.get_running_loop(), q))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ggml-dist-live", daemon=True)
                self._thread.start()
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        with self._lock:
            self._subscribers = [(lp, s) for lp, s in self._subscribers if s is not q]

    def watching(self) -> int:
        return len(self._subscribers)

    @property
    def sampling(self) -> bool:
        """Whether the stream's thread is running (only while streams are open, and one interval after)."""
        return self._thread is not None

    def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            with self._lock:
                if not self._subscribers:
                    self._thread = None
                    return
            try:
                out = self.sample()
            except Exception as e:  # noqa: BLE001 - a failed reading is a gap in the view, not its end
                print(f"ggml-dist serve: the live view's reading failed: {type(e).__name__}: {e}", file=sys.stderr)
                time.sleep(self.interval_s)
                continue
            with self._lock:
                subs = list(self._subscribers)
            for loop, q in subs:
                try:
                    loop.call_soon_threadsafe(_offer, q, out)
                except RuntimeError:            # its event loop has closed (the server stopped)
                    self.unsubscribe(q)
            time.sleep(max(0.0, self.interval_s - (time.monotonic() - t0)))


def _offer(q: asyncio.Queue, item: dict[str, Any]) -> None:
    """A sample to a stream's queue; a stream that does not keep up loses its oldest sample."""
    if q.full():
        q.get_nowait()
    q.put_nowait(item)


def _same(a: Lane, b: Lane) -> bool:
    """One process in both readings (a replaced stage's counters start again from zero)."""
    return a.incarnation == b.incarnation and a.busy_s is not None and b.busy_s is not None


def _rate(before: float | None, after: float | None, dt: float, same: bool) -> float | None:
    if before is None or after is None or dt <= 0 or not same:
        return None
    return round(max(0.0, after - before) / dt, 4)

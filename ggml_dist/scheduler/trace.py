"""Split timing trace: when each split started and ended on its backend, as Chrome/Perfetto JSON.

The scheduler calls `begin`/`end` from inside each backend's stream (its worker thread for an
asynchronous backend), so the times are when the split really ran, not when it was queued. Load the
written file in chrome://tracing or ui.perfetto.dev: one row (tid) per backend.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass


@dataclass(slots=True)
class TraceEvent:
    name: str
    backend: str
    ts_us: float
    dur_us: float


class TraceRecorder:
    """Records complete ("ph": "X") events; thread-safe, because backends record from their workers."""

    def __init__(self, pid: int = 0) -> None:
        self.pid = pid
        self.events: list[TraceEvent] = []
        self._open: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()

    def _now_us(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def begin(self, backend: str, name: str) -> None:
        with self._lock:
            self._open[(backend, name)] = self._now_us()

    def end(self, backend: str, name: str) -> None:
        t = self._now_us()
        with self._lock:
            t0 = self._open.pop((backend, name), t)
            self.events.append(TraceEvent(name, backend, t0, t - t0))

    def to_json(self) -> dict:
        tids: dict[str, int] = {}
        out = []
        for e in sorted(self.events, key=lambda e: e.ts_us):
            tid = tids.setdefault(e.backend, len(tids))
            out.append({"name": e.name, "ph": "X", "ts": round(e.ts_us, 3), "dur": round(e.dur_us, 3),
                        "pid": self.pid, "tid": tid, "args": {"backend": e.backend}})
        meta = [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": b}}
                for b, tid in tids.items()]
        return {"traceEvents": meta + out}

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

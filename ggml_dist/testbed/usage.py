"""Each host's CPU over a window of time, from its cgroup, for measurements that run inside the hosts.

A process inside a host cannot read the cgroup tree (`ip netns exec` mounts a sysfs of its own), so the
testbed samples every host's counters from outside, and a measurement names its window afterwards by
wall-clock time (time.time()):

    with UsageSampler(cluster.groups) as s:
        ... run something in the hosts, which reports (t0, t1) ...
        s.window(t0, t1)    # per host: cores used, CPU seconds, throttled share of periods, in the window
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import Any

from .cgroups import HostGroup

PERIOD_S = 0.05


class UsageSampler:
    def __init__(self, groups: list[HostGroup | None], period_s: float = PERIOD_S) -> None:
        self.groups = groups
        self.period_s = period_s
        self.times: list[float] = []
        self.samples: list[list[tuple[float, int, int, float] | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="usage-sampler", daemon=True)
        self._lock = threading.Lock()

    def __enter__(self) -> UsageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _read(self) -> list[tuple[float, int, int, float] | None]:
        out: list[tuple[float, int, int, float] | None] = []
        for g in self.groups:
            if g is None or not g.dirs:
                out.append(None)
                continue
            try:
                t = g.throttling()
                out.append((g.cpu_usage_s(), t.nr_periods, t.nr_throttled, g.ticker_cpu_s()))
            except (OSError, KeyError, ValueError):
                out.append(None)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            now, row = time.time(), self._read()
            with self._lock:
                self.times.append(now)
                self.samples.append(row)
            self._stop.wait(self.period_s)

    def _at(self, t: float) -> tuple[float, list]:
        with self._lock:
            i = bisect.bisect_left(self.times, t)
            i = min(max(i, 0), len(self.times) - 1)
            if i > 0 and abs(self.times[i - 1] - t) < abs(self.times[i] - t):
                i -= 1
            return self.times[i], self.samples[i]

    def window(self, t0: float, t1: float) -> list[dict[str, float] | None]:
        """Per host over [t0, t1] (to the nearest samples): cores (CPU seconds / wall seconds), cpu_s,
        throttled (the share of its runnable periods that hit the quota), ticker_cores (what the ticker
        took of it). None for a host without groups, or a window the sampler did not see."""
        if not self.times or t1 <= t0:
            return [None] * len(self.groups)
        (a, ra), (b, rb) = self._at(t0), self._at(t1)
        out: list[dict[str, float] | None] = []
        for x, y in zip(ra, rb):
            if x is None or y is None or b <= a:
                out.append(None)
                continue
            periods = y[1] - x[1]
            out.append({"cores": round((y[0] - x[0]) / (b - a), 3), "cpu_s": round(y[0] - x[0], 3),
                        "throttled": round((y[2] - x[2]) / periods, 3) if periods > 0 else 0.0,
                        "ticker_cores": round((y[3] - x[3]) / (b - a), 3)})
        return out

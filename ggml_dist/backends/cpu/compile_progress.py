"""Progress lines while numba compiles kernels: a first run compiles for tens of seconds, and silence that
long reads as a hang.

    CompileTracker(expected)  a numba compile listener: the outermost kernel compiles done (kernel and
                              seconds each), the one under way, and an estimate of what is left from
                              `expected`, the kernels this compile should take with their measured cost
                              (model/warmup.py's cost manifests); status() is a CompileStatus
    install(label)            from then on, the first kernel compile prints a line, and while compiles run a
                              line every 2 s (kernels done of those expected, which one now, how long, about
                              how long left); kernels already in the cache (kernel_cache.py) print nothing.
                              Idempotent.
    expect(kernels)           the expected kernels of install()'s lines (ggml-dist warmup sets them)

The estimate: the expected kernels not yet compiled, at their measured cost (seconds on the machine the
manifest was measured on) times this compile's pace so far (what its done kernels took over their
measured cost, held near 1 until PACE_PRIOR_S of measured cost are done), less what the kernel under way
has had: a machine twice as busy doubles it. The lines go to stderr, so `--json` output on
stdout stays one object.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from numba.core import event

INTERVAL_S = 2.0
PACE_PRIOR_S = 10.0        # measured seconds of kernels before the estimate trusts its pace


def kernel_name(dispatcher: object) -> str:
    """A kernel as the cost manifests name it: its module's last part and its qualified name
    ("fkernels._attention_serial")."""
    f = getattr(dispatcher, "py_func", None)
    return f"{getattr(f, '__module__', '?').rsplit('.', 1)[-1]}.{getattr(f, '__qualname__', 'a kernel')}"


@dataclass(frozen=True, slots=True)
class CompileStatus:
    n_done: int
    n_expected: int | None          # None: no manifest for this compile (no estimate)
    elapsed_s: float
    eta_s: float | None             # seconds left, estimated; None without a manifest
    current: str                    # the kernel being compiled ("" between kernels)

    def text(self) -> str:
        done = f"{self.n_done} of {max(self.n_expected, self.n_done)}" if self.n_expected else f"{self.n_done}"
        left = f", about {self.eta_s:.0f} s left" if self.eta_s is not None else ""
        now = f", now {self.current}" if self.current else ""
        return f"{done} kernels done{now}, {self.elapsed_s:.0f} s{left}"

    def to_json(self) -> dict:
        return {"n_done": self.n_done, "n_expected": self.n_expected, "elapsed_s": round(self.elapsed_s, 1),
                "eta_s": None if self.eta_s is None else round(self.eta_s, 1), "current": self.current}


class CompileTracker(event.Listener):
    """The outermost kernel compiles of this process (a kernel compiles the helpers it calls: those nest),
    each timed; on_change() after each one begins and ends."""

    def __init__(self, expected: Sequence[tuple[str, float]] = (),
                 on_change: Callable[[CompileTracker], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.expected = list(expected)
        self.on_change = on_change
        self.depth = 0
        self.done: list[tuple[str, float]] = []     # (kernel, wall seconds), in the order they ended
        self.current = ""
        self.t_current = 0.0
        self.t_first: float | None = None

    def on_start(self, ev: event.Event) -> None:
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                self.current = kernel_name((ev.data or {}).get("dispatcher"))
                self.t_current = time.monotonic()
                if self.t_first is None:
                    self.t_first = self.t_current
        if self.depth == 1 and self.on_change is not None:
            self.on_change(self)

    def on_end(self, ev: event.Event) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.done.append((self.current, time.monotonic() - self.t_current))
                self.current = ""
        if self.depth == 0 and self.on_change is not None:
            self.on_change(self)

    def reset(self, expected: Sequence[tuple[str, float]]) -> None:
        """Count a new compile from here, expecting `expected`."""
        with self.lock:
            self.expected, self.done, self.t_first = list(expected), [], None

    def status(self, now: float | None = None) -> CompileStatus:
        with self.lock:
            now = time.monotonic() if now is None else now
            elapsed = 0.0 if self.t_first is None else now - self.t_first
            if not self.expected:
                return CompileStatus(len(self.done), None, elapsed, None, self.current)
            left = Counter(k for k, _ in self.expected)
            cost = dict(self.expected)
            measured = actual = 0.0
            for k, s in self.done:
                if left[k] > 0:
                    left[k] -= 1
                    measured, actual = measured + cost[k], actual + s
            # this compile's pace against the measured one: what its done kernels took over what they took
            # there, held near 1 until PACE_PRIOR_S of them are done (a first kernel also pays LLVM's start)
            pace = (actual + PACE_PRIOR_S) / (measured + PACE_PRIOR_S)
            remaining = sum(cost[k] * n for k, n in left.items()) * pace
            if self.current and left[self.current] > 0:         # the one under way: what it has had so far
                remaining -= min(cost[self.current] * pace, now - self.t_current)
            return CompileStatus(len(self.done), len(self.expected), elapsed, max(0.0, remaining), self.current)


class _Progress:
    """install()'s lines: a CompileTracker and a thread that says its status every INTERVAL_S while a
    compile runs (LLVM's work releases the GIL)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.tracker = CompileTracker(on_change=self._changed)
        self.t_said = 0.0
        self.started = False

    def _changed(self, tr: CompileTracker) -> None:
        if not self.started and tr.depth > 0:
            self.started = True
            self.t_said = time.monotonic()
            from .kernel_cache import kernel_cache_dir
            self._say(f"compiling kernels for this CPU (once; cached in {kernel_cache_dir()})")
            threading.Thread(target=self._tick, name="ggml-dist-compile-progress", daemon=True).start()

    def _tick(self) -> None:
        while True:
            time.sleep(INTERVAL_S / 4)
            now = time.monotonic()
            if self.tracker.depth > 0 and now - self.t_said >= INTERVAL_S:
                self.t_said = now
                self._say(f"compiling kernels: {self.tracker.status(now).text()}")

    def _say(self, msg: str) -> None:
        print(f"{self.label}: {msg}", file=sys.stderr, flush=True)


_installed: _Progress | None = None


def install(label: str = "ggml-dist") -> None:
    global _installed
    if _installed is None:
        _installed = _Progress(label)
        event.register("numba:compile", _installed.tracker)


def expect(kernels: Sequence[tuple[str, float]]) -> None:
    """A new compile begins: the kernels (name, measured seconds) it is expected to take, for install()'s
    count and estimate (what was compiled before no longer counts)."""
    if _installed is not None:
        _installed.tracker.reset(kernels)

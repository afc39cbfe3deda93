"""Progress lines while numba compiles kernels: a first run compiles for tens of seconds, and silence that
long reads as a hang.

    install(label)    from then on, the first kernel compile prints a line, and while compiles run a
                      line every 2 s (how many kernels, which one, how long); kernels already in the
                      cache (kernel_cache.py) print nothing. Idempotent.

The lines go to stderr, so `--json` output on stdout stays one object.
"""
from __future__ import annotations

import sys
import threading
import time

from numba.core import event

INTERVAL_S = 2.0


class _Progress(event.Listener):
    def __init__(self, label: str) -> None:
        self.label = label
        self.lock = threading.Lock()
        self.depth = 0                  # compiles nest (a kernel compiles the helpers it calls)
        self.n_done = 0
        self.current = ""               # the outermost kernel being compiled
        self.t_first: float | None = None
        self.t_said = 0.0

    def on_start(self, ev: event.Event) -> None:
        with self.lock:
            self.depth += 1
            if self.depth == 1:
                disp = (ev.data or {}).get("dispatcher")
                self.current = getattr(getattr(disp, "py_func", None), "__qualname__", "a kernel")
            if self.t_first is None:
                self.t_first = self.t_said = time.monotonic()
                from .kernel_cache import kernel_cache_dir
                self._say(f"compiling kernels for this CPU (once; cached in {kernel_cache_dir()})")
                threading.Thread(target=self._tick, name="ggml-dist-compile-progress", daemon=True).start()

    def on_end(self, ev: event.Event) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                self.n_done += 1

    def _tick(self) -> None:
        """Every INTERVAL_S while a compile runs (LLVM's work releases the GIL), a line."""
        while True:
            time.sleep(INTERVAL_S / 4)
            with self.lock:
                now = time.monotonic()
                if self.depth > 0 and self.t_first is not None and now - self.t_said >= INTERVAL_S:
                    self.t_said = now
                    self._say(f"compiling kernels: {self.n_done} done, now {self.current}, "
                              f"{now - self.t_first:.0f} s")

    def _say(self, msg: str) -> None:
        print(f"{self.label}: {msg}", file=sys.stderr, flush=True)


_installed: _Progress | None = None


def install(label: str = "ggml-dist") -> None:
    global _installed
    if _installed is None:
        _installed = _Progress(label)
        event.register("numba:compile", _installed)

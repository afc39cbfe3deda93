"""The thread count of every numba kernel (qkernels, fkernels, qpack), set once per process.

    set_threads(n)    threads per parallel launch (1..NUMBA_NUM_THREADS); the CLI's --threads, a stage
                      actor's n_threads, a serving replica's share of the cores
    get_threads()     the count; kernels split their work into chunks by it
    launch()          `with launch(): kernel(...)`: around every parallel launch
    released()        `with released(): wait(...)`: the launch lock let go around a wait on other threads

numba's thread count is per calling thread, so `launch` applies it to the thread that launches (skipped
when that thread already has it: the call costs ~3 us and a decode step makes ~150 launches), and holds
one lock: numba's "workqueue" layer aborts on concurrent launches from two Python threads. The lock is
reentrant: a bound graph's flat replay (cpu.BoundGraph) holds it around all its calls, and a call in it
may launch again.
"""
from __future__ import annotations

import os
import threading

import numba

# OpenMP first: its workers spin briefly (GOMP_SPINCOUNT, 300k by default) before sleeping, so a decode
# step's back-to-back launches cost a few us each, where numba's workqueue layer wakes sleeping threads
# (50-100 us per launch on this 2-core VM: more than the product it splits). workqueue where no OpenMP
# runtime loads. A user's NUMBA_THREADING_LAYER is kept. Takes effect only before the first parallel launch.
# (numba.config sets its options at run time, from the environment, so mypy cannot see them: attr-defined)
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "default"                                    # type: ignore[attr-defined]
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]         # type: ignore[attr-defined]


def _numba_num_threads() -> int:
    """numba.config.NUMBA_NUM_THREADS: the most threads a launch may use."""
    return numba.config.NUMBA_NUM_THREADS                                       # type: ignore[attr-defined]


def _default_threads() -> int:
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, _numba_num_threads()))


_n_threads = _default_threads()
_lock = threading.RLock()
_applied = threading.local()


def set_threads(n: int) -> None:
    global _n_threads
    if not 1 <= n <= _numba_num_threads():
        raise ValueError(f"set_threads({n}): must be 1..{_numba_num_threads()} (NUMBA_NUM_THREADS)")
    _n_threads = int(n)


def get_threads() -> int:
    return _n_threads


class _Launch:
    """The launch lock held, numba set to get_threads() threads on this thread; `as` gives the count.
    A class, not a generator context manager: it is entered ~150 times per decode step."""

    def __enter__(self) -> int:
        _lock.acquire()
        if getattr(_applied, "n", None) != _n_threads:
            numba.set_num_threads(_n_threads)
            _applied.n = _n_threads
        return _n_threads

    def __exit__(self, *exc: object) -> None:
        _lock.release()


_LAUNCH = _Launch()


def launch() -> _Launch:
    return _LAUNCH


class _Released:
    """The launch lock let go by this thread (however deep it holds it) for the block, then taken back as
    it was. Around a wait on threads that launch kernels themselves: a tensor-parallel rank's ALL_GATHER
    waits, inside its flat replay, for ranks that are threads of this process. The RLock's own
    _release_save / _acquire_restore do it, as threading.Condition.wait does (CPython's _thread.RLock)."""

    def __enter__(self) -> None:
        self._state = _lock._release_save() if _lock._is_owned() else None     # type: ignore[attr-defined]

    def __exit__(self, *exc: object) -> None:
        if self._state is not None:
            _lock._acquire_restore(self._state)                                # type: ignore[attr-defined]


def released() -> _Released:
    return _Released()

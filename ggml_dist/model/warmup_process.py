"""The background compile process of model/warmup.py: `python -m ggml_dist.model.warmup_process PATH MARKER
LOCK_FD [N_THREADS]` compiles the kernels a run of the model at PATH at N_THREADS takes (default 1), then
writes MARKER. LOCK_FD is MARKER's lock, taken by the process that started this one: held while this
process lives.

Progress (a kernel compile begun or ended, a decode step done) touches MARKER.progress, which holds this
process's pid; a watchdog thread ends the process when there has been none for the stall time
(warmup.stall_s()), with a line in the log: the exit frees the lock. Each kernel begun or done also
rewrites MARKER.status (compile_progress.CompileStatus: kernels done of those expected, the estimate),
which the watcher that started the process reads for its progress lines; a finished compile records each
kernel's seconds (warmup.record_costs) for the next estimate.

The process is not niced: the caller computes with the numpy kernels meanwhile, ~50x slower than what
this process makes, so the compile finishing sooner is what the caller gains most from (at nice 10 it
got a tenth of a core beside a busy caller: 415-423 s for SmolLM2 on a 2-core VM, issue 43).
"""
from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numba

from ..backends.host import COMPILED_DEFAULT, compile_progress, kernel_cache, kernel_threads
from .context import ContextParams, LlamaContext
from .model import LlamaModel
from .ubatch import Batch
from .warmup import (
    WarmResult,
    costs_key,
    expected_costs,
    lock_path,
    marker_path,
    progress_path,
    record_costs,
    stall_s,
    status_path,
    thread_class,
    write_marker,
)


def compile_kernels(path: str | Path, progress: Callable[[], None] = lambda: None,
                    thread_counts: Sequence[int] | None = None) -> None:
    """Decode a prompt of 32 tokens and then 2 single tokens of the model at each of thread_counts
    (default: 1 and all the cores) with the compiled kernels: every kernel and specialization such a run
    takes lands in the cache (32 rows are enough for the row ops' thread split,
    fkernels._ROW_PARALLEL_WORK, from 512 columns). progress() after each step."""
    model = LlamaModel.load(path)
    progress()
    prompt = [int(t) % model.hp.n_vocab for t in range(1, 33)]
    for n in thread_counts or sorted({1, kernel_threads.get_threads()}):
        # numba.config sets its options at run time, from the environment, so mypy cannot see them
        kernel_threads.set_threads(min(n, numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
        ctx = LlamaContext(model, ContextParams(n_ctx=64, n_batch=32, n_ubatch=32))
        ctx.decode(Batch.from_tokens(prompt))
        progress()
        for i in range(2):
            ctx.decode(Batch.from_tokens([prompt[i]], pos0=len(prompt) + i))
            progress()


def warm(path: str | Path, thread_counts: Sequence[int] | None = None) -> WarmResult:
    """Compile the model's kernels for each thread count (default: 1 and the cores available) in this
    process, each class's marker written once its kernels are cached; a class already cached is skipped,
    one whose compile runs elsewhere (a background compile) is waited for. Progress lines on stderr
    (compile_progress.install, with the expected kernels)."""
    if not COMPILED_DEFAULT:
        raise RuntimeError("ggml-dist warmup: the compiled kernels are off (GGML_DIST_NO_NUMBA, or numba "
                           "unavailable): there is nothing to compile")
    if not kernel_cache.cache_writable():
        raise RuntimeError(f"ggml-dist warmup: the kernel cache {kernel_cache.configured_cache_dir()} cannot be "
                           f"written; set GGML_DIST_CACHE or NUMBA_CACHE_DIR to a writable directory")
    counts = list(thread_counts) if thread_counts else sorted({1, kernel_threads.get_threads()})
    t0 = time.monotonic()
    res = WarmResult(str(path), str(kernel_cache.kernel_cache_dir()))
    done: set[str] = set()
    for n in counts:
        cls = thread_class(n)
        if cls in done:
            continue
        done.add(cls)
        marker = marker_path(path, n)
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path(marker), "a") as lock:
            if not marker.exists():
                fcntl.flock(lock, fcntl.LOCK_EX)        # a background compile of it: wait for it
            if marker.exists():
                res.classes.append({"threads": n, "class": cls, "cached": True, "compiled_s": 0.0, "kernels": []})
                continue
            key = costs_key(path, n)
            compile_progress.install("ggml-dist warmup")
            compile_progress.expect(expected_costs(key))
            tracker = compile_progress.CompileTracker()
            from numba.core import event
            event.register("numba:compile", tracker)
            t1 = time.monotonic()
            try:
                compile_kernels(path, thread_counts=[n])
            finally:
                event.unregister("numba:compile", tracker)
            took = time.monotonic() - t1
            write_marker(marker, path, took, tracker.done)
            record_costs(key, tracker.done, took)
            res.classes.append({"threads": n, "class": cls, "cached": False, "compiled_s": round(took, 1),
                                "kernels": [[k, round(v, 2)] for k, v in tracker.done]})
    res.total_s = time.monotonic() - t0
    res.load_average = os.getloadavg()
    return res


class _Watchdog:
    """The time of the last progress, its file touched (at most once a second, or a quarter of the stall
    time), and the thread that ends the process when it is older than stall_s."""

    def __init__(self, marker: Path, stall: float) -> None:
        self.file, self.stall = progress_path(marker), stall
        self.file.write_text(f"{os.getpid()}\n")
        self.last = self._touched = time.monotonic()
        threading.Thread(target=self._watch, name="ggml-dist-compile-watchdog", daemon=True).start()

    def progress(self) -> None:
        self.last = now = time.monotonic()
        if now - self._touched >= min(1.0, self.stall / 4):   # the watcher's frozen check reads its age
            self._touched = now
            try:
                os.utime(self.file)
            except OSError:
                pass

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.stall / 4))
            idle = time.monotonic() - self.last
            if idle > self.stall:
                print(f"ggml-dist compile: no progress for {idle:.0f} s (no kernel compiled, no step done; "
                      f"GGML_DIST_COMPILE_STALL_S={self.stall:g}): ended, the lock is freed, and the runs waiting "
                      f"on it compile what they need themselves", flush=True)
                os._exit(3)


def _on_compiles(progress: Callable[[], None], status: Path, key: str) -> compile_progress.CompileTracker:
    """progress() at every numba compile's start and end; the tracker's status written to `status` at
    each (for the watcher's lines)."""
    from numba.core import event

    def changed(tr: compile_progress.CompileTracker) -> None:
        progress()
        try:
            tmp = status.with_name(f"{status.name}.tmp")
            tmp.write_text(json.dumps(tr.status().to_json()))
            os.replace(tmp, status)
        except OSError:
            pass                                # the watcher's lines only
    tracker = compile_progress.CompileTracker(expected_costs(key), on_change=changed)
    event.register("numba:compile", tracker)
    return tracker


def main(argv: list[str]) -> int:
    path, marker = argv[0], Path(argv[1])
    lock = os.fdopen(int(argv[2]), "a")        # held open to the end: that is the lock
    n_threads = int(argv[3]) if len(argv) > 3 else 1
    dog = _Watchdog(marker, stall_s())
    key = costs_key(path, n_threads)
    tracker = _on_compiles(dog.progress, status_path(marker), key)
    t0 = time.monotonic()
    compile_kernels(path, dog.progress, [n_threads])
    took = time.monotonic() - t0
    record_costs(key, tracker.done, took)
    write_marker(marker, path, took, tracker.done)
    print(f"ggml-dist compile: {len(tracker.done)} kernels in {took:.1f} s at {n_threads} thread(s) "
          f"(load average {', '.join(f'{x:.2f}' for x in os.getloadavg())})", flush=True)
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The GGUF fuzzer's worker processes (bench/fuzz_gguf.py): each runs cases (bench/fuzz_probe.py) under
RLIMIT_AS, forked for the numpy reference, spawned where cases take the compiled kernels (a crash then
takes down a worker, not the run), and tells the parent when numba starts compiling inside a case.
"""
from __future__ import annotations

import gc
import logging
import os
import resource
import signal
import time
import tracemalloc
import warnings
from dataclasses import dataclass
from typing import Any

from .fuzz_probe import run_case, warm_up


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class _CaseDone:
    """Worker -> parent: the case's result (run_case's dict)."""
    index: int
    res: dict[str, Any]


@dataclass(frozen=True)
class _JitStarted:
    """Worker -> parent: numba started compiling a kernel inside a case (a kernel or specialisation the
    warm-up did not reach): seconds to minutes of wall time on a busy host that are not a hang."""
    index: int


def _notify_jit(conn: Any, index: list[int]) -> Any:
    """Send _JitStarted for each compile numba starts from now on in this process (index[0]: the case);
    returns the listener (numba.core.event.unregister takes it off)."""
    from numba.core import event

    class Notice(event.Listener):
        def on_start(self, ev: Any) -> None:
            conn.send(_JitStarted(index[0]))

        def on_end(self, ev: Any) -> None:
            pass

    listener = Notice()
    event.register("numba:compile", listener)
    return listener


def _worker(conn: Any, tmpdir: str, case_time_limit: float, mem_overhead: int, as_headroom: int,
            strict_path: bool, compiled: bool) -> None:
    """A fuzz worker: (index, file bytes, compiled) in, _CaseDone out (and _JitStarted during a compiled
    case whose kernels numba compiles). A forked worker (compiled False) must not start numba's OpenMP
    threads: after a parent that ran kernels (bench faults decodes first, pytest ran other tests) GNU
    OpenMP terminates the child ("fork() called from a process already using GNU OpenMP"), so it runs
    the numpy reference kernels only. A spawned worker (compiled True) is a fresh interpreter with its
    own OpenMP and one kernel thread (the workers are the parallelism, and a second thread spinning
    would count as the case's CPU time), and runs either path, as each case says."""
    if compiled:
        os.environ["NUMBA_NUM_THREADS"] = "1"          # before numba is imported (warm_up imports it)
    warm_up(False)                # imports and first allocations before the address-space limit
    kernels = "numpy"
    if compiled:
        warm_up(True)
        from ggml_dist.backends.cpu import qpack
        kernels = qpack.default_kernels().value
    # a corrupt file's weights overflow and its special ids are "bad": numpy's warnings and the
    # tokenizer's log lines are expected here, once per case, and say nothing the outcome does not
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    vm = _vm_size()
    if vm and as_headroom > 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (vm + as_headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
        except (ValueError, OSError):
            pass
    tracemalloc.start()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    current = [-1]
    if compiled:
        _notify_jit(conn, current)
    conn.send(("ready", rss0, kernels))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, data, case_compiled = msg
        current[0] = index
        assert compiled or not case_compiled, "a forked worker runs the numpy reference kernels only"
        path = os.path.join(tmpdir, f"fuzz-{os.getpid()}-{index:06d}.gguf")
        with open(path, "wb") as fh:
            fh.write(data)
        res = run_case(path, case_time_limit, mem_overhead, strict_path, compiled=case_compiled)
        os.unlink(path)
        res["maxrss_growth_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        conn.send(_CaseDone(index, res))


class _Worker:
    def __init__(self, ctx: Any, tmpdir: str, args: tuple, compiled: bool) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, tmpdir, *args, compiled), daemon=True)
        # a forked worker must never collect the parent's objects: after `bench faults` the parent holds
        # Ray handles in garbage cycles, whose finalizers, run by the child's first full collection (a
        # forward pass allocates enough), write to the parent's GCS connection and break it ("Missing
        # :authority header"); frozen objects are left alone by every collection in the child
        gc.freeze()
        try:
            self.proc.start()
        finally:
            gc.unfreeze()
        child.close()
        try:
            _, self.rss0, self.kernels = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"a fuzz worker died while starting (exit code {self.proc.exitcode}); run "
                               f"`ggml-dist bench fuzz-gguf --cases 1 --jobs 1` to see its error") from None
        self.case: tuple[int, str, bytes, list[str], bool] | None = None
        self.t0 = self.deadline = 0.0

    def submit(self, case: tuple[int, str, bytes, list[str], bool], hard_timeout: float) -> None:
        self.case, self.t0 = case, time.perf_counter()
        self.deadline = self.t0 + hard_timeout
        self.conn.send((case[0], case[2], case[4]))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


def _death(exitcode: int | None) -> str:
    """How a worker ended, for a crash's message: "killed by SIGSEGV (exit code -11)"."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


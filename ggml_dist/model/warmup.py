"""Compiling a model's kernels in the background, so that a first run does not wait a minute for numba.

A cold kernel cache costs a minute or more of compilation on a small machine (every kernel the model's
types need, serial and parallel variants). A first `ggml-dist run` should not sit through that, nor
should two stage actors on one node compile the same kernels side by side. So, in a process that
computes (the CLI's run/serve, a stage actor):

    w = background_compile(path)            None when the cache is ready (or numba is off); else a
                                            watcher, and one compile process per node is running
    w.ready()                               the cache now holds the model's kernels (a stat, at most
                                            once a second)

Until `ready()`, the caller computes with the numpy reference kernels (ComputeOptions(numba=False):
the same bits, several times slower), then switches to the compiled ones (which now load from the
cache in milliseconds). The compile process (warmup_process.py) runs
niced and detached from the caller, so it outlives a short run and the next run finds the cache
warm. The caller takes an exclusive lock (one per node and marker) and hands it to the process; a
caller that finds it taken watches the running compile instead of starting another. The process
decodes a short prompt and single tokens of the same file with the compiled kernels at 1 thread and
at all (the serial and the parallel variants), which compiles every specialization such a run takes,
and then writes the ready marker. The marker's name
hashes what the cached code depends on: the kernel sources, numba and Python, the CPU, the model's
weight types and architecture. GGML_DIST_NO_BACKGROUND_COMPILE=1 keeps the old way: compile in the
caller, with progress lines.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..backends.cpu.ops import NUMBA_DEFAULT
from .gguf import load_gguf

CHECK_INTERVAL_S = 1.0


def marker_path(path: str | Path) -> Path:
    """Where the compile process says the model's kernels are cached (kernel_cache_dir()/ready/KEY)."""
    import numba
    from llvmlite import binding as llvm

    from ..backends.cpu import kernel_cache
    h = hashlib.sha256(kernel_cache.backends_stamp().encode())     # every module of backends/cpu/
    f = load_gguf(path)
    types = sorted({t.type.name for t in f.tensors.values()})
    h.update(repr((numba.__version__, sys.version_info[:2], llvm.get_host_cpu_name(),
                   llvm.get_host_cpu_features().flatten(), types, f.get("general.architecture"),
                   [os.environ.get(v) for v in ("GGML_DIST_FORCE_AVX2", "GGML_DIST_NO_AVX2",
                                                "GGML_DIST_NO_VNNI")])).encode())
    return kernel_cache.kernel_cache_dir() / "ready" / h.hexdigest()[:32]


class Warmup:
    """Watches the compile process: ready once its marker exists, or once its lock is free without a
    marker (a failed compile: the caller then compiles what it needs itself, as without this module)."""

    def __init__(self, marker: Path, spawned: bool) -> None:
        self.marker, self.spawned = marker, spawned     # spawned: by this caller (else by another)
        self._ready = False
        self._checked = 0.0

    def ready(self) -> bool:
        if not self._ready and time.monotonic() - self._checked >= CHECK_INTERVAL_S:
            self._checked = time.monotonic()
            self._ready = self.marker.exists() or not _locked(self.marker)
        return self._ready


def background_compile(path: str | Path, say: Callable[[str], None] | None = None) -> Warmup | None:
    """None if the compiled kernels are off or already cached for this model; else start the compile
    process unless one runs already, and return its watcher. `say` gets one line for the user
    (default: stderr)."""
    if not NUMBA_DEFAULT or os.environ.get("GGML_DIST_NO_BACKGROUND_COMPILE", "") in ("1", "true", "yes"):
        return None
    marker = marker_path(path)
    if marker.exists():
        return None
    marker.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(marker), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            spawned = False                         # another caller's compile process holds it
        else:
            if marker.exists():                     # it finished just now
                return None
            _spawn(path, marker, lock.fileno())
            spawned = True
    (say or _stderr)(f"kernels for this CPU and model are compiling in the background "
                     f"({'started now' if spawned else 'started by another process'}; cached in "
                     f"{marker.parent.parent}); until they are ready this process computes with the numpy "
                     f"kernels (the same results, slower), then switches")
    return Warmup(marker, spawned)


def _spawn(path: str | Path, marker: Path, lock_fd: int) -> None:
    """The compile process, holding the lock this process took (it inherits the locked file; the lock
    lasts as long as the compile process, so no watcher sees it free before it began). Started through
    a shell that exits at once, so it belongs to no one who could end it: a short run's exit, a Ctrl-C,
    a Ray worker's exit (Ray ends its workers' children) all leave it compiling for the next run. It
    imports the same copy of ggml_dist as this process (a Ray job's stage actor runs a shipped copy)."""
    import ggml_dist
    root = str(Path(ggml_dist.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    cmd = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "ggml_dist.model.warmup_process", str(path),
                                             str(marker), str(lock_fd)))
    log = shlex.quote(f"{marker}.log")              # the compile's output, kept for a failed compile
    subprocess.run(["/bin/sh", "-c", f"{cmd} </dev/null >>{log} 2>&1 &"], env=env, check=True,
                   pass_fds=(lock_fd,), start_new_session=True)


def lock_path(marker: Path) -> Path:
    return Path(f"{marker}.lock")


def _locked(marker: Path) -> bool:
    """A compile process holds the marker's lock now."""
    with open(lock_path(marker), "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)

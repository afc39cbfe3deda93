"""model/warmup.py: a cold kernel cache compiles in one detached process per node while the caller computes
with the numpy kernels, and the caller switches to the compiled kernels once they are cached, with the
same logits throughout."""
from __future__ import annotations

import fcntl
import subprocess
import time

import numpy as np
import pytest

from ggml_dist.backends.cpu.backend import CPUBackend
from ggml_dist.model import context as context_mod
from ggml_dist.model import warmup
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("warm") / "m.gguf", SyntheticSpec(n_vocab=256, seed=3))


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """A marker of this test's own (the user's cache keeps its real ones), the feature turned on."""
    m = tmp_path / "ready" / "key"
    m.parent.mkdir()
    monkeypatch.setattr(warmup, "marker_path", lambda path, n_threads=1: m)
    monkeypatch.delenv("GGML_DIST_NO_BACKGROUND_COMPILE", raising=False)
    monkeypatch.setattr(warmup, "CHECK_INTERVAL_S", 0.0)
    return m


def _wait_ready(w: warmup.Warmup, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while not w.ready():
        assert time.monotonic() - t0 < timeout, "the compile process did not finish"
        time.sleep(0.5)


def test_the_compile_process_fills_the_cache_and_says_so(model_path, marker):
    said: list[str] = []
    w = warmup.background_compile(model_path, say=said.append)
    assert w is not None and w.spawned and "compiling in the background (started now" in said[0]
    assert warmup._locked(marker)                       # the lock passed to the compile process
    assert warmup.background_compile(model_path, say=said.append).spawned is False    # one per node
    assert "started by another process" in said[1]
    _wait_ready(w)
    assert "compiled_s" in marker.read_text(), (marker.parent / "key.log").read_text()
    assert any("the compiled kernels take over" in x for x in said)     # the hand-over, one line
    assert not warmup._locked(marker)                   # the process ended
    assert warmup.background_compile(model_path, say=said.append) is None     # warm: nothing to do


def test_a_failed_compile_frees_the_watchers(marker, tmp_path):
    """A compile process that dies leaves no marker: its watchers are released (and compile what they
    need themselves) instead of computing with the numpy kernels for ever; its log says why."""
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF but not really")
    w = warmup.background_compile(bad, say=lambda s: None)
    assert w is not None and w.spawned
    _wait_ready(w, timeout=120)
    assert not marker.exists() and "Error" in (marker.parent / "key.log").read_text()


def test_context_switches_to_the_compiled_kernels_with_the_same_logits(model_path, marker, monkeypatch):
    model = LlamaModel.load(model_path)
    ref = LlamaContext(model, ContextParams(n_ctx=64))
    lock = open(f"{marker}.lock", "a")                       # a compile "in progress" elsewhere
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        ctx = LlamaContext(model, ContextParams(n_ctx=64, background_compile=True))
        backend = ctx.backends[0]
        assert isinstance(backend, CPUBackend) and ctx.warmup is not None and not backend.opts.numba
        prompt = [5, 9, 17, 33, 2, 77, 41, 8, 100]
        np.testing.assert_array_equal(ctx.decode(Batch.from_tokens(prompt)), ref.decode(Batch.from_tokens(prompt)))
        marker.write_text("done\n")
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    one = Batch.from_tokens([12], pos0=len(prompt))
    np.testing.assert_array_equal(ctx.decode(one), ref.decode(Batch.from_tokens([12], pos0=len(prompt))))
    assert ctx.warmup is None and backend.opts.numba        # switched at that ubatch


def test_off_when_numba_is(model_path, marker, monkeypatch):
    monkeypatch.setattr(warmup.host, "COMPILED_DEFAULT", False)
    assert warmup.background_compile(model_path) is None
    monkeypatch.setattr(warmup.host, "COMPILED_DEFAULT", True)
    monkeypatch.setenv("GGML_DIST_NO_BACKGROUND_COMPILE", "1")
    assert warmup.background_compile(model_path) is None
    assert context_mod.LlamaContext(LlamaModel.load(model_path),
                                    ContextParams(n_ctx=64, background_compile=True)).warmup is None


def test_marker_names_what_the_cache_depends_on(model_path, tmp_path, monkeypatch):
    a = warmup.marker_path(model_path)
    assert a == warmup.marker_path(model_path) and a.parent.name == "ready"
    other = write_synthetic(tmp_path / "q4.gguf", SyntheticSpec(n_vocab=256, wtype="Q4_0", seed=3))
    assert warmup.marker_path(other) != a                       # other weight types
    monkeypatch.setenv("GGML_DIST_FORCE_AVX2", "1")
    assert warmup.marker_path(model_path) != a                  # other kernels


# a compile that makes no progress for the stall time ends itself (a line in its log), which frees the lock;
# its watchers say so in one line and go on to compile for themselves. The stall time here, 0.5 s, is
# shorter than LLVM's work on one kernel of a cold cache (no numba event meanwhile): that is the stall
def test_a_stalled_compile_is_ended(model_path, marker, tmp_path, monkeypatch):
    monkeypatch.setenv("GGML_DIST_COMPILE_STALL_S", "0.5")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cold"))
    said: list[str] = []
    w = warmup.background_compile(model_path, say=said.append)
    assert w is not None and w.spawned
    _wait_ready(w, timeout=300)
    assert not marker.exists() and not warmup._locked(marker)
    assert "no progress for" in (marker.parent / "key.log").read_text()
    assert "ended without finishing" in said[-1]


# a compile process that cannot even run its watchdog (frozen: SIGSTOP here) is killed by a watcher once its
# progress file is twice the stall time old
def test_a_frozen_compile_is_killed_by_its_watcher(model_path, marker, tmp_path, monkeypatch):
    import os
    import signal
    monkeypatch.setenv("GGML_DIST_COMPILE_STALL_S", "2")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cold"))
    said: list[str] = []
    w = warmup.background_compile(model_path, say=said.append)
    assert w is not None
    progress = warmup.progress_path(marker)
    t0 = time.monotonic()
    while not (progress.exists() and progress.read_text().strip()):
        assert time.monotonic() - t0 < 60, "the compile process did not start"
        time.sleep(0.01)
    pid = int(progress.read_text())
    os.kill(pid, signal.SIGSTOP)
    _wait_ready(w, timeout=60)
    assert any(f"pid {pid}) made no progress" in s for s in said), said
    t0 = time.monotonic()
    while warmup._locked(marker):                   # the lock goes with the process, a moment after the kill
        assert time.monotonic() - t0 < 10
        time.sleep(0.05)
    assert not marker.exists()


# a kernel cache that cannot be written starts no compile process and claims nothing is cached; the kernel
# cache says, once, that kernels are compiled for this process only
def test_a_read_only_kernel_cache(model_path, monkeypatch, capsys):
    from numba.core import config

    from ggml_dist.backends.cpu import kernel_cache
    if config.CACHE_DIR:
        pytest.skip("NUMBA_CACHE_DIR is set: the test points GGML_DIST_CACHE elsewhere")
    monkeypatch.delenv("GGML_DIST_NO_BACKGROUND_COMPILE", raising=False)
    monkeypatch.setenv("GGML_DIST_CACHE", "/proc/ggml-dist-no-such-dir")      # cannot be created, even by root
    said: list[str] = []
    assert warmup.background_compile(model_path, say=said.append) is None and said == []
    assert not kernel_cache.cache_writable() and kernel_cache.kernel_cache_dir().is_dir()
    warmup.background_compile(model_path, say=said.append)
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1 and "not cached" in err


_KERNEL_RUN = """
import numpy as np
from ggml_dist.backends.cpu import fkernels
b = np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4)
c = np.array([[[[0, 2]]]], dtype=np.int64)
dst = np.zeros((1, 1, 4, 4), dtype=np.float32)
fkernels._set_rows_part(b, c, dst, 0, 1)
print(dst.ravel().tolist())
"""


# a cache entry that fails to load (overwritten here) is discarded and compiled again, with one line; the
# next run loads the new entry, silently (it raised numba's pickle error before, for good)
def test_a_broken_cache_entry_is_recompiled(tmp_path):
    import os
    import sys
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _KERNEL_RUN], capture_output=True, text=True, env=env,
                              timeout=300, check=False)
    first = run()
    assert first.returncode == 0, first.stderr
    entries = list((tmp_path / "numba").rglob("fkernels._set_rows_part-*"))
    assert {p.suffix for p in entries} == {".nbi", ".nbc"}
    for p in entries:
        p.write_bytes(b"not a pickle")
    second = run()
    assert second.returncode == 0 and second.stdout == first.stdout, second.stderr
    assert second.stderr.count("failed to load") == 1 and "recompiling" in second.stderr
    third = run()
    assert third.returncode == 0 and third.stdout == first.stdout and "failed to load" not in third.stderr

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
    monkeypatch.setattr(warmup, "marker_path", lambda path: m)
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
    assert "compiled in" in marker.read_text(), (marker.parent / "key.log").read_text()
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
    monkeypatch.setattr(warmup, "NUMBA_DEFAULT", False)
    assert warmup.background_compile(model_path) is None
    monkeypatch.setattr(warmup, "NUMBA_DEFAULT", True)
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

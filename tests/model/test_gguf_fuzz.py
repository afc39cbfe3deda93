"""GGUF fuzzing: structure-aware mutations of a small valid model must end in a valid model or a clean
GGUFError/ValueError, never a crash, hang or allocation beyond the file's size (ggml_dist/bench/fuzz_gguf.py).

The default run is a short fixed-seed budget; the long one is `python benchmarks/fuzz_gguf.py --cases 10000`.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_dist.bench import fuzz_gguf as fz
from ggml_dist.model.gguf import GGUFError, load_gguf
from ggml_dist.model.hparams import LLAMA_MAX_LAYERS, hparams_from_gguf
from ggml_dist.model.model import LlamaModel

needs_fork = pytest.mark.skipif("fork" not in mp.get_all_start_methods(),
                                reason="failure injection reaches the workers through fork")


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> fz.Layout:
    p = fz.seed_file(tmp_path_factory.mktemp("fuzzseed") / "seed.gguf")
    return fz.Layout.walk(p.read_bytes())


def _patched(layout: fz.Layout, tmp_path: Path, key: str, value: int) -> Path:
    f = next(f for f in layout.by_kind("scalar") if f.info["key"] == key)
    buf = bytearray(layout.raw)
    buf[f.offset:f.offset + f.size] = value.to_bytes(f.size, "little")
    p = tmp_path / "patched.gguf"
    p.write_bytes(buf)
    return p


# ---------------------------------------------------------------------------------------------------
# the fuzzer itself

def test_short_fuzz_budget(tmp_path: Path) -> None:
    """The default-test budget: 420 fixed-seed cases, every mutation kind, no failure."""
    rep = fz.run_fuzz(420, seed=0, jobs=2, failures_dir=tmp_path / "failures")
    assert rep.fuzz_failures == 0, rep.failures[:5]
    assert rep.fuzz_cases == 420
    assert set(rep.by_mutation) == set(fz.MUTATIONS)
    assert rep.ok > 0 and rep.clean_errors > 0
    assert rep.max_case_s < 2.0
    assert rep.peak_mem_over_file_mb < 64
    assert not (tmp_path / "failures").exists()


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), index=st.integers(0, 10**6))
def test_hypothesis_cases(layout: fz.Layout, tmp_path: Path, seed: int, index: int) -> None:
    """Hypothesis picks (seed, case index) pairs; each case runs in-process, no failure."""
    name, data, descs = fz.make_case(seed, index, layout)
    p = tmp_path / f"h-{seed}-{index}.gguf"
    p.write_bytes(data)
    res = fz.run_case(str(p))
    p.unlink()
    assert res["outcome"] != "failure", (name, descs, res)


def test_layout_walk_and_cases_are_deterministic(layout: fz.Layout, tmp_path: Path) -> None:
    p = tmp_path / "seed.gguf"
    p.write_bytes(layout.raw)
    f = load_gguf(p)
    assert len(layout.kv_spans) == len(f.metadata) and [k for k, *_ in layout.kv_spans] == list(f.metadata)
    assert [n for n, *_ in layout.tensor_spans] == list(f.tensors)
    assert layout.data_start == f.data_offset
    assert len(layout.by_kind("elem_str_len")) == len(f.metadata["tokenizer.ggml.tokens"])
    assert fz.run_case(str(p))["outcome"] == "ok"
    for i in range(3 * len(fz.MUTATIONS)):
        assert fz.make_case(7, i, layout) == fz.make_case(7, i, layout)
        assert fz.make_case(7, i, layout)[0] == fz.MUTATIONS[i % len(fz.MUTATIONS)]


@needs_fork
def test_harness_classifies_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Injected faults are caught: a stray exception, a slow case, a memory blow-up, a hang, a crash."""
    import ggml_dist.model.model as model_mod

    real = model_mod.hparams_from_gguf
    mode = {"v": ""}

    def faulty(f):
        if mode["v"] == "index":
            raise IndexError("list index out of range")
        if mode["v"] == "slow":                  # busy: "slow" is CPU time
            end = time.process_time() + 0.5
            while time.process_time() < end:
                pass
        if mode["v"] == "memory":
            blob = bytearray(80 << 20)        # 80 MB for a 29 kB file
            del blob
        if mode["v"] == "unnamed":
            raise GGUFError("no file in this message")
        return real(f)

    import ggml_dist.model.gguf as gguf_mod
    real_load = gguf_mod.load_gguf

    def faulty_load(path):                    # run_case calls this one first, for every case
        if mode["v"] == "hang":
            time.sleep(60)
        if mode["v"] == "crash":
            os._exit(3)
        return real_load(path)

    monkeypatch.setattr(model_mod, "hparams_from_gguf", faulty)
    monkeypatch.setattr(gguf_mod, "load_gguf", faulty_load)
    seed = fz.seed_file(tmp_path / "s.gguf")
    for m, kind in (("index", "IndexError"), ("slow", "slow"), ("memory", "memory")):
        mode["v"] = m
        res = fz.run_case(str(seed), case_time_limit=0.3)
        assert (res["outcome"], res["kind"]) == ("failure", kind), res
    mode["v"] = "unnamed"
    assert fz.run_case(str(seed))["outcome"] == "clean"
    res = fz.run_case(str(seed), strict_path=True)
    assert res["outcome"] == "failure" and "does not name the file" in res["kind"]

    # hang and crash through the worker processes, which are replaced and keep going
    for m, kind in (("hang", "hang"), ("crash", "crash")):
        mode["v"] = m
        rep = fz.run_fuzz(2, seed=0, jobs=1, failures_dir=tmp_path / m, hard_timeout=1.0)
        assert rep.fuzz_cases == 2 and rep.fuzz_failures == 2, rep
        assert rep.failure_kinds == {kind: 2}
        saved = sorted((tmp_path / m).glob("*.gguf"))
        assert saved and saved[0].with_suffix(".txt").exists()


# ---------------------------------------------------------------------------------------------------
# regressions for what the fuzzer found

@pytest.mark.parametrize("n_layer", [LLAMA_MAX_LAYERS + 1, 2**20, 2**31, 2**32 - 1])
def test_huge_block_count_is_a_clean_error(layout: fz.Layout, tmp_path: Path, n_layer: int) -> None:
    """llama.block_count = 2**31 used to build 2**31 x 9 expected-tensor entries (a hang, then GBs)."""
    p = _patched(layout, tmp_path, "llama.block_count", n_layer)
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=f"block_count = {n_layer} exceeds the maximum of {LLAMA_MAX_LAYERS}"):
        hparams_from_gguf(load_gguf(p))
    with pytest.raises(GGUFError, match=str(p)):
        LlamaModel.load(p)
    assert time.perf_counter() - t0 < 1.0


def test_max_block_count_is_checked_against_tensors(layout: fz.Layout, tmp_path: Path) -> None:
    p = _patched(layout, tmp_path, "llama.block_count", LLAMA_MAX_LAYERS)
    assert hparams_from_gguf(load_gguf(p)).n_layer == LLAMA_MAX_LAYERS
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.attn_norm.weight'"):
        LlamaModel.load(p)

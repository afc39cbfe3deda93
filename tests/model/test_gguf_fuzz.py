"""GGUF fuzzing: structure-aware mutations of a small valid model must end in a valid model that runs a
forward pass, or in one of the project's own errors (GGUFError, BatchError, ContextFullError) naming the
file; never another exception, a crash, a hang or an allocation beyond the file's size
(ggml_dist/bench/fuzz_gguf.py).

The default run is a short fixed-seed budget; the long one is `ggml-dist bench fuzz-gguf --cases 10000`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_dist.bench import fuzz_gguf as fz
from ggml_dist.bench import fuzz_probe, fuzz_workers
from ggml_dist.core.ops import ShapeError
from ggml_dist.core.types import GGMLType
from ggml_dist.model.gguf import GGUFError, load_gguf
from ggml_dist.model.hparams import LLAMA_MAX_LAYERS, hparams_from_gguf
from ggml_dist.model.kv_cache import ContextFullError
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.ubatch import BatchError

needs_fork = pytest.mark.skipif("fork" not in mp.get_all_start_methods(),
                                reason="failure injection reaches the workers through fork")


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> fz.Layout:
    p = fz.seed_file(tmp_path_factory.mktemp("fuzzseed") / "seed.gguf")
    return fz.Layout.walk(p.read_bytes())


@pytest.fixture(scope="module")
def warm(layout: fz.Layout, tmp_path_factory) -> None:
    """The seed file run once, so the kernels it needs are compiled (on a cold kernel cache the first
    case took 12.5 s) before any case runs under the hypothesis deadline, which is there for hangs."""
    p = tmp_path_factory.mktemp("fuzzwarm") / "seed.gguf"
    p.write_bytes(layout.raw)
    assert fz.run_case(str(p))["outcome"] == "ok"


def _patched(layout: fz.Layout, tmp_path: Path, key: str, value: int | float) -> Path:
    f = next(f for f in layout.by_kind("scalar") if f.info["key"] == key)
    buf = bytearray(layout.raw)
    buf[f.offset:f.offset + f.size] = (struct.pack("<f", value) if isinstance(value, float)
                                       else value.to_bytes(f.size, "little"))
    p = tmp_path / "patched.gguf"
    p.write_bytes(buf)
    return p


def _retyped(layout: fz.Layout, tmp_path: Path, name: str, ttype: GGMLType) -> Path:
    """The seed with one tensor's type id replaced, and zeros appended so its data stays inside the file."""
    f = next(f for f in layout.by_kind("ttype") if f.info["name"] == name)
    buf = bytearray(layout.raw)
    buf[f.offset:f.offset + 4] = int(ttype).to_bytes(4, "little")
    p = tmp_path / f"retyped-{ttype.name}.gguf"
    p.write_bytes(bytes(buf) + b"\0" * 65536)
    return p


# ---------------------------------------------------------------------------------------------------
# the fuzzer itself

def test_short_fuzz_budget(tmp_path: Path) -> None:
    """The default-test budget: 420 fixed-seed cases, every mutation kind, no failure."""
    rep = fz.run_fuzz(420, seed=0, jobs=2, failures_dir=tmp_path / "failures")
    assert rep.fuzz_failures == 0, rep.failures[:5]
    assert rep.unclear_errors == 0, rep.unclear_messages
    assert rep.fuzz_cases == 420
    assert set(rep.by_mutation) == set(fz.MUTATIONS)
    assert rep.ok > 0 and rep.clean_errors > 0
    assert rep.max_case_s < 2.0
    assert rep.peak_mem_over_file_mb < 64
    assert not (tmp_path / "failures").exists()


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), index=st.integers(0, 10**6))
def test_hypothesis_cases(layout: fz.Layout, warm: None, tmp_path: Path, seed: int, index: int) -> None:
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
    res = fz.run_case(str(p))
    assert (res["outcome"], res["stage"]) == ("ok", "forward")          # it loaded, encoded and ran
    for i in range(3 * len(fz.MUTATIONS)):
        assert fz.make_case(7, i, layout) == fz.make_case(7, i, layout)
        assert fz.make_case(7, i, layout)[0] == fz.MUTATIONS[i % len(fz.MUTATIONS)]


@needs_fork
def test_harness_classifies_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Injected faults are caught: a stray exception, a slow case, a memory blow-up, a hang, a crash."""
    import ggml_dist.model.model as model_mod
    fz.warm_up()                              # with the real loader, before it is patched

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
    assert fz.run_case(str(seed))["outcome"] == "unclear"
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


def _raise(e: BaseException) -> None:
    raise e


# (stage the exception is raised in, what raises, outcome); `P` stands for the file's path
CLASSIFIED = [
    ("model", lambda p: np.zeros(6).reshape(4, 4), "failure"),          # numpy: cannot reshape
    ("model", lambda p: int("x"), "failure"),                             # int() on a bad value
    ("model", lambda p: _raise(KeyError("llama.block_count")), "failure"),
    ("model", lambda p: _raise(ValueError(f"{p}: a plain ValueError, file named")), "failure"),
    ("model", lambda p: _raise(GGUFError("a GGUFError without the file")), "unclear"),
    ("model", lambda p: _raise(GGUFError(f"{p}: a GGUFError naming the file")), "clean"),
    ("forward", lambda p: _raise(IndexError("index 300 is out of bounds")), "failure"),
    ("forward", lambda p: _raise(ShapeError("a core-layer error from the graph")), "failure"),
    ("forward", lambda p: _raise(BatchError("token id 300 outside the vocabulary")), "unclear"),
    ("forward", lambda p: _raise(ContextFullError(f"{p}: no free KV cells")), "clean"),
]


@pytest.mark.parametrize("stage,action,outcome", CLASSIFIED)
def test_only_project_errors_naming_the_file_are_clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                       stage: str, action, outcome: str) -> None:
    """A ValueError from numpy or int() is a failure, even one naming the file; GGUFError, BatchError and
    ContextFullError are clean when they name the file, unclear when not; in the loader and the forward
    pass alike."""
    import ggml_dist.model.model as model_mod
    fz.warm_up()
    seed = str(fz.seed_file(tmp_path / "s.gguf"))
    if stage == "model":
        monkeypatch.setattr(model_mod, "hparams_from_gguf", lambda f: action(f.path))
    else:
        monkeypatch.setattr(fuzz_probe, "forward_probe", lambda model, tokens, compiled=True: action(model.file.path))
    res = fz.run_case(seed)
    assert (res["stage"], res["outcome"]) == (stage, outcome), res
    assert ("does not name the file" in res["kind"]) == (outcome == "unclear")
    strict = fz.run_case(seed, strict_path=True)
    assert strict["outcome"] == ("failure" if outcome == "unclear" else outcome)


@needs_fork
def test_report_counts_unclear_errors_apart_from_failures(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """Through the workers: unclear errors are counted and grouped by message, neither failures nor clean;
    with strict_path they are failures."""
    import ggml_dist.model.model as model_mod
    fz.warm_up()
    monkeypatch.setattr(model_mod, "hparams_from_gguf", lambda f: _raise(GGUFError("no file here")))
    n = 2 * len(fz.MUTATIONS)
    rep = fz.run_fuzz(n, seed=0, jobs=1)
    assert rep.fuzz_cases == n and rep.fuzz_failures == 0 and rep.ok == 0
    assert rep.unclear_errors > 0 and rep.unclear_errors + rep.clean_errors == n
    assert rep.unclear_messages == {"model: GGUFError: no file here": rep.unclear_errors}
    assert rep.to_json()["unclear_errors"] == rep.unclear_errors
    strict = fz.run_fuzz(n, seed=0, jobs=1, strict_path=True)
    assert strict.fuzz_failures == rep.unclear_errors and strict.unclear_errors == 0


def test_compiled_case_draw() -> None:
    """--compiled-share: a draw per case, apart from the mutation's stream; every mutation gets its share."""
    assert not any(fz.compiled_case(0, i, 0.0) for i in range(200))
    assert all(fz.compiled_case(0, i, 1.0) for i in range(200))
    drawn = [i for i in range(2000) if fz.compiled_case(0, i, 0.25)]
    assert drawn == [i for i in range(2000) if fz.compiled_case(0, i, 0.25)]         # deterministic
    assert 400 < len(drawn) < 600
    assert {fz.MUTATIONS[i % len(fz.MUTATIONS)] for i in drawn} == set(fz.MUTATIONS)
    assert drawn != [i for i in range(2000) if fz.compiled_case(1, i, 0.25)]          # per seed
    with pytest.raises(ValueError, match="compiled_share"):
        fz.run_fuzz(1, compiled_share=1.5)


def test_compiled_share_runs_the_compiled_kernels(tmp_path: Path) -> None:
    """A share of the cases runs through the compiled kernels (in spawned workers), the rest through the
    numpy reference; both paths are reported apart, with the kernels each ran, and neither fails."""
    from ggml_dist.backends.cpu import qpack
    n = 2 * len(fz.MUTATIONS)
    rep = fz.run_fuzz(n, seed=3, jobs=2, compiled_share=0.5, failures_dir=tmp_path / "failures")
    assert rep.fuzz_failures == 0 and rep.crashes == 0, rep.failures[:5]
    assert rep.unclear_errors == 0, rep.unclear_messages
    want = sum(fz.compiled_case(3, i, 0.5) for i in range(n))
    assert rep.by_path["compiled"]["cases"] == want and rep.by_path["numpy"]["cases"] == n - want
    assert rep.by_path["compiled"]["kernels"] == qpack.default_kernels().value
    assert rep.by_path["numpy"]["kernels"] == "numpy"
    assert all(rep.by_path[k].get("ok", 0) > 0 for k in fz.PATHS)       # the seed-like cases ran forward
    assert rep.to_json()["compiled_share"] == 0.5


def test_compiled_worker_killed_by_sigsegv_is_a_counted_crash(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A compiled-path worker that dies by SIGSEGV in a case (a real signal, sent while the case's file is
    in the worker's hands, as a kernel's bad read raises it) is a failure of kind crash, counted in
    crashes and in its path, its case saved; the run goes on with a new worker."""
    import signal
    import tempfile
    import threading
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))       # where run_fuzz puts the cases' files
    killed: list[str] = []

    def kill_first_case() -> None:
        deadline = time.monotonic() + 300
        while not killed and time.monotonic() < deadline:
            for f in tmp_path.glob("gguf-fuzz-*/fuzz-*-*.gguf"):     # fuzz-<worker pid>-<index>.gguf
                os.kill(int(f.name.split("-")[1]), signal.SIGSEGV)
                killed.append(f.name)
                break
            time.sleep(0.001)

    t = threading.Thread(target=kill_first_case)
    t.start()
    try:
        rep = fz.run_fuzz(6, seed=0, jobs=1, compiled_share=1.0, failures_dir=tmp_path / "failures")
    finally:
        killed.append("done")
        t.join()
    assert killed[0] != "done"
    assert rep.fuzz_cases == 6 and rep.crashes == 1 and rep.fuzz_failures == 1, rep.failures
    assert rep.failure_kinds == {"crash": 1}
    assert rep.by_path["compiled"]["cases"] == 6 and rep.by_path["compiled"]["crash"] == 1
    assert "numpy" not in rep.by_path
    fail = rep.failures[0]
    assert fail["path"] == "compiled" and "killed by SIGSEGV (exit code -11)" in fail["msg"]
    saved = Path(fail["file"])
    assert saved.exists() and json.loads(saved.with_suffix(".txt").read_text())["kind"] == "crash"


def test_a_jit_compile_in_a_case_is_announced() -> None:
    """A compiled worker tells the parent when numba starts compiling inside a case, so that the compile
    (over 20 s of wall time on a busy host) gets jit_timeout, not the hard timeout of a hang."""
    import numba
    from numba.core import event
    here, there = mp.Pipe()
    listener = fuzz_workers._notify_jit(there, [7])
    try:
        numba.njit(lambda x: x + 1)(1)                  # a function no cache holds: a real compile
    finally:
        event.unregister("numba:compile", listener)
    assert here.poll(5) and here.recv() == fz._JitStarted(7)


def test_bench_faults_reports_unclear_errors(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`bench faults --json` reports fuzz_failures and unclear_errors as two numbers."""
    import ggml_dist.model.pull as pull
    from ggml_dist.bench import faults
    monkeypatch.setattr(pull, "resolve_model", lambda name: Path("unused.gguf"))
    monkeypatch.setattr(faults, "kill_study", lambda *a, **k: {"kills": 0})
    monkeypatch.setattr(fz, "run_fuzz", lambda n, jobs=1: fz.FuzzReport(fuzz_cases=n, fuzz_failures=1,
                                                                         unclear_errors=2))
    assert faults.main(["--runs", "0", "--fuzz-cases", "7", "--sections", "kill,fuzz", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["fuzz_cases"], out["fuzz_failures"], out["unclear_errors"]) == (7, 1, 2)


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


@pytest.mark.parametrize("base", [float("nan"), 0.0, -1.0, 1.0, float("-inf"), float("inf")])
def test_bad_rope_freq_base_is_a_clean_error(layout: fz.Layout, tmp_path: Path, base: float) -> None:
    """rope.freq_base NaN / 0 / -1 / 1 loaded, then ROPE's yarn_corr_dims raised a ValueError (math domain
    error, int(NaN)) or ZeroDivisionError in the first forward pass."""
    p = _patched(layout, tmp_path, "llama.rope.freq_base", base)
    with pytest.raises(GGUFError, match=re.escape(f"{p}: llama.rope.freq_base = {base!r} must be a finite "
                                                  f"number above 1")):
        LlamaModel.load(p)
    assert fz.run_case(str(p))["outcome"] == "clean"


@pytest.mark.parametrize("name,ttype,op", [
    ("blk.0.attn_q.weight", GGMLType.IQ4_NL, "MUL_MAT"),     # a block layout, no kernel
    ("blk.0.attn_k.weight", GGMLType.I64, "MUL_MAT"),
    ("blk.0.ffn_down.weight", GGMLType.F64, "MUL_MAT"),
    ("token_embd.weight", GGMLType.Q8_1, "MUL_MAT"),        # tied: the output projection too
    ("blk.0.ffn_norm.weight", GGMLType.Q8_0, "MUL"),        # a quantized norm: no backend runs the MUL
])
def test_weight_type_without_a_kernel_is_a_clean_error(layout: fz.Layout, tmp_path: Path, name: str,
                                                       ttype: GGMLType, op: str) -> None:
    """A weight whose type has a block layout but no CPU kernel for its op loaded, then failed in the first
    forward pass (NotImplementedError from mul_mat / dequantize, SchedAssignError for a quantized norm)."""
    p = _retyped(layout, tmp_path, name, ttype)
    with pytest.raises(GGUFError, match=re.escape(f"{p}: tensor '{name}' has type {ttype.name}, which {op} "
                                                  f"does not compute on the CPU backend")):
        LlamaModel.load(p)
    assert fz.run_case(str(p))["outcome"] == "clean"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # Q8_0 bytes read as another type: NaNs
@pytest.mark.parametrize("name,ttype", [("blk.0.attn_q.weight", GGMLType.F16),
                                        ("blk.0.ffn_up.weight", GGMLType.Q4_0),
                                        ("blk.0.attn_norm.weight", GGMLType.F16)])
def test_weight_types_with_a_kernel_still_load_and_run(layout: fz.Layout, tmp_path: Path, name: str,
                                                       ttype: GGMLType) -> None:
    p = _retyped(layout, tmp_path, name, ttype)
    # the retyped weight may take a kernel the fuzzer's warm-up (the seed model) did not: on a cold kernel
    # cache a first run compiles it inside the case, against the case's time and memory limits
    fz.run_case(str(p), case_time_limit=600.0, mem_overhead=1 << 30)
    res = fz.run_case(str(p))
    assert (res["outcome"], res["stage"]) == ("ok", "forward"), res

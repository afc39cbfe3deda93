"""The kernel cache: its stamp is every module of the CPU backend package (backends/cpu/), so an edit to a
file a kernel is made of (qpack's kernels inline vnni.py's IR) recompiles the kernel instead of loading
the old code; its locator keys a kernel by its file's place inside ggml_dist, not by the absolute path."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ggml_dist

kc = pytest.importorskip("ggml_dist.backends.cpu.kernel_cache")
qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")

CPU = Path(ggml_dist.__file__).resolve().parent / "backends" / "cpu"


def test_a_kernel_is_stamped_with_every_cpu_backend_module():
    f = qpack._prep.py_func
    loc = kc.PackageCacheLocator.from_function(f, f.__code__.co_filename)
    assert loc is not None and loc.get_source_stamp() == kc.backends_stamp()
    assert kc.backends_stamp() == kc.sources_stamp(CPU)
    # every module a kernel inlines or calls lives in the package the stamp hashes
    for name in ("qkernels", "fkernels", "qpack", "kpack", "kquant_ir", "vnni", "avx2", "numerics",
                 "threads", "kernel_cache"):
        assert (CPU / f"{name}.py").is_file(), name


def test_the_locator_keys_by_the_place_in_the_package():
    f = qpack._prep.py_func
    loc = kc.PackageCacheLocator.from_function(f, f.__code__.co_filename)
    path = Path(loc.get_cache_path())
    assert path.parts[-2:] == ("backends", "cpu") and path.is_relative_to(kc.kernel_cache_dir())


def test_a_function_outside_the_package_is_left_to_numba(tmp_path):
    src = tmp_path / "elsewhere.py"
    src.write_text("def f():\n    return 1\n")
    ns: dict = {}
    exec(compile(src.read_text(), str(src), "exec"), ns)
    assert kc.PackageCacheLocator.from_function(ns["f"], str(src)) is None


def test_the_stamp_changes_with_any_module(tmp_path):
    copy = tmp_path / "cpu"
    shutil.copytree(CPU, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kc.sources_stamp(copy) == kc.sources_stamp(CPU)
    vnni = copy / "vnni.py"
    vnni.write_text(vnni.read_text() + "\n# an edit that changes no kernel's own file\n")
    assert kc.sources_stamp(copy) != kc.sources_stamp(CPU)


def test_the_stamp_covers_sub_packages_and_names(tmp_path):
    copy = tmp_path / "cpu"
    shutil.copytree(CPU, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "sub").mkdir()
    (copy / "sub" / "ir.py").write_text("X = 1\n")
    a = kc.sources_stamp(copy)
    assert a != kc.sources_stamp(CPU)
    (copy / "sub" / "ir.py").rename(copy / "sub" / "ir2.py")       # same bytes, another module
    assert kc.sources_stamp(copy) != a

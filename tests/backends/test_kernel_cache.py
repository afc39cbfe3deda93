"""The kernel cache's stamp: every backends module, so an edit to a file a kernel is made of (qpack's
kernels inline vnni.py's IR) recompiles the kernel instead of loading the old code."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

kc = pytest.importorskip("ggml_dist.backends.kernel_cache")
qpack = pytest.importorskip("ggml_dist.backends.qpack")


def test_a_kernel_is_stamped_with_every_backends_module():
    f = qpack._prep.py_func
    loc = kc.PackageCacheLocator.from_function(f, f.__code__.co_filename)
    assert loc is not None and loc.get_source_stamp() == kc.backends_stamp()
    assert kc.backends_stamp() == kc.sources_stamp(Path(kc.__file__).parent)


def test_the_stamp_changes_with_any_module(tmp_path):
    src = Path(kc.__file__).parent
    copy = tmp_path / "backends"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert kc.sources_stamp(copy) == kc.sources_stamp(src)
    vnni = copy / "vnni.py"
    vnni.write_text(vnni.read_text() + "\n# an edit that changes no kernel's own file\n")
    assert kc.sources_stamp(copy) != kc.sources_stamp(src)

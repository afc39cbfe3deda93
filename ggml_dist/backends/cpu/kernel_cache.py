"""Where numba caches the compiled kernels: one directory per node, whichever copy of ggml_dist runs.

Numba's own locators key a kernel's cache by the absolute path of its source file (the package's
__pycache__, or a hash of the path under NUMBA_CACHE_DIR). A stage actor that runs the copy of
ggml_dist a job shipped (Ray py_modules, unpacked under each node's session directory) would then
compile every kernel again in every new session, and never share with the installed copy. This
locator keys by the file's path inside the package and the numba and Python versions:

    $NUMBA_CACHE_DIR/ggml_dist/...   if NUMBA_CACHE_DIR is set
    $GGML_DIST_CACHE/kernels/...     else (default ~/.cache/ggml_dist/kernels)

Numba's stamp (the source file's mtime and size) would not notice an edit to another file that the
kernel's code is made of: qpack's kernels inline vnni.py's and avx2.py's IR and call fkernels', and
qkernels' read blocks.py's offsets as constants. So the stamp here is a hash of every module of the CPU backend package
(backends/cpu/, where every kernel and everything a kernel is made of lives), and a copy whose CPU
backend differs in any byte never loads another copy's kernels (an upgrade recompiles them once).
Importing this module registers the locator (before the kernels are defined: qkernels imports it first).
"""
from __future__ import annotations

import hashlib
import os
import sys
from functools import cache
from pathlib import Path

import numba
from numba.core import caching, config

_HERE = Path(__file__).resolve().parent                                 # .../ggml_dist/backends/cpu
_PACKAGE = _HERE.parents[len(__name__.split(".")) - 3]                  # .../ggml_dist


def kernel_cache_dir() -> Path:
    # numba.config sets its options at run time, from the environment, so mypy cannot see them
    if config.CACHE_DIR:                                            # type: ignore[attr-defined]
        return Path(config.CACHE_DIR) / "ggml_dist"                 # type: ignore[attr-defined]
    base = os.environ.get("GGML_DIST_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "ggml_dist") / "kernels"


def sources_stamp(directory: Path) -> str:
    """sha256 of the modules under directory, sub-packages included (their paths there and bytes)."""
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*.py")):
        h.update(p.relative_to(directory).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


@cache
def backends_stamp() -> str:
    """The CPU backend package's sources_stamp, read once per process."""
    return sources_stamp(_HERE)


class PackageCacheLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """A kernel of ggml_dist, cached under kernel_cache_dir() by its file's place in the package."""

    def __init__(self, py_func, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        rel = Path(py_file).resolve().parent.relative_to(_PACKAGE)
        tag = f"py{sys.version_info.major}{sys.version_info.minor}-numba{numba.__version__}"
        self._cache_path = str(kernel_cache_dir() / tag / rel)

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        return backends_stamp()

    @classmethod
    def from_function(cls, py_func, py_file: str):
        try:
            Path(py_file).resolve().relative_to(_PACKAGE)
        except ValueError:
            return None                                     # not ours: numba's own locators
        return super().from_function(py_func, py_file)


if PackageCacheLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes.insert(0, PackageCacheLocator)

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

Two states of the directory that numba would not report well:
    a cache entry that fails to load (a truncated or overwritten .nbi/.nbc: numba raises its pickle
        error, and every run of the model failed, blamed on the .gguf): the entry's files are deleted
        and the kernel compiled again, and the first such entry of a process says so in one line
    a directory that cannot be written (read-only, not creatable): numba would skip this locator for its
        own, which key by the source file only; instead the kernels go to a temporary directory of this
        process, compiled at every start, and one line says so (not "cached": the background compile of
        model/warmup.py is then not started, as it could cache nothing)
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import sys
import tempfile
import threading
from functools import cache
from pathlib import Path
from typing import Any

import numba
from numba.core import caching, config

_HERE = Path(__file__).resolve().parent                                 # .../ggml_dist/backends/cpu
_PACKAGE = _HERE.parents[len(__name__.split(".")) - 3]                  # .../ggml_dist


def configured_cache_dir() -> Path:
    """$NUMBA_CACHE_DIR/ggml_dist, else $GGML_DIST_CACHE/kernels, else ~/.cache/ggml_dist/kernels."""
    # numba.config sets its options at run time, from the environment, so mypy cannot see them
    if config.CACHE_DIR:                                            # type: ignore[attr-defined]
        return Path(config.CACHE_DIR) / "ggml_dist"                 # type: ignore[attr-defined]
    base = os.environ.get("GGML_DIST_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "ggml_dist") / "kernels"


def kernel_cache_dir() -> Path:
    """Where the kernels are cached: the configured directory, or, where it cannot be written, this
    process's temporary one (the module docstring)."""
    return _usable(configured_cache_dir())


def cache_writable() -> bool:
    """The configured directory is the cache (kernels compiled now are there at the next start)."""
    return kernel_cache_dir() == configured_cache_dir()


@cache
def _usable(d: Path) -> Path:
    try:
        d.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=d).close()
        return d
    except OSError as e:
        tmp = Path(tempfile.mkdtemp(prefix="ggml_dist_kernels_"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        print(f"ggml-dist: the kernel cache {d} cannot be written ({e.strerror or e}): kernels are compiled "
              f"for this process only, at every start, not cached; set GGML_DIST_CACHE or NUMBA_CACHE_DIR to "
              f"a writable directory", file=sys.stderr, flush=True)
        return tmp


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


# -- entries that fail to load ------------------------------------------------------------------------

_numba_load_overload = getattr(caching.Cache.load_overload, "numba_original", caching.Cache.load_overload)
_said_discarded = threading.Event()


def _load_or_discard(self: Any, sig: Any, target_context: Any) -> Any:
    """numba's Cache.load_overload, and for our kernels: an entry that fails to load is discarded (its
    index and data files deleted), so that numba compiles the kernel again and saves a good one.
    # differs from numba: a broken entry raises there (UnpicklingError, EOFError), for good"""
    if not isinstance(getattr(self._impl, "locator", None), PackageCacheLocator):
        return _numba_load_overload(self, sig, target_context)
    try:
        return _numba_load_overload(self, sig, target_context)
    except Exception as e:  # noqa: BLE001 - any failure to read the entry: it is rebuilt, not trusted
        cf = self._cache_file
        base = os.path.basename(cf._index_path)[:-len(".nbi")]
        for p in Path(cf._cache_path).glob(f"{base}.*"):
            p.unlink(missing_ok=True)
        if not _said_discarded.is_set():
            _said_discarded.set()
            print(f"ggml-dist: a kernel cache entry failed to load ({base} in {cf._cache_path}: "
                  f"{type(e).__name__}: {str(e)[:120]}); discarded it, recompiling (later ones are "
                  f"discarded without a line)", file=sys.stderr, flush=True)
        return None


if PackageCacheLocator not in caching.CacheImpl._locator_classes:
    caching.CacheImpl._locator_classes.insert(0, PackageCacheLocator)
_load_or_discard.numba_original = _numba_load_overload     # type: ignore[attr-defined]
caching.Cache.load_overload = _load_or_discard              # type: ignore[method-assign]

"""The host's backend as the layers above reach it: the kernels that compute on this machine's own memory,
today the CPU backend (backends/cpu). model/ asks this module, never the CPU classes, for what a model needs
of the host, so a second backend is added in backends/ and wired here, and no file of model/ changes.

    MUL_MAT_TYPES                       weight types the host's MUL_MAT takes (a file's 2-d weights must be one)
    COMPILED_DEFAULT                    the compiled kernels are on unless GGML_DIST_NO_NUMBA=1 (or numba is absent)
    compute_options(exact, compiled, batch_invariant)   the numerics a host backend computes with
    host_backend(name, options)         a backend on the host's memory (the scheduler's last, the fallback)
    use_compiled_kernels(backends)      from now on the compiled kernels, where a backend was on the reference
                                        ones while they compiled (the same bits)
    attn_inputs(...)                    a step's KQ masks and KV slot indices by one compiled call (the numpy
                                        reference is model/kv_cache.py's, for where the compiled kernels are off)
    kernel_cache, compile_progress,     the compiled kernels' on-disk cache, its compile progress lines and the
    kernel_threads, kernels_name()      kernels' thread count: what model/warmup*.py compiles ahead of a run
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .cpu import compile_progress, kernel_cache
from .cpu import threads as kernel_threads
from .cpu.backend import CPUBackend, CPUDevice
from .cpu.ops import NUMBA_DEFAULT, ComputeOptions, resolve
from .cpu.quants import VEC_DOT_TYPE

MUL_MAT_TYPES = frozenset(VEC_DOT_TYPE)
COMPILED_DEFAULT = NUMBA_DEFAULT
HostOptions = ComputeOptions
__all__ = [
    "COMPILED_DEFAULT",
    "MUL_MAT_TYPES",
    "HostOptions",
    "attn_inputs",
    "compile_progress",
    "compute_options",
    "host_backend",
    "kernel_cache",
    "kernel_threads",
    "kernels_name",
    "use_compiled_kernels",
]


def compute_options(exact: bool = False, compiled: bool = True, batch_invariant: bool = False) -> ComputeOptions:
    return ComputeOptions(exact=exact, numba=compiled and COMPILED_DEFAULT, batch_invariant=batch_invariant)


def host_backend(options: ComputeOptions, name: str = "CPU") -> CPUBackend:
    return CPUDevice(name).init_backend(opts=options)


def use_compiled_kernels(backends: list[Any]) -> None:
    for b in backends:
        if isinstance(b, CPUBackend):
            b.opts = replace(b.opts, numba=True)


_attn_inputs: Any = None


def attn_inputs(*args: Any) -> None:
    global _attn_inputs
    if _attn_inputs is None:            # compiled: numba is imported where it is first used
        from .cpu.kv_inputs import attn_inputs as kernel
        _attn_inputs = kernel
    _attn_inputs(*args)


def kernels_name() -> str:
    """The packed weights' kernel set the host's default options pick ("vnni", "avx2", ...; "float")."""
    return resolve(ComputeOptions()).kernels or "float"

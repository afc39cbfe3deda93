"""The SIMD each side of `bench decode` runs: the host's CPU and its x86 flags, the kernel path ours takes,
and the flags the llama.cpp library was built with, so that a ratio says what it compares.
"""
from __future__ import annotations

import contextlib
import os
import platform
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# x86 flags of /proc/cpuinfo that decide which kernels either engine can run, with llama.cpp's names
# for them (ggml-cpu's feature list in llama_print_system_info()); SSE3 is "pni" in /proc/cpuinfo
_X86_FLAGS = {"pni": "SSE3", "ssse3": "SSSE3", "sse4_1": None, "sse4_2": None, "avx": "AVX", "avx2": "AVX2",
              "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx_vnni": "AVX_VNNI", "avx512f": "AVX512",
              "avx512dq": None, "avx512cd": None, "avx512bw": None, "avx512vl": None,
              "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI", "avx512_bf16": "AVX512_BF16",
              "amx_tile": None, "amx_int8": "AMX_INT8", "amx_bf16": None}
# entries of llama_print_system_info() that are build options, not instruction sets
_NOT_SIMD = frozenset({"LLAMAFILE", "OPENMP", "REPACK", "KLEIDIAI", "ACCELERATE", "BLAS", "SVE_CNT",
                       "OPENBLAS", "MKL", "ARCHS", "USE_GRAPHS", "PEER_MAX_BATCH_SIZE", "FA_ALL_QUANTS",
                       "NO_VMM", "FORCE_MMQ", "FORCE_CUBLAS"})
# the widest int8 dot-product tier of a flag set, best first (how either side multiplies quantized rows)
_TIERS = ("AMX_INT8", "AVX512_VNNI", "AVX_VNNI", "AVX512", "AVX2", "AVX", "SSE3")
OURS_ATTENTION = {"flash_attn": False,
                  "attention": "unfused KQ -> softmax -> KQV (ggml's non-flash graph, transposed V cache), "
                               "masked cells skipped"}
_OUR_KERNEL_SIMD = {"vnni": "AVX512_VNNI", "avx2": "AVX2"}
_ENV = ("GGML_DIST_FORCE_AVX2", "GGML_DIST_NO_VNNI", "GGML_DIST_NO_AVX2", "GGML_DIST_NO_NUMBA",
        "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", "NUMBA_THREADING_LAYER")


def parse_cpuinfo(text: str) -> tuple[str, list[str]]:
    """(model name, the flags of _X86_FLAGS it has, in that order) from /proc/cpuinfo or `lscpu` text."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "model name(s)") and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, [f for f in _X86_FLAGS if f in flags]


def simd_names(flags: Sequence[str]) -> list[str]:
    """/proc/cpuinfo flags in llama.cpp's spelling (the ones llama_print_system_info() reports)."""
    return [n for f in flags if (n := _X86_FLAGS.get(f))]


def best_tier(simd: Sequence[str]) -> str:
    """The widest int8 dot-product instruction set among llama.cpp-spelled names ("scalar" if none)."""
    return next((t for t in _TIERS if t in simd), "scalar")


def host_info() -> dict[str, Any]:
    """The host's CPU model, its SIMD flags (/proc/cpuinfo names and llama.cpp's), numba's LLVM CPU
    target (what the float kernels are compiled for) and the environment variables that change the path."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
    if not text:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            text = subprocess.run(["lscpu"], check=False, capture_output=True, text=True, timeout=10).stdout
    model, flags = parse_cpuinfo(text)
    out: dict[str, Any] = {"cpu": model or platform.processor() or platform.machine(), "machine": platform.machine(),
                           "flags": flags, "simd": simd_names(flags)}
    try:
        from llvmlite import binding as llvm
        out["llvm_cpu"] = os.environ.get("NUMBA_CPU_NAME") or llvm.get_host_cpu_name()
    except (ImportError, RuntimeError):
        pass
    out["env"] = {k: os.environ[k] for k in _ENV if k in os.environ}
    return out


def ours_info() -> dict[str, Any]:
    """The kernel path of this process (qpack.default_kernels(), or the numpy reference kernels with
    GGML_DIST_NO_NUMBA=1), its SIMD, and how ours computes attention."""
    from ..backends.cpu import ops as cpu_ops
    from ..backends.cpu import qpack
    kernels = qpack.default_kernels().value if cpu_ops.NUMBA_DEFAULT else "numpy"
    return {"kernels": kernels, "simd": _OUR_KERNEL_SIMD.get(kernels, "float"), **OURS_ATTENTION}


def parse_system_info(text: str | bytes) -> dict[str, Any]:
    """llama_print_system_info() -> {"system_info", "simd", "features"}: the CPU backend's entries, the
    instruction sets it was built with ("X = 1"; entries "= 0", as older builds print them, are left
    out) and its other build options (LLAMAFILE, OPENMP, REPACK...). Other backends' entries ("CUDA :
    ARCHS = 890 | ...") go to "backends"."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    simd: list[str] = []
    features: list[str] = []
    backends: dict[str, dict[str, str]] = {}
    section = "CPU"                                     # older builds print the CPU flags without a prefix
    for raw in text.split("|"):
        entry = raw.strip()
        if not entry:
            continue
        m = re.match(r"^([A-Za-z0-9_ .-]+?)\s*:\s*(.*)$", entry)
        if m and "=" in m.group(2) and "=" not in m.group(1):
            section, entry = m.group(1).strip(), m.group(2).strip()
        key, sep, value = entry.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key:
            continue
        if section.upper() != "CPU":
            backends.setdefault(section, {})[key] = value
        elif value in ("0", ""):
            continue
        elif key.upper() in _NOT_SIMD:
            features.append(key if value == "1" else f"{key}={value}")
        else:
            simd.append(key)
    out: dict[str, Any] = {"system_info": text.strip(), "simd": simd, "features": features}
    if backends:
        out["backends"] = backends
    return out


def simd_comparison(ours: dict[str, Any], llamacpp: dict[str, Any] | None, host_simd: Sequence[str] = ()) -> str:
    """e.g. "ours vnni (AVX512_VNNI) vs llama.cpp AVX2 build (host: AVX512_VNNI)": what a ratio compares."""
    head = f"ours {ours.get('kernels')} ({ours.get('simd')})"
    if not llamacpp or "simd" not in llamacpp:
        return f"{head} vs llama.cpp not measured"
    tail = f" (host: {best_tier(host_simd)})" if host_simd else ""
    return f"{head} vs llama.cpp {best_tier(llamacpp['simd'])} build{tail}"

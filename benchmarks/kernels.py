"""MUL_MAT kernel benchmark: numpy paths vs the numba kernels (same bits), weights kept quantized, for both
accumulation orders of quants.mul_mat ("fast"; "ggml" with repacked=False, i.e. the AVX2 lane orders; the
repacked Q4_0/Q4_K "ggml" chains have the "fast" numerics and run the "fast" kernel).

Prints one JSON object: {"threads", "copy": {...}, "cases": [{"type", "M", "K", "weight_bytes",
"gemv": {"numpy": {...}, "numba": {...}, "numpy_ggml": {...}, "numba_ggml": {...}}, "gemm64": {...}}],
"packed": [...]}. gemv (N = 1) reports GB/s of weight bytes read
and G weights/s; gemm (N = 64) GFLOP/s (2*M*K*N). "copy" is a plain numpy copy of 256 MB measured in the
same run (GB/s counts the bytes read), the memory-bandwidth yardstick for gemv.

"packed" times qpack.PackedWeight.mul_mat (the path model weights take) with each kernel set the host
has: the float kernels, avx2.py's int8 (vpmaddubsw + vpmaddwd) and vnni.py's int8 (vpdpbusd), for
Q4_0 (the repacked chain), Q4_1 and Q8_0 at M = K = 2048, decode (N = 1) and prompt (N = 64) shaped;
each entry {"type", "M", "K", "N", "weight_bytes", "<kernels>": {"ms", "GBps" (N = 1) or "GFLOPs"},
"<kernels>_speedup" (over "float")}, all
kernels' outputs checked bit-identical. To see the AVX2 code an AVX2-only CPU gets (16 ymm registers,
no GFNI/VNNI folds), run it as NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2,+fma,+f16c
GGML_DIST_NO_VNNI=1.

    python -m benchmarks.kernels [--threads 2] [--quick] [--orders fast,ggml] [--suites quants,packed]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ggml_dist.backends.cpu import qkernels
from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu import threads as kernel_threads
from ggml_dist.core.types import GGMLType

# (type, M rows, K): a 1B-class Q4_0 matrix and the SmolLM2-135M shapes (q/o, ffn up/gate, ffn down, head)
CASES = [("Q4_0", 16384, 4096)] + [(t, m, k) for t in ("Q4_1", "Q8_0")
                                   for m, k in ((576, 576), (1536, 576), (576, 1536), (49152, 576))] + \
    [("Q4_K", 2048, 2048), ("Q6_K", 2048, 2048), ("F16", 1536, 576)]


def best_time(fn: Callable[[], Any], min_total: float = 0.3, min_runs: int = 3, max_runs: int = 50) -> float:
    fn()                                       # warm-up (and JIT on first use)
    ts: list[float] = []
    t_start = time.perf_counter()
    while len(ts) < min_runs or (time.perf_counter() - t_start < min_total and len(ts) < max_runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def copy_bandwidth(nbytes: int = 256 << 20) -> dict[str, float]:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    t = best_time(lambda: np.copyto(dst, src), min_runs=5)
    return {"bytes": nbytes, "read_GBps": nbytes / t / 1e9, "read_write_GBps": 2 * nbytes / t / 1e9}


def mm(wtype: GGMLType, w: np.ndarray, x: np.ndarray, use_numba: bool, order: str = "fast") -> np.ndarray:
    if use_numba and wtype in qkernels.COVERED:
        return qkernels.mul_mat_q(wtype, w, x, order=order, repacked=False)
    return Q.mul_mat(wtype, w, x, order=order, repacked=False)


def run_case(tname: str, M: int, K: int, n_gemm: int, skip_numpy_gemm: bool,
             orders: tuple[str, ...] = ("fast", "ggml")) -> dict[str, Any]:
    t = GGMLType[tname]
    rng = np.random.default_rng(0)
    w = Q.quantize(t, (rng.standard_normal((M, K)) * 0.05).astype(np.float32))
    x = rng.standard_normal((n_gemm, K)).astype(np.float32)
    out: dict[str, Any] = {"type": tname, "M": M, "K": K, "weight_bytes": int(w.nbytes)}
    gemv: dict[str, Any] = {}
    gemm: dict[str, Any] = {}
    for order in orders:
        sfx = "" if order == "fast" else "_" + order
        assert np.array_equal(mm(t, w, x[:1], True, order), mm(t, w, x[:1], False, order)), \
            f"{tname} {M}x{K} {order}: numba != numpy"
        for name, use in (("numpy", False), ("numba", True)):
            s = best_time(lambda use=use, order=order: mm(t, w, x[:1], use, order))
            gemv[name + sfx] = {"ms": s * 1e3, "GBps": w.nbytes / s / 1e9, "Gweights_per_s": M * K / s / 1e9}
        gemv["speedup" + sfx] = gemv["numpy" + sfx]["ms"] / gemv["numba" + sfx]["ms"]
        for name, use in (("numpy", False), ("numba", True)):
            if name == "numpy" and skip_numpy_gemm:
                continue
            s = best_time(lambda use=use, order=order: mm(t, w, x, use, order), min_total=0.0,
                          min_runs=2 if M * K > 1 << 24 else 3)
            gemm[name + sfx] = {"ms": s * 1e3, "GFLOPs": 2 * M * K * n_gemm / s / 1e9}
        if "numpy" + sfx in gemm:
            gemm["speedup" + sfx] = gemm["numpy" + sfx]["ms"] / gemm["numba" + sfx]["ms"]
    if "fast" in orders and "ggml" in orders:     # cost of the bit-faithful order in the numba kernels
        gemv["ggml_over_fast"] = gemv["numba_ggml"]["ms"] / gemv["numba"]["ms"]
        gemm["ggml_over_fast"] = gemm["numba_ggml"]["ms"] / gemm["numba"]["ms"]
    out["gemv"] = gemv
    out[f"gemm{n_gemm}"] = gemm
    return out


def run_packed_case(tname: str, M: int, K: int, N: int) -> dict[str, Any]:
    from ggml_dist.backends.cpu import avx2, qpack, vnni
    t = GGMLType[tname]
    rng = np.random.default_rng(0)
    w = Q.quantize(t, (rng.standard_normal((M, K)) * 0.05).astype(np.float32))
    x = rng.standard_normal((N, K)).astype(np.float32)
    kernels = [qpack.Kernels.FLOAT] + [k for k, ok in ((qpack.Kernels.AVX2, avx2.AVAILABLE),
                                                         (qpack.Kernels.VNNI, vnni.AVAILABLE)) if ok]
    out: dict[str, Any] = {"type": tname, "M": M, "K": K, "N": N, "weight_bytes": int(w.nbytes)}
    ref = None
    for k in kernels:
        pw = qpack.PackedWeight(t, w, kernels=k)
        dst = np.empty((N, M), np.float32)
        got = pw.mul_mat(x, dst)
        assert got is not None and (ref is None or np.array_equal(got, ref)), f"{tname} N={N}: {k.value} differs"
        ref = got.copy() if ref is None else ref
        s = best_time(lambda pw=pw, dst=dst: pw.mul_mat(x, dst), min_total=0.5, min_runs=5, max_runs=200)
        rate = {"GBps": w.nbytes / s / 1e9} if N == 1 else {"GFLOPs": 2 * M * K * N / s / 1e9}
        out[k.value] = {"ms": s * 1e3, **rate}
        if k is not qpack.Kernels.FLOAT:
            out[k.value + "_speedup"] = out["float"]["ms"] / out[k.value]["ms"]
    return out


PACKED_CASES = [(t, 2048, 2048, n) for n in (1, 64) for t in ("Q4_0", "Q4_1", "Q8_0")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-gemm", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="skip the numpy gemm timings (slowest part)")
    ap.add_argument("--orders", default="fast,ggml", help="comma-separated accumulation orders to time")
    ap.add_argument("--suites", default="quants,packed",
                    help="quants: quants.mul_mat (numpy) vs qkernels (numba); packed: qpack's float/AVX2/VNNI kernels")
    args = ap.parse_args(argv)
    suites = set(args.suites.split(","))
    kernel_threads.set_threads(args.threads)
    result: dict[str, Any] = {"threads": args.threads, "copy": copy_bandwidth(), "cases": []}
    for tname, M, K in CASES if "quants" in suites else ():
        result["cases"].append(run_case(tname, M, K, args.n_gemm, args.quick, tuple(args.orders.split(","))))
    if "packed" in suites:
        result["packed"] = [run_packed_case(*c) for c in PACKED_CASES]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

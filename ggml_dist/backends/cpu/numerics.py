"""ggml's CPU float helpers, emulated in numpy (ggml-numerics.md §2).

fma(a, b, c) on float32 is emulated in float64: the product of two f32 is exact there, so only the final
add can double-round, which happens on a vanishing fraction of inputs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable
from functools import cache

import numpy as np
import numpy.typing as npt

from ...core.tensor import UnaryOp

F32 = np.float32
F64 = np.float64


def fma32(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):   # inf/nan lanes (masked -inf) are expected
        return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


_C_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_C_SHIFT = F32(float.fromhex("0x1.8p23"))
_C_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))
_C_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_C_P0 = F32(float.fromhex("0x1.0e4020p-7"))
_C_P1 = F32(float.fromhex("0x1.573e2ep-5"))
_C_P2 = F32(float.fromhex("0x1.555e66p-3"))
_C_P3 = F32(float.fromhex("0x1.fffdb6p-2"))
_C_P4 = F32(float.fromhex("0x1.ffffecp-1"))


def vexp(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf (AVX2+FMA): the vectorised exp softmax and SiLU use on full chunks of 8. In numpy:
    this module is the reference; fkernels.vexp is its compiled twin."""
    x = np.asarray(x, F32)
    z = fma32(x, _C_LOG2E, _C_SHIFT)
    n = (z - _C_SHIFT).astype(F32)
    b = fma32(-n, _C_LN2_LO, fma32(-n, _C_LN2_HI, x))
    e = z.view(np.uint32) << np.uint32(23)
    k = (e + np.uint32(0x3F800000)).view(F32)
    u = (b * b).astype(F32)
    p = fma32(fma32(_C_P0, b, _C_P1), u, fma32(_C_P2, b, _C_P3))
    j = fma32(p, u, (_C_P4 * b).astype(F32))
    out = fma32(j, k, k)
    big = np.abs(n) > 126
    if np.any(big):
        g = np.where(n <= 0, np.uint32(0x82000000), np.uint32(0)).astype(np.uint32)
        s1 = (g + np.uint32(0x7F000000)).view(F32)
        s2 = (e - g).view(F32)
        with np.errstate(over="ignore", invalid="ignore"):
            far = (s1 * s1).astype(F32)
            near = (fma32(s2, j, s2) * s1).astype(F32)
        out = np.where(big, np.where(np.abs(n) > 192, far, near), out)
    return out


def expf(x: npt.ArrayLike) -> np.ndarray:
    """The C library's expf, which glibc rounds correctly (to within its 0.502 ulp bound): exp in double,
    rounded once to f32. numpy's own f32 exp is a SIMD approximation that may differ in the last bit."""
    with np.errstate(over="ignore", under="ignore"):
        return np.exp(np.asarray(x, F32).astype(F64)).astype(F32)


def exp_chunked(x: np.ndarray) -> np.ndarray:
    """vexp on the leading multiple of 8 of the last axis, the C library's expf on the tail (as ggml)."""
    n8 = x.shape[-1] // 8 * 8
    if n8 == x.shape[-1]:
        return vexp(x)
    out = np.empty(x.shape, F32)
    out[..., :n8] = vexp(x[..., :n8])
    out[..., n8:] = expf(x[..., n8:])
    return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    """ggml's op_sigmoid, element by element: 1.f / (1.f + expf(-x))."""
    x = np.asarray(x, F32)
    return (F32(1) / (F32(1) + expf(-x)).astype(F32)).astype(F32)


@cache
def _libm_f(name: str) -> Callable[[float], float] | None:
    """The C library's float function `name` (expf, logf) through ctypes; None where no libm loads."""
    path = ctypes.util.find_library("m")
    try:
        lib = ctypes.CDLL(path) if path else None
    except OSError:
        return None
    if lib is None:
        return None
    f = getattr(lib, name)
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def libm(name: str, x: np.ndarray) -> np.ndarray:
    """The C library's expf / logf element by element, as ggml's scalar code calls them: glibc's differ
    from the double result rounded once in a few inputs per thousand (logf) or ten thousand (expf).
    Without a loadable libm, the double result rounded once. For small arrays (a step's gates)."""
    x = np.asarray(x, F32)
    f = _libm_f(name)
    if f is None:
        with np.errstate(over="ignore", divide="ignore"):
            return getattr(np, name[:-1])(x.astype(F64)).astype(F32)
    return np.array([f(float(v)) for v in x.reshape(-1)], F32).reshape(x.shape)


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml's op_softplus, element by element: x > 20 ? x : logf(1 + expf(x)), each step in f32 with the
    C library's expf and logf (bit for bit with llama.cpp's ggml)."""
    x = np.asarray(x, F32)
    one_plus = (F32(1) + libm("expf", np.minimum(x, F32(20)))).astype(F32)
    return np.where(x > F32(20), x, libm("logf", one_plus))


def swiglu_oai(g: np.ndarray, u: np.ndarray, alpha: float, limit: float) -> np.ndarray:
    """ggml_compute_forward_swiglu_oai_f32: x = min(g, limit), y = clamp(u, -limit, limit),
    x / (1 + expf(alpha * -x)) * (y + 1), each step in f32."""
    a, lim = F32(alpha), F32(limit)
    x = np.minimum(np.asarray(g, F32), lim)
    y = np.clip(np.asarray(u, F32), -lim, lim).astype(F32)
    out_glu = (x / (F32(1) + expf((a * -x).astype(F32))).astype(F32)).astype(F32)
    return (out_glu * (y + F32(1)).astype(F32)).astype(F32)


def hsum_ha(v: np.ndarray) -> np.ndarray:
    """HA horizontal sum of 8 lanes (last axis): ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) in f32."""
    v = v.astype(F32, copy=False)
    a = (v[..., 0] + v[..., 4]).astype(F32) + (v[..., 2] + v[..., 6]).astype(F32)
    b = (v[..., 1] + v[..., 5]).astype(F32) + (v[..., 3] + v[..., 7]).astype(F32)
    return (a.astype(F32) + b.astype(F32)).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_silu_f32: x / (1 + exp(-x)) with vexp on chunks of 8."""
    x = np.asarray(x, F32)
    with np.errstate(over="ignore"):
        return (x / (F32(1) + exp_chunked(-x)).astype(F32)).astype(F32)


_GELU_TABLE: np.ndarray | None = None
_GELU_TABLE_F16: np.ndarray | None = None


def _tanhf():
    """glibc's tanhf (what ggml's table is built with: numpy's f32 tanh differs in ~235 f16 entries)."""
    import ctypes
    import ctypes.util
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        f = libm.tanhf
    except (OSError, AttributeError):
        return None
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    return f


def gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 (ggml_cpu_init): f16(ggml_gelu_f32(x)) for every f16 bit pattern x, where
    ggml_gelu_f32(x) = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) in f32, with glibc's
    tanhf and the fma the compiler makes of 1.0f + GELU_COEF_A*x*x."""
    global _GELU_TABLE
    if _GELU_TABLE is None:
        h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(F32)
        c, a = F32(0.79788456080286535587989211986876), F32(0.044715)
        with np.errstate(all="ignore"):
            # gcc contracts 1.0f + GELU_COEF_A*x*x into fma(GELU_COEF_A*x, x, 1.0f) (-mfma): that decides
            # one entry (f16 0xbfff, -1.999), which llama.cpp's logits confirm
            ax = (a * h).astype(F32)
            inner = (c * h * (ax.astype(np.float64) * h.astype(np.float64) + 1.0).astype(F32)).astype(F32)
            tanhf = _tanhf()
            if tanhf is None:
                th = np.tanh(inner).astype(F32)
            else:
                th = np.array([tanhf(float(v)) if np.isfinite(v) else float("nan") for v in inner.tolist()],
                              dtype=F32)
            g = (F32(0.5) * h * (F32(1) + th).astype(F32)).astype(F32)
            _GELU_TABLE = g.astype(np.float16).astype(F32)
    return _GELU_TABLE


def gelu_table_f16() -> np.ndarray:
    """gelu_table as f16 bits (uint16 [65536]): ggml_table_gelu_f16 itself (every entry is an f16)."""
    global _GELU_TABLE_F16
    if _GELU_TABLE_F16 is None:
        _GELU_TABLE_F16 = gelu_table().astype(np.float16).view(np.uint16)
    return _GELU_TABLE_F16


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: 0 for x <= -10, x for x >= 10, else the f16 table entry of
    f16(x) (ggml_table_gelu_f16). ggml_vec_geglu_f32 is gelu(x) * g with the same three cases."""
    x = np.asarray(x, F32)
    g = gelu_table()[x.astype(np.float16).view(np.uint16)]
    return np.where(x <= -10, F32(0), np.where(x >= 10, x, g)).astype(F32)


# the UNARY node's element-wise function by ggml_unary_op
UNARY = {UnaryOp.SILU: silu, UnaryOp.GELU: gelu, UnaryOp.SIGMOID: sigmoid, UnaryOp.SOFTPLUS: softplus}

"""ggml's CPU float helpers, emulated in numpy (ggml-numerics.md §2).

fma(a, b, c) on float32 is emulated in float64: the product of two f32 is exact there, so only the final
add can double-round, which happens on a vanishing fraction of inputs.
"""
from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = np.float32
F64 = np.float64


def fma32(a: npt.ArrayLike, b: npt.ArrayLike, c: npt.ArrayLike) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):   # inf/nan lanes (masked -inf) are expected
        return (np.asarray(a, F64) * np.asarray(b, F64) + np.asarray(c, F64)).astype(F32)


def _f(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(F32)[0]


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
    """ggml_v_expf (AVX2+FMA): the vectorised exp softmax and SiLU use on full chunks of 8.
    Runs the numba twin _vexp_nb (same float steps, one pass) when numba is available."""
    x = np.asarray(x, F32)
    nb = _vexp_kernel()
    if nb:
        out = np.empty(x.shape, F32)
        nb(np.ascontiguousarray(x).reshape(-1), out.reshape(-1))
        return out
    return vexp_numpy(x)


def vexp_numpy(x: np.ndarray) -> np.ndarray:
    """vexp in numpy (the reference for _vexp_nb)."""
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


def exp_chunked(x: np.ndarray) -> np.ndarray:
    """vexp on the leading multiple of 8 of the last axis, libm-like expf on the tail (as ggml)."""
    n8 = x.shape[-1] // 8 * 8
    if n8 == x.shape[-1]:
        return vexp(x)
    out = np.empty(x.shape, F32)
    out[..., :n8] = vexp(x[..., :n8])
    with np.errstate(over="ignore"):
        out[..., n8:] = np.exp(x[..., n8:].astype(F32))
    return out


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


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: 0 for x <= -10, x for x >= 10, else the f16 table entry of
    f16(x) (ggml_table_gelu_f16). ggml_vec_geglu_f32 is gelu(x) * g with the same three cases."""
    x = np.asarray(x, F32)
    g = gelu_table()[x.astype(np.float16).view(np.uint16)]
    return np.where(x <= -10, F32(0), np.where(x >= 10, x, g)).astype(F32)


# -- numba twin of vexp ----------------------------------------------------------------------------
_VEXP_NB = None          # the compiled kernel once built; False without numba


def _vexp_kernel():
    global _VEXP_NB
    if _VEXP_NB is None:
        try:
            _VEXP_NB = _build_vexp_nb()
        except ImportError:
            _VEXP_NB = False
    return _VEXP_NB


def _build_vexp_nb():
    from numba import njit

    from . import kernel_cache  # noqa: F401  (where the kernel is cached)

    c_log2e, c_shift, c_ln2_hi, c_ln2_lo = _C_LOG2E, _C_SHIFT, _C_LN2_HI, _C_LN2_LO
    p0, p1, p2, p3, p4 = _C_P0, _C_P1, _C_P2, _C_P3, _C_P4

    @njit(cache=True, fastmath=False)
    def _vexp_nb(x, out):
        """vexp_numpy elementwise: fma32(a, b, c) = f32(f64(a) * f64(b) + f64(c)); uint32 bit steps."""
        n_el = x.shape[0]
        zs = np.empty(n_el, F32)
        ks = np.empty(n_el, F32)
        ss = np.empty(2, F32)
        zb = zs.view(np.uint32)
        kb = ks.view(np.uint32)
        sb = ss.view(np.uint32)
        for i in range(n_el):
            xi = x[i]
            z = F32(F64(xi) * F64(c_log2e) + F64(c_shift))
            zs[i] = z
            n = F32(z - c_shift)
            b = F32(F64(-n) * F64(c_ln2_lo) + F64(F32(F64(-n) * F64(c_ln2_hi) + F64(xi))))
            e = (np.uint64(zb[i]) << np.uint64(23)) & np.uint64(0xFFFFFFFF)
            kb[i] = np.uint32((e + np.uint64(0x3F800000)) & np.uint64(0xFFFFFFFF))
            k = ks[i]
            u = F32(b * b)
            q = F32(F64(F32(F64(p0) * F64(b) + F64(p1))) * F64(u) + F64(F32(F64(p2) * F64(b) + F64(p3))))
            j = F32(F64(q) * F64(u) + F64(F32(p4 * b)))
            r = F32(F64(j) * F64(k) + F64(k))
            an = abs(n)
            if an > 126:
                g = np.uint64(0x82000000) if n <= 0 else np.uint64(0)
                sb[0] = np.uint32((g + np.uint64(0x7F000000)) & np.uint64(0xFFFFFFFF))
                sb[1] = np.uint32((e - g) & np.uint64(0xFFFFFFFF))
                s1 = ss[0]
                s2 = ss[1]
                r = F32(s1 * s1) if an > 192 else F32(F32(F64(s2) * F64(j) + F64(s2)) * s1)
            out[i] = r

    return _vexp_nb

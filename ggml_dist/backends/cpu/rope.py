"""ROPE on the CPU (ggml_compute_forward_rope_flt, ggml_rope_cache_init, rope_yarn; numerics §2)."""
from __future__ import annotations

import ctypes
import ctypes.util
import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from ...core.tensor import Tensor
from .numerics import fma32

F32 = np.float32
ROPE_TYPE_NEOX = 2
ROPE_TYPE_MROPE = 8
ROPE_TYPE_IMROPE = 40


def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the dims where YaRN ramps from extrapolation to interpolation."""
    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(freq_base))
    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    return float(max(0, start)), float(min(n_dims - 1, end))


def rope_scalars(n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
                 attn_factor: float) -> tuple[np.float32, np.float32]:
    """(theta_scale, mscale) of ggml_rope_cache_init: powf(base, -2.0f/n_dims), and attn_factor with
    YaRN's magnitude correction where ext_factor != 0: mscale *= 1.0f + 0.1f * logf(1.0f / freq_scale),
    in f32 with the fma GCC makes of it and the C library's logf (correctly rounded: log in double)."""
    theta_scale = F32(np.float64(freq_base) ** np.float64(F32(-2.0 / n_dims)))   # powf(base, -2.0f/n_dims)
    mscale = F32(attn_factor)
    if ext_factor != 0.0:
        inv = F32(F32(1.0) / F32(freq_scale))
        mscale = F32(mscale * fma32(F32(0.1), F32(math.log(float(inv))), F32(1.0)))
    return theta_scale, mscale


def rope_cache(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
               attn_factor: float, corr_dims: tuple[float, float],
               freq_factors: np.ndarray | None, fk: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_pos, n_dims/2]: theta by the iterated f32 product, as ggml_rope_cache_init. With fk
    (fkernels, where its cos and sin are libm's), by its one compiled call fk.rope_cache (same bits)."""
    half = n_dims // 2
    if fk is not None and fk.LIBM_COS_SIN:
        cos, sin = np.empty((len(pos), half), F32), np.empty((len(pos), half), F32)
        fk.rope_cache(pos, *rope_fill_args(n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr_dims,
                                           freq_factors), cos, sin)
        return cos, sin
    theta_scale, mscale = rope_scalars(n_dims, freq_base, freq_scale, ext_factor, attn_factor)
    theta = np.empty((len(pos), half), F32)
    theta[:, 0] = pos.astype(F32)
    theta[:, 1:] = theta_scale
    np.multiply.accumulate(theta, axis=1, out=theta)    # t_{i+1} = f32(t_i * theta_scale), in order
    if freq_factors is not None:
        theta = (theta / freq_factors[:half].astype(F32)).astype(F32)
    theta_interp = (F32(freq_scale) * theta).astype(F32)
    if ext_factor != 0.0:
        i0 = np.arange(0, n_dims, 2, dtype=F32)
        y = (i0 / 2 - corr_dims[0]) / max(0.001, corr_dims[1] - corr_dims[0])
        ramp = ((1 - np.minimum(1, np.maximum(0, y))) * ext_factor).astype(F32)
        theta = (theta_interp * (1 - ramp) + theta * ramp).astype(F32)
    else:
        theta = theta_interp
    cos = (libm_cosf(theta) * mscale).astype(F32)
    sin = (libm_sinf(theta) * mscale).astype(F32)
    return cos, sin


def rope_fill_args(n_dims: int, freq_base: float, freq_scale: float, ext_factor: float, attn_factor: float,
                   corr_dims: tuple[float, float], freq_factors: np.ndarray | None) -> tuple:
    """fk.rope_cache's arguments after pos, as f32 (the reference's scalars act in f32)."""
    theta_scale, mscale = rope_scalars(n_dims, freq_base, freq_scale, ext_factor, attn_factor)
    ff = np.zeros(0, F32) if freq_factors is None else np.ascontiguousarray(freq_factors[:n_dims // 2], F32)
    return (theta_scale, ff, F32(freq_scale), F32(ext_factor), F32(corr_dims[0]),
            F32(max(0.001, corr_dims[1] - corr_dims[0])), mscale)


def _libm() -> tuple[Callable[[float], float], Callable[[float], float]] | tuple[None, None]:
    """libm's (cosf, sinf) through ctypes, or (None, None) where no libm loads."""
    name = ctypes.util.find_library("m")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        lib = None
    if lib is None:
        return None, None
    out = []
    for fn in ("cosf", "sinf"):
        f = getattr(lib, fn)
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
        out.append(f)
    return out[0], out[1]


_COSF, _SINF = _libm()


@lru_cache(maxsize=1 << 16)
def _cos_sin_one(theta: float) -> tuple[float, float]:
    assert _COSF is not None and _SINF is not None, "called only with a loadable libm"
    return _COSF(theta), _SINF(theta)


def libm_cosf(theta: np.ndarray) -> np.ndarray:
    """The C library's cosf, as ggml calls it (numpy's float32 cos differs in ~12% of inputs, a
    float64 cos rounded to f32 in ~1%). Falls back to the latter without a loadable libm."""
    if _COSF is None:
        return np.cos(theta.astype(np.float64)).astype(F32)
    flat = theta.reshape(-1)
    return np.array([_cos_sin_one(float(v))[0] for v in flat], F32).reshape(theta.shape)


def libm_sinf(theta: np.ndarray) -> np.ndarray:
    if _SINF is None:
        return np.sin(theta.astype(np.float64)).astype(F32)
    flat = theta.reshape(-1)
    return np.array([_cos_sin_one(float(v))[1] for v in flat], F32).reshape(theta.shape)


_CACHE: dict = {}            # the last few rope_cache results: every layer ropes Q and K at the same positions
_CACHE_MAX = 8


def _rope_cache_cached(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float, ext_factor: float,
                       attn_factor: float, corr_dims: tuple[float, float],
                       freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """rope_cache, memoized on the values of its arguments (results are read-only)."""
    key = (pos.dtype.str, pos.tobytes(), n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr_dims,
           None if freq_factors is None else (freq_factors.dtype.str, freq_factors.tobytes()))
    return _memoized(key, lambda: rope_cache(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor,
                                             corr_dims, freq_factors))


def _memoized(key: tuple, make: Callable[[], tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """_CACHE's (cos, sin) for key, made (read-only) by make() where absent."""
    hit = _CACHE.get(key)
    if hit is None:
        cos, sin = make()
        cos.flags.writeable = False
        sin.flags.writeable = False
        if len(_CACHE) >= _CACHE_MAX:
            try:                                        # oldest entry (another thread may race us)
                _CACHE.pop(next(iter(_CACHE)), None)
            except (StopIteration, RuntimeError):
                pass
        hit = _CACHE[key] = (cos, sin)
    return hit


@lru_cache(maxsize=256)
def _rope_params(op_params: tuple) -> tuple:
    """(n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, corr_dims) from a ROPE node's
    op_params (ggml stores the floats as f32); memoized: every layer ropes with the same ones."""
    _, n_dims, mode, _, n_ctx_orig = (int(v) for v in op_params[:5])
    freq_base, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow = \
        (float(F32(v)) for v in op_params[5:11])
    corr = yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow)
    return n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, corr


def mrope_cache(pos: np.ndarray, sections: tuple, mode: int, n_dims: int, freq_base: float, freq_scale: float,
                ext_factor: float, attn_factor: float, corr_dims: tuple[float, float],
                freq_factors: np.ndarray | None, fk: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [n_tok, n_dims/2] of ggml_mrope_cache_init: pos holds four streams of n_tok positions (time,
    height, width, extra); pair i takes its angle from one stream, by its sector i mod sum(sections). Each
    stream's angles are the plain cache's (the same iterated f32 product from its position), so the
    column of a pair is that stream's column. IMROPE interleaves the sections (sector % 3 picks t, h, w
    while within 3 * their size, the rest the extra stream); MROPE puts them one after the other. fk:
    rope_cache's (the same bits)."""
    n = len(pos) // 4
    streams = [rope_cache(pos[s * n:(s + 1) * n], n_dims, freq_base, freq_scale, ext_factor, attn_factor,
                          corr_dims, freq_factors, fk) for s in range(4)]
    s0, s1, s2, _ = (int(v) for v in sections)
    sect_dims = sum(int(v) for v in sections)
    cos, sin = np.empty_like(streams[0][0]), np.empty_like(streams[0][1])
    for i in range(n_dims // 2):
        sector = i % sect_dims
        if mode == ROPE_TYPE_IMROPE:
            which = (1 if sector % 3 == 1 and sector < 3 * s1 else 2 if sector % 3 == 2 and sector < 3 * s2
                     else 0 if sector % 3 == 0 and sector < 3 * s0 else 3)
        else:
            which = 0 if sector < s0 else 1 if sector < s0 + s1 else 2 if sector < s0 + s1 + s2 else 3
        cos[:, i], sin[:, i] = streams[which][0][:, i], streams[which][1][:, i]
    return cos, sin


def rope_forward(t: Tensor, dst: np.ndarray, srcs: list, fk=None) -> None:
    """x: [ne3, n_tok, n_head, head_dim]; rotates pairs (NORM: 2i, 2i+1; NEOX: i, i+n_dims/2).
    With fk (the fkernels module) and F32 x and dst, the rotation is one fk.rope call (same bits)."""
    n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, corr = _rope_params(tuple(t.op_params))
    pos = srcs[1].reshape(-1)
    ff = srcs[2].reshape(-1) if len(srcs) > 2 and srcs[2] is not None else None
    if mode & ROPE_TYPE_MROPE:                      # memoized: every attention layer ropes Q and K alike
        sections = tuple(t.op_params[11:15])
        key = ("mrope", pos.dtype.str, pos.tobytes(), sections, mode, n_dims, freq_base, freq_scale, ext_factor,
               attn_factor, corr, None if ff is None else (ff.dtype.str, ff.tobytes()))
        cos, sin = _memoized(key, lambda: mrope_cache(pos, sections, mode, n_dims, freq_base, freq_scale,
                                                      ext_factor, attn_factor, corr, ff, fk))
        mode |= ROPE_TYPE_NEOX                      # the multi-section ropes rotate NEOX's pairs (i, i + n_dims/2)
    else:
        cos, sin = _rope_cache_cached(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor, corr, ff)
    if fk is not None and srcs[0].dtype == F32 and dst.dtype == F32:
        fk.rope(srcs[0], cos, sin, n_dims, bool(mode & ROPE_TYPE_NEOX), dst)
        return
    x = srcs[0].astype(F32, copy=False)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]    # broadcast over ne3 and heads
    if mode & ROPE_TYPE_NEOX:
        x0, x1 = x[..., : n_dims // 2], x[..., n_dims // 2: n_dims]
    else:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
    # GCC contracts x0*c - x1*s into fma(x0, c, -(x1*s)) (the first product fuses; -ffp-contract=fast)
    y0 = fma32(x0, cos, -(x1 * sin).astype(F32))
    y1 = fma32(x0, sin, (x1 * cos).astype(F32))
    rest = x[..., n_dims:].copy() if n_dims < x.shape[-1] else None
    if mode & ROPE_TYPE_NEOX:
        dst[..., : n_dims // 2], dst[..., n_dims // 2: n_dims] = y0, y1
    else:
        dst[..., 0:n_dims:2], dst[..., 1:n_dims:2] = y0, y1
    if rest is not None:
        dst[..., n_dims:] = rest


def bind_rope(t: Tensor, dst: np.ndarray, srcs: list, fk: Any, prologue: list, shared: dict
              ) -> Callable[[], None] | None:
    """rope_forward's fk path with its parameters and views resolved once (rope_args); None where that
    path does not apply."""
    args = rope_args(t, dst, srcs, fk, prologue, shared)
    return None if args is None else fk.bind_rope(*args)


def rope_args(t: Tensor, dst: np.ndarray, srcs: list, fk: Any, prologue: list, shared: dict) -> tuple | None:
    """The arguments (x, cos, sin, n_dims, neox, dst) of the fk rope kernels for a node, or None where
    that path does not apply. The cos/sin of the step's positions are made once per replay, by a
    prologue call that every ROPE node with the same positions and parameters shares (shared: key ->
    the arrays it fills; prologue: the calls a replay makes first)."""
    if srcs[0].dtype != F32 or dst.dtype != F32 or int(t.op_params[2]) & ROPE_TYPE_MROPE:
        return None
    params = _rope_params(tuple(t.op_params))
    n_dims, mode, freq_base, freq_scale, ext_factor, attn_factor, corr = params
    x, pos = srcs[0], srcs[1].reshape(-1)
    has_ff = len(srcs) > 2 and srcs[2] is not None
    ff = srcs[2].reshape(-1) if has_ff else None
    key = ("rope", t.src[1], t.src[2] if has_ff else None, params)
    cs = shared.get(key)
    if cs is None:
        cs = shared[key] = (np.empty((len(pos), n_dims // 2), F32), np.empty((len(pos), n_dims // 2), F32))

        if fk.LIBM_COS_SIN:             # one compiled call a step
            prologue.append(fk.bind_rope_cache(pos, *rope_fill_args(n_dims, freq_base, freq_scale, ext_factor,
                                                                   attn_factor, corr, ff), *cs))
        else:
            def fill(cos: np.ndarray = cs[0], sin: np.ndarray = cs[1]) -> None:
                cos[...], sin[...] = rope_cache(pos, n_dims, freq_base, freq_scale, ext_factor, attn_factor,
                                                corr, ff, fk)
            prologue.append(fill)
    return x, cs[0], cs[1], n_dims, bool(mode & ROPE_TYPE_NEOX), dst

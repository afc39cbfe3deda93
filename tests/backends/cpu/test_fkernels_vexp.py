"""fkernels' branch-free vexp and the vectorised soft_max / swiglu passes keep the reference bits.

vexp uses true fmas and selects instead of branches so that its loops vectorise; numerics.vexp
(fma emulated in float64) stays the reference. All 2^32 inputs were compared once offline (no
difference but NaN payload signs, which vexp itself does not fix: see test_vexp_nan_rule); here a
large random sweep plus every exponent and the branch boundaries.
"""
import numpy as np
import pytest
from numba import njit

from ggml_dist.backends.cpu import fkernels as fk
from ggml_dist.backends.cpu import numerics as nm

F32 = np.float32


@njit(error_model="numpy")
def _vexp_loop(x, out):
    for i in range(x.shape[0]):
        out[i] = fk.vexp(x[i])


@njit(error_model="numpy")
def _row_max_loop(w):
    mx = F32(-np.inf)
    for v in w:
        if v > mx or np.isnan(v):
            mx = v
            if np.isnan(v):
                break
    return mx


@njit(error_model="numpy")
def _row_max(w):
    return fk._row_max(w)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def vexp(x):
    out = np.empty_like(x)
    _vexp_loop(x, out)
    return out


def edge_values():
    """Every exponent (both signs, subnormals included) with a few mantissas, and the branch
    boundaries: |n| = 126 / 192 (x near ±126 ln2, ±192 ln2), exp's over- and underflow near 88.7, -87.3,
    -103.3, plus zeros and infinities."""
    e = np.arange(256, dtype=np.uint32) << np.uint32(23)
    mant = np.array([0, 1, 0x2AAAAA, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32)
    grid = (e[:, None] | mant[None, :]).ravel()
    grid = np.concatenate([grid, grid | np.uint32(0x80000000)])
    grid = grid[(grid & np.uint32(0x7F800000)) != np.uint32(0x7F800000)].view(F32)
    ln2 = np.log(2.0)
    centres = np.array([88.0, 88.72, 89.0, 87.34, 103.28, 104.0, 126 * ln2, 126.5 * ln2, 127 * ln2,
                        192 * ln2, 192.5 * ln2, 193 * ln2, 0.5 * ln2, 1.5 * ln2], np.float64)
    centres = np.concatenate([centres, -centres]).astype(F32)
    u = bits(centres).astype(np.int64)
    near = (u[:, None] + np.arange(-300, 301)[None, :]).astype(np.uint32).ravel().view(F32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 3e38, -3e38], F32)
    return np.concatenate([grid, near, special])


def test_vexp_bits():
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.integers(0, 2 ** 32, 4_000_000, dtype=np.uint64).astype(np.uint32).view(F32),
                        rng.uniform(-110, 100, 2_000_000).astype(F32), edge_values()])
    x = x[~np.isnan(x)]
    with np.errstate(all="ignore"):
        ref = nm.vexp(x)
    got = vexp(x)
    assert np.array_equal(bits(got), bits(ref)), f"{np.sum(bits(got) != bits(ref))} differ"
    for i in range(8):                                  # each lane position of a vector, and the tail
        assert np.array_equal(bits(vexp(x[i:i + 1001])), bits(ref[i:i + 1001]))


def test_vexp_nan_rule():
    """A NaN x gives x quieted with its sign flipped: vexp's result in its vectorised loop body
    (its scalar tail may keep the sign) and what the float64 emulation fkernels used before gives."""
    m = np.arange(1, 1 << 23, 997, dtype=np.uint32)
    x = np.concatenate([m | np.uint32(0x7F800000), m | np.uint32(0xFF800000)]).view(F32)
    want = (bits(x) | np.uint32(0x00400000)) ^ np.uint32(0x80000000)
    assert np.array_equal(bits(vexp(x)), want)
    with np.errstate(all="ignore"):
        ref = bits(nm.vexp(x))
    assert np.mean(ref == want) > 0.99


@pytest.mark.parametrize("n", [8, 24, 768, 13])
def test_row_max_same_as_scalar_loop(n):
    """The vectorised max gives ggml's scalar loop's value; NaN rows its first NaN, payload included;
    with both zeros it may keep the other one, which no vexp(v - max) tells apart (checked)."""
    rng = np.random.default_rng(n)
    cases = [rng.standard_normal(n).astype(F32) * 5, np.full(n, -np.inf, F32),
             -np.abs(rng.standard_normal(n)).astype(F32)]
    w = np.full(n, -np.inf, F32)
    w[n // 2] = 3.0
    cases.append(w)
    w = rng.standard_normal(n).astype(F32)
    w[-1] = np.inf
    cases.append(w)
    for k in (0, n // 3, n - 1):
        w = rng.standard_normal(n).astype(F32)
        w[k] = np.float32(np.nan)
        w[(k + 1) % n] = np.array([0x7F812345], np.uint32).view(F32)[0]    # a second, signalling NaN
        cases.append(w)
    for w in cases:
        assert bits(np.array([_row_max(w)]))[0] == bits(np.array([_row_max_loop(w)]))[0]
    z = np.array([-0.0, 0.0, -1.0, -0.0, -2.0, 0.0, -3.0, -0.0], F32)
    assert _row_max(z) == 0
    assert np.array_equal(bits(vexp(z - F32(0.0))), bits(vexp(z - F32(-0.0))))


def test_swiglu_in_place_and_strided():
    """swiglu's scratch row: dst = g (in place) and strided halves give the out-of-place bits."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((1, 2, 3, 2 * 40)) * 4).astype(F32)
    g, u = a[..., :40], a[..., 40:]
    ref = np.empty(g.shape, F32)
    fk.swiglu(np.ascontiguousarray(g), np.ascontiguousarray(u), ref)
    with np.errstate(all="ignore"):
        want = (g / (F32(1) + nm.vexp(-g)) * u).astype(F32)
    assert np.array_equal(bits(ref), bits(want))
    out = np.empty(g.shape, F32)
    fk.swiglu(g, u, out)
    assert np.array_equal(bits(out), bits(ref))
    fk.swiglu(g, u, g)                                  # dst aliases g
    assert np.array_equal(bits(a[..., :40]), bits(ref))

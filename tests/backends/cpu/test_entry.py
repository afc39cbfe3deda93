"""entry.py: a kernel's overload resolved once for the arrays a bound replay passes, with one overload per
dtype and rank where asked (any_layout) whatever the views' strides, and read-only arrays sharing the
writable ones' overload; a pointer block gives a kernel the caller's arrays."""
from __future__ import annotations

import numpy as np
import pytest

entry = pytest.importorskip("ggml_dist.backends.cpu.entry")
numba = pytest.importorskip("numba")


def _kernel():
    """A fresh (uncached) kernel: dst[...] = 2 * src[...] + k, row by row through strides."""
    @numba.njit(nogil=True)
    def twice(src, dst, k):
        for i3 in range(src.shape[0]):
            for i2 in range(src.shape[1]):
                for i1 in range(src.shape[2]):
                    for i0 in range(src.shape[3]):
                        dst[i3, i2, i1, i0] = 2 * src[i3, i2, i1, i0] + k
    return twice


def test_bound_is_the_kernel_call():
    k = _kernel()
    src = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    dst = np.zeros_like(src)
    call = entry.bound(k, src, dst, 1)
    call()
    np.testing.assert_array_equal(dst, 2 * src + 1)
    src += 1                                        # the bound arrays are read when the call runs
    call()
    np.testing.assert_array_equal(dst, 2 * src + 1)


def test_any_layout_compiles_one_overload_for_every_view():
    k = _kernel()
    base = np.arange(2 * 3 * 4 * 6, dtype=np.float32).reshape(2, 3, 4, 6)
    views = [base, base[:, :, :, :4], base.transpose(0, 2, 1, 3), base[:1]]  # C, A, A, C
    assert {v.flags.c_contiguous for v in views} == {True, False}
    for v in views:
        dst = np.zeros(v.shape, np.float32)
        entry.bound(k, v, dst, 0, any_layout=True)()
        np.testing.assert_array_equal(dst, 2 * v)
    assert len(k.signatures) == 1 and k.signatures[0][0].layout == "A"
    dst = np.zeros(base.shape, np.float32)
    entry.bound(k, base, dst, 0)()                  # without any_layout: the view's own layout
    assert len(k.signatures) == 2


def test_a_read_only_array_shares_the_writable_overload():
    k = _kernel()
    src = np.ones((1, 1, 2, 8), np.float32)
    ro = src.copy()
    ro.setflags(write=False)
    for a in (src, ro):
        dst = np.zeros_like(src)
        entry.bound(k, a, dst, 3)()
        np.testing.assert_array_equal(dst, 5)
    assert len(k.signatures) == 1


def test_lazy_resolves_at_its_first_call():
    @numba.njit(nogil=True)
    def fill(dst, v, n):
        for i in range(min(n, dst.size)):
            dst[i] = v
    dst = np.zeros(6, np.float32)
    call = entry.Lazy(fill, dst, np.float32(2))
    assert fill.signatures == []                    # nothing compiled until a call needs it
    call(4)
    np.testing.assert_array_equal(dst, [2, 2, 2, 2, 0, 0])
    call(6)
    np.testing.assert_array_equal(dst, 2)
    assert len(fill.signatures) == 1


def test_a_pointer_block_gives_the_arrays_back_in_a_kernel():
    from numba import njit

    from ggml_dist.backends.cpu.entry import F32P, I8P, I32P, U8P, U16P, array2, pointer_block

    @njit
    def touch(block):
        f, i8, u8, u16, i32 = (array2(F32P, block, 0), array2(I8P, block, 1), array2(U8P, block, 2),
                               array2(U16P, block, 3), array2(I32P, block, 4))
        f[1, 2] += 1                                   # written where the caller's array is
        return f.shape[0], f.shape[1], i8[0, 1], u8[1, 0], u16[0, 0], i32[2, 1]

    f = np.arange(12, dtype=np.float32).reshape(3, 4)
    arrays = (f, np.array([[1, -2]], np.int8), np.array([[7], [250]], np.uint8), np.array([[65535]], np.uint16),
              np.arange(6, dtype=np.int32).reshape(3, 2))
    assert touch(pointer_block(arrays)) == (3, 4, -2, 250, 65535, 5)
    assert f[1, 2] == 7


def test_a_block_passed_by_its_address_is_held_and_read_back():
    import gc

    from numba import njit, typeof

    from ggml_dist.backends.cpu.entry import F32P, address, array2, at, pointer_block

    @njit
    def first(addr):
        f = array2(F32P, at(addr, 3), 0)
        f[0, 1] = -1                                   # written where the caller's array is
        return f.shape[0] * 10 + f.shape[1]

    f = np.zeros((2, 3), np.float32)
    addr = address(pointer_block((f,)))                # the only reference to the block
    gc.collect()
    assert typeof(addr) == numba.types.int64 and int(addr) == addr.block.ctypes.data
    assert first(addr) == 23 and f[0, 1] == -1
    for bad in (np.zeros(3, np.int32), np.zeros((1, 3), np.int64), np.zeros(6, np.int64)[::2]):
        with pytest.raises(ValueError, match="int64 \\[n\\] C-contiguous"):
            address(bad)


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.float32)[:, ::2], np.zeros(4, np.float32)])
def test_a_pointer_block_takes_only_2d_contiguous_arrays(bad):
    from ggml_dist.backends.cpu.entry import pointer_block
    with pytest.raises(ValueError, match="not 2-D C-contiguous"):
        pointer_block((np.zeros((2, 2), np.float32), bad))


def test_a_view_block_gives_strided_views_back_in_a_kernel():
    from numba import njit

    from ggml_dist.backends.cpu.entry import F32V4, I64V4, U16V4, array4, view_block

    @njit
    def total(block):
        f, h, i = array4(F32V4, block, 0), array4(U16V4, block, 1), array4(I64V4, block, 2)
        f[0, 1, 2, 0] = -1.0                           # written through the view, into the caller's array
        s = 0.0
        for i3 in range(f.shape[0]):
            for i2 in range(f.shape[1]):
                for i1 in range(f.shape[2]):
                    for i0 in range(f.shape[3]):
                        s += f[i3, i2, i1, i0]
        return s, f.shape, h[0, 0, 1, 1], i[0, 1, 0, 0]

    base = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    f = base.transpose(1, 0, 3, 2)[:, :, ::2]           # strided every way: [3, 2, 3, 4]
    h = np.arange(4, dtype=np.uint16).reshape(1, 1, 2, 2)
    i = np.array([5, -7], np.int64).reshape(1, 2, 1, 1)
    expect = f.sum(dtype=np.float64) - f[0, 1, 2, 0] - 1.0
    s, shape, h11, i1 = total(view_block((f, h, i), (np.float32, np.uint16, np.int64)))
    assert (s, shape, h11, i1) == (expect, f.shape, 3, -7)
    assert f[0, 1, 2, 0] == -1.0


def test_a_view_block_checks_rank_and_dtype():
    from ggml_dist.backends.cpu.entry import view_block
    with pytest.raises(ValueError, match="not 4-d float32"):
        view_block((np.zeros((1, 1, 2, 2), np.float64),), (np.float32,))
    with pytest.raises(ValueError, match="not 4-d"):
        view_block((np.zeros((2, 2), np.float32),), (np.float32,))

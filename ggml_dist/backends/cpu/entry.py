"""A numba kernel's overload chosen once, when a graph is bound, for the arguments its replay passes.

    entry(kernel, *args, any_layout=False)
                            the compiled overload for args (from the kernel cache, else compiled now),
                            as its entry point: a call of it types nothing and looks nothing up
    bound(kernel, *args, any_layout=False)
                            entry(...) with args bound: the zero-argument call a bound replay makes
    Lazy(kernel, *args, any_layout=False)
                            kernel(*args, *more) through the entry point of its first call's
                            arguments (a parallel twin, given its thread count: a run at one thread
                            never launches it, and so never compiles it)
    Split(serial, parallel, most)
                            a bound op that may split across threads: the serial Lazy at one thread,
                            else the parallel one under launch()
    flat(call, n_threads)   a bound call as (entry point, arguments, fallback) once its entry points are
                            resolved: what a replay calls without the bound call's own Python frames

A dispatcher call types every argument and looks its overload up on every call (~0.05 us an array:
0.6 us of an attention call's 14 arguments, against 1.3 us for the whole call of its entry point), and a
replay calls the same kernel with the same arrays every step. Read-only arrays (mapped weights, shared
constants) are typed writable (no kernel writes its sources), so they share the overload of writable ones.

any_layout=True also types 4-d arrays as 'A' (any strides) whatever their strides. numba compiles an
overload per layout of each array argument, and a tensor view is 'C' (contiguous) or 'A' by its shape
(a one-token Q, a KV view over the whole cache): the attention chain compiled up to 9 times for the
shapes of the test suite (~30 s each, parallel, on a 2-core machine). For kernels that index their
tensors row by row through strides or fkernels._rows_view's flat view (the attention products, SET_ROWS),
the code is the same; a row op's loop over a contiguous 'C' row vectorises where an 'A' one does not
(SWIGLU ran 3x slower), so row ops keep their layouts.

An entry point takes its arguments as the types it was compiled for, unchecked beyond numba's unboxing,
so it is only ever called with the arrays it was chosen for (or ones of the same dtype and rank).

    pointer_block(arrays)   2-D C-contiguous arrays as one int64 array of (address, rows, columns)
    array2(ptr, block, i)   (in a kernel) array i of the block again, ptr its dtype's (F32P, I8P, ...)
    view_block(arrays, dtypes)
                            4-d arrays of any strides as one int64 array of (address, shape, strides)
    array4(view, block, i)  (in a kernel) view i of the block again, an 'A' array; view its dtype's
                            (F32V4, U16V4, I64V4)
    shape_block(arrays)     C-contiguous 4-d arrays as one int64 array of (address, shape)
    array4c(ptr, block, i)  (in a kernel) array i of the block again, a 'C' array (its loops vectorise as
                            over the array itself); ptr its dtype's
    keep_alive(call, arrays)
                            call, holding the arrays whose addresses its block holds
    address(block)          the block's address, an int that holds the block (what a bound call passes)
    at(addr, n)             (in a kernel) the int64 [n] block at addr again

Unboxing an array is cheap when its objects are in cache (~0.05 us) and not in a decode step, where the
weights streamed since the last step have evicted them: a call of 20 arrays costs ~10 us more than one
of a single array there (measured after a 16 MB sweep). The int8 products take their arrays as one
pointer block, the attention chain and the cache-row call their views as one view block: the caller
keeps the arrays alive as long as their block is used (keep_alive, or the bound call's own references).
The hottest calls (a decode step's products, norms, GLUs and attention) pass their block by its address:
an int unboxes for a fraction of a cold array's cost (numba's NRT_adapt_ndarray_from_python, with its
allocation, was ~1.5% of a SmolLM2 step's calling thread).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from numba import carray, njit, typeof, types
from numba.core import cgutils
from numba.core.typing.typeof import Purpose
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from .threads import get_threads, launch


def arg_type(a: Any, any_layout: bool = False) -> types.Type:
    """numba's type of argument a, every array writable, a 4-d one of layout 'A' with any_layout."""
    t = typeof(a, Purpose.argument)
    if isinstance(t, types.Array):
        return t.copy(layout="A" if any_layout and t.ndim == 4 else t.layout, readonly=False)
    return t


_ENTRIES: dict[tuple[int, tuple], tuple[Any, Callable[..., Any]]] = {}


def entry(kernel: Any, *args: Any, any_layout: bool = False) -> Callable[..., Any]:
    """The entry point of kernel's overload for args (see the module docstring). Kept per (kernel,
    signature): the dispatcher's compile() finds an existing overload under its compiler lock and event
    timers, ~0.13 ms a call, and binding a new graph shape resolves every call of the step again (~270
    for the 1.1B, ~35 ms, on a pipeline's stage as in one process)."""
    sig = tuple(arg_type(a, any_layout) for a in args)
    hit = _ENTRIES.get((id(kernel), sig))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    fn = kernel.compile(sig)
    _ENTRIES[(id(kernel), sig)] = (kernel, fn)
    return fn


def bound(kernel: Any, *args: Any, any_layout: bool = False) -> Callable[[], Any]:
    """kernel(*args) as a zero-argument call of its entry point."""
    return partial(entry(kernel, *args, any_layout=any_layout), *args)


class Lazy:
    """kernel(*args, *more), args bound, more given per call (a parallel kernel's thread count), through
    the entry point of the first call's arguments (loaded or compiled then)."""

    __slots__ = ("any_layout", "args", "fn", "kernel")

    def __init__(self, kernel: Any, *args: Any, any_layout: bool = False) -> None:
        self.kernel, self.args, self.any_layout = kernel, args, any_layout
        self.fn: Callable[..., Any] | None = None

    def __call__(self, *more: Any) -> Any:
        if self.fn is None:
            self.fn = entry(self.kernel, *self.args, *more, any_layout=self.any_layout)
        return self.fn(*self.args, *more)


class Split:
    """A bound op that may split across threads: serial() at one thread, else parallel(n) under launch(),
    n the kernels' thread count (threads.py), at most `most`; serial and parallel are Lazy."""

    __slots__ = ("keep_alive", "most", "parallel", "serial")

    def __init__(self, serial: Lazy, parallel: Lazy, most: int = 1 << 30) -> None:
        self.serial, self.parallel, self.most = serial, parallel, most
        self.keep_alive: tuple = ()

    def __call__(self) -> None:
        nt = min(get_threads(), self.most)
        if nt == 1:
            self.serial()
            return
        with launch():
            self.parallel(nt)

    def flat(self, n_threads: int) -> Flat | None:
        nt = min(n_threads, self.most)
        lazy = self.serial if nt == 1 else self.parallel
        if lazy.fn is None:
            return None
        return lazy.fn, lazy.args if nt == 1 else (*lazy.args, nt), None


Flat = tuple[Callable[..., Any], tuple, Callable[[], object] | None]


def flat(call: Callable[[], Any], n_threads: int) -> Flat | None:
    """A bound call (a replay's step) as (f, args, fallback): called under launch() (threads.py) by the
    thread that made the call before, at n_threads threads, f(*args) does what call() does, except
    that where it returns False the call would then have run fallback() (an int8 product given back: a
    non-finite activation). A partial is its function and arguments; a call with a `flat` method
    (Split, qpack's int8 call) says itself, None while an entry point is not resolved yet (its first
    call compiles or loads it) or where the thread's scratch is another's; other calls are None."""
    method = getattr(call, "flat", None)
    if method is not None:
        return method(n_threads)
    if isinstance(call, partial) and not call.keywords:
        return call.func, call.args, None
    return None


class Address(int):
    """An int64 block's address (address()), holding the block: numba takes it as an int64."""
    block: np.ndarray


def address(block: np.ndarray) -> Address:
    """block (int64, C-contiguous) by its address, for a kernel that reads it with at(addr, block.size);
    whoever holds the address holds the block."""
    if block.dtype != np.int64 or block.ndim != 1 or not block.flags.c_contiguous:
        raise ValueError(f"address: a block is int64 [n] C-contiguous, got {block.dtype} {block.shape}")
    a = Address(block.ctypes.data)
    a.block = block
    return a


def pointer_block(arrays: tuple | list) -> np.ndarray:
    """The arrays (2-D, C-contiguous) as int64 [3 * n]: address, rows, columns of each in turn."""
    block = np.empty(3 * len(arrays), np.int64)
    for i, a in enumerate(arrays):
        if a.ndim != 2 or not a.flags.c_contiguous:
            raise ValueError(f"pointer_block: array {i} is not 2-D C-contiguous ({a.shape}, {a.strides})")
        block[3 * i:3 * i + 3] = a.ctypes.data, a.shape[0], a.shape[1]
    return block


def _pointer(dtype: types.Type) -> Any:
    """An intrinsic: an int64 address as a pointer to dtype."""
    @intrinsic
    def ptr(typingctx: Any, addr: Any) -> Any:
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))
        return sig, codegen
    return ptr


F32P, I8P, U8P, U16P, I32P, I64P = (_pointer(t) for t in (types.float32, types.int8, types.uint8, types.uint16,
                                                           types.int32, types.int64))


@njit(cache=True, inline="always")
def at(addr, n):
    """The int64 [n] block at address addr (address())."""
    return carray(I64P(addr), n)


@njit(cache=True, inline="always")
def array2(ptr, block, i):
    """Array i of a pointer_block, as a 2-D C array of ptr's dtype."""
    return carray(ptr(block[3 * i]), (block[3 * i + 1], block[3 * i + 2]))


def view_block(arrays: tuple | list, dtypes: tuple | list) -> np.ndarray:
    """The 4-d arrays (any strides) of the given dtypes (the views the kernel makes of them) as int64
    [9 * n]: address, the 4 extents, the 4 byte strides."""
    block = np.empty(9 * len(arrays), np.int64)
    for i, (a, dt) in enumerate(zip(arrays, dtypes, strict=True)):
        if a.ndim != 4 or a.dtype != dt:
            raise ValueError(f"view_block: array {i} is not 4-d {np.dtype(dt)} ({a.shape}, {a.dtype})")
        block[9 * i:9 * i + 9] = (a.ctypes.data, *a.shape, *a.strides)
    return block


def shape_block(arrays: tuple | list) -> np.ndarray | None:
    """The arrays as int64 [5 * n]: address and the 4 extents of each; None unless each is 4-d and
    C-contiguous."""
    if not all(a.ndim == 4 and a.flags.c_contiguous for a in arrays):
        return None
    block = np.empty(5 * len(arrays), np.int64)
    for i, a in enumerate(arrays):
        block[5 * i:5 * i + 5] = (a.ctypes.data, *a.shape)
    return block


@njit(cache=True, inline="always")
def array4c(ptr, block, i):
    """Array i of a shape_block, as a 4-d C array of ptr's dtype."""
    o = 5 * i
    return carray(ptr(block[o]), (block[o + 1], block[o + 2], block[o + 3], block[o + 4]))


def keep_alive(call: Callable[..., Any], arrays: tuple | list) -> Callable[..., Any]:
    """call (a functools.partial or a Split), holding arrays: a block holds their addresses, not them."""
    setattr(call, "keep_alive", tuple(arrays))      # noqa: B010 - a partial's attribute, not a declared one
    return call


def _view4(dtype: types.Type) -> Any:
    """An intrinsic: (address, shape, byte strides) as a 4-d 'A' array of dtype over that memory (no
    owner: the caller keeps the memory alive)."""
    aty = types.Array(dtype, 4, "A")

    @intrinsic
    def view(typingctx: Any, addr: Any, shape: Any, strides: Any) -> Any:
        sig = aty(types.int64, types.UniTuple(types.int64, 4), types.UniTuple(types.int64, 4))

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            ary = make_array(aty)(context, builder)
            data = builder.inttoptr(args[0], context.get_data_type(dtype).as_pointer())
            itemsize = context.get_constant(types.intp, context.get_abi_sizeof(context.get_data_type(dtype)))
            populate_array(ary, data=data, shape=cgutils.unpack_tuple(builder, args[1], 4),
                           strides=cgutils.unpack_tuple(builder, args[2], 4), itemsize=itemsize, meminfo=None)
            return ary._getvalue()
        return sig, codegen
    return view


F32V4, U16V4, I64V4 = _view4(types.float32), _view4(types.uint16), _view4(types.int64)


@njit(cache=True, inline="always")
def array4(view, block, i):
    """View i of a view_block, as a 4-d 'A' array of view's dtype."""
    o = 9 * i
    return view(block[o], (block[o + 1], block[o + 2], block[o + 3], block[o + 4]),
                (block[o + 5], block[o + 6], block[o + 7], block[o + 8]))

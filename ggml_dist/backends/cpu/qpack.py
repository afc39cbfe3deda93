"""Quantized weights repacked once for the CPU MUL_MAT (ggml's CPU_REPACK "extra" buffer), and the numba
kernels that read them with ggml's AVX2 numerics, bit for bit.

Why: in GGUF order (one row's blocks after another, two codes per byte) a SIMD loop must decode every block
before it can use it (qkernels.py does that, at 1-3 GB/s). Repacked once, at a weight's first MUL_MAT, into
groups of R rows whose blocks are interleaved, the codes of the R rows that meet the same activation value
sit side by side: every inner loop runs over the rows of a group, unit-stride, with the activation codes as
broadcast scalars, and LLVM vectorizes it.

Layout of a packed weight (Q4_0, Q4_1, Q8_0; M rows padded with zero rows to G = ceil(M/R) groups,
nb = K/32 blocks per row; "lane L" = ggml's AVX2 lane, elements 4L..4L+3 of a block):
* Q4_0/Q4_1 ``qs`` uint8 [G, nb*16*R]: byte (b, k, l, r) at b*16R + k*4R + l*R + r is row r's ``qs[4l+k]`` of
  block b, i.e. element 4l+k (lane l) in the low nibble and element 16+4l+k (lane 4+l) in the high one.
* Q8_0 ``qs`` int8 [G, nb*32*R]: code (b, k, L, r) at b*32R + k*8R + L*R + r is row r's element 4L+k.
* ``d`` uint16 [G, nb*R]: f16 bits of row r's block scale at b*R + r; ``m`` the same for Q4_1's min. The
  packed weight has exactly the file's size: decode reads every byte once, so bytes are time.
Activations are quantized once per call (``_prep``: quants.quantize_q8_0/_q8_1's steps) into f32 and
int8 codes. Where the CPU has AVX-512 VNNI, weights are packed in vnni.py's layout instead and read by its
int8 kernels (same bits, 2.5-4x faster); where it has AVX2 but not VNNI, in the same layout for avx2.py's
int8 kernels (vpmaddubsw + vpmaddwd; same bits). The float kernels and their layout below are the
portable path. ``Kernels`` names the three; default_kernels() picks the host's.

Q5_0/Q5_1 (int8 kernels only): a group's block b is 20R bytes at b*20R, the Q4 nibbles of vnni.py's
layout (16R bytes: byte (l, r, k) at l*4R + 4r + k is row r's qs[4l+k]) and then the block's 5th bits as
a plane of 4R bytes: bit i of byte 4r + k is bit 4i+k of row r's qh, the 5th bit of element 4i+k (lane i),
so byte 4r + k of the plane sits at the same offset as the nibble bytes of its row and k, and a word shift
brings lane l's bit (and lane 4+l's) to bit 4 of every byte at once; ``d`` (and Q5_1's ``m``) as above.
The packed weight again has the file's size. With the float kernels (a CPU without AVX2) Q5 is not
repacked: PackedWeight keeps the file's rows and multiplies them with qkernels.mul_mat_q (the same bits).

MXFP4 (int8 kernels, where llama.cpp repacks it: M % 8 == 0): Q4_0's nibble layout, and a plane of E8M0
bytes [G, nb*R] in (block, row) order (seen as uint16 by the kernels' signature) for ``d``; the kernels
turn each nibble into its kvalues_mxfp4 value with a vpshufb (vnni.py: + 12, unsigned, the lanes
starting at -12 sum(y); avx2.py: signed, ggml's sign trick) and run the repack kernels' chain,
acc = fma(f32(isum), f32(2^(e-128) * dy), acc) (ggml_gemv_mxfp4_8x8_q8_0). Elsewhere (vec_dot's two
accumulators where M % 8 != 0, or no int8 kernels) it keeps the file's rows, as Q5 does with the float
kernels.

Numerics (ggml-numerics.md §1.5): a lane is the exact integer sum of its four products (f32 arithmetic on
integers below 2^24 is exact, in any order). Then
* "lanes" (ggml_vec_dot_*_q8_* and tinyBLAS_Q0_AVX): acc[L, r] = fma(f32(dx*dy), lane, acc[L, r]) over
  blocks, result HA over the 8 lanes, plus for Q4_1/Q5_1 the sequential f32 sum of m*s (Q5_0, Q5_1 are
  never repacked on x86, so always these);
* "chain" (the repacked q4_0_8x8 kernels, Q4_0 with M % 8 == 0): acc[r] = fma(f32(isum), f32(dx*dy), acc[r]),
  isum = the block's integer dot.
The fma is llvm.fma.f32 (one rounding; the same bits as quants.py's float64 emulation, and vectorized).
The int8 kernels take every token count (two tokens per group call). In the float kernels, below
MIN_TOKENS tokens each token runs the decode kernels (nibbles decoded in the loop); from there on the tiled
kernels decode a block's codes once for a tile of tokens and take 4 tokens per code load.
These are exactly quants.mul_mat(order="ggml")'s values; tests/backends/cpu/test_qpack.py checks it. The
kernels release the GIL (nogil=True), as fkernels' do.
"""
from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from functools import partial
from threading import get_ident
from typing import Protocol, TypeVar

import numpy as np
from numba import njit, prange

from ...core.types import GGMLType, row_size
from . import avx2, vnni
from .blocks import BLOCKS, QPACK_TYPES, ggml_repacks
from .entry import F32P, I8P, I32P, U8P, U16P, Flat, address, array2, at, entry, pointer_block
from .fkernels import _bits, _float, _fma, _half, _round_half
from .threads import get_threads, launch

T = GGMLType
F32 = np.float32
R = 64                                  # rows per group: the vector loops run over a group's rows
PACKABLE = QPACK_TYPES                  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks.py's packed="qpack")
_Q5 = (T.Q5_0, T.Q5_1)                  # int8 kernels only; with Kernels.FLOAT qkernels' product (see PackedWeight)
_KIND_Q4_0, _KIND_Q4_1, _KIND_Q4_0_CHAIN, _KIND_Q8_0, _KIND_Q5_0, _KIND_Q5_1, _KIND_MXFP4 = 0, 1, 2, 3, 4, 5, 6
# multiply-adds from which a product is split across threads (a launch costs a few us with OpenMP, see
# qkernels; ~50-100 us with numba's workqueue layer, where only large products gain)
_PARALLEL_WORK = 1 << 18
# block bytes, offset of the codes (Q5: of the nibbles; its 32-bit qh sits just before them)
_BLOCK = {t: (BLOCKS[t].nbytes, BLOCKS[t].off("qs")) for t in PACKABLE}


# ------------------------------------------------------------------------------------------------
# kernel choice and packing (numpy, once per weight)
class Kernels(enum.Enum):
    """The kernels that read a packed weight; all three give the same bits."""
    FLOAT = "float"                     # the numba float kernels below (any CPU), their group layout
    AVX2 = "avx2"                       # avx2.py: vnni.py's layout, Q8_0 codes as they are
    VNNI = "vnni"                       # vnni.py: its layout, Q8_0 codes stored as x + 128


def default_kernels() -> Kernels:
    """The host's fastest: VNNI, else AVX2 (also with GGML_DIST_FORCE_AVX2=1), else the float kernels."""
    if avx2.AVAILABLE and (avx2.FORCED or not vnni.AVAILABLE):
        return Kernels.AVX2
    return Kernels.VNNI if vnni.AVAILABLE else Kernels.FLOAT


class PackedWeight:
    """One weight matrix [M, K] of type Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/MXFP4 in the layout of `kernels` (default:
    default_kernels(); vnni_layout=True/False is the older spelling of Kernels.VNNI/FLOAT). ``chain``
    picks the repacked-kernel numerics (llama.cpp repacks Q4_0 when M % 8 == 0). Q5 has no float
    kernels: with Kernels.FLOAT it keeps the file's rows (``raw``) and multiplies them with
    qkernels.mul_mat_q (the same bits, decoded per block). MXFP4 is packed for the int8 kernels where
    llama.cpp repacks it (M % 8 == 0: one chain per row, ``KIND_MXFP4``); otherwise (vec_dot's two
    accumulators, or no int8 kernels) it keeps the file's rows as Q5 does. ``rows``: the matrix height
    that decides ggml's repack rule where it is not M (experts.py stacks a 3-D weight's experts, each
    of ``rows`` rows padded to whole groups, into one matrix)."""

    def __init__(self, wtype: GGMLType, w: np.ndarray, key: tuple = (),
                 vnni_layout: bool | None = None, kernels: Kernels | str | None = None,
                 rows: int | None = None) -> None:
        wtype = GGMLType(wtype)
        kernels = _checked_kernels(wtype, vnni_layout, kernels)
        bs = _BLOCK[wtype][0]
        M, nbytes = w.shape
        if nbytes % bs:
            raise ValueError(f"{wtype.name} rows are whole {bs}-byte blocks, got {nbytes} bytes")
        nb = nbytes // bs
        G = -(-M // R)
        self.type, self.M, self.K, self.key = wtype, M, nb * 32, key
        self.kernels = kernels
        self.vnni = kernels is Kernels.VNNI
        self.rows = M if rows is None else rows
        self.chain = wtype in (T.Q4_0, T.MXFP4) and self.rows % 8 == 0
        self.kind = {T.Q4_0: _KIND_Q4_0_CHAIN if self.chain else _KIND_Q4_0, T.Q4_1: _KIND_Q4_1,
                     T.Q8_0: _KIND_Q8_0, T.Q5_0: _KIND_Q5_0, T.Q5_1: _KIND_Q5_1, T.MXFP4: _KIND_MXFP4}[wtype]
        self.q8_1 = wtype in (T.Q4_1, T.Q5_1)            # activations as Q8_1, plus the sum of m*s
        self.raw: np.ndarray | None = None
        int8 = kernels is not Kernels.FLOAT
        self._int8: tuple[Callable[..., bool], Callable[..., bool]] | None = \
            _INT8_ENTRIES[kernels] if int8 else None                # (serial, parallel) entry points
        if (wtype in _Q5 and not int8) or (wtype == T.MXFP4 and not (int8 and self.chain)):
            self.raw, self._int8 = w, None
            self.qs = self.d = self.m = np.zeros((G, 1), np.uint16)
            return
        if M % R:
            w = np.concatenate([w, np.zeros((G * R - M, nbytes), np.uint8)])
        b = np.asarray(w, np.uint8).reshape(G, R, nb, bs)
        self.qs = _codes(wtype, b, kernels)
        self.d = _e8m0_plane(b) if wtype == T.MXFP4 else _f16_plane(b, 0)
        self.m = _f16_plane(b, 2) if self.q8_1 else np.zeros((G, 1), np.uint16)

    def bind(self, x: np.ndarray, out: np.ndarray, fallback: Callable[[], object] | None = None,
             vec_n: int | None = None) -> Callable[[], bool]:
        """mul_mat(x, out) for arrays fixed from now on (a replayed step's): the kernel and its
        arguments chosen once (bound_int8_call); the call returns False where mul_mat would return
        None, after fallback() if given. x f32 [N, K] C-contiguous, out f32 [N, M] C-contiguous.
        vec_n: kpack's argument (ops passes it to either), without effect: no order of these types
        depends on the row count (the module docstring's numerics; ComputeOptions.batch_invariant)."""
        N, K = x.shape
        if K != self.K or x.dtype != F32 or not x.flags.c_contiguous:
            raise ValueError(f"packed {self.type.name} weight: x must be f32 [N, {self.K}] C-contiguous")
        if self._int8 is None or N == 0:
            def plain() -> bool:
                ok = self.mul_mat(x, out) is not None
                if not ok and fallback is not None:
                    fallback()
                return ok
            return plain
        return bind_products([self], x, [out], fallback)

    def shares_call(self, other: PackedWeight) -> bool:
        """Whether one int8 call can multiply this weight and other by the same activation
        (bind_products): the same kernels, kind and row length."""
        return (self._int8 is not None and other._int8 is self._int8 and other.kind == self.kind
                and other.K == self.K)

    def mul_mat(self, x: np.ndarray, out: np.ndarray | None = None, vec_n: int | None = None) -> np.ndarray | None:
        """x f32 [N, K] -> f32 [N, M] (into `out` if given, C-contiguous), or None when x has a non-finite
        value (the caller's generic path then gives ggml's values for those). vec_n: as bind's."""
        N, K = x.shape
        if K != self.K:
            raise ValueError(f"packed {self.type.name} weight has rows of {self.K}, x has {K}")
        if self.raw is not None:
            return self._mul_mat_raw(x, out)
        tiled = N >= MIN_TOKENS and self._int8 is None
        Y, Yb, Y4, Yz, dy, sy, ys = _work(-(-N // 4) * 4 if tiled else N, K)     # tiled: 4 tokens at once
        if out is None:
            out = np.empty((N, self.M), F32)
        x = np.ascontiguousarray(x, F32)
        parallel = get_threads() > 1 and N * self.M * K >= _PARALLEL_WORK
        if self._int8 is not None:      # quantize and multiply in one call
            serial_mm, parallel_mm = self._int8
            args = int8_args((x, self.q8_1, Y, Yb, Y4, Yz, dy, sy, ys, *_products_tail([self], [out])))
            if not parallel:
                return out if serial_mm(*args) else None
            with launch():
                return out if parallel_mm(*args, get_threads()) else None
        if not _prep(x, self.q8_1, Y, Yb, dy, sy, ys):
            return None
        args = (self.kind, self.qs, self.d, self.m, Y, dy, sy, ys, out)
        if not parallel:
            (_mm_t_serial if tiled else _mm_serial)(*args)
            return out
        with launch():
            (_mm_t if tiled else _mm)(*args, 4 * get_threads())
        return out

    def _mul_mat_raw(self, x: np.ndarray, out: np.ndarray | None) -> np.ndarray | None:
        """Q5 without int8 kernels: qkernels' product of the file's rows (mul_mat's contract)."""
        from . import qkernels
        assert self.raw is not None
        if not np.isfinite(x).all():
            return None
        if x.shape[0] == 0:
            return np.empty((0, self.M), F32) if out is None else out
        r = qkernels.mul_mat_q(self.type, self.raw, np.ascontiguousarray(x, F32), order="ggml",
                               repacked=ggml_repacks(self.type, self.rows))
        assert r is not None, f"qkernels covers {self.type.name}"
        if out is None:
            return r
        out[...] = r
        return out


def _checked_kernels(wtype: GGMLType, vnni_layout: bool | None, kernels: Kernels | str | None) -> Kernels:
    """PackedWeight's kernels: the one asked for (or the host's), if wtype and the CPU allow it."""
    if wtype not in PACKABLE:
        raise ValueError(f"cannot pack {wtype.name}; packable: {sorted(t.name for t in PACKABLE)}")
    if vnni_layout is not None:
        if kernels is not None:
            raise ValueError("give kernels or vnni_layout, not both")
        kernels = Kernels.VNNI if vnni_layout else Kernels.FLOAT
    kernels = default_kernels() if kernels is None else Kernels(kernels)
    if kernels is Kernels.VNNI and not vnni.AVAILABLE:
        raise ValueError("the vnni layout needs a CPU with AVX-512 VNNI (and GGML_DIST_NO_VNNI unset)")
    if kernels is Kernels.AVX2 and not avx2.AVAILABLE:
        raise ValueError("the avx2 kernels need a CPU with AVX2, FMA and F16C (and GGML_DIST_NO_AVX2 "
                         "unset)")
    return kernels


def _codes(wtype: GGMLType, b: np.ndarray, kernels: Kernels) -> np.ndarray:
    """The codes of blocks b [G, R, nb, bs] in the layout of kernels (module docstring): [G, ...]."""
    G, _, nb, _ = b.shape
    oq = _BLOCK[wtype][1]
    int8 = kernels is not Kernels.FLOAT
    n_lanes = 8 if wtype == T.Q8_0 else 4
    q = b[..., oq:oq + 4 * n_lanes].reshape(G, R, nb, n_lanes, 4)     # [g, r, b, L, k] (Q4: byte 4l+k)
    blocks = np.ascontiguousarray(q.transpose((0, 2, 3, 1, 4) if int8 else (0, 2, 4, 3, 1))).reshape(G, nb, -1)
    if wtype in _Q5:                                         # each block's nibbles, then its 5th-bit plane
        blocks = np.concatenate([blocks, _fifth_bit_plane(b[..., oq - 4:oq])], axis=2)
    qs = blocks.reshape(G, -1)
    if wtype == T.Q8_0 and kernels is Kernels.VNNI:          # x + 128, vpdpbusd's unsigned operand
        return qs ^ np.uint8(0x80)
    if wtype == T.Q8_0 and kernels is Kernels.FLOAT:
        return qs.view(np.int8)
    return qs


def _fifth_bit_plane(qh: np.ndarray) -> np.ndarray:
    """Q5's qh bytes [G, R, nb, 4] -> uint8 [G, nb, 4R]: byte 4r + k of block b holds row r's 5th bits
    of elements 4i + k, i = 0..7, as bit i (bit i for ggml lane i). Done in slices of groups, so the
    unpacked bits (8 bytes per qh byte) stay small next to the weight."""
    G, _, nb, _ = qh.shape
    plane = np.empty((G, nb, R, 4), np.uint8)
    step = max(1, (1 << 16) // (R * nb))
    for g in range(0, G, step):
        bits = np.unpackbits(qh[g:g + step], axis=-1, bitorder="little")        # [g, r, b, e]: bit e of qh
        by_lane = bits.reshape(*bits.shape[:3], 8, 4)                          # e = 4i + k
        plane[g:g + step] = np.packbits(by_lane, axis=-2, bitorder="little")[..., 0, :].transpose(0, 2, 1, 3)
    return plane.reshape(G, nb, 4 * R)


MULTI = 3       # most weights one int8 call multiplies by the same activation (a layer's Q, K and V)


def slots(items: list) -> tuple:
    """items padded to MULTI slots with its first (the kernels read the first n_w only)."""
    return (*items, *(items[0],) * (MULTI - len(items)))


def _products_tail(pws: list[PackedWeight], outs: list[np.ndarray]) -> tuple:
    """The int8 entries' arguments after the activation scratch: kind, the weights' planes and outputs
    in MULTI slots, and how many there are."""
    return (pws[0].kind, slots([p.qs for p in pws]), slots([p.d for p in pws]), slots([p.m for p in pws]),
            slots(outs), len(pws))


def bind_products(pws: list[PackedWeight], x: np.ndarray, outs: list[np.ndarray],
                  fallback: Callable[[], object] | None = None, vec_n: int | None = None) -> Callable[[], bool]:
    """The products of up to MULTI weights that share one int8 call (PackedWeight.shares_call) by the
    same activation x f32 [N >= 1, K] C-contiguous, into outs (f32 [N, M_i] C-contiguous), as one bound
    call (bound_int8_call): x quantized once, and the weights' groups shared among the threads in one
    launch (a layer's Q, K and V, its FFN gate and up: fusion.py), each product's bits as its own
    call's. False where the products are given back (a non-finite x), after fallback() if given.
    vec_n: as PackedWeight.bind's (no effect)."""
    if not 1 <= len(pws) <= MULTI or not all(pws[0].shares_call(p) for p in pws) or len(outs) != len(pws):
        raise ValueError(f"bind_products: 1..{MULTI} weights of one int8 layout and kind, one output each")
    N, K = x.shape
    if N == 0 or K != pws[0].K or x.dtype != F32 or not x.flags.c_contiguous:
        raise ValueError(f"packed products: x must be f32 [N >= 1, {pws[0].K}] C-contiguous, got {x.shape}")
    for p, o in zip(pws, outs):
        if o.shape != (N, p.M) or o.dtype != F32 or not o.flags.c_contiguous:
            raise ValueError(f"packed product: out must be f32 [{N}, {p.M}] C-contiguous, got {o.shape}")
    assert pws[0]._int8 is not None
    return bound_int8_call(pws[0]._int8, _work, N, K, (x, pws[0].q8_1), _products_tail(pws, outs),
                           N * sum(p.M for p in pws) * K >= _PARALLEL_WORK, fallback, int8_args)


def int8_args(args: tuple) -> tuple:
    """The int8 entries' arguments for (x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w):
    the arrays as one pointer_block by its address (entry.py; the caller keeps them alive), q8_1, kind,
    n_w."""
    x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w = args
    return address(pointer_block((x, Y, Yb, Y4, Yz, dy, sy, ys, *qs, *d, *m, *out))), q8_1, kind, n_w


def bound_int8_call(entries: tuple[Callable, Callable], work: Callable[[int, int], tuple], N: int, K: int,
                    head: tuple, tail: tuple, big: bool, fallback: Callable[[], object] | None,
                    pack: Callable[[tuple], tuple] = tuple) -> Int8Call:
    """The replayed call of an int8 packed product (qpack's, kpack's): entries (serial, parallel) called
    with pack((*head, *work(N, K), *tail)), the scratch being the calling thread's (looked up again only
    when another thread calls, and kept alive with it: pack may turn arrays into their addresses); the
    parallel entry, given the thread count, where the product is big and the kernels have threads;
    fallback() where the kernel gives the product back (False: a non-finite activation). One Python
    frame between the replay and the kernel, whose entry point (entry.py) is resolved at its first call;
    none once the replay calls it flat (entry.flat)."""
    return Int8Call(entries, partial(work, N, K), head, tail, big, fallback, pack)


class Int8Call:
    """bound_int8_call's call."""

    __slots__ = ("args", "arrays", "big", "entries", "fallback", "head", "ident", "pack", "parallel", "serial",
                 "tail", "work")

    def __init__(self, entries: tuple[Callable, Callable], work: Callable[[], tuple], head: tuple, tail: tuple,
                 big: bool, fallback: Callable[[], object] | None, pack: Callable[[tuple], tuple]) -> None:
        self.entries, self.work, self.head, self.tail, self.pack = entries, work, head, tail, pack
        self.big, self.fallback = big, fallback
        self.ident: int | None = None               # the thread whose scratch args holds
        self.args: tuple = ()
        self.arrays: tuple = ()                     # what args was packed from
        self.serial: Callable[..., bool] | None = None      # the entry points, resolved at first call
        self.parallel: Callable[..., bool] | None = None

    def __call__(self) -> bool:
        if self.ident != get_ident():
            self.arrays = (*self.head, *self.work(), *self.tail)
            self.ident, self.args = get_ident(), self.pack(self.arrays)
        args = self.args
        if self.big and get_threads() > 1:
            if self.parallel is None:
                self.parallel = entry(self.entries[1], *args, 2)
            with launch() as nt:
                ok = self.parallel(*args, nt)
        else:
            if self.serial is None:
                self.serial = entry(self.entries[0], *args)
            ok = self.serial(*args)
        if not ok and self.fallback is not None:
            self.fallback()
        return ok

    def flat(self, n_threads: int) -> Flat | None:
        """entry.flat's form, for the thread that called last."""
        if self.ident != get_ident():
            return None
        if self.big and n_threads > 1:
            return None if self.parallel is None else (self.parallel, (*self.args, n_threads), self.fallback)
        return None if self.serial is None else (self.serial, self.args, self.fallback)


_WORK = threading.local()


def thread_scratch(store: threading.local, make: Callable[[int, int], tuple[np.ndarray, ...]], N: int,
                   K: int) -> tuple[np.ndarray, ...]:
    """make(N, K)'s arrays, made once per thread of `store` and reused (at most 16 shapes kept)."""
    cache: dict[tuple[int, int], tuple[np.ndarray, ...]] | None = getattr(store, "bufs", None)
    if cache is None:
        cache = store.bufs = {}
    bufs = cache.get((N, K))
    if bufs is None:
        if len(cache) > 16:
            cache.clear()
        bufs = cache[(N, K)] = make(N, K)
    return bufs


def _work(Np: int, K: int) -> tuple[np.ndarray, ...]:
    """Activation scratch (Y, Yb, Y4, Yz, dy, sy, ys) for Np tokens of K, reused per thread (Y4: Yb's
    codes as int32 words of 4, Yz: the vnni kernels' lane starting values). Rows past a call's N (the
    padding to 4 tokens) hold zeros or an earlier call's finite codes: only the accumulators of those
    padding tokens read them, and those are never stored."""
    return thread_scratch(_WORK, _make_work, Np, K)


def _make_work(Np: int, K: int) -> tuple[np.ndarray, ...]:
    Yb, Yz = np.zeros((Np, K), np.int8), np.zeros((Np, K // 4), np.int32)
    scales = tuple(np.zeros((Np, K // 32), F32) for _ in range(3))
    return (np.zeros((Np, K), F32), Yb, Yb.view(np.int32), Yz, *scales)


def _e8m0_plane(b: np.ndarray) -> np.ndarray:
    """MXFP4's E8M0 byte of every block [G, R, nb, 17] as uint8 [G, nb*R] in (block, row) order, seen as
    uint16 [G, nb*R/2] (the kernels' scale plane type; they read its bytes, vnni.Emit.e8m0_half)."""
    G, _, nb, _ = b.shape
    return np.ascontiguousarray(b[..., 0].transpose(0, 2, 1)).reshape(G, nb * R).view(np.uint16)


def _f16_plane(b: np.ndarray, off: int) -> np.ndarray:
    """The f16 field at byte `off` of every block, as uint16 bits [G, nb*R] in (block, row) order (the
    kernels widen them with _half, a vector conversion: the packed weight is no bigger than the file's)."""
    G, _, nb, _ = b.shape
    return np.ascontiguousarray(b[..., off:off + 2].transpose(0, 2, 1, 3)).view(np.uint16).reshape(G, nb * R)


_PACK_LOCK = threading.Lock()


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) == 3 and a[0] is b[0] and a[1:] == b[1:]


def packed(wtype: GGMLType, w: np.ndarray, t, kernels: Kernels | str | None = None) -> PackedWeight:
    """The packed form of weight tensor t (bytes w) for `kernels` (None: default_kernels()), made once
    and kept in ``t.extra`` as ggml keeps its repack buffer; made again if t was rebound to other bytes
    or is asked for with other kernels."""
    return packed_as(PackedWeight, wtype, w, t, kernels)


class Packed(Protocol):
    """What packed_as needs of a packed weight (PackedWeight, kpack.PackedKWeight)."""
    key: tuple
    raw: np.ndarray | None              # the file's rows, if it keeps them (then their pages stay)
    K: int
    M: int
    kernels: Kernels

    def __init__(self, wtype: GGMLType, w: np.ndarray, key: tuple, kernels: Kernels | str | None = None
                 ) -> None: ...


P = TypeVar("P", bound=Packed)


def packed_as(cls: type[P], wtype: GGMLType, w: np.ndarray, t, kernels: Kernels | str | None = None) -> P:
    """packed() for any packed-weight class."""
    key = (t.buffer, t.data, w.shape)       # the buffer itself, not its id: an id can be reused
    want = None if kernels is None else Kernels(kernels)
    pw = t.extra
    if isinstance(pw, cls) and _same(pw.key, key) and want in (None, pw.kernels):
        return pw
    with _PACK_LOCK:
        pw = t.extra
        if not (isinstance(pw, cls) and _same(pw.key, key) and want in (None, pw.kernels)):
            pw = t.extra = cls(wtype, w, key, kernels=want)
            release = getattr(t.buffer, "release_pages", None)
            if release is not None and pw.raw is None:      # the mapping's pages of t are not read again
                release(t.data, getattr(pw, "file_bytes", 0) or row_size(wtype, pw.K) * pw.M)
    return pw


# ------------------------------------------------------------------------------------------------
# activations: quants.quantize_q8_0 / _q8_1 and the Y layout, in one pass
@njit(cache=True, nogil=True)
def _prep(x, q8_1, Y, Yb, dy, sy, ys, f32_codes=True):
    """x f32 [N, K] -> Y f32 and Yb int8 [N, K] (the Q8 codes), dy, sy f32 [N, K/32] with
    quants.quantize_q8_0 (q8_1=False; sy = dy) or quantize_q8_1's float steps (qkernels.q8_block's), ys =
    each block's sum of codes (Y only with f32_codes: the int8 kernels read Yb). False if x has a
    non-finite value. Written to vectorize: a block's amax is
    the integer max of the |x| bit patterns (ordered like the values; an inf or NaN shows as
    >= 0x7F800000), f16 rounding is the hardware's (fptrunc: nearest-even, as numpy's)."""
    N, K = x.shape
    for n in range(N):
        for b in range(K // 32):
            o = 32 * b
            m = np.uint32(0)
            for j in range(o, o + 32):
                m = max(m, _bits(x[n, j]) & np.uint32(0x7FFFFFFF))
            if m >= np.uint32(0x7F800000):
                return False
            amax = _float(np.uint32(m))
            d = amax / F32(127)
            idv = F32(127) / amax if amax != 0 else F32(0)
            isum = 0
            for j in range(o, o + 32):
                qj = np.int8(np.rint(x[n, j] * idv))
                Yb[n, j] = qj
                if f32_codes:                               # the float kernels' Y (not the int8 ones')
                    Y[n, j] = qj
                isum += int(qj)
            d16 = _round_half(d)
            dy[n, b] = d16
            sy[n, b] = _round_half(d * F32(isum)) if q8_1 else d16
            ys[n, b] = isum
    return True


# ------------------------------------------------------------------------------------------------
# kernels
@njit(parallel=True, cache=True, nogil=True)
def _mm(kind, qs, d, m, Y, dy, sy, ys, out, n_chunks):
    G = qs.shape[0]
    n_chunks = min(G, n_chunks)
    for c in prange(n_chunks):
        _rows(kind, qs, d, m, Y, dy, sy, ys, out, c * G // n_chunks, (c + 1) * G // n_chunks)


@njit(cache=True, nogil=True)
def _mm_serial(kind, qs, d, m, Y, dy, sy, ys, out):
    """_mm on the calling thread (a parallel launch costs more than a small product)."""
    _rows(kind, qs, d, m, Y, dy, sy, ys, out, np.int64(0), qs.shape[0])


@njit(cache=True, nogil=True)
def _rows(kind, qs, d, m, Y, dy, sy, ys, out, g0, g1):
    """Groups g0 .. g1-1; one specialized loop nest per kind (flags are constants once inlined)."""
    if kind == _KIND_Q4_0:
        _rows_q4(qs, d, m, Y, dy, sy, ys, out, g0, g1, True, False, False)
    elif kind == _KIND_Q4_1:
        _rows_q4(qs, d, m, Y, dy, sy, ys, out, g0, g1, False, True, False)
    elif kind == _KIND_Q4_0_CHAIN:
        _rows_q4(qs, d, m, Y, dy, sy, ys, out, g0, g1, True, False, True)
    else:
        _rows_q8(qs, d, Y, dy, out, g0, g1)


@njit(cache=True, inline="always")
def _rows_q4(qs, d, m, Y, dy, sy, ys, out, g0, g1, center, has_m, chain):
    N = Y.shape[0]
    nb = dy.shape[1]
    acc = np.empty(8 * R, F32)
    S = np.empty(R, F32)
    D = np.empty(R, F32)
    sm = np.zeros(R, F32)
    nr = D.shape[0]     # = R, read at run time: LLVM unrolls a short constant loop instead of vectorizing
    for g in range(g0, g1):
        qg = qs[g]
        dg = d[g]
        mg = m[g]
        for n in range(N):
            acc[:] = 0
            for b in range(nb):
                q = qg[16 * R * b:16 * R * (b + 1)]
                yb = Y[n, 32 * b:32 * b + 32]
                db = dy[n, b]
                for r in range(nr):
                    D[r] = _half(dg[R * b + r]) * db                # f32(dx*dy), exact
                    S[r] = 0
                if has_m:                                           # Q4_1: sequential f32 sum of m*s
                    sb = sy[n, b]
                    for r in range(nr):
                        p = _half(mg[R * b + r]) * sb
                        sm[r] = p if b == 0 else sm[r] + p
                for l in range(4):                                  # unrolled; the r loop is the vector
                    y0, y1, y2, y3 = yb[4 * l], yb[4 * l + 1], yb[4 * l + 2], yb[4 * l + 3]
                    z0, z1, z2, z3 = yb[16 + 4 * l], yb[17 + 4 * l], yb[18 + 4 * l], yb[19 + 4 * l]
                    if chain:
                        _chain_step(q, l, y0, y1, y2, y3, z0, z1, z2, z3, S)
                        continue
                    for r in range(nr):
                        o = l * R + r
                        f0 = F32(q[o])
                        f1 = F32(q[4 * R + o])
                        f2 = F32(q[8 * R + o])
                        f3 = F32(q[12 * R + o])
                        h0 = np.floor(f0 * F32(0.0625))             # high nibbles, then low = f - 16h
                        h1 = np.floor(f1 * F32(0.0625))
                        h2 = np.floor(f2 * F32(0.0625))
                        h3 = np.floor(f3 * F32(0.0625))
                        l0 = _fma(h0, F32(-16), f0)
                        l1 = _fma(h1, F32(-16), f1)
                        l2 = _fma(h2, F32(-16), f2)
                        l3 = _fma(h3, F32(-16), f3)
                        if center:                                  # (Q4_0 lanes; the chain subtracts 8*sum(y))
                            l0 -= F32(8)
                            l1 -= F32(8)
                            l2 -= F32(8)
                            l3 -= F32(8)
                            h0 -= F32(8)
                            h1 -= F32(8)
                            h2 -= F32(8)
                            h3 -= F32(8)
                        slo = _fma(l3, y3, _fma(l2, y2, _fma(l1, y1, l0 * y0)))        # exact integers
                        shi = _fma(h3, z3, _fma(h2, z2, _fma(h1, z1, h0 * z0)))
                        acc[o] = _fma(D[r], slo, acc[o])
                        acc[4 * R + o] = _fma(D[r], shi, acc[4 * R + o])
                if chain:
                    c8 = F32(8) * ys[n, b]
                    for r in range(nr):
                        acc[r] = _fma(S[r] - c8, D[r], acc[r])
            _store(acc, sm, out, g, n, has_m, chain)


@njit(cache=True, inline="always")
def _chain_step(q, l, y0, y1, y2, y3, z0, z1, z2, z3, S):
    """S[r] += row r's integer dot over bytes 4l..4l+3 of a Q4_0 block (codes not centred). With byte
    c = lo + 16*hi: lo*y + hi*z = c*y + hi*(z - 16y), so the low nibble is never split out (exact
    integers throughout)."""
    w0, w1, w2, w3 = z0 - F32(16) * y0, z1 - F32(16) * y1, z2 - F32(16) * y2, z3 - F32(16) * y3
    for r in range(S.shape[0]):
        o = l * R + r
        f0 = F32(q[o])
        f1 = F32(q[4 * R + o])
        f2 = F32(q[8 * R + o])
        f3 = F32(q[12 * R + o])
        sc = _fma(f3, y3, _fma(f2, y2, _fma(f1, y1, f0 * y0)))
        sh = _fma(np.floor(f3 * F32(0.0625)), w3, _fma(np.floor(f2 * F32(0.0625)), w2,
                  _fma(np.floor(f1 * F32(0.0625)), w1, np.floor(f0 * F32(0.0625)) * w0)))
        S[r] += sc + sh


@njit(cache=True, inline="always")
def _store(acc, sm, out, g, n, has_m, chain):
    """Row results of group g for token n: the chain's accumulator or HA over the 8 lanes acc[L*R + r],
    plus for Q4_1 the sequential sum of m*s (sm)."""
    for r in range(min(R, out.shape[1] - g * R)):
        res = acc[r] if chain else _ha(acc, r)
        if has_m:
            res = res + sm[r]
        out[n, g * R + r] = res


@njit(cache=True, inline="always")
def _ha(acc, r):
    """ggml's HA horizontal sum of lanes acc[L*R + r], L = 0..7."""
    return (((acc[r] + acc[4 * R + r]) + (acc[2 * R + r] + acc[6 * R + r]))
            + ((acc[R + r] + acc[5 * R + r]) + (acc[3 * R + r] + acc[7 * R + r])))


@njit(cache=True, nogil=True)
def _rows_q8(qs, d, Y, dy, out, g0, g1):
    N = Y.shape[0]
    nb = dy.shape[1]
    acc = np.empty(8 * R, F32)
    D = np.empty(R, F32)
    nr = D.shape[0]
    for g in range(g0, g1):
        qg = qs[g]
        dg = d[g]
        for n in range(N):
            acc[:] = 0
            for b in range(nb):
                q = qg[32 * R * b:32 * R * (b + 1)]
                yb = Y[n, 32 * b:32 * b + 32]
                db = dy[n, b]
                for r in range(nr):
                    D[r] = _half(dg[R * b + r]) * db
                for L in range(8):
                    y0, y1, y2, y3 = yb[4 * L], yb[4 * L + 1], yb[4 * L + 2], yb[4 * L + 3]
                    for r in range(nr):
                        o = L * R + r
                        s = _fma(F32(q[24 * R + o]), y3, _fma(F32(q[16 * R + o]), y2,
                                 _fma(F32(q[8 * R + o]), y1, F32(q[o]) * y0)))      # exact integers
                        acc[o] = _fma(D[r], s, acc[o])
            _store(acc, D, out, g, n, False, False)


# ------------------------------------------------------------------------------------------------
# int8 kernels (Kernels.VNNI, Kernels.AVX2): one group intrinsic of vnni.py or avx2.py per (group, token
# pair), for every token count (a group's bytes stay in L1/L2 while its tokens pass, and the int8 lane
# sums are cheap enough that decoding codes once per tile, as the float kernels below do, would not pay).
# Each ISA has its own entry points, so a host compiles only the intrinsics it has; the code between them
# takes the ISA's group function (_group_vnni, _group_avx2) as an argument, inlined.
_LANE_BIAS_VNNI = (8, 0, 8, 128, 16, 0, vnni.MXFP4_BIAS)  # per kind: -bias * (sum of a lane's 4 codes) starts a lane
_LANE_BIAS_AVX2 = (8, 0, 8, 0, 16, 0, 0)    # avx2.py keeps Q8_0 codes unbiased, MXFP4's signed (sign trick)


@njit(cache=True, inline="always")
def _prep_mm_int8(x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w, n_threads, group, bias):
    """_prep, then the products of the n_w weights that share the activation x (qs, d, m, out: tuples of
    MULTI slots, the first n_w used; products_args) split across n_threads; False (nothing computed) on
    a non-finite x. Work units are (group, token slice) pairs, the weights' groups in turn. A product
    has few groups (192 rows: 3), so with one slice per group the threads' shares would be unequal
    (2 groups against 1) whenever G is not a multiple of n_threads; then the tokens are split too, in
    up to n_threads slices of whole pairs. One chunk of consecutive units per thread: a group call
    prefetches the next group only within its chunk (and weight), so chunks of about one group (4 per
    thread, as before) left every group of a decode step cold, and 2 threads read a cold AVX2 weight no
    faster than 1."""
    if not _prep(x, q8_1, Y, Yb, dy, sy, ys, False):
        return False
    _lane_starts(Yb, Yz, bias[kind])
    G, N = 0, Y4.shape[0]
    for w in range(n_w):
        G += qs[w].shape[0]
    ts = 1 if G % n_threads == 0 else max(1, min((N + 1) // 2, n_threads))
    n_units = G * ts
    n_chunks = min(n_units, n_threads)
    for c in prange(n_chunks):
        u0, u1 = c * n_units // n_chunks, (c + 1) * n_units // n_chunks
        base = 0
        for w in range(n_w):
            n = qs[w].shape[0] * ts
            if u0 < base + n and base < u1:
                _rows_v(kind, qs[w], d[w], m[w], Y4, Yz, dy, sy, out[w], max(u0, base) - base,
                        min(u1, base + n) - base, ts, group)
            base += n
    return True


# The entries take their arrays as one pointer_block by its address (entry.py; int8_args): x, Y, Yb, Y4,
# Yz, dy, sy, ys, then the MULTI slots of qs, d, m and out.
_INT8_BLOCK = 3 * (8 + 4 * MULTI)


@njit(cache=True, inline="always")
def _int8_arrays(addr):
    block = at(addr, _INT8_BLOCK)
    return (array2(F32P, block, 0), array2(F32P, block, 1), array2(I8P, block, 2), array2(I32P, block, 3),
            array2(I32P, block, 4), array2(F32P, block, 5), array2(F32P, block, 6), array2(F32P, block, 7),
            (array2(U8P, block, 8), array2(U8P, block, 9), array2(U8P, block, 10)),
            (array2(U16P, block, 11), array2(U16P, block, 12), array2(U16P, block, 13)),
            (array2(U16P, block, 14), array2(U16P, block, 15), array2(U16P, block, 16)),
            (array2(F32P, block, 17), array2(F32P, block, 18), array2(F32P, block, 19)))


@njit(parallel=True, cache=True, nogil=True)
def _prep_mm_v(addr, q8_1, kind, n_w, n_threads):
    x, Y, Yb, Y4, Yz, dy, sy, ys, qs, d, m, out = _int8_arrays(addr)
    return _prep_mm_int8(x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w, n_threads,
                         _group_vnni, _LANE_BIAS_VNNI)


@njit(cache=True, nogil=True)
def _prep_mm_v_serial(addr, q8_1, kind, n_w):
    x, Y, Yb, Y4, Yz, dy, sy, ys, qs, d, m, out = _int8_arrays(addr)
    return _prep_mm_int8(x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w, 1,
                         _group_vnni, _LANE_BIAS_VNNI)


@njit(parallel=True, cache=True, nogil=True)
def _prep_mm_a(addr, q8_1, kind, n_w, n_threads):
    x, Y, Yb, Y4, Yz, dy, sy, ys, qs, d, m, out = _int8_arrays(addr)
    return _prep_mm_int8(x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w, n_threads,
                         _group_avx2, _LANE_BIAS_AVX2)


@njit(cache=True, nogil=True)
def _prep_mm_a_serial(addr, q8_1, kind, n_w):
    x, Y, Yb, Y4, Yz, dy, sy, ys, qs, d, m, out = _int8_arrays(addr)
    return _prep_mm_int8(x, q8_1, Y, Yb, Y4, Yz, dy, sy, ys, kind, qs, d, m, out, n_w, 1,
                         _group_avx2, _LANE_BIAS_AVX2)


@njit(cache=True, nogil=True)
def _lane_starts(Yb, Yz, bias):
    """Yz[n, w] = -bias * (the sum of token n's codes 4w .. 4w+3): where an int8 kernel's lane w starts."""
    if bias == 0:
        return
    for n in range(Yb.shape[0]):
        for w in range(Yz.shape[1]):
            Yz[n, w] = -bias * (np.int32(Yb[n, 4 * w]) + np.int32(Yb[n, 4 * w + 1])
                                + np.int32(Yb[n, 4 * w + 2]) + np.int32(Yb[n, 4 * w + 3]))


@njit(cache=True, inline="always")
def _rows_v(kind, qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, group):
    """Work units u0 .. u1-1 of an int8-layout weight: unit u = group u // ts against token slice u % ts
    of ts (slices of whole token pairs); Y4 [N, K/4] int32 = the tokens' Q8 codes, 4 per word, Yz
    the lanes' starting values."""
    if kind == _KIND_Q4_0:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q4_0, group)
    elif kind == _KIND_Q4_1:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q4_1, group)
    elif kind == _KIND_Q4_0_CHAIN:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q4_0_CHAIN, group)
    elif kind == _KIND_Q5_0:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q5_0, group)
    elif kind == _KIND_Q5_1:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q5_1, group)
    elif kind == _KIND_MXFP4:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_MXFP4, group)
    else:
        _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, _KIND_Q8_0, group)


@njit(cache=True, inline="always")
def _rows_v_kind(qs, d, m, Y4, Yz, dy, sy, out, u0, u1, ts, kind, group):
    N = Y4.shape[0]
    pairs = (N + 1) // 2
    res = np.empty(2 * R, F32)
    for u in range(u0, u1):
        g, sl = u // ts, u % ts
        n, n1 = 2 * (sl * pairs // ts), min(N, 2 * ((sl + 1) * pairs // ts))
        nxt = min(g + 1, qs.shape[0] - 1)
        first = True                    # the group's first call prefetches the next unit's group, if new
        while n < n1:
            two = n + 1 < n1
            pf = first and u + 1 < u1 and (u + 1) // ts == g + 1
            group(kind, two, qs[g], d[g], m[g], Y4, Yz, n, dy, sy, res, qs[nxt], d[nxt], m[nxt], pf)
            first = False
            for t in range(2 if two else 1):
                for r in range(min(R, out.shape[1] - g * R)):
                    out[n + t, g * R + r] = res[t * R + r]
            n += 2


def _group_fn(isa):
    """The group function of intrinsics module isa (vnni or avx2): one group against tokens n and n+1
    (two) or n alone, by kind (a constant once inlined)."""
    q4_0_x2, q4_0_x1, q4_1_x2, q4_1_x1 = isa.q4_0_x2, isa.q4_0_x1, isa.q4_1_x2, isa.q4_1_x1
    chain_x2, chain_x1, q8_0_x2, q8_0_x1 = isa.chain_x2, isa.chain_x1, isa.q8_0_x2, isa.q8_0_x1
    q5_0_x2, q5_0_x1, q5_1_x2, q5_1_x1 = isa.q5_0_x2, isa.q5_0_x1, isa.q5_1_x2, isa.q5_1_x1
    mxfp4_x2, mxfp4_x1 = isa.mxfp4_x2, isa.mxfp4_x1

    @njit(inline="always")
    def group(kind, two, q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf):
        if kind == _KIND_Q4_0:
            if two:
                q4_0_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                q4_0_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        elif kind == _KIND_Q4_1:
            if two:
                q4_1_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                q4_1_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        elif kind == _KIND_Q4_0_CHAIN:
            if two:
                chain_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                chain_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        elif kind == _KIND_Q5_0:
            if two:
                q5_0_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                q5_0_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        elif kind == _KIND_Q5_1:
            if two:
                q5_1_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                q5_1_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        elif kind == _KIND_MXFP4:
            if two:
                mxfp4_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                mxfp4_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
        else:
            if two:
                q8_0_x2(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
            else:
                q8_0_x1(q, d, m, Y4, Yz, n, dy, sy, res, pq, pd, pm, pf)
    return group


_group_vnni, _group_avx2 = _group_fn(vnni), _group_fn(avx2)
_INT8_ENTRIES = {Kernels.VNNI: (_prep_mm_v_serial, _prep_mm_v), Kernels.AVX2: (_prep_mm_a_serial, _prep_mm_a)}


# ------------------------------------------------------------------------------------------------
# many tokens: for each group, each block's codes are decoded once into C (f32, [k][L][r] like Y) and used
# by every token of a tile; the per-token loop is then the same unit-stride product as above, without the
# nibble decode. Work items are (token tile, group) pairs, tile-major, so a tile's activations stay in L2
# while the weights stream past.
MIN_TOKENS = 4                          # from this many tokens on, the tiled kernels are used
_TILE_TOKENS = 16                       # tokens per work item (a multiple of 4)


@njit(parallel=True, cache=True, nogil=True)
def _mm_t(kind, qs, d, m, Y, dy, sy, ys, out, n_chunks):
    n_items = -(-out.shape[0] // _TILE_TOKENS) * qs.shape[0]
    n_chunks = min(n_items, n_chunks)
    for c in prange(n_chunks):
        _items_t(kind, qs, d, m, Y, dy, sy, ys, out, c * n_items // n_chunks, (c + 1) * n_items // n_chunks)


@njit(cache=True, nogil=True)
def _mm_t_serial(kind, qs, d, m, Y, dy, sy, ys, out):
    _items_t(kind, qs, d, m, Y, dy, sy, ys, out, np.int64(0), -(-out.shape[0] // _TILE_TOKENS) * qs.shape[0])


@njit(cache=True, nogil=True)
def _items_t(kind, qs, d, m, Y, dy, sy, ys, out, i0, i1):
    """Items i0 .. i1-1 (item = tile * G + group); one specialized loop nest per kind."""
    if kind == _KIND_Q4_0:
        _items_t_kind(qs, d, m, Y, dy, sy, ys, out, i0, i1, 0)
    elif kind == _KIND_Q4_1:
        _items_t_kind(qs, d, m, Y, dy, sy, ys, out, i0, i1, 1)
    elif kind == _KIND_Q4_0_CHAIN:
        _items_t_kind(qs, d, m, Y, dy, sy, ys, out, i0, i1, 2)
    else:
        _items_t_kind(qs, d, m, Y, dy, sy, ys, out, i0, i1, 3)


@njit(cache=True, inline="always")
def _codes_block(qg, kind, b, C):
    """All R rows' codes of block b as f32: C[(k*8 + L)*R + r] = code of element 4L+k of row r (Q4_0
    centred unless chained). Trip counts come from C's shape (see _rows_q4)."""
    n8 = C.shape[0] // 4                                 # 8R
    n4 = n8 // 2
    if kind == _KIND_Q8_0:
        q = qg[32 * R * b:32 * R * (b + 1)]
        for i in range(4 * n8):
            C[i] = F32(np.int8(q[i]))
    else:
        q = qg[16 * R * b:16 * R * (b + 1)]
        for k in range(4):
            for i in range(n4):
                f = F32(q[k * n4 + i])
                h = np.floor(f * F32(0.0625))
                lo = _fma(h, F32(-16), f)
                if kind == _KIND_Q4_0:
                    lo -= F32(8)
                    h -= F32(8)
                C[k * n8 + i] = lo
                C[k * n8 + n4 + i] = h


@njit(cache=True, inline="always")
def _items_t_kind(qs, d, m, Y, dy, sy, ys, out, i0, i1, kind):
    N = out.shape[0]
    G = qs.shape[0]
    nb = dy.shape[1]
    chain = kind == _KIND_Q4_0_CHAIN
    C = np.empty(32 * R, F32)
    dR = np.empty(R, F32)
    S = np.empty((4, R), F32)
    acc = np.empty((_TILE_TOKENS, 8 * R), F32)
    sm = np.zeros((_TILE_TOKENS, R), F32)
    has_m = kind == _KIND_Q4_1
    for item in range(i0, i1):
        tile, g = item // G, item % G
        n0 = tile * _TILE_TOKENS
        n1 = min(N, n0 + _TILE_TOKENS)
        acc[:] = 0
        for b in range(nb):
            _codes_block(qs[g], kind, b, C)
            for r in range(R):
                dR[r] = _half(d[g, R * b + r])
            for n in range(n0, n1, 4):                          # 4 tokens share each code load
                _tokens4(C, dR, Y, dy, ys, S, acc, n, n0, b, chain)
            if has_m:                                           # Q4_1: sequential f32 sum of m*s
                mb = m[g, R * b:R * (b + 1)]
                for n in range(n0, n1):
                    smn = sm[n - n0]
                    sb = sy[n, b]
                    for r in range(dR.shape[0]):
                        p = _half(mb[r]) * sb
                        smn[r] = p if b == 0 else smn[r] + p
        for n in range(n0, n1):
            _store(acc[n - n0], sm[n - n0], out, g, n, has_m, chain)


@njit(cache=True, inline="always")
def _tokens4(C, dR, Y, dy, ys, S, acc, n, n0, b, chain):
    """Block b of tokens n .. n+3 (Y, dy, ys padded to a multiple of 4 tokens) into acc[n-n0 ..]: for each
    lane L the 16 activation codes are scalars (broadcast) and the loop over the R rows is the vector."""
    nr = dR.shape[0]
    a0 = acc[n - n0]
    a1 = acc[n - n0 + 1]
    a2 = acc[n - n0 + 2]
    a3 = acc[n - n0 + 3]
    e0 = dy[n, b]
    e1 = dy[n + 1, b]
    e2 = dy[n + 2, b]
    e3 = dy[n + 3, b]
    if chain:
        S[:] = 0
    for L in range(8):
        o = 32 * b + 4 * L
        p0, p1, p2, p3 = Y[n, o], Y[n, o + 1], Y[n, o + 2], Y[n, o + 3]
        q0, q1, q2, q3 = Y[n + 1, o], Y[n + 1, o + 1], Y[n + 1, o + 2], Y[n + 1, o + 3]
        u0, u1, u2, u3 = Y[n + 2, o], Y[n + 2, o + 1], Y[n + 2, o + 2], Y[n + 2, o + 3]
        v0, v1, v2, v3 = Y[n + 3, o], Y[n + 3, o + 1], Y[n + 3, o + 2], Y[n + 3, o + 3]
        for r in range(nr):
            i = L * R + r
            c0 = C[i]
            c1 = C[8 * R + i]
            c2 = C[16 * R + i]
            c3 = C[24 * R + i]
            s0 = _fma(c3, p3, _fma(c2, p2, _fma(c1, p1, c0 * p0)))     # exact integers
            s1 = _fma(c3, q3, _fma(c2, q2, _fma(c1, q1, c0 * q0)))
            s2 = _fma(c3, u3, _fma(c2, u2, _fma(c1, u1, c0 * u0)))
            s3 = _fma(c3, v3, _fma(c2, v2, _fma(c1, v1, c0 * v0)))
            if chain:
                S[0, r] += s0
                S[1, r] += s1
                S[2, r] += s2
                S[3, r] += s3
            else:
                dr = dR[r]
                a0[i] = _fma(dr * e0, s0, a0[i])                    # f32(dx*dy), exact
                a1[i] = _fma(dr * e1, s1, a1[i])
                a2[i] = _fma(dr * e2, s2, a2[i])
                a3[i] = _fma(dr * e3, s3, a3[i])
    if chain:
        for j in range(4):
            a = acc[n - n0 + j]
            c8 = F32(8) * ys[n + j, b]
            e = dy[n + j, b]
            for r in range(nr):
                a[r] = _fma(S[j, r] - c8, dR[r] * e, a[r])

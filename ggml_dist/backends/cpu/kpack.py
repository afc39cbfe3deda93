"""Q4_K, Q5_K and Q6_K weights repacked once for the CPU MUL_MAT, and the numba kernels that read them
with int8 SIMD (kquant_ir.py's intrinsics) and ggml's numerics, bit for bit: qpack.py's design for the
K-quants.

Why: qkernels decodes every superblock of a K-quant row on every call (1-3 GB/s). Packed once, at a
weight's first MUL_MAT, into groups of R = 64 rows whose superblocks are interleaved, one vector load
gives 16 (VNNI) or 8 (AVX2) rows' codes of one ggml lane, and a decode step streams the weight once.

Layout: ``qs`` uint8 [G, nb * SB], G = ceil(M / 64) groups (padding rows zero), nb = K / 256 superblocks
per row; superblock s of group g is one record of SB bytes (kquant_ir.LAYOUT; ``4r + i`` is byte i of
row r's 4-byte lane, so a run of 4n bytes is n rows):
* Q4_K (SB = 9472 = 148 * 64): codes (c, k, r, i) at 2048c + 256k + 4r + i = row r's qs[32c + 4k + i]
  (low nibble: sub-block 2c, element 4k+i; high: sub-block 2c+1); sc (j, r) at 8192 + 64j + r (6-bit
  scales, unpacked from get_scale_min_k4); min pairs (i, r, e) at 8704 + 128i + 2r + e = m_{2i+e};
  d, dmin f16 [64] at 9216, 9344.
* Q5_K (SB = 11520 = 180 * 64): Q4_K's, with qh (k, r, i) at 8192 + 256k + 4r + i = row r's qh[4k + i]
  (bit j: the 5th bit of sub-block j) and the scale parts after it.
* Q6_K (SB = 13440 = 210 * 64, the file's size): ql (h, p, k, r, i) at 4096h + 2048p + 256k + 4r + i =
  ql[64h + 32p + 4k + i]; qh (h, k, r, i) at 8192 + 2048h + 256k + 4r + i = qh[32h + 4k + i]; sc int8
  (j, r) at 12288 + 64j + r; d f16 [64] at 13312.
Activations are quantized once per call (``_prep``: quants.quantize_q8_K's float steps) into int8 codes
(read 4 per int32 word), f32 d per superblock, and int16 pairs for the vpmaddwd steps: sp (s_2i, s_2i+1),
s_j = the sum of sub-block j's 32 codes, and bp (bsum_2k, bsum_2k+1) of the 16-code bsums.

Numerics (ggml-numerics.md §1.5, 1.6; the exact steps in kquant_ir's docstring): the same bits as
quants.mul_mat(order="ggml") and qkernels.mul_mat_q with ggml's repack rule (Q4_K repacked iff M % 8 == 0):
* not repacked, vec_n < 8 rows: ggml_vec_dot_q{4,5,6}_K_q8_K's 8 lanes, HA (kquant_ir "lanes");
* not repacked, vec_n >= 8 (quants.takes_tiled): the tiled kernel's per-superblock r, fma(r, dy, acc);
* repacked Q4_K: ggml_gemm_q4_K_8x8_q8_K's four steps per superblock for rows 0 .. N - N % 4 - 1 when
  N > 3 (and vec_n, where given, > 3), ggml_gemv_q4_K_8x8_q8_K's one step for the rest (two chains,
  acc - accm).
vec_n = 1 (ComputeOptions.batch_invariant) gives every row the one-row order: lanes, or the gemv chain.
mul_mat gives None (the caller then takes qkernels' path) for a non-finite activation.
Kernels: VNNI where the CPU has AVX-512 VNNI, else AVX2 (also with GGML_DIST_FORCE_AVX2=1), as
qpack.default_kernels(); without either, ``available()`` is False and K-quants stay on qkernels.
The kernels release the GIL (nogil=True).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ...core.types import GGMLType
from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from . import quants as Q
from .blocks import BLOCKS, KPACK_TYPES
from .entry import F32P, I8P, I32P, U8P, address, array2, at, pointer_block
from .kquant_ir import LAYOUT, group_intrinsic
from .qpack import MULTI, Kernels, bound_int8_call, default_kernels, packed_as, slots, thread_scratch
from .threads import get_threads, launch

T = GGMLType
F32 = np.float32
R = 64                                  # rows per group (kquant_ir's, vnni's)
PACKABLE = KPACK_TYPES                  # Q4_K, Q5_K, Q6_K (blocks.py's packed="kpack")
_NAME = {T.Q4_K: "q4_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k"}
_BLOCK = {t: BLOCKS[t].nbytes for t in PACKABLE}
_LANES, _TILED, _REPACKED = 0, 1, 2     # modes of a call; _REPACKED: gemm for rows < ng, then chain
_PARALLEL_WORK = 1 << 18                # multiply-adds from which a product is split across threads


def kernels_here() -> Kernels | None:
    """The int8 kernels this host runs (qpack.default_kernels()'s choice), None without VNNI or AVX2."""
    k = default_kernels()
    return None if k is Kernels.FLOAT else k


def available() -> bool:
    return kernels_here() is not None


# ------------------------------------------------------------------------------------------------
# packing (numpy, once per weight)
def _pack(wtype: GGMLType, w: np.ndarray) -> np.ndarray:
    """GGUF rows [M, nb * block bytes] -> qs uint8 [G, nb * SB] (the module docstring's layout)."""
    bs = _BLOCK[wtype]
    M, nbytes = w.shape
    nb = nbytes // bs
    G = -(-M // R)
    w = np.asarray(w, np.uint8)
    if M % R:
        w = np.concatenate([w, np.zeros((G * R - M, nbytes), np.uint8)])
    b = w.reshape(G, R, nb, bs)

    def rows_last(a, n_lead):           # [G, R, nb, *lead, *tail] -> [G, nb, *lead, R, *tail]
        nd = a.ndim
        order = (0, 2, *range(3, 3 + n_lead), 1, *range(3 + n_lead, nd))
        return a.transpose(order).reshape(G, nb, -1)

    def f16(off):                       # [G, nb, R*2] bytes of the f16 at byte off of every block
        return rows_last(b[..., off:off + 2], 0)

    if wtype == T.Q6_K:
        parts = [rows_last(b[..., 0:128].reshape(G, R, nb, 2, 2, 8, 4), 3),      # ql (h, p, k, r, i)
                 rows_last(b[..., 128:192].reshape(G, R, nb, 2, 8, 4), 2),       # qh (h, k, r, i)
                 rows_last(b[..., 192:208], 1), f16(208)]                         # sc (j, r), d
    else:
        oq = 16 if wtype == T.Q4_K else 48
        sc, m = Q._scale_min_k4(b[..., 4:16])                                    # [G, R, nb, 8]
        parts = [rows_last(b[..., oq:oq + 128].reshape(G, R, nb, 4, 8, 4), 2)]   # codes (c, k, r, i)
        if wtype == T.Q5_K:
            parts.append(rows_last(b[..., 16:48].reshape(G, R, nb, 8, 4), 1))    # qh (k, r, i)
        parts += [rows_last(sc.astype(np.uint8), 1),                             # sc (j, r)
                  rows_last(m.astype(np.uint8).reshape(G, R, nb, 4, 2), 1),      # min pairs (i, r, e)
                  f16(0), f16(2)]
    rec = np.concatenate(parts, axis=2)
    assert rec.shape[2] == LAYOUT[_NAME[wtype]]["size"]
    return np.ascontiguousarray(rec).reshape(G, nb * rec.shape[2])


class PackedKWeight:
    """One Q4_K/Q5_K/Q6_K weight matrix [M, K] packed for `kernels` (default: the host's, see
    kernels_here()). ``repacked``: llama.cpp's q4_K_8x8 numerics (Q4_K with M % 8 == 0; ``rows`` in
    place of M where given: experts.py's stacked experts, as qpack.PackedWeight's)."""
    raw: np.ndarray | None = None       # it never keeps the file's rows (qpack.packed_as)

    def __init__(self, wtype: GGMLType, w: np.ndarray, key: tuple = (),
                 kernels: Kernels | str | None = None, rows: int | None = None) -> None:
        wtype = GGMLType(wtype)
        if wtype not in PACKABLE:
            raise ValueError(f"cannot pack {wtype.name}; packable: {sorted(t.name for t in PACKABLE)}")
        kernels = kernels_here() if kernels is None else Kernels(kernels)
        if kernels is None or kernels is Kernels.FLOAT:
            raise ValueError("the K-quant packed kernels need AVX-512 VNNI or AVX2 (see kernels_here())")
        if kernels is Kernels.VNNI and not _vnni_ok():
            raise ValueError("the vnni kernels need a CPU with AVX-512 VNNI (and GGML_DIST_NO_VNNI unset)")
        if kernels is Kernels.AVX2 and not _avx2_ok():
            raise ValueError("the avx2 kernels need a CPU with AVX2, FMA and F16C (and GGML_DIST_NO_AVX2 unset)")
        M, nbytes = w.shape
        if nbytes % _BLOCK[wtype]:
            raise ValueError(f"{wtype.name} rows are whole {_BLOCK[wtype]}-byte superblocks, got {nbytes} bytes")
        self.type, self.M, self.K, self.key = wtype, M, nbytes // _BLOCK[wtype] * 256, key
        self.kernels: Kernels = kernels
        self.qs = _pack(wtype, w)
        self.rows = M if rows is None else rows         # the height ggml's repack rule sees (qpack's rows)
        self.repacked = wtype == T.Q4_K and self.rows % 8 == 0
        self._entries: tuple[Callable[..., bool], Callable[..., bool]] = _ENTRIES[kernels][wtype]  # (serial, parallel)

    def _mode(self, N: int, vec_n: int | None) -> tuple[int, int]:
        """(mode, ng): ng = the rows that take the repacked gemm order (none where vec_n < 4: the gemv
        chain for every row, as ggml runs a row alone)."""
        if self.repacked:
            return _REPACKED, Q.gemm_rows(N, vec_n)
        return (_TILED if Q.takes_tiled(self.type, False, N if vec_n is None else vec_n, "ggml") else _LANES), 0

    def _check(self, x: np.ndarray) -> None:
        if x.ndim != 2 or x.shape[1] != self.K:
            raise ValueError(f"packed {self.type.name} weight has rows of {self.K}, x has shape {x.shape}")

    def mul_mat(self, x: np.ndarray, out: np.ndarray | None = None, vec_n: int | None = None) -> np.ndarray | None:
        """x f32 [N, K] -> f32 [N, M] (into `out` if given, C-contiguous), or None where the caller must
        take qkernels' path (a non-finite activation). vec_n as quants.mul_mat's."""
        self._check(x)
        N = x.shape[0]
        if out is None:
            out = np.empty((N, self.M), F32)
        if N == 0:
            return out
        x = np.ascontiguousarray(x, F32)
        mode, ng = self._mode(N, vec_n)
        return out if self._run(x, out, mode, ng, N * self.M * self.K >= _PARALLEL_WORK) else None

    def bind(self, x: np.ndarray, out: np.ndarray, vec_n: int | None = None,
             fallback: Callable[[], object] | None = None) -> Callable[[], bool]:
        """mul_mat(x, out) for arrays fixed from now on (a replayed step's, qpack.bound_int8_call): the
        call returns False where mul_mat would return None, after fallback() if given. x f32 [N, K]
        C-contiguous, out f32 [N, M] C-contiguous."""
        self._check(x)
        if x.dtype != F32 or not x.flags.c_contiguous:
            raise ValueError(f"packed {self.type.name} weight: x must be f32 [N, {self.K}] C-contiguous")
        if x.shape[0] == 0:
            return lambda: True
        return bind_products([self], x, [out], vec_n, fallback)

    def shares_call(self, other: PackedKWeight) -> bool:
        """Whether one call can multiply this weight and other by the same activation (bind_products):
        the same type, kernels, numerics and row length."""
        return other._entries is self._entries and other.repacked == self.repacked and other.K == self.K

    def _run(self, x: np.ndarray, out: np.ndarray, mode: int, ng: int, big: bool) -> bool:
        serial, parallel = self._entries
        Yb, Y4, dy, sp, bp = _work(x.shape[0], self.K)
        args: tuple = int8_args((x, Yb, Y4, dy, sp, bp, mode, ng, slots([self.qs]), slots([out]), 1))
        if not big or get_threads() == 1:
            return bool(serial(*args))
        with launch() as nt:
            return bool(parallel(*args, nt))


def bind_products(pws: list[PackedKWeight], x: np.ndarray, outs: list[np.ndarray], vec_n: int | None = None,
                  fallback: Callable[[], object] | None = None) -> Callable[[], bool]:
    """qpack.bind_products for K-quant weights (PackedKWeight.shares_call): their products by the same
    activation x f32 [N >= 1, K] C-contiguous, into outs, as one bound call. vec_n as mul_mat's."""
    if not 1 <= len(pws) <= MULTI or not all(pws[0].shares_call(p) for p in pws) or len(outs) != len(pws):
        raise ValueError(f"bind_products: 1..{MULTI} weights of one type and layout, one output each")
    N = x.shape[0]
    if x.ndim != 2 or N == 0 or x.shape[1] != pws[0].K or x.dtype != F32 or not x.flags.c_contiguous:
        raise ValueError(f"packed products: x must be f32 [N >= 1, {pws[0].K}] C-contiguous, got {x.shape}")
    for p, o in zip(pws, outs):
        if o.shape != (N, p.M) or o.dtype != F32 or not o.flags.c_contiguous:
            raise ValueError(f"packed product: out must be f32 [{N}, {p.M}] C-contiguous, got {o.shape}")
    mode, ng = pws[0]._mode(N, vec_n)
    return bound_int8_call(pws[0]._entries, _work, N, pws[0].K, (x,),
                           (mode, ng, slots([p.qs for p in pws]), slots(outs), len(pws)),
                           N * sum(p.M for p in pws) * pws[0].K >= _PARALLEL_WORK, fallback, int8_args)


def int8_args(args: tuple) -> tuple:
    """The entries' arguments for (x, Yb, Y4, dy, sp, bp, mode, ng, qs, out, n_w): the arrays as one
    pointer_block by its address (entry.py; the caller keeps them alive), mode, ng, n_w."""
    x, Yb, Y4, dy, sp, bp, mode, ng, qs, out, n_w = args
    return address(pointer_block((x, Yb, Y4, dy, sp, bp, *qs, *out))), mode, ng, n_w


def _vnni_ok() -> bool:
    from . import vnni
    return vnni.AVAILABLE


def _avx2_ok() -> bool:
    from . import avx2
    return avx2.AVAILABLE


_WORK = threading.local()


def _work(N: int, K: int) -> tuple[np.ndarray, ...]:
    """Activation scratch (Yb, Y4, dy, sp, bp) for N tokens of K, reused per thread."""
    return thread_scratch(_WORK, _make_work, N, K)


def _make_work(N: int, K: int) -> tuple[np.ndarray, ...]:
    nb = K // 256
    Yb = np.zeros((N, K), np.int8)
    return (Yb, Yb.view(np.int32), np.zeros((N, nb), F32), np.zeros((N, 4 * nb), np.int32),
            np.zeros((N, 8 * nb), np.int32))


def packed(wtype: GGMLType, w: np.ndarray, t, kernels: Kernels | str | None = None) -> PackedKWeight:
    """The packed form of weight tensor t (bytes w) for `kernels` (None: kernels_here()), made once and
    kept in ``t.extra`` (as qpack.packed); made again if t was rebound to other bytes."""
    return packed_as(PackedKWeight, wtype, w, t, kernels)


# ------------------------------------------------------------------------------------------------
# activations: quants.quantize_q8_K and the pair words, in one pass
@njit(cache=True, nogil=True)
def _prep(x, Yb, dy, sp, bp):
    """x f32 [N, K] -> Yb int8 [N, K] codes, dy f32 [N, K/256], sp int32 [N, K/64] (s_2i, s_2i+1) and bp
    int32 [N, K/32] (bsum_2k, bsum_2k+1) int16 pairs, with quantize_row_q8_K_ref's float steps: mx the
    first value of largest |x|, iscale = f32(-127/mx), q = min(127, rne(iscale*x)), d = f32(1/iscale).
    False if x has a non-finite value. (Where iscale overflows, d = -0 and the codes do not reach the
    result; they are then 0 here.)"""
    N, K = x.shape
    bs = np.zeros(16, np.int64)
    for n in range(N):
        for b in range(K // 256):
            o = 256 * b
            amax = F32(-1)
            mx = F32(0)
            for j in range(o, o + 256):
                v = x[n, j]
                if not np.isfinite(v):
                    return False
                a = abs(v)
                if a > amax:
                    amax = a
                    mx = v
            if mx == 0:
                dy[n, b] = 0
                for j in range(o, o + 256):
                    Yb[n, j] = 0
            else:
                iscale = F32(-127) / mx
                for j in range(o, o + 256):
                    q = np.rint(iscale * x[n, j])
                    Yb[n, j] = np.int8(min(q, F32(127))) if q >= F32(-128) else np.int8(0)
                dy[n, b] = F32(1) / iscale
            for s in range(16):
                t = np.int64(0)
                for j in range(o + 16 * s, o + 16 * s + 16):
                    t += np.int64(Yb[n, j])
                bs[s] = t
            for i in range(4):
                lo = bs[4 * i] + bs[4 * i + 1]
                hi = bs[4 * i + 2] + bs[4 * i + 3]
                sp[n, 4 * b + i] = np.int32((lo & 0xFFFF) | (hi << 16))
            for k in range(8):
                bp[n, 8 * b + k] = np.int32((bs[2 * k] & 0xFFFF) | (bs[2 * k + 1] << 16))
    return True


# ------------------------------------------------------------------------------------------------
# kernels: work units are (group, token slice) pairs, as qpack's int8 kernels split them
@njit(cache=True, inline="always")
def _prep_mm(addr, mode, ng, n_w, n_threads, worker):
    """_prep, then the products of the n_w weights that share the activation x (qs, out: tuples of
    qpack.MULTI slots, the first n_w used; the arrays in a pointer_block at addr, int8_args) split across
    n_threads (worker: the type's _units), the weights' units in turn; False (the caller's fallback)
    on a non-finite x."""
    block = at(addr, 3 * (6 + 2 * MULTI))
    x, Yb, Y4, dy = array2(F32P, block, 0), array2(I8P, block, 1), array2(I32P, block, 2), array2(F32P, block, 3)
    sp, bp = array2(I32P, block, 4), array2(I32P, block, 5)
    qs = (array2(U8P, block, 6), array2(U8P, block, 7), array2(U8P, block, 8))
    out = (array2(F32P, block, 9), array2(F32P, block, 10), array2(F32P, block, 11))
    if not _prep(x, Yb, dy, sp, bp):
        return False
    G, N = 0, x.shape[0]
    for w in range(n_w):
        G += qs[w].shape[0]
    ts = 1 if G % n_threads == 0 else max(1, min((N + 1) // 2, n_threads))
    n_units = G * ts
    n_chunks = min(n_units, 4 * n_threads) if n_threads > 1 else 1
    for c in prange(n_chunks):
        u0, u1 = c * n_units // n_chunks, (c + 1) * n_units // n_chunks
        base = 0
        for w in range(n_w):
            n = qs[w].shape[0] * ts
            if u0 < base + n and base < u1:
                worker(mode, ng, qs[w], Y4, dy, sp, bp, out[w], max(u0, base) - base, min(u1, base + n) - base, ts)
            base += n
    return True


@njit(cache=True, inline="always")
def _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, group):
    """Units u0 .. u1-1: group u // ts against token slice u % ts of ts (slices of whole token pairs)."""
    N = Y4.shape[0]
    pairs = (N + 1) // 2
    res = np.empty(2 * R, F32)
    for u in range(u0, u1):
        g, sl = u // ts, u % ts
        n, n1 = 2 * (sl * pairs // ts), min(N, 2 * ((sl + 1) * pairs // ts))
        while n < n1:
            two = n + 1 < n1
            group(mode, n < ng, two, qs[g], Y4, n, dy, sp, bp, res)
            for t in range(2 if two else 1):
                for r in range(min(R, out.shape[1] - g * R)):
                    out[n + t, g * R + r] = res[t * R + r]
            n += 2


def _group_fn(isa: str, wt: str):
    """The group function of packed type wt on isa: its mode's intrinsic, for one token or two."""
    l1, l2 = group_intrinsic(wt, "lanes", 1, isa), group_intrinsic(wt, "lanes", 2, isa)
    t1, t2 = group_intrinsic(wt, "tiled", 1, isa), group_intrinsic(wt, "tiled", 2, isa)
    if wt != "q4_k":
        @njit(inline="always")
        def group(mode, gemm, two, q, Y4, n, dy, sp, bp, res):
            if mode == _LANES:
                if two:
                    l2(q, Y4, n, dy, sp, bp, res)
                else:
                    l1(q, Y4, n, dy, sp, bp, res)
            elif two:
                t2(q, Y4, n, dy, sp, bp, res)
            else:
                t1(q, Y4, n, dy, sp, bp, res)
        return group
    c1, c2 = group_intrinsic(wt, "chain", 1, isa), group_intrinsic(wt, "chain", 2, isa)
    g2 = group_intrinsic(wt, "gemm", 2, isa)     # gemm rows come in fours: never a lone token

    @njit(inline="always")
    def group_q4(mode, gemm, two, q, Y4, n, dy, sp, bp, res):
        if mode == _LANES:
            if two:
                l2(q, Y4, n, dy, sp, bp, res)
            else:
                l1(q, Y4, n, dy, sp, bp, res)
        elif mode == _TILED:
            if two:
                t2(q, Y4, n, dy, sp, bp, res)
            else:
                t1(q, Y4, n, dy, sp, bp, res)
        elif gemm:
            g2(q, Y4, n, dy, sp, bp, res)
        elif two:
            c2(q, Y4, n, dy, sp, bp, res)
        else:
            c1(q, Y4, n, dy, sp, bp, res)
    return group_q4


_g_q4k_v, _g_q5k_v, _g_q6k_v = (_group_fn("vnni", w) for w in ("q4_k", "q5_k", "q6_k"))
_g_q4k_a, _g_q5k_a, _g_q6k_a = (_group_fn("avx2", w) for w in ("q4_k", "q5_k", "q6_k"))


# one worker per (type, isa), compiled once and called by both entry points (serial, parallel), which a
# host compiles only for the types its model has
@njit(cache=True, nogil=True)
def _w_q4k_v(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q4k_v)


@njit(cache=True, nogil=True)
def _w_q4k_a(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q4k_a)


@njit(cache=True, nogil=True)
def _w_q5k_v(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q5k_v)


@njit(cache=True, nogil=True)
def _w_q5k_a(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q5k_a)


@njit(cache=True, nogil=True)
def _w_q6k_v(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q6k_v)


@njit(cache=True, nogil=True)
def _w_q6k_a(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts):
    _units(mode, ng, qs, Y4, dy, sp, bp, out, u0, u1, ts, _g_q6k_a)


@njit(cache=True, nogil=True)
def _q4k_v_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q4k_v)


@njit(parallel=True, cache=True, nogil=True)
def _q4k_v(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q4k_v)


@njit(cache=True, nogil=True)
def _q4k_a_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q4k_a)


@njit(parallel=True, cache=True, nogil=True)
def _q4k_a(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q4k_a)


@njit(cache=True, nogil=True)
def _q5k_v_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q5k_v)


@njit(parallel=True, cache=True, nogil=True)
def _q5k_v(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q5k_v)


@njit(cache=True, nogil=True)
def _q5k_a_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q5k_a)


@njit(parallel=True, cache=True, nogil=True)
def _q5k_a(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q5k_a)


@njit(cache=True, nogil=True)
def _q6k_v_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q6k_v)


@njit(parallel=True, cache=True, nogil=True)
def _q6k_v(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q6k_v)


@njit(cache=True, nogil=True)
def _q6k_a_serial(addr, mode, ng, n_w):
    return _prep_mm(addr, mode, ng, n_w, 1, _w_q6k_a)


@njit(parallel=True, cache=True, nogil=True)
def _q6k_a(addr, mode, ng, n_w, n_threads):
    return _prep_mm(addr, mode, ng, n_w, n_threads, _w_q6k_a)


_ENTRIES = {
    Kernels.VNNI: {T.Q4_K: (_q4k_v_serial, _q4k_v), T.Q5_K: (_q5k_v_serial, _q5k_v),
                   T.Q6_K: (_q6k_v_serial, _q6k_v)},
    Kernels.AVX2: {T.Q4_K: (_q4k_a_serial, _q4k_a), T.Q5_K: (_q5k_a_serial, _q5k_a),
                   T.Q6_K: (_q6k_a_serial, _q6k_a)},
}

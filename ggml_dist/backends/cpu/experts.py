"""MUL_MAT_ID on a 3-D expert weight packed once (qpack's and kpack's 64-row groups and int8 kernels), one
compiled call per step for all the experts the step's tokens chose, with ggml's bits.

Why: ops._mul_mat_id (the reference) loops over the chosen experts in Python and multiplies each
through qkernels, decoding the file's blocks on every call (1-3 GB/s), one launch per expert. Here the
weight is packed once, at the first bind, as the 2-D weights are (kept in the tensor's ``extra``, the
mapping's pages released), and a step is one call: route, quantize, gather, then every (expert, weight,
group, token pair) unit of the step split across the threads in one launch.

Layout: the experts [E, M, K] stacked into one matrix of E * Gp * 64 rows (Gp = ceil(M / 64): each
expert padded with zero rows to whole groups), packed as one qpack.PackedWeight or kpack.PackedKWeight
with ``rows=M`` (ggml's repack rule reads the expert's height): expert e's group g is group e * Gp + g.

A call (``_moe_q`` for qpack's types, ``_moe_k`` for kpack's):
1. route: ggml's matrix_rows (repack.cpp forward_mul_mat_id, ggml-cpu.c mul_mat_id): per expert, the
   (token, slot) pairs that chose it, token-major; an id outside 0..E-1 gives the call back (the
   reference then raises);
2. quantize every activation row once (qpack._prep / kpack._prep: Q8_0, Q8_1, Q8_K as ggml; a
   non-finite value gives the call back, the reference's path then computes it), and copy each routed
   pair's row into expert order (the group intrinsics read a token pair from consecutive rows);
3. units (used expert, weight, group, token pair), expert-major, each thread a contiguous share of them
   (one launch): in decode 8 experts x 12 groups x 2 weights (gate and up fused) split in two.
Each row goes through its expert's rows as the 2-D kernels take a row, in the order ggml gives an
expert's row in MUL_MAT_ID (ops.mul_mat_id_vec_n): the repacked types (Q4_0, MXFP4, Q4_K with M % 8 == 0)
their gemv chain one row at a time, whatever the expert's row count; a K-quant left in its blocks its
vec_dot lanes below 8 rows and the tiled order from 8 (``tiled``: False under batch_invariant, where
every row takes a row alone's order); the other types vec_dot lanes (the same for any row count).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from numba import njit, prange

from ...core.types import GGMLType
from . import kpack, qpack
from .entry import F32P, I8P, I32P, I64P, U8P, U16P, address, array2, at
from .qpack import MULTI, Int8Call, Kernels, packed_as, slots
from .quants import TILED_MIN_ROWS

T = GGMLType
F32 = np.float32
R = qpack.R
_PARALLEL_WORK = 1 << 18                 # multiply-adds from which a call splits across threads (qpack's)


def packable(wtype: GGMLType, M: int, kernels: Kernels | str | None) -> bool:
    """Whether experts of wtype with M rows each take the packed path with `kernels` (None: the host's):
    qpack's types on the int8 kernels (MXFP4 where ggml repacks it, M % 8 == 0: its chain), kpack's
    where the host has VNNI or AVX2."""
    k = qpack.default_kernels() if kernels is None else Kernels(kernels)
    if k is Kernels.FLOAT:
        return False
    if wtype in qpack.PACKABLE:
        return wtype != T.MXFP4 or M % 8 == 0
    return wtype in kpack.PACKABLE and kpack.available()


class PackedExperts:
    """A 3-D expert weight (uint8 [E, M, row bytes]) packed once (module docstring), for `kernels`."""
    raw: np.ndarray | None = None       # never the file's rows (qpack.packed_as releases their pages)

    def __init__(self, wtype: GGMLType, w: np.ndarray, key: tuple = (),
                 kernels: Kernels | str | None = None) -> None:
        wtype = GGMLType(wtype)
        E, M, nbytes = w.shape
        if not packable(wtype, M, kernels):
            raise ValueError(f"experts of {wtype.name} with {M} rows do not take the packed path here")
        Gp = -(-M // R)
        if M % R:
            wp = np.zeros((E, Gp * R, nbytes), np.uint8)
            wp[:, :M] = w
        else:
            wp = np.asarray(w, np.uint8)
        flat = wp.reshape(E * Gp * R, nbytes)
        self.pw: qpack.PackedWeight | kpack.PackedKWeight
        if wtype in qpack.PACKABLE:
            self.pw = qpack.PackedWeight(wtype, flat, kernels=kernels, rows=M)
            assert self.pw.raw is None and self.pw._int8 is not None
        else:
            self.pw = kpack.PackedKWeight(wtype, flat, kernels=kernels, rows=M)
        self.type, self.E, self.M, self.Gp, self.K, self.key = wtype, E, M, Gp, self.pw.K, key
        self.kernels: Kernels = self.pw.kernels
        self.file_bytes = E * M * nbytes        # what qpack.packed_as releases of the mapping
        self.qfam = wtype in qpack.PACKABLE

    def shares_call(self, other: PackedExperts) -> bool:
        """Whether one call can multiply this weight and other by the same activations and ids."""
        if not (other.qfam == self.qfam and other.kernels is self.kernels and other.K == self.K
                and other.E == self.E and other.type == self.type):
            return False
        if self.qfam:
            return self.pw.shares_call(other.pw)               # type: ignore[arg-type]
        return self.pw.shares_call(other.pw)                   # type: ignore[arg-type]

    def bind(self, x: np.ndarray, ids: np.ndarray, out: np.ndarray, n_b: int, tiled: bool = True,
             fallback: Callable[[], object] | None = None) -> Callable[[], bool]:
        """bind_experts([self], ...)."""
        return bind_experts([self], x, ids, [out], n_b, tiled, fallback)

    def mul_mat_id(self, x: np.ndarray, ids: np.ndarray, n_b: int, tiled: bool = True) -> np.ndarray | None:
        """out f32 [n_tok * n_used, M] for x f32 [n_tok * n_b, K] and ids int32 [n_tok, n_used] (row t * n_used
        + s: expert ids[t, s] times x row t * n_b + s % n_b), or None where the call gives it back."""
        out = np.zeros((ids.shape[0] * ids.shape[1], self.M), F32)
        if out.shape[0] == 0:
            return out
        return out if bind_experts([self], x, ids, [out], n_b, tiled)() else None


def packed(wtype: GGMLType, w: np.ndarray, t, kernels: Kernels | str | None = None) -> PackedExperts:
    """The packed experts of weight tensor t (bytes w, uint8 [E, M, row bytes]), made once and kept in
    ``t.extra`` (qpack.packed_as)."""
    return packed_as(PackedExperts, wtype, w, t, kernels)


def bind_experts(pes: list[PackedExperts], x: np.ndarray, ids: np.ndarray, outs: list[np.ndarray], n_b: int,
                 tiled: bool = True, fallback: Callable[[], object] | None = None) -> Callable[[], bool]:
    """The MUL_MAT_IDs of up to MULTI expert weights that share a call (PackedExperts.shares_call) by the same
    activations and ids, as one bound call (qpack.Int8Call: flat in a replay): x f32 [n_tok * n_b, K]
    C-contiguous; ids int32 [n_tok, n_used], rows of any stride (the top-k view of an ARGSORT), elements
    contiguous; outs f32 [n_tok * n_used, M] C-contiguous. The call returns False (after fallback() if
    given) for a non-finite activation or an id outside 0..E-1. tiled: K-quants left in their blocks
    take the tiled order for experts with >= 8 rows (False: batch_invariant)."""
    p0 = pes[0]
    if not 1 <= len(pes) <= MULTI or not all(p0.shares_call(p) for p in pes) or len(outs) != len(pes):
        raise ValueError(f"bind_experts: 1..{MULTI} expert weights that share a call, one output each")
    n_tok, n_used = ids.shape
    n_src, K = x.shape
    if (x.dtype != F32 or not x.flags.c_contiguous or K != p0.K or n_src != n_tok * n_b or n_b < 1
            or n_used % n_b):
        raise ValueError(f"experts: x must be f32 [{n_tok} * {n_b}, {p0.K}] C-contiguous, got {x.shape}")
    if ids.dtype != np.int32 or ids.ndim != 2 or ids.strides[1] != 4 or ids.strides[0] % 4 or \
            (n_tok > 1 and ids.strides[0] < 4 * n_used):
        raise ValueError(f"experts: ids must be int32 [n_tok, n_used] with contiguous rows, got {ids.strides}")
    n_rows = n_tok * n_used
    for p, o in zip(pes, outs):
        if o.shape != (n_rows, p.M) or o.dtype != F32 or not o.flags.c_contiguous:
            raise ValueError(f"experts: out must be f32 [{n_rows}, {p.M}] C-contiguous, got {o.shape}")
    if n_rows == 0:
        return lambda: True
    stride = ids.strides[0] // 4 if n_tok > 1 else n_used
    big = n_rows * sum(p.M for p in pes) * K >= _PARALLEL_WORK
    E, Gp, M = p0.E, p0.Gp, p0.M
    if p0.qfam:
        pw = p0.pw
        assert isinstance(pw, qpack.PackedWeight)
        qs, d, m = (slots([getattr(p.pw, a) for p in pes]) for a in ("qs", "d", "m"))
        entries = _Q_ENTRIES[p0.kernels]

        def work() -> tuple:
            return _work_q(n_src, n_rows, K, E)
        tail = (*qs, *d, *m, *slots(outs))
        scalars = (pw.q8_1, pw.kind, len(pes), n_used, n_b, E, Gp, M)
    else:
        pk = p0.pw
        assert isinstance(pk, kpack.PackedKWeight)
        qs = slots([p.pw.qs for p in pes])
        entries = _K_ENTRIES[p0.kernels][p0.type]

        def work() -> tuple:
            return _work_k(n_src, n_rows, K, E)
        tail = (*qs, *slots(outs))
        scalars = (pk.repacked, tiled, len(pes), n_used, n_b, E, Gp, M)

    def pack(arrays: tuple) -> tuple:
        return (address(_pointers(arrays, stride)), *scalars)
    return Int8Call(entries, work, (x, ids), tail, big, fallback, pack)


def _pointers(arrays: tuple, ids_stride: int) -> np.ndarray:
    """The arrays as int64 [3 * n]: address, rows, columns (entry.pointer_block's), except ids (array 1),
    whose columns are its row stride in elements (the kernel reads its first n_used of each row)."""
    block = np.empty(3 * len(arrays), np.int64)
    for i, a in enumerate(arrays):
        if i == 1:
            block[3:6] = a.ctypes.data, a.shape[0], ids_stride
            continue
        if a.ndim != 2 or not a.flags.c_contiguous:
            raise ValueError(f"experts: array {i} is not 2-D C-contiguous ({a.shape}, {a.strides})")
        block[3 * i:3 * i + 3] = a.ctypes.data, a.shape[0], a.shape[1]
    return block


_WORK = threading.local()


def _scratch(key: tuple, make: Callable[[], tuple]) -> tuple:
    cache: dict | None = getattr(_WORK, "bufs", None)
    if cache is None:
        cache = _WORK.bufs = {}
    bufs = cache.get(key)
    if bufs is None:
        if len(cache) > 16:
            cache.clear()
        bufs = cache[key] = make()
    return bufs


def _index(E: int, n_rows: int) -> np.ndarray:
    """The routing scratch (int64 [1, n]): counts [E], starts [E + 1], fill [E], used experts [E], then each
    routed row's source row and destination row [n_rows] each."""
    return np.zeros((1, 4 * E + 1 + 2 * n_rows), np.int64)


def _work_q(n_src: int, n_rows: int, K: int, E: int) -> tuple:
    """qpack's activation scratch (Y, Yb, Y4, Yz, dy, sy, ys) for the source rows, its gathered rows (Y4,
    Yz, dy, sy), the routing index."""
    def make() -> tuple:
        Yb = np.zeros((n_src, K), np.int8)
        src = (np.zeros((n_src, K), F32), Yb, Yb.view(np.int32), np.zeros((n_src, K // 4), np.int32),
               *(np.zeros((n_src, K // 32), F32) for _ in range(3)))
        gathered = (np.zeros((n_rows, K // 4), np.int32), np.zeros((n_rows, K // 4), np.int32),
                    np.zeros((n_rows, K // 32), F32), np.zeros((n_rows, K // 32), F32))
        return (*src, *gathered, _index(E, n_rows))
    return _scratch(("q", n_src, n_rows, K, E), make)


def _work_k(n_src: int, n_rows: int, K: int, E: int) -> tuple:
    """kpack's activation scratch (Yb, Y4, dy, sp, bp), its gathered rows (Y4, dy, sp, bp), the index."""
    def make() -> tuple:
        nb = K // 256
        Yb = np.zeros((n_src, K), np.int8)
        src = (Yb, Yb.view(np.int32), np.zeros((n_src, nb), F32), np.zeros((n_src, 4 * nb), np.int32),
               np.zeros((n_src, 8 * nb), np.int32))
        gathered = (np.zeros((n_rows, K // 4), np.int32), np.zeros((n_rows, nb), F32),
                    np.zeros((n_rows, 4 * nb), np.int32), np.zeros((n_rows, 8 * nb), np.int32))
        return (*src, *gathered, _index(E, n_rows))
    return _scratch(("k", n_src, n_rows, K, E), make)


# ------------------------------------------------------------------------------------------------
# the compiled call
@njit(cache=True, inline="always")
def _route(ids, n_used, n_b, E, idx, n_rows):
    """ggml's row groups (module docstring): the number of experts used (their ids ascending in idx), or -1
    for an id outside 0..E-1. An id of -1 (another rank's expert: core/ops.py mul_mat_id) is routed to no
    expert: start[E], the rows routed, is below n_rows then."""
    n_tok = ids.shape[0]
    cnt, start, fill = idx[0:E], idx[E:2 * E + 1], idx[2 * E + 1:3 * E + 1]
    used = idx[3 * E + 1:4 * E + 1]
    src, dest = idx[4 * E + 1:4 * E + 1 + n_rows], idx[4 * E + 1 + n_rows:4 * E + 1 + 2 * n_rows]
    cnt[:] = 0
    for t in range(n_tok):
        for s in range(n_used):
            e = ids[t, s]
            if e == -1:
                continue
            if e < 0 or e >= E:
                return -1
            cnt[e] += 1
    acc, nu = 0, 0
    for e in range(E):
        start[e] = acc
        fill[e] = acc
        acc += cnt[e]
        if cnt[e] > 0:
            used[nu] = e
            nu += 1
    start[E] = acc
    for t in range(n_tok):
        for s in range(n_used):
            e = ids[t, s]
            if e == -1:
                continue
            p = fill[e]
            fill[e] = p + 1
            src[p] = t * n_b + s % n_b
            dest[p] = t * n_used + s
    return nu


@njit(cache=True, inline="always")
def _gather(a, g, idx, E, n_rows):
    """Row p of g = row src[p] of a (a routed pair's activation row, in expert order), for the rows routed."""
    src = idx[4 * E + 1:4 * E + 1 + n_rows]
    for p in range(idx[2 * E]):
        g[p, :] = a[src[p], :]


@njit(cache=True, inline="always")
def _zero_skipped(ids, n_used, out, n_w, routed, n_rows):
    """The rows of slots of id -1 (not computed here) set to 0 in the n_w outputs."""
    if routed == n_rows:
        return
    for t in range(ids.shape[0]):
        for s in range(n_used):
            if ids[t, s] == -1:
                for w in range(n_w):
                    out[w][t * n_used + s, :] = 0


@njit(cache=True, inline="always")
def _n_units(idx, E, nu, n_w, Gp):
    """Token pairs over all units: each used expert's pairs, times its weights' groups."""
    cnt, used = idx[0:E], idx[3 * E + 1:4 * E + 1]
    total = 0
    for k in range(nu):
        total += (cnt[used[k]] + 1) // 2
    return total * n_w * Gp


@njit(cache=True, inline="always")
def _unit(idx, E, nu, k, w, g, n_w, Gp):
    """Unit (used expert k, weight w, group g)'s expert, row (group of the stacked weight), and the next
    unit's weight and row (the group to prefetch; its own where there is none)."""
    used = idx[3 * E + 1:4 * E + 1]
    e = used[k]
    row = e * Gp + g
    nw, nrow = w, row
    if g + 1 < Gp:
        nrow = row + 1
    elif w + 1 < n_w:
        nw, nrow = w + 1, e * Gp
    elif k + 1 < nu:
        nw, nrow = 0, used[k + 1] * Gp
    return e, row, nw, nrow


@njit(cache=True, inline="always")
def _scatter(res, o, dest, n, two, g, M):
    """res's rows (t * R + r) for gathered rows n (and n + 1) into their destination rows of o."""
    nr = min(R, M - g * R)
    for t in range(2 if two else 1):
        dr = dest[n + t]
        for r in range(nr):
            o[dr, g * R + r] = res[t * R + r]


# qpack's types: the arrays of a pointer block (x, ids, 7 source scratch, 4 gathered, idx, then the MULTI
# slots of qs, d, m and out)
_Q_BLOCK = 3 * (14 + 4 * MULTI)


@njit(cache=True, inline="always")
def _q_arrays(addr):
    b = at(addr, _Q_BLOCK)
    return (array2(F32P, b, 0), array2(I32P, b, 1),
            (array2(F32P, b, 2), array2(I8P, b, 3), array2(I32P, b, 4), array2(I32P, b, 5),
             array2(F32P, b, 6), array2(F32P, b, 7), array2(F32P, b, 8)),
            (array2(I32P, b, 9), array2(I32P, b, 10), array2(F32P, b, 11), array2(F32P, b, 12)),
            array2(I64P, b, 13)[0],
            (array2(U8P, b, 14), array2(U8P, b, 15), array2(U8P, b, 16)),
            (array2(U16P, b, 17), array2(U16P, b, 18), array2(U16P, b, 19)),
            (array2(U16P, b, 20), array2(U16P, b, 21), array2(U16P, b, 22)),
            (array2(F32P, b, 23), array2(F32P, b, 24), array2(F32P, b, 25)))


@njit(cache=True, inline="always")
def _moe_q(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, n_threads, worker, bias):
    x, ids, s, gth, idx, qs, d, m, out = _q_arrays(addr)
    Y, Yb, Y4, Yz, dy, sy, ys = s
    gY4, gYz, gdy, gsy = gth
    n_rows = ids.shape[0] * n_used
    nu = _route(ids, n_used, n_b, E, idx, n_rows)
    if nu < 0:
        return False
    _zero_skipped(ids, n_used, out, n_w, idx[2 * E], n_rows)
    if not qpack._prep(x, q8_1, Y, Yb, dy, sy, ys, False):
        return False
    qpack._lane_starts(Yb, Yz, bias[kind])
    _gather(Y4, gY4, idx, E, n_rows)
    _gather(Yz, gYz, idx, E, n_rows)
    _gather(dy, gdy, idx, E, n_rows)
    _gather(sy, gsy, idx, E, n_rows)
    total = _n_units(idx, E, nu, n_w, Gp)
    n_chunks = min(total, n_threads)
    for c in prange(n_chunks):
        worker(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M,
               c * total // n_chunks, (c + 1) * total // n_chunks)
    return True


@njit(cache=True, inline="always")
def _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kind, group):
    """Token pairs p0 .. p1-1 of the units (used expert, weight, group), in that order (a unit has its
    expert's pairs), through qpack's group function of `kind` (a constant); the first pair of a unit
    prefetches the next unit's group where this thread computes it too."""
    cnt, start = idx[0:E], idx[E:2 * E + 1]
    used = idx[3 * E + 1:4 * E + 1]
    dest = idx[4 * E + 1 + n_rows:4 * E + 1 + 2 * n_rows]
    res = np.empty(2 * R, F32)
    base = 0
    for k in range(nu):
        if base >= p1:
            break
        ce = cnt[used[k]]
        pairs = (ce + 1) // 2
        if base + n_w * Gp * pairs <= p0:
            base += n_w * Gp * pairs
            continue
        for w in range(n_w):
            for g in range(Gp):
                if base < p1 and base + pairs > p0:
                    e, row, nw, nrow = _unit(idx, E, nu, k, w, g, n_w, Gp)
                    first = base + pairs < p1 and (nw != w or nrow != row)
                    n1 = min(start[e] + 2 * min(p1 - base, pairs), start[e] + ce)
                    n = start[e] + 2 * max(p0 - base, 0)
                    while n < n1:
                        two = n + 1 < n1
                        group(kind, two, qs[w][row], d[w][row], m[w][row], gY4, gYz, n, gdy, gsy, res,
                              qs[nw][nrow], d[nw][nrow], m[nw][nrow], first)
                        first = False
                        _scatter(res, out[w], dest, n, two, g, M)
                        n += 2
                base += pairs


@njit(cache=True, inline="always")
def _walk_q_kinds(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, group):
    """_walk_q with kind a constant in each branch (one specialized loop nest per kind, as qpack's)."""
    if kind == 0:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 0, group)
    elif kind == 1:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 1, group)
    elif kind == 2:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 2, group)
    elif kind == 3:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 3, group)
    elif kind == 4:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 4, group)
    elif kind == 5:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 5, group)
    else:
        _walk_q(qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, 6, group)


# one worker per isa, compiled once and called by both entry points (serial, parallel)
@njit(cache=True, nogil=True)
def _wq_v(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_q_kinds(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1,
                  qpack._group_vnni)


@njit(cache=True, nogil=True)
def _wq_a(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_q_kinds(kind, qs, d, m, gY4, gYz, gdy, gsy, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1,
                  qpack._group_avx2)


@njit(cache=True, nogil=True)
def _moe_q_v_serial(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M):
    return _moe_q(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, 1, _wq_v, qpack._LANE_BIAS_VNNI)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q_v(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_q(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, n_threads, _wq_v, qpack._LANE_BIAS_VNNI)


@njit(cache=True, nogil=True)
def _moe_q_a_serial(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M):
    return _moe_q(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, 1, _wq_a, qpack._LANE_BIAS_AVX2)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q_a(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_q(addr, q8_1, kind, n_w, n_used, n_b, E, Gp, M, n_threads, _wq_a, qpack._LANE_BIAS_AVX2)


_Q_ENTRIES = {Kernels.VNNI: (_moe_q_v_serial, _moe_q_v), Kernels.AVX2: (_moe_q_a_serial, _moe_q_a)}


# kpack's types: x, ids, 5 source scratch (Yb, Y4, dy, sp, bp), 4 gathered (Y4, dy, sp, bp), idx, then the
# MULTI slots of qs and out
_K_BLOCK = 3 * (12 + 2 * MULTI)


@njit(cache=True, inline="always")
def _k_arrays(addr):
    b = at(addr, _K_BLOCK)
    return (array2(F32P, b, 0), array2(I32P, b, 1),
            (array2(I8P, b, 2), array2(I32P, b, 3), array2(F32P, b, 4), array2(I32P, b, 5), array2(I32P, b, 6)),
            (array2(I32P, b, 7), array2(F32P, b, 8), array2(I32P, b, 9), array2(I32P, b, 10)),
            array2(I64P, b, 11)[0],
            (array2(U8P, b, 12), array2(U8P, b, 13), array2(U8P, b, 14)),
            (array2(F32P, b, 15), array2(F32P, b, 16), array2(F32P, b, 17)))


@njit(cache=True, inline="always")
def _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, worker):
    x, ids, s, gth, idx, qs, out = _k_arrays(addr)
    Yb, Y4, dy, sp, bp = s
    gY4, gdy, gsp, gbp = gth
    n_rows = ids.shape[0] * n_used
    nu = _route(ids, n_used, n_b, E, idx, n_rows)
    if nu < 0:
        return False
    _zero_skipped(ids, n_used, out, n_w, idx[2 * E], n_rows)
    if not kpack._prep(x, Yb, dy, sp, bp):
        return False
    _gather(Y4, gY4, idx, E, n_rows)
    _gather(dy, gdy, idx, E, n_rows)
    _gather(sp, gsp, idx, E, n_rows)
    _gather(bp, gbp, idx, E, n_rows)
    total = _n_units(idx, E, nu, n_w, Gp)
    n_chunks = min(total, n_threads)
    for c in prange(n_chunks):
        worker(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M,
               c * total // n_chunks, (c + 1) * total // n_chunks)
    return True


@njit(cache=True, inline="always")
def _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, group):
    """_walk_q for kpack's group functions: an expert's mode is the repacked chain (gemv, never the gemm:
    ggml's MUL_MAT_ID takes a row at a time), the tiled order from TILED_MIN_ROWS rows where tiled, else
    vec_dot's lanes."""
    cnt, start = idx[0:E], idx[E:2 * E + 1]
    used = idx[3 * E + 1:4 * E + 1]
    dest = idx[4 * E + 1 + n_rows:4 * E + 1 + 2 * n_rows]
    res = np.empty(2 * R, F32)
    base = 0
    for k in range(nu):
        if base >= p1:
            break
        ce = cnt[used[k]]
        pairs = (ce + 1) // 2
        if base + n_w * Gp * pairs <= p0:
            base += n_w * Gp * pairs
            continue
        mode = kpack._REPACKED if repacked else (kpack._TILED if tiled and ce >= TILED_MIN_ROWS else kpack._LANES)
        for w in range(n_w):
            for g in range(Gp):
                if base < p1 and base + pairs > p0:
                    e, row, _, _ = _unit(idx, E, nu, k, w, g, n_w, Gp)
                    n1 = min(start[e] + 2 * min(p1 - base, pairs), start[e] + ce)
                    n = start[e] + 2 * max(p0 - base, 0)
                    while n < n1:
                        two = n + 1 < n1
                        group(mode, False, two, qs[w][row], gY4, n, gdy, gsp, gbp, res)
                        _scatter(res, out[w], dest, n, two, g, M)
                        n += 2
                base += pairs


@njit(cache=True, nogil=True)
def _wk_q4k_v(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q4k_v)


@njit(cache=True, nogil=True)
def _moe_q4k_v_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q4k_v)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q4k_v(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q4k_v)


@njit(cache=True, nogil=True)
def _wk_q5k_v(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q5k_v)


@njit(cache=True, nogil=True)
def _moe_q5k_v_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q5k_v)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q5k_v(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q5k_v)


@njit(cache=True, nogil=True)
def _wk_q6k_v(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q6k_v)


@njit(cache=True, nogil=True)
def _moe_q6k_v_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q6k_v)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q6k_v(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q6k_v)


@njit(cache=True, nogil=True)
def _wk_q4k_a(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q4k_a)


@njit(cache=True, nogil=True)
def _moe_q4k_a_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q4k_a)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q4k_a(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q4k_a)


@njit(cache=True, nogil=True)
def _wk_q5k_a(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q5k_a)


@njit(cache=True, nogil=True)
def _moe_q5k_a_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q5k_a)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q5k_a(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q5k_a)


@njit(cache=True, nogil=True)
def _wk_q6k_a(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1):
    _walk_k(repacked, tiled, qs, gY4, gdy, gsp, gbp, out, idx, E, nu, n_rows, n_w, Gp, M, p0, p1, kpack._g_q6k_a)


@njit(cache=True, nogil=True)
def _moe_q6k_a_serial(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, 1, _wk_q6k_a)


@njit(parallel=True, cache=True, nogil=True)
def _moe_q6k_a(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads):
    return _moe_k(addr, repacked, tiled, n_w, n_used, n_b, E, Gp, M, n_threads, _wk_q6k_a)


_K_ENTRIES = {
    Kernels.VNNI: {T.Q4_K: (_moe_q4k_v_serial, _moe_q4k_v), T.Q5_K: (_moe_q5k_v_serial, _moe_q5k_v),
                   T.Q6_K: (_moe_q6k_v_serial, _moe_q6k_v)},
    Kernels.AVX2: {T.Q4_K: (_moe_q4k_a_serial, _moe_q4k_a), T.Q5_K: (_moe_q5k_a_serial, _moe_q5k_a),
                   T.Q6_K: (_moe_q6k_a_serial, _moe_q6k_a)},
}

"""A group of R = 64 rows of a packed quantized weight against one or two tokens' Q8 codes, with the
AVX-512 VNNI int8 dot product (vpdpbusd), written as LLVM IR intrinsics that qpack's numba kernels inline.

Why: numba vectorizes qpack's float loops well, but a float multiply-add per weight is 3-4x the work of
ggml's int8 kernels, which add four u8 x s8 products into an int32 lane in one instruction. numba has no
vector types, so these intrinsics build the vectors themselves. One call runs the whole row: a loop over
the blocks with the f32 lane accumulators in registers (16 rows per vector, 8 lanes), so per block, lane
and token only one vpdpbusd, one int->float conversion and one fma remain, the floor ggml's numerics set.
Two tokens per call share each weight vector's load and nibble split (``*_x2``); a lone token
(``*_x1``) runs two (Q4) or four (Q8_0) row vectors per pass, which streams a cold weight faster.

Layout (qpack.PackedWeight(vnni_layout=True)): a group's block b is 16*R (Q4) or 32*R (Q8) bytes, in
row-major chunks of 4 codes per lane: byte (b, l, r, k) at b*16R + l*4R + 4r + k is row r's qs[4l+k]
(Q4: element 4l+k in the low nibble, lane l; element 16+4l+k in the high one, lane 4+l); Q8's (b, L, r, k)
at b*32R + L*4R + 4r + k is row r's element 4L+k (lane L), stored as x + 128 (u8). One 32-bit lane of a
64-byte vector is then one row's four codes of a ggml lane, which vpdpbusd multiplies by the token's
four codes (broadcast). Q5_0/Q5_1: a block is 20*R bytes, Q4's 16*R and then the 5th-bit plane of 4*R,
byte (r, k) at b*20R + 16R + 4r + k with bit i = row r's 5th bit of element 4i+k (lane i): the plane's
vector at the offset of a row vector's nibbles holds the bits of all 8 lanes, and Emit.fifth_bits moves
lane l's (shift left by 4-l) and lane 4+l's (right by l) to bit 4 of the low and high nibble bytes.

Numerics: exactly those of qpack's float kernels and quants.mul_mat(order="ggml") (ggml-numerics.md §1.5):
lane sums are exact integers either way; Q4_0 lanes are centred as sum((u - 8) y) = sum(u y) - 8 sum(y),
Q5_0's 5-bit codes as sum(u y) - 16 sum(y), Q8_0's biased codes as sum((x + 128) y) - 128 sum(y); the
token's -8, -16 or -128 sum(y) per lane (``yz``, from qpack._lane_starts) is vpdpbusd's starting value
(exact: it does not saturate). Then acc = fma(f32(dx*dy), f32(lane), acc) per lane from acc = +0, block
after block, and ggml's HA over the 8 lanes; Q4_1 and Q5_1 add the sequential f32 sum of m*s (from -0,
so its first term is kept as is); the Q4_0 chain (repacked q4_0_8x8) runs
acc = fma(f32(isum), f32(dx*dy), acc) per row, isum the block's integer dot. MXFP4 ("mxfp4", repacked
mxfp4_8x8 only) is that chain on Q4_0's layout with each nibble looked up (vpshufb) as its kvalues_mxfp4
value + MXFP4_BIAS (0..24, vpdpbusd's unsigned operand; the lanes start at -12 sum(y)) and dx its E8M0
scale 2^(e-128) (Emit.e8m0_half), read from a plane of one byte per row and block.

Only hosts whose LLVM target has avx512vnni compile these (``AVAILABLE``); elsewhere, and with
GGML_DIST_NO_VNNI=1, qpack takes avx2.py's kernels (the same layout and numerics on 256-bit vectors,
which reuse this module's Emit and group_intrinsic with their own block emitter) where the CPU has
AVX2, else its float kernels and their layout.
"""
from __future__ import annotations

import os

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

R = 64                                  # rows per group (qpack.R): 4 vectors of 16 int32 lanes


def _host_has_vnni() -> bool:
    try:
        return bool(llvm.get_host_cpu_features().get("avx512vnni", False))
    except RuntimeError:                # an LLVM that cannot report features: take the portable path
        return False


AVAILABLE = _host_has_vnni() and os.environ.get("GGML_DIST_NO_VNNI", "") in ("", "0")

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_INTS = ir.VectorType(_I32, 16)
# a group's bytes per block: Q5's are the Q4 nibbles (16R) and then its 5th-bit plane (4R)
BLOCK_BYTES = {"q4_0": 16 * R, "q4_1": 16 * R, "chain": 16 * R, "q8_0": 32 * R, "q5_0": 20 * R, "q5_1": 20 * R,
               "mxfp4": 16 * R}
HAS_M = ("q4_1", "q5_1")                # a min per block: Q8_1 activations, the sequential sum of m*s
Q5 = ("q5_0", "q5_1")
CHAINS = ("chain", "mxfp4")             # one fma chain per row (the repack kernels' order)
# bytes of a row's scale per block: f16 bits, MXFP4's E8M0 byte
SCALE_BYTES = {k: 1 if k == "mxfp4" else 2 for k in BLOCK_BYTES}
# ggml-common.h kvalues_mxfp4 (the E2M1 values doubled); the vnni kernels read them + MXFP4_BIAS, unsigned
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
MXFP4_BIAS = 12


class Emit:
    """IR helpers for one intrinsic call: typed pointers into numba arrays, vector loads, splats. n is
    the number of int32 lanes (rows) per vector: 16 here (zmm), 8 for avx2.py (ymm)."""

    def __init__(self, context, builder, sig, args, n=16):
        self.context, self.b, self.sig, self.args, self.n = context, builder, sig, args, n
        self.BYTES, self.INTS = ir.VectorType(_I8, 4 * n), ir.VectorType(_I32, n)
        self.FLOATS, self.HALVES = ir.VectorType(_F32, n), ir.VectorType(ir.HalfType(), n)

    def array(self, i):
        return self.context.make_array(self.sig.args[i])(self.context, self.b, self.args[i])

    def ptr(self, i, ty):
        return self.b.bitcast(self.array(i).data, ty.as_pointer())

    def rows(self, i, n0, count, ty):
        """Pointers to rows n0 .. n0+count-1 of C-contiguous 2-d argument i, as pointers to ty."""
        a = self.array(i)
        stride = self.b.extract_value(a.strides, 0)
        base = self.b.bitcast(a.data, _I8.as_pointer())
        b = self.b
        return [b.bitcast(b.gep(base, [b.mul(b.add(n0, _c64(t)), stride)]), ty.as_pointer())
                for t in range(count)]

    def vector(self, p, off, vty, align):
        """The vty at element `off` of pointer p."""
        return self.b.load(self.b.bitcast(self.b.gep(p, [off]), vty.as_pointer()), align=align)

    def splat(self, p, off, vty):
        """Element `off` of p (a scalar) in every lane of vty: vpbroadcastd, or a broadcast operand."""
        v = self.b.load(self.b.gep(p, [off]), align=4)
        one = self.b.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(_I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                     ir.Constant(ir.VectorType(_I32, vty.count), None))

    def halves(self, p, off):
        """n f16 bits at element `off` of p, widened to f32 (vcvtph2ps, exact)."""
        return self.b.fpext(self.vector(p, off, self.HALVES, 2), self.FLOATS)

    def intrinsic(self, name, ty, n_args):
        return cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ty, [ty] * n_args), name)

    def vpdpbusd(self, acc, a, b):
        """acc + per int32 lane the sum of 4 products u8(a) x s8(b): exact, no saturation."""
        return self.b.call(self.intrinsic("llvm.x86.avx512.vpdpbusd.512", _INTS, 3),
                           [acc, self.b.bitcast(a, _INTS), b])

    def fifth_bits(self, lo, hi, h, l):
        """Q5: lo, hi = a row vector's low and high nibbles of lanes l and 4+l, with bit 4 of each byte
        set from the 5th-bit plane h (the same rows; bit i of a byte is lane i's bit, see qpack). Bit l
        moves up to bit 4 and bit 4+l down to it by word shifts: each stays in its byte."""
        b, words = self.b, ir.VectorType(_I32, self.n)
        hw = b.bitcast(h, words)
        up = b.bitcast(b.shl(hw, ir.Constant(words, [4 - l] * self.n)), self.BYTES)
        down = b.bitcast(b.lshr(hw, ir.Constant(words, [l] * self.n)), self.BYTES) if l else h
        bit4 = ir.Constant(self.BYTES, [16] * (4 * self.n))
        return b.or_(lo, b.and_(up, bit4)), b.or_(hi, b.and_(down, bit4))

    def fma(self, a, b, c):
        return self.b.call(self.intrinsic(f"llvm.fma.v{self.n}f32", self.FLOATS, 3), [a, b, c])

    def lut(self, table, idx):
        """vpshufb: per byte, table[idx & 15] (idx < 128; table: 16 bytes, the same in every 128-bit
        lane)."""
        name = "llvm.x86.avx512.pshuf.b.512" if self.n == 16 else "llvm.x86.avx2.pshuf.b"
        vals = [v & 0xFF for v in table] * (4 * self.n // 16)
        return self.b.call(self.intrinsic(name, self.BYTES, 2), [ir.Constant(self.BYTES, vals), idx])

    def e8m0_half(self, p, off):
        """n E8M0 bytes at byte `off` of p (an i8 pointer) as f32 2^(e-128) (GGML_E8M0_TO_FP32_HALF: the
        subnormals 2^-128, 2^-127 for e = 0, 1; exact)."""
        b, ints = self.b, self.INTS
        ev = b.zext(self.vector(p, off, ir.VectorType(_I8, self.n), 1), ints)
        small = b.shl(ir.Constant(ints, [0x00200000] * self.n), b.and_(ev, ir.Constant(ints, [1] * self.n)))
        big = b.shl(b.sub(ev, ir.Constant(ints, [1] * self.n)), ir.Constant(ints, [23] * self.n))
        bits = b.select(b.icmp_unsigned("<", ev, ir.Constant(ints, [2] * self.n)), small, big)
        return b.bitcast(bits, self.FLOATS)

    def scales(self, kind, d, off):
        """The f32 scales of n rows at element `off` of plane d: f16 bits, or MXFP4's E8M0 bytes."""
        if kind == "mxfp4":
            return self.e8m0_half(self.b.bitcast(d, _I8.as_pointer()), off)
        return self.halves(d, off)

    def prefetch(self, p, off):
        """prefetcht1 of the line holding byte `off` of p (into L2: the next call reads it)."""
        fty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(self.b.module, fty, "llvm.prefetch.p0i8")
        read, locality_l2, data = (ir.Constant(_I32, v) for v in (0, 2, 1))
        self.b.call(fn, [self.b.gep(p, [off]), read, locality_l2, data])


def _c64(i):
    return ir.Constant(_I64, i)


def _bytes(v):
    return ir.Constant(ir.VectorType(_I8, 64), [v] * 64)


def _ha(b, a):
    """ggml's HA of 8 lane vectors (hsum_float_8's order), row by row in the vector lanes."""
    return b.fadd(b.fadd(b.fadd(a[0], a[4]), b.fadd(a[2], a[6])),
                  b.fadd(b.fadd(a[1], a[5]), b.fadd(a[3], a[7])))


CHAIN_AHEAD = 32        # blocks ahead that a lone token's chain pass prefetches (32 KB of codes, 4 KB of scales)


def _group_codegen(kind, T, V, block, n, prefetch=True, ahead=0):
    """Rows of group q (bytes), scales d and mins m (f16 bits) against tokens n0 .. n0+T-1 of Y4 (codes,
    4 per int32), yz (lane starting values), dy and sy (block scales, Q8_1 sums) into res[t*R + r]. Row
    vectors v0 .. v0+V-1 (n rows each) run in one pass over the blocks, block(...) adding each block
    into their accumulators, allocas that LLVM keeps in registers. With pf set, the passes also prefetch
    the next group (pq, pd, pm) in the order of its bytes, an equal share per (pass, block), so that
    group arrives while this one computes: the hardware prefetchers do not follow a pass's strided
    reads across groups, and they do follow an ascending stream of prefetches (prefetching block by
    block, each pass its lines of every block, read a cold 178 MB Q8_0 weight at 10 GB/s with two
    threads on an AVX2-only host, in order 13-15). prefetch=False emits none (pf is then ignored). ahead
    (blocks, for one pass that reads each block whole, in order: the chain's lone token): each block
    prefetches the lines of the block `ahead` blocks on, codes and scales, across the end of the group
    into the next one (a group's rows are contiguous; past the weight's end a prefetch does not fault),
    a stream the hardware prefetchers then need not find alone."""
    n_acc = 1 if kind in CHAINS else 8
    sbytes = SCALE_BYTES[kind] * R                                 # a block's scale bytes of a group
    n_pass = R // n // V
    lines = BLOCK_BYTES[kind] // 64                                # cache lines per block of a group

    def codegen(context, builder, sig, args):
        e, b = Emit(context, builder, sig, args, n), builder
        n0 = args[5]
        q, d, m = e.ptr(0, _I8), e.ptr(1, ir.HalfType()), e.ptr(2, ir.HalfType())
        y, yz, dy, sy = (e.rows(i, n0, T, ty) for i, ty in ((3, _I32), (4, _I32), (6, _F32), (7, _F32)))
        res = e.ptr(8, _F32)
        pq, pd, pm = e.ptr(9, _I8), e.ptr(10, _I8), e.ptr(11, _I8)
        pf = b.icmp_unsigned("!=", args[12], ir.Constant(args[12].type, 0))
        d8 = e.ptr(1, _I8)                                          # the scales' bytes (ahead)
        nb = b.extract_value(e.array(6).shape, 1)
        for k, v0 in enumerate(range(0, R // n, V)):
            vs = range(v0, v0 + V)
            acc = {(t, v, L): cgutils.alloca_once_value(b, ir.Constant(e.FLOATS, None))
                   for t in range(T) for v in vs for L in range(n_acc)}
            sm = {(t, v): cgutils.alloca_once_value(b, ir.Constant(e.FLOATS, [-0.0] * n))
                  for t in range(T) for v in vs}
            with cgutils.for_range(b, nb) as loop:
                blk = loop.index
                if ahead:
                    on = b.add(blk, _c64(ahead))
                    for j in range(lines):
                        e.prefetch(q, b.add(b.mul(on, _c64(BLOCK_BYTES[kind])), _c64(64 * j)))
                    for j in range(-(-sbytes // 64)):
                        e.prefetch(d8, b.add(b.mul(on, _c64(sbytes)), _c64(64 * j)))
                with b.if_then(pf if prefetch else ir.Constant(ir.IntType(1), 0), likely=False):
                    unit = b.add(b.mul(_c64(k), nb), blk)         # lines unit*lines/n_pass ..
                    for j in range(-(-lines // n_pass)):
                        line = b.add(b.udiv(b.mul(unit, _c64(lines)), _c64(n_pass)), _c64(j))
                        e.prefetch(pq, b.mul(line, _c64(64)))
                    if k == 0:                                     # the block's scale bytes of d and m
                        for p in ((pd, pm) if kind in HAS_M else (pd,)):
                            for j in range(-(-sbytes // 64)):
                                e.prefetch(p, b.add(b.mul(blk, _c64(sbytes)), _c64(64 * j)))
                block(e, kind, blk, vs, q, d, m, y, yz, dy, sy, acc, sm)
            for t in range(T):
                for v in vs:
                    lanes = [b.load(acc[t, v, L]) for L in range(n_acc)]
                    h = lanes[0] if kind in CHAINS else _ha(b, lanes)
                    if kind in HAS_M:
                        h = b.fadd(h, b.load(sm[t, v]))
                    b.store(h, b.bitcast(b.gep(res, [_c64(t * R + n * v)]), e.FLOATS.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def _block(e, kind, blk, vs, q, d, m, y, yz, dy, sy, acc, sm):
    """One block of every (token, row vector) into its accumulators (see _group_codegen)."""
    b, T = e.b, len(y)
    qb = b.gep(q, [b.mul(blk, _c64(BLOCK_BYTES[kind]))])
    zero = ir.Constant(_INTS, None)

    def lane(L):                                                   # the block's word L of a token's codes
        return b.add(b.mul(blk, _c64(8)), _c64(L))

    def rows(v):                                                   # the block's scales of row vector v
        return b.add(b.mul(blk, _c64(R)), _c64(16 * v))

    def weights(L, v):
        return e.vector(qb, _c64(L * 4 * R + 64 * v), e.BYTES, 1)

    def start(t, L):
        return zero if kind in HAS_M else e.splat(yz[t], lane(L), _INTS)

    dyt = [e.splat(dy[t], blk, e.FLOATS) for t in range(T)]
    D = {(t, v): b.fmul(e.scales(kind, d, rows(v)), dyt[t]) for t in range(T) for v in vs}     # f32(dx*dy)

    def fold(t, v, L, s):                                          # acc = fma(D, f32(lane), acc)
        b.store(e.fma(D[t, v], b.sitofp(s, e.FLOATS), b.load(acc[t, v, L])), acc[t, v, L])

    if kind == "q8_0":
        for L in range(8):
            x = {v: weights(L, v) for v in vs}
            for t in range(T):
                yv = e.splat(y[t], lane(L), _INTS)
                for v in vs:
                    fold(t, v, L, e.vpdpbusd(start(t, L), x[v], yv))
        return
    isum: dict[tuple[int, int], ir.Value] = {}
    h = {v: e.vector(qb, _c64(16 * R + 64 * v), e.BYTES, 1) for v in vs} if kind in Q5 else {}
    for l in range(4):
        for v in vs:
            x = weights(l, v)
            lo_x, hi_x = b.and_(x, _bytes(15)), b.lshr(x, _bytes(4))
            if kind in Q5:
                lo_x, hi_x = e.fifth_bits(lo_x, hi_x, h[v], l)
            if kind == "mxfp4":                                    # the values + MXFP4_BIAS, unsigned
                lut = [v + MXFP4_BIAS for v in KVALUES_MXFP4]
                lo_x, hi_x = e.lut(lut, lo_x), e.lut(lut, hi_x)
            for t in range(T):
                lo = e.vpdpbusd(start(t, l), lo_x, e.splat(y[t], lane(l), _INTS))
                hi = e.vpdpbusd(start(t, 4 + l), hi_x, e.splat(y[t], lane(4 + l), _INTS))
                if kind in CHAINS:
                    isum[t, v] = b.add(lo, hi) if l == 0 else b.add(isum[t, v], b.add(lo, hi))
                else:
                    fold(t, v, l, lo)
                    fold(t, v, 4 + l, hi)
    if kind in CHAINS:                                             # acc = fma(f32(isum), D, acc)
        for (t, v), s in isum.items():
            b.store(e.fma(b.sitofp(s, e.FLOATS), D[t, v], b.load(acc[t, v, 0])), acc[t, v, 0])
    if kind in HAS_M:                                              # sm += f32(m) * s, sequential
        for v in vs:
            mv = e.halves(m, rows(v))
            for t in range(T):
                b.store(b.fadd(b.load(sm[t, v]), b.fmul(mv, e.splat(sy[t], blk, e.FLOATS))), sm[t, v])


def group_intrinsic(kind, T, V, block=None, n=16, isa="vnni", prefetch=True, ahead=0):
    """The numba intrinsic of one group's rows against T tokens, V row vectors of n rows per pass, each
    block emitted by block(e, kind, blk, vs, ...) (default: this module's vpdpbusd _block); prefetch,
    ahead: see _group_codegen."""
    block = block or _block

    def group(typingctx, q, d, m, y4, yz, n0, dy, sy, res, pq, pd, pm, pf):
        u8, u16, f32 = (types.Array(t, 1, "C") for t in (types.uint8, types.uint16, types.float32))
        i32x2, f32x2 = types.Array(types.int32, 2, "C"), types.Array(types.float32, 2, "C")
        ok = (q == pq == u8 and d == m == pd == pm == u16 and res == f32 and y4 == yz == i32x2
              and dy == sy == f32x2 and isinstance(n0, types.Integer) and isinstance(pf, types.Boolean))
        sig = types.void(q, d, m, y4, yz, types.intp, dy, sy, res, pq, pd, pm, types.boolean)
        return (sig, _group_codegen(kind, T, V, block, n, prefetch, ahead)) if ok else None
    group.__name__ = name = f"{isa}_{kind}_x{T}"
    group.__doc__ = (f"{name}(q, d, m, y4, yz, n0, dy, sy, res, pq, pd, pm, pf): one group's {R} rows "
                     f"against tokens n0 .. n0+{T - 1}, prefetching the next group's (pq, pd, pm) if pf "
                     "(see _group_codegen).")
    return intrinsic(group)


# two tokens per call; a lone token with two (Q4) or four (Q8_0) row vectors per pass. The chain (repacked
# Q4_0, one accumulator per row vector) runs a lone token's four in one pass that reads each block whole, in
# order, without the next group's prefetch spread over the group (1.1B Q4_0 decode step, 2 threads, Zen 4:
# ~29.4 -> ~26.2 ms, medians of 6 alternating runs) but with its stream prefetched CHAIN_AHEAD blocks on,
# as avx2.py's: in one process, alternating with and without over 20 pairs of 8 steps, the 1.1B's decode
# step -1.9 and -2.2 ms (median of the pairs' differences, steps of 25-30 ms; 8 blocks ahead -0.1 to -0.4,
# 96 none). Q8_0's single pass without its prefetch was no faster (cold 178 MB).
q4_0_x2, q4_0_x1 = group_intrinsic("q4_0", 2, 1), group_intrinsic("q4_0", 1, 2)
q4_1_x2, q4_1_x1 = group_intrinsic("q4_1", 2, 1), group_intrinsic("q4_1", 1, 2)
chain_x2, chain_x1 = group_intrinsic("chain", 2, 1), group_intrinsic("chain", 1, 4, prefetch=False, ahead=CHAIN_AHEAD)
q8_0_x2, q8_0_x1 = group_intrinsic("q8_0", 2, 1), group_intrinsic("q8_0", 1, 4)
q5_0_x2, q5_0_x1 = group_intrinsic("q5_0", 2, 1), group_intrinsic("q5_0", 1, 2)
q5_1_x2, q5_1_x1 = group_intrinsic("q5_1", 2, 1), group_intrinsic("q5_1", 1, 2)
mxfp4_x2 = group_intrinsic("mxfp4", 2, 1)
mxfp4_x1 = group_intrinsic("mxfp4", 1, 4, prefetch=False, ahead=CHAIN_AHEAD)



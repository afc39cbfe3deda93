"""vnni.py's int8 group kernels for CPUs with AVX2 but no AVX-512 VNNI: the four-product lane sum that
vpdpbusd makes in one instruction is vpmaddubsw (u8 x s8 -> pairs summed into int16) and vpmaddwd by
ones (int16 pairs -> int32), as ggml's own AVX2 kernels do it (mul_sum_us8_pairs_float), on 256-bit
vectors: 8 rows per vector, 8 vectors per group of R = 64 rows.

Why: without VNNI, qpack's float kernels spend a float multiply-add per weight, plus the nibble decode;
here a block of 8 rows and one token costs per ggml lane one vpmaddubsw, one vpmaddwd, one int->float
conversion and one fma. Everything but the block emitter (_block below) is vnni.py's: the loop over the
blocks with the f32 lane accumulators in registers, the passes over the row vectors, the prefetch of
the next group, the signature the numba kernels call.

Layout: vnni.py's (qpack.PackedWeight(kernels=Kernels.AVX2)), except that Q8_0 codes are stored as
they are (int8), not as x + 128: vpmaddubsw saturates its int16 pair sums, and (x + 128) * y would
reach 255 * 127 * 2.

Saturation (every int16 below is exact, so each lane is the exact integer sum vpdpbusd gives):
* Q4: a nibble u <= 15 against a code |y| <= 128 gives pairs |u0 y0 + u1 y1| <= 3840. The chain
  (repacked Q4_0) adds a row's 8 pairs of a block (4 low lanes, 4 high) in int16, <= 30720 < 32767,
  so one vpmaddwd per block gives its integer dot; the lanes kinds take one vpmaddwd per lane.
* Q5 (lanes only; 5th bits merged into the nibble bytes by vnni's Emit.fifth_bits): u <= 31, pairs
  <= 7936.
* MXFP4 (the chain only): the nibbles' kvalues_mxfp4 values (vpshufb, signed, |v| <= 12) by ggml's sign
  trick (below): pairs <= 2 * 12 * 127 = 3048, a block's 8 pairs summed in int16 <= 24384, then one
  vpmaddwd (its lanes start at 0: no yz).
* Q8_0 x Q8_0 (both signed): ggml's sign trick, |x| as the unsigned operand and y with x's sign
  (vpsignb) as the signed one: |x| <= 128 (a -128 weight code, valid in a file, is 128 as u8) and
  |y| <= 127 give pairs <= 32512. A code y = -128 would wrap in vpsignb where x < 0; qpack._prep never
  makes one (|f32(x * 127/amax)| <= 127.00002 rounds to at most 127; tests/backends/cpu/test_avx2.py checks
  it), and a block where ggml's quantizer makes them (amax below 127/FLT_MAX, so id = inf) has
  d = f16(amax/127) = 0, whose lanes enter the result only as fma(+-0, lane, acc) = acc.
Numerics are then vnni.py's exactly: Q4_0 lanes start at -8 sum(y) (yz), Q5_0's at -16 sum(y), the
chain subtracts 8 sum(y) of the block (the sum of its 8 yz words), acc = fma(f32(dx*dy), f32(lane), acc)
per lane (the chain: fma(f32(isum), f32(dx*dy), acc)), ggml's HA over the 8 lanes, Q4_1's and Q5_1's
sequential m*s sum.

Switches, read once at import: GGML_DIST_NO_AVX2=1 turns these kernels off (qpack then runs its float
kernels where VNNI is absent too); GGML_DIST_FORCE_AVX2=1 chooses them over vnni.py's on a host with
both (to test or measure them there). The host checks read LLVM's host features, not numba's target: to
compile as an AVX2-only CPU would (16 vector registers, no GFNI or VNNI folds of these instructions) run
with NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=+avx2,+fma,+f16c GGML_DIST_NO_VNNI=1 (without the last,
the vnni kernels would be chosen, and that target cannot compile them).
"""
from __future__ import annotations

import os

from llvmlite import binding as llvm
from llvmlite import ir
from numba.core import cgutils

from .vnni import BLOCK_BYTES, CHAIN_AHEAD, HAS_M, KVALUES_MXFP4, Q5, R, group_intrinsic

N = 8                                   # int32 lanes (rows) per 256-bit vector
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_BYTES, _SHORTS, _INTS = ir.VectorType(_I8, 32), ir.VectorType(_I16, 16), ir.VectorType(_I32, N)


def _host_has_avx2() -> bool:
    try:
        features = llvm.get_host_cpu_features()
        return all(features.get(f, False) for f in ("avx2", "fma", "f16c"))
    except RuntimeError:                # an LLVM that cannot report features: take the portable path
        return False


AVAILABLE = _host_has_avx2() and os.environ.get("GGML_DIST_NO_AVX2", "") in ("", "0")
FORCED = AVAILABLE and os.environ.get("GGML_DIST_FORCE_AVX2", "") not in ("", "0")


def _c64(i):
    return ir.Constant(_I64, i)


def _call(e, name, ret, args):
    fn = cgutils.get_or_insert_function(e.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return e.b.call(fn, args)


def _maddubs(e, u, s):
    """vpmaddubsw: per int16, u8(u) x s8(s) over two adjacent bytes, summed (saturating; see above)."""
    return _call(e, "llvm.x86.avx2.pmadd.ub.sw", _SHORTS, [u, s])


def _madd_ones(e, p):
    """vpmaddwd by ones: per int32 lane the exact sum of its two int16."""
    return _call(e, "llvm.x86.avx2.pmadd.wd", _INTS, [p, ir.Constant(_SHORTS, [1] * 16)])


def _abs(e, x):
    return _call(e, "llvm.abs.v32i8", _BYTES, [x, ir.Constant(ir.IntType(1), 0)])


def _sign(e, y, x):
    """vpsignb: y where x > 0, -y where x < 0, 0 where x = 0."""
    return _call(e, "llvm.x86.avx2.psign.b", _BYTES, [y, x])


def _block(e, kind, blk, vs, q, d, m, y, yz, dy, sy, acc, sm):
    """One block of every (token, row vector) into its accumulators (vnni._group_codegen's contract)."""
    b, T = e.b, len(y)
    qb = b.gep(q, [b.mul(blk, _c64(BLOCK_BYTES[kind]))])

    def lane(L):                                                   # the block's word L of a token's codes
        return b.add(b.mul(blk, _c64(8)), _c64(L))

    def rows(v):                                                   # the block's f16 of row vector v
        return b.add(b.mul(blk, _c64(R)), _c64(N * v))

    def weights(L, v):
        return e.vector(qb, _c64(L * 4 * R + 4 * N * v), _BYTES, 1)

    def codes(t, L):                                               # token t's 4 codes of lane L, every row
        return b.bitcast(e.splat(y[t], lane(L), _INTS), _BYTES)

    dyt = [e.splat(dy[t], blk, e.FLOATS) for t in range(T)]
    D = {(t, v): b.fmul(e.scales(kind, d, rows(v)), dyt[t]) for t in range(T) for v in vs}     # f32(dx*dy)

    def fold(t, v, L, s):                                          # acc = fma(D, f32(lane), acc)
        b.store(e.fma(D[t, v], b.sitofp(s, e.FLOATS), b.load(acc[t, v, L])), acc[t, v, L])

    if kind == "q8_0":
        for L in range(8):
            for v in vs:
                x = weights(L, v)
                ax = _abs(e, x)
                for t in range(T):
                    fold(t, v, L, _madd_ones(e, _maddubs(e, ax, _sign(e, codes(t, L), x))))
        return

    if kind == "mxfp4":                                            # the chain of the values, by the sign trick
        s16m: dict[tuple[int, int], ir.Value] = {}
        for l in range(4):
            for v in vs:
                x = weights(l, v)
                lo_v = e.lut(KVALUES_MXFP4, b.and_(x, ir.Constant(_BYTES, [15] * 32)))
                hi_v = e.lut(KVALUES_MXFP4, b.lshr(x, ir.Constant(_BYTES, [4] * 32)))
                lo_a, hi_a = _abs(e, lo_v), _abs(e, hi_v)
                for t in range(T):
                    lo = _maddubs(e, lo_a, _sign(e, codes(t, l), lo_v))
                    hi = _maddubs(e, hi_a, _sign(e, codes(t, 4 + l), hi_v))
                    s16m[t, v] = b.add(lo, hi) if l == 0 else b.add(s16m[t, v], b.add(lo, hi))
        for (t, v), s in s16m.items():                             # acc = fma(f32(isum), D, acc)
            b.store(e.fma(b.sitofp(_madd_ones(e, s), e.FLOATS), D[t, v], b.load(acc[t, v, 0])), acc[t, v, 0])
        return

    def start(t, L, s):                                            # Q4_0, Q5_0: + -8 or -16 sum(y) of the lane
        return b.add(s, e.splat(yz[t], lane(L), _INTS)) if kind in ("q4_0", "q5_0") else s

    s16: dict[tuple[int, int], ir.Value] = {}
    h = {v: e.vector(qb, _c64(16 * R + 4 * N * v), _BYTES, 1) for v in vs} if kind in Q5 else {}
    for l in range(4):
        for v in vs:
            x = weights(l, v)
            lo_x, hi_x = b.and_(x, ir.Constant(_BYTES, [15] * 32)), b.lshr(x, ir.Constant(_BYTES, [4] * 32))
            if kind in Q5:
                lo_x, hi_x = e.fifth_bits(lo_x, hi_x, h[v], l)
            for t in range(T):
                lo = _maddubs(e, lo_x, codes(t, l))
                hi = _maddubs(e, hi_x, codes(t, 4 + l))
                if kind == "chain":                                # int16 sums of the block's 8 pairs
                    s16[t, v] = b.add(lo, hi) if l == 0 else b.add(s16[t, v], b.add(lo, hi))
                else:
                    fold(t, v, l, start(t, l, _madd_ones(e, lo)))
                    fold(t, v, 4 + l, start(t, 4 + l, _madd_ones(e, hi)))
    if kind == "chain":                                            # acc = fma(f32(isum), D, acc)
        cz: dict[int, ir.Value] = {}
        for t in range(T):                                         # -8 sum(y): the block's 8 yz words
            words = e.vector(yz[t], lane(0), _INTS, 4)
            cz[t] = _call(e, "llvm.vector.reduce.add.v8i32", _I32, [words])
        for (t, v), s in s16.items():
            one = b.insert_element(ir.Constant(_INTS, ir.Undefined), cz[t], ir.Constant(_I32, 0))
            czv = b.shuffle_vector(one, ir.Constant(_INTS, ir.Undefined), ir.Constant(_INTS, None))
            isum = b.add(_madd_ones(e, s), czv)
            b.store(e.fma(b.sitofp(isum, e.FLOATS), D[t, v], b.load(acc[t, v, 0])), acc[t, v, 0])
    if kind in HAS_M:                                              # sm += f32(m) * s, sequential
        for v in vs:
            mv = e.halves(m, rows(v))
            for t in range(T):
                b.store(b.fadd(b.load(sm[t, v]), b.fmul(mv, e.splat(sy[t], blk, e.FLOATS))), sm[t, v])


def _group(kind, T, V, prefetch=True, ahead=0):
    return group_intrinsic(kind, T, V, _block, N, "avx2", prefetch, ahead)


# qpack's signature and names, as vnni.py's: two tokens per call (*_x2) or one (*_x1). The chain (repacked
# Q4_0) keeps one accumulator per row vector, so one token runs all 8 in one pass: each block read once, in
# order (hot, the same time as two passes of 4; decode-shaped cold products 5-10% faster on the AVX2 host),
# and without prefetching the next group (1.1B-shaped decode products, 48, 297 MB, 2 threads: ~29.5 -> ~23
# ms there), but its own stream CHAIN_AHEAD blocks on (vnni.py): the 1.1B's decode step, alternating in one
# process, -4.9 ms (26.3 -> 21.3) forced on the Zen 4 host, -3.8 ms (34.9 -> 30.3) compiled for an AVX2-only
# target (NUMBA_CPU_NAME=znver3 ...). The other kinds' passes read strided
# parts of each block, which the hardware does not follow: without their prefetch, Q4_1 and Q8_0 products
# took 1.6-2x as long.
q4_0_x2, q4_0_x1 = _group("q4_0", 2, 1), _group("q4_0", 1, 2)
q4_1_x2, q4_1_x1 = _group("q4_1", 2, 1), _group("q4_1", 1, 2)
chain_x2, chain_x1 = _group("chain", 2, 2), _group("chain", 1, 8, prefetch=False, ahead=CHAIN_AHEAD)
q8_0_x2, q8_0_x1 = _group("q8_0", 2, 1), _group("q8_0", 1, 2)
q5_0_x2, q5_0_x1 = _group("q5_0", 2, 1), _group("q5_0", 1, 2)
q5_1_x2, q5_1_x1 = _group("q5_1", 2, 1), _group("q5_1", 1, 2)
mxfp4_x2, mxfp4_x1 = _group("mxfp4", 2, 2), _group("mxfp4", 1, 8, prefetch=False, ahead=CHAIN_AHEAD)

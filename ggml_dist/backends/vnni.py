"""One block of a packed quantized weight against one token's Q8 codes, for R = 64 rows at once, with the
AVX-512 VNNI int8 dot product (vpdpbusd), written as LLVM IR intrinsics that qpack's numba kernels inline.

Why: numba vectorizes qpack's float loops well, but a float multiply-add per weight is 3-4x the work of
ggml's int8 kernels, which add four u8 x s8 products into an int32 lane in one instruction. numba has no
vector types, so these intrinsics build the vectors themselves: each call loads a block's 16 (Q4) or 32
(Q8) bytes of all 64 rows (4 x 64-byte vectors per 4 codes), makes the lane sums with vpdpbusd in
registers and folds them into the caller's f32 accumulators with one fma per lane.

Layout (qpack.PackedWeight(vnni_layout=True)): a group's block b is 16*R (Q4) or 32*R (Q8) bytes, in
row-major chunks of 4 codes per lane: byte (b, l, r, k) at b*16R + l*4R + 4r + k is row r's qs[4l+k]
(Q4: element 4l+k in the low nibble, lane l; element 16+4l+k in the high one, lane 4+l); Q8's (b, L, r, k)
at b*32R + L*4R + 4r + k is row r's element 4L+k (lane L), stored as x + 128 (u8). One 32-bit lane of a
64-byte vector is then one row's four codes of a ggml lane, which vpdpbusd multiplies by the token's
four codes (broadcast).

Numerics: exactly those of qpack's float kernels and quants.mul_mat(order="ggml") (ggml-numerics.md §1.5):
lane sums are exact integers either way; Q4_0 lanes are centred as sum((u - 8) y) = sum(u y) - 8 sum(y),
Q8_0's signed codes biased (when packed) as sum((x + 128) y) - 128 sum(y) (vpdpbusd takes u8 x s8 and
does not saturate); then acc = fma(f32(dx*dy), f32(lane), acc) per lane, or for the Q4_0 chain (repacked
q4_0_8x8) acc = fma(f32(isum), f32(dx*dy), acc) per row with isum the whole block's integer dot.

Only hosts whose LLVM target has avx512vnni compile these (``AVAILABLE``); qpack keeps its float kernels
and their layout everywhere else, and with GGML_DIST_NO_VNNI=1.
"""
from __future__ import annotations

import os

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

R = 64                                  # rows per group (qpack.R): 4 vectors of 16 int32 lanes
_NV = R // 16


def _host_has_vnni() -> bool:
    try:
        return bool(llvm.get_host_cpu_features().get("avx512vnni", False))
    except Exception:                   # an LLVM that cannot report features: take the portable path
        return False


AVAILABLE = _host_has_vnni() and os.environ.get("GGML_DIST_NO_VNNI", "") in ("", "0")

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_BYTES, _INTS, _FLOATS = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16), ir.VectorType(ir.FloatType(), 16)
_HALVES = ir.VectorType(ir.HalfType(), 16)


def _splat(builder, v, vty):
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_I32, vty.count), None))


def _bytes(v):
    return ir.Constant(_BYTES, [v] * 64)


def _vpdpbusd(builder, a, b):
    """Per int32 lane: sum of 4 products u8(a) x s8(b), exact (vpdpbusd from zero, no saturation)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_INTS, [_INTS] * 3),
                                        "llvm.x86.avx512.vpdpbusd.512")
    return builder.call(fn, [ir.Constant(_INTS, None), builder.bitcast(a, _INTS), b])


def _at(context, builder, aty, a, off, vty):
    """Pointer to array a's element `off`, as a pointer to vty."""
    p = builder.gep(context.make_array(aty)(context, builder, a).data, [off])
    return builder.bitcast(p, vty.as_pointer())


def _block_codegen(kind):
    def codegen(context, builder, sig, args):
        q, qo, d, do, dy, y, yo, acc = args
        at = sig.args
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_FLOATS, [_FLOATS] * 3),
                                             "llvm.fma.v16f32")
        qp = _at(context, builder, at[0], q, qo, _BYTES)
        dp = _at(context, builder, at[2], d, do, _HALVES)
        yp = _at(context, builder, at[5], y, yo, _I32)
        ap = _at(context, builder, at[7], acc, ir.Constant(ir.IntType(64), 0), _FLOATS)
        c = lambda i: ir.Constant(_I32, i)
        dyv = _splat(builder, dy, _FLOATS)
        D = [builder.fmul(builder.fpext(builder.load(builder.gep(dp, [c(v)]), align=2), _FLOATS), dyv)
             for v in range(_NV)]                                   # f32(dx*dy), exact
        codes = lambda lane: _splat(builder, builder.load(builder.gep(yp, [c(lane)]), align=4), _INTS)
        row_bytes = lambda i: builder.load(builder.gep(qp, [c(i)]), align=1)

        def fold(i, a, b):                                          # acc[i] = fma(a, b, acc[i])
            p = builder.gep(ap, [c(i)])
            builder.store(builder.call(fma, [a, b, builder.load(p, align=4)]), p, align=4)

        if kind == "q8_0":
            for L in range(8):
                yv = codes(L)
                bias = _vpdpbusd(builder, _bytes(128), yv)     # 128 * the lane's sum of codes
                for v in range(_NV):
                    x = row_bytes(L * _NV + v)                   # x + 128 as u8 (packed so)
                    s = builder.sub(_vpdpbusd(builder, x, yv), bias)
                    fold(L * _NV + v, D[v], builder.sitofp(s, _FLOATS))
            return context.get_dummy_value()
        centred = kind in ("q4_0", "chain")
        isum = [ir.Constant(_INTS, None)] * _NV
        for l in range(4):
            yv, zv = codes(l), codes(4 + l)
            if centred:
                cy, cz = _vpdpbusd(builder, _bytes(8), yv), _vpdpbusd(builder, _bytes(8), zv)
            for v in range(_NV):
                b = row_bytes(l * _NV + v)
                lo = _vpdpbusd(builder, builder.and_(b, _bytes(15)), yv)
                hi = _vpdpbusd(builder, builder.lshr(b, _bytes(4)), zv)
                if centred:
                    lo, hi = builder.sub(lo, cy), builder.sub(hi, cz)
                if kind == "chain":
                    isum[v] = builder.add(isum[v], builder.add(lo, hi))
                else:
                    fold(l * _NV + v, D[v], builder.sitofp(lo, _FLOATS))
                    fold((4 + l) * _NV + v, D[v], builder.sitofp(hi, _FLOATS))
        if kind == "chain":
            for v in range(_NV):
                fold(v, builder.sitofp(isum[v], _FLOATS), D[v])
        return context.get_dummy_value()
    return codegen


def _block_typer(q, qo, d, do, dy, y, yo, acc):
    ok = (q == types.Array(types.uint8, 1, "C") and d == types.Array(types.uint16, 1, "C")
          and y == types.Array(types.int32, 1, "C") and acc == types.Array(types.float32, 1, "C")
          and all(isinstance(v, types.Integer) for v in (qo, do, yo)) and isinstance(dy, types.Float))
    return types.void(q, types.intp, d, types.intp, types.float32, y, types.intp, acc) if ok else None


def _block_intrinsic(kind, name):
    def block(typingctx, q, qo, d, do, dy, y, yo, acc):
        sig = _block_typer(q, qo, d, do, dy, y, yo, acc)
        return (sig, _block_codegen(kind)) if sig is not None else None
    block.__name__ = name
    block.__doc__ = (f"{name}(q, qo, d, do, dy, y, yo, acc): block at byte qo of group bytes q (uint8), "
                     "scales d[do:do+R] (f16 bits), token scale dy, token codes y[yo:yo+8] (int32 = 4 int8 "
                     "codes each), into acc (f32: lane L of row r at L*R + r; the chain's row r at r).")
    return intrinsic(block)


block_q4_1 = _block_intrinsic("q4_1", "block_q4_1")
block_q4_0 = _block_intrinsic("q4_0", "block_q4_0")
block_q4_0_chain = _block_intrinsic("chain", "block_q4_0_chain")
block_q8_0 = _block_intrinsic("q8_0", "block_q8_0")

"""numba kernels of the hybrid models' recurrent ops: the compiled twins of recurrent.py's numpy kernels,
bit for bit (recurrent.py stays the reference, and the path without numba).

* ``gated_delta_net``: ggml_compute_forward_gated_delta_net_one_chunk, its (sequence, head) pairs split
  across the kernels' threads as ggml splits them. Each pair's state is read once into dst's state rows and
  updated there token after token; a token works row by row of M = S^T, since every step of the
  recurrence on row j (the gate, delta[j] from dot(M[j], k), the rank-1 update of M[j], out[j] from
  dot(M[j], q)) reads only row j and the token's vectors: a token goes through the state _R rows at a
  time, each block in L1, where the numpy reference makes four passes over whole arrays: an LLVM
  intrinsic (_rows_then_dot) makes the gate and dot(M[j], k) one pass, and the update and dot(M[j], q)
  another, the lane chains of _R rows in vector registers. Each element sees the reference's float
  steps in the same order, so the bits are the same.

Float steps as recurrent.py emulates them (ggml-numerics.md): ggml_vec_mad_f32's fma is
f32(f64(a) * f64(b) + f64(c)) (numerics.fma32: the product of two f32 is exact in f64, so contracting
it changes nothing); ggml_vec_dot_f32 is four accumulators of 8 lanes over 32-element steps, folded
a0+a2, a1+a3, a0+a1, the lanes summed ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7)), the n mod 32 tail added in
f32. The gates' expf is computed by the caller in numpy (recurrent.py), exactly as the reference does.
fastmath stays off: LLVM then neither contracts nor reorders the f32 steps.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)
from .fkernels import _intrinsic, _reduce_lanes
from .threads import get_threads, launch

F32 = np.float32
F64 = np.float64


_R = 4         # state rows a token's steps take together (independent chains hide each one's latency)
_GATE, _MAD = 0, 1


def _rows_then_dot(R: int, mode: int):
    """An intrinsic (x, xo, xs, a, d, y, steps, out) -> None over R rows x[xo + r*xs:] and `steps` whole
    32-element steps: first each element's step of the recurrence, stored back into the row,
        _GATE: x = f32(x * a)                     (the gate: ggml_vec_scale_f32 / ggml_vec_mul_f32)
        _MAD:  x = f32(f64(a) * f64(d[r]) + f64(x))  (ggml_vec_mad_f32, its fma as numerics.fma32)
    then ggml_vec_dot_f32(x, y)'s 32 lane chains on the new x, each lane's fma f32(f64(x) * f64(y) +
    f64(acc)), in LLVM <8 x float> registers (numba neither vectorises these chains nor keeps them in
    registers), folded a0+a2, a1+a3, a0+a1 and the 8 lanes summed ((l0+l4)+(l1+l5))+((l2+l6)+(l3+l7))
    (_reduce_lanes) into out[r]. Each element sees the steps of the separate passes in their order, so
    the bits are theirs; the R rows' chains are independent, and hide each other's latency."""
    def kernel(typingctx, x, xo, xs, a, d, y, steps, out):
        f1c = types.Array(types.float32, 1, "C")
        if not (x == a == d == y == out == f1c and all(isinstance(v, types.Integer) for v in (xo, xs, steps))):
            return None

        def codegen(context, builder, sig, args):
            v8, d8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.DoubleType(), 8)
            x_, xo_, xs_, a_, d_, y_, steps_, out_ = args

            def data(i, arg):
                return context.make_array(sig.args[i])(context, builder, arg).data

            offsets = [builder.add(xo_, builder.mul(xs_, ir.Constant(xs_.type, r))) for r in range(R)]
            xps = [builder.bitcast(builder.gep(data(0, x_), [o]), v8.as_pointer()) for o in offsets]
            ap, yp = builder.bitcast(data(3, a_), v8.as_pointer()), builder.bitcast(data(5, y_), v8.as_pointer())
            i32 = ir.IntType(32)
            dsplat = []                                 # _MAD: each row's delta in all 8 lanes, as f64
            for r in range(R if mode == _MAD else 0):
                dr = builder.fpext(builder.load(builder.gep(data(4, d_), [ir.Constant(ir.IntType(64), r)])),
                                   ir.DoubleType())
                one = builder.insert_element(ir.Constant(d8, None), dr, ir.Constant(i32, 0))
                dsplat.append(builder.shuffle_vector(one, ir.Constant(d8, None),
                                                     ir.Constant(ir.VectorType(i32, 8), [0] * 8)))
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v8, None)) for _ in range(4)] for _ in range(R)]
            with cgutils.for_range(builder, steps_) as loop:
                base = builder.mul(loop.index, ir.Constant(loop.index.type, 4))
                for g in range(4):
                    o = builder.add(base, ir.Constant(base.type, g))
                    av = builder.load(builder.gep(ap, [o]), align=4)
                    a64 = builder.fpext(av, d8) if mode == _MAD else None
                    yv = builder.fpext(builder.load(builder.gep(yp, [o]), align=4), d8)
                    for r in range(R):
                        xptr = builder.gep(xps[r], [o])
                        xv = builder.load(xptr, align=4)
                        if mode == _GATE:
                            nv = builder.fmul(xv, av)
                        else:
                            nv = builder.fptrunc(builder.fadd(builder.fmul(a64, dsplat[r]), builder.fpext(xv, d8)), v8)
                        builder.store(nv, xptr, align=4)
                        acc = accs[r][g]
                        s = builder.fadd(builder.fmul(builder.fpext(nv, d8), yv), builder.fpext(builder.load(acc), d8))
                        builder.store(builder.fptrunc(s, v8), acc)
            op = data(7, out_)
            for r, acc in enumerate(accs):
                builder.store(_reduce_lanes(builder, [builder.load(x) for x in acc]),
                              builder.gep(op, [ir.Constant(ir.IntType(64), r)]))
            return context.get_dummy_value()
        ip = types.intp
        return types.void(x, ip, ip, a, d, y, ip, out), codegen
    kernel.__name__ = f"_{'gate' if mode == _GATE else 'mad'}_dot32x{R}"
    return _intrinsic(kernel)


_gate_dotR, _gate_dot1 = _rows_then_dot(_R, _GATE), _rows_then_dot(1, _GATE)
_mad_dotR, _mad_dot1 = _rows_then_dot(_R, _MAD), _rows_then_dot(1, _MAD)


@njit(cache=True, inline="always")
def _step_dots(flat, o, n_rows, mode, a, d, y, res):
    """The rows' step (_GATE or _MAD, see _rows_then_dot) then res[r] = ggml_vec_dot_f32(row r, y), for
    the n_rows (_R or 1) contiguous rows of length S from flat[o:]: the intrinsic over the whole 32-element
    steps, then the S mod 32 tail's steps and its products added in f32, one at a time."""
    S = y.shape[0]
    n32 = S // 32
    if n32 == 0:
        for r in range(n_rows):
            res[r] = F32(0)
    elif mode == _GATE:
        if n_rows == _R:
            _gate_dotR(flat, o, S, a, d, y, n32, res)
        else:
            _gate_dot1(flat, o, S, a, d, y, n32, res)
    elif n_rows == _R:
        _mad_dotR(flat, o, S, a, d, y, n32, res)
    else:
        _mad_dot1(flat, o, S, a, d, y, n32, res)
    for r in range(n_rows):
        sumf = res[r]
        d64 = F64(d[r])
        for i in range(n32 * 32, S):
            e = o + r * S + i
            flat[e] = F32(flat[e] * a[i]) if mode == _GATE else F32(F64(a[i]) * d64 + F64(flat[e]))
            sumf = F32(sumf + F32(flat[e] * y[i]))
        res[r] = sumf


@njit(cache=True, nogil=True, error_model="numpy")
def _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, p0, p1):
    """The recurrence of (sequence, head) pairs p0 .. p1-1 (pair p = s * H + h) over every token.
    q [ns_q, n_t, Hq, S], k [ns_k, n_t, Hk, S] (value head h reads key head h mod Hq/Hk, sequence s reads
    s // (n_s / ns)), v [n_s, n_t, H, S], eg = expf(g) [n_s, n_t, H, 1 or S], beta [n_s, n_t, H, 1],
    state [n_s, H, S, S] (M = S^T, as ggml stores it); out [n_s, n_t, H, S] and st [n_s, H, S, S] are
    dst's two parts, contiguous."""
    n_t, H, S = v.shape[1], v.shape[2], v.shape[3]
    per_key = eg.shape[3] != 1
    kk = np.empty(S, F32)
    qq = np.empty(S, F32)
    gk = np.empty(S, F32)
    res = np.empty(_R, F32)
    dl = np.zeros(_R, F32)
    for p in range(p0, p1):
        s, h = p // H, p % H
        sq, hq = s // (v.shape[0] // q.shape[0]), h % q.shape[2]
        sk, hk = s // (v.shape[0] // k.shape[0]), h % k.shape[2]
        m = st[s, h].reshape(S * S)                     # M's rows one after another
        for j in range(S):
            for i in range(S):
                m[j * S + i] = state[s, h, j, i]
        for t in range(n_t):
            for i in range(S):
                kk[i] = k[sk, t, hk, i]
                qq[i] = q[sq, t, hq, i]
                gk[i] = eg[s, t, h, i] if per_key else eg[s, t, h, 0]
            b = beta[s, t, h, 0]
            j0 = 0
            while j0 < S:
                n_rows = _R if j0 + _R <= S else 1
                o = j0 * S
                _step_dots(m, o, n_rows, _GATE, gk, dl, kk, res)     # the gate, then dot(M[j], k)
                for r in range(n_rows):
                    dl[r] = F32(F32(v[s, t, h, j0 + r] - res[r]) * b)
                _step_dots(m, o, n_rows, _MAD, kk, dl, qq, res)      # M[j] += k * delta[j], dot(M[j], q)
                for r in range(n_rows):
                    out[s, t, h, j0 + r] = F32(res[r] * scale)
                j0 += n_rows


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _gdn_par(q, k, v, eg, beta, state, out, st, scale, n_chunks):
    n_pairs = v.shape[0] * v.shape[2]
    n_chunks = min(n_pairs, n_chunks)
    for c in prange(n_chunks):
        _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, c * n_pairs // n_chunks,
                   (c + 1) * n_pairs // n_chunks)


def gated_delta_net(q, k, v, eg, beta, state, out, st, scale) -> None:
    """The fused recurrence into out and st (recurrent.gated_delta_net's numerics; arguments as
    _gdn_pairs'), its pairs split across the kernels' threads (threads.py) where there are several."""
    n_pairs = v.shape[0] * v.shape[2]
    if n_pairs > 1 and get_threads() > 1:
        with launch() as n:
            _gdn_par(q, k, v, eg, beta, state, out, st, scale, n)
        return
    _gdn_pairs(q, k, v, eg, beta, state, out, st, scale, 0, n_pairs)


@njit(cache=True, nogil=True, error_model="numpy")
def ssm_conv(sx, c, dst):
    """SSM_CONV (recurrent._ssm_conv's numerics): dst[s, t, i] = sum over k of f32(sx[s, i, t + k] * c[i, k]),
    a sequential f32 sum from 0. sx [n_s, d_inner, d_conv - 1 + n_t], c [d_inner, d_conv], dst [n_s, n_t,
    d_inner]."""
    d_conv, n_t, d_inner = c.shape[1], dst.shape[1], sx.shape[1]
    acc = np.empty((_CB, n_t), F32)
    for s in range(sx.shape[0]):
        for i0 in range(0, d_inner, _CB):
            nb = min(_CB, d_inner - i0)
            for b in range(nb):
                xr, cr, ar = sx[s, i0 + b], c[i0 + b], acc[b]
                for t in range(n_t):
                    ar[t] = F32(0)
                for k in range(d_conv):             # tap by tap, every token at once (it vectorises)
                    ck = cr[k]
                    for t in range(n_t):
                        ar[t] = F32(ar[t] + F32(xr[t + k] * ck))
            for t in range(n_t):                    # a block of channels: whole cache lines of dst
                for b in range(nb):
                    dst[s, t, i0 + b] = acc[b, t]


_CB = 16        # SSM_CONV's channels per block


@njit(cache=True, nogil=True, error_model="numpy")
def l2_norm(x, eps, dst):
    """L2_NORM per row of the 4-d arrays (recurrent._l2_norm's numerics): sum += f64(f32(x*x)) in order,
    scale = 1/max(sqrtf(f32(sum)), eps) (a nan norm stays nan, as numpy's maximum keeps it), y = f32(x*scale)."""
    for i3 in range(x.shape[0]):
        for i2 in range(x.shape[1]):
            for i1 in range(x.shape[2]):
                xr, dr = x[i3, i2, i1], dst[i3, i2, i1]
                total = 0.0
                for i in range(xr.shape[0]):
                    total += F64(F32(xr[i] * xr[i]))
                norm = np.sqrt(F32(total))
                scale = F32(F32(1) / (norm if norm >= eps or norm != norm else eps))
                for i in range(xr.shape[0]):
                    dr[i] = F32(xr[i] * scale)

"""A group of R = 64 rows of a packed Q4_K / Q5_K / Q6_K weight (kpack.py's layout) against one or two
tokens' Q8_K codes, as LLVM IR intrinsics that kpack's numba kernels inline: 512-bit vectors of 16 rows
with AVX-512 VNNI (``isa="vnni"``), 256-bit vectors of 8 rows with AVX2 (``isa="avx2"``). vnni.py's Emit
builds the typed pointers, loads and splats.

One call runs the group's rows over all superblocks (a loop over them, the unrolled superblock body
inside, accumulators in allocas that LLVM keeps in registers or spills). Per superblock, for every row
vector and token, the codes of a ggml lane (4 bytes of one row) meet the token's 4 codes, broadcast:
* "lanes" (ggml_vec_dot_q4_K/q5_K/q6_K_q8_K): lane k = sum over the sub-blocks j of sc_j * (4-product
  sum): vpmaddubsw (pair sums, |p| <= 63*128*2, no saturation), then with VNNI one vpdpwssd by (sc_j, sc_j)
  int16 pairs into the lane, with AVX2 vpmaddwd by them and vpaddd.
* "chain", "gemm", "tiled" (repacked q4_K_8x8 gemv / gemm, the tiled kernel): only sums per sub-block
  (chain, tiled) or per pair of sub-blocks (gemm) are needed, so the 4-product sums of a sub-block are
  added first (VNNI: vpdpbusd accumulating; AVX2: vpmaddubsw pairs added in int16 while they cannot
  overflow) and multiplied by sc_j once (vpmulld / vpmaddwd).
Mins (Q4_K, Q5_K): lane i = m_2i * s_2i + m_2i+1 * s_2i+1 (s = the token's sub-block sums), one vpmaddwd
of (m_2i, m_2i+1) pairs by the token's (s_2i, s_2i+1) pair. Q6_K's -32 * (sc_2k bsum_2k + sc_2k+1 bsum_2k+1)
per lane k: one vpmaddwd of (sc_2k, sc_2k+1) by the token's bsum pair, shifted left by 5.

The integers are exact (every int16 bound above holds for codes |y| <= 128); the float steps are
ggml's, per superblock with D = f32(dy*d), DM = f32(dy*dmin) (ggml-numerics.md §1.5, quants.mul_mat):
* lanes: acc_k = fma(D, f32(lane_k), acc_k); Q4_K accm_i = fma(-DM, f32(mlane_i), accm_i), Q5_K one
  accm = fma(-DM, f32(mlane_0+..+mlane_3), accm) (its AVX2 vec_dot sums the mins in a scalar); the result
  HA(acc) + ((accm0+accm2)+(accm1+accm3)), or + accm. Q6_K lanes can pass 2^24 (f32(lane) would round), so its
  fma runs in f64 on the exact lane, rounded to f32: the reference's own emulation, step for step.
* chain: acc = fma(f32(isum), D, acc), accm = fma(f32(minsum), DM, accm); result acc - accm.
* gemm: the same, four steps per superblock (one per 64 values, sub-blocks 2c and 2c+1), in order.
* tiled: r = f32(d * f32(isum)); r = fma(-dmin, f32(minsum), r) (Q4_K, Q5_K); acc = fma(r, dy, acc).
Passes: VNNI runs a group's 4 row vectors in one pass, AVX2 its 8 in eight passes of one (a run-time loop
inside the loop over the superblocks, so the body is emitted once, the accumulators of all passes live in
memory, and each record is read in order, once: the hardware prefetchers follow it. Two passes of four
outside that loop, each over all the group's superblocks, read every record twice in strided halves,
and a cold weight came in at 3-4 GB/s). Each pass prefetches its share of the record PREFETCH
superblocks ahead (the next group's, past a group's last), spread over the superblock's loads.
kpack's cached kernels are stamped with every backends module (kernel_cache.py): an edit here
recompiles them.
"""
from __future__ import annotations

from contextlib import contextmanager

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .vnni import Emit, R

_I8, _I16, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
MODES = ("lanes", "chain", "gemm", "tiled")
PREFETCH = 2                            # superblock records ahead that a call prefetches (into L2)
# one superblock of a group, byte offsets of its parts (R = 64 rows; see kpack's docstring)
LAYOUT = {
    "q4_k": {"codes": 0, "sc": 8192, "mins": 8704, "d": 9216, "dmin": 9344, "size": 9472},
    "q5_k": {"codes": 0, "qh": 8192, "sc": 10240, "mins": 10752, "d": 11264, "dmin": 11392, "size": 11520},
    "q6_k": {"ql": 0, "qh": 8192, "sc": 12288, "d": 13312, "size": 13440},
}


def _c64(i):
    return ir.Constant(_I64, i)


def _vec(ty, n, v):
    return ir.Constant(ir.VectorType(ty, n), [v] * n)


class _Block:
    """The IR of one superblock for a (type, mode, isa): codes, scales, products, float steps."""

    def __init__(self, e, wt, mode, isa, T, vs):
        self.e, self.b, self.wt, self.mode, self.isa, self.T, self.vs = e, e.b, wt, mode, isa, T, vs
        self.n = e.n
        self.L = LAYOUT[wt]
        self.BYTES = ir.VectorType(_I8, 4 * self.n)
        self.SHORTS = ir.VectorType(_I16, 2 * self.n)
        self.DOUBLES = ir.VectorType(ir.DoubleType(), self.n)
        self.zero = ir.Constant(e.INTS, None)
        self.prefetch_lines: list[int] = []     # byte offsets from the record to prefetch (emit spreads them)

    # -- intrinsics
    def call(self, name, ret, args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def maddubs(self, u, s):
        name = "llvm.x86.avx512.pmaddubs.w.512" if self.n == 16 else "llvm.x86.avx2.pmadd.ub.sw"
        return self.call(name, self.SHORTS, [u, s])

    def maddwd(self, a, c):
        name = "llvm.x86.avx512.pmaddw.d.512" if self.n == 16 else "llvm.x86.avx2.pmadd.wd"
        return self.call(name, self.e.INTS, [self.b.bitcast(a, self.SHORTS), self.b.bitcast(c, self.SHORTS)])

    def dpbusd(self, acc, u, s):
        return self.e.vpdpbusd(acc, u, self.b.bitcast(s, self.e.INTS))

    def dpwssd(self, acc, a, c):
        return self.call("llvm.x86.avx512.vpdpwssd.512", self.e.INTS, [acc, a, c])

    # -- loads (row vector v of the pass: rows r0 + n*v ..; r0 is the pass's first row, at run time)
    def rows_at(self, off, count, v):
        """The byte offset off + count * (first row of v): parts that hold count bytes per row."""
        return self.b.add(_c64(off + count * self.n * v), self.b.mul(self.r0, _c64(count)))

    def bytes_of_rows(self, off, v, count, vty=None):
        """count bytes per row of row vector v, part starting at byte off."""
        vty = vty or ir.VectorType(_I8, count * self.n)
        return self.e.vector(self.base, self.rows_at(off, count, v), vty, 1)

    def codes_of_rows(self, off, v):
        return self.bytes_of_rows(off, v, 4, self.BYTES)

    def halves(self, part, v):
        p = self.b.bitcast(self.b.gep(self.base, [_c64(self.L[part])]), ir.HalfType().as_pointer())
        return self.e.halves(p, self.rows_at(0, 1, v))

    def token(self, arr, t, idx, vty):
        """Token t's int32 word idx (+ the superblock's start) of arr, in every lane, as vty."""
        w = self.e.splat(arr[t], self.b.add(self.b.mul(self.blk, _c64(self.per_blk[id(arr)])), _c64(idx)),
                         self.e.INTS)
        return self.b.bitcast(w, vty)

    # -- scales
    def scale(self, j, v):
        """sc_j of the vector's rows, shaped for the products: VNNI lanes (sc, 0) per int32 lane; VNNI sums
        sc as int32 (vpmulld); AVX2 (sc, sc) int16 pairs."""
        b, n = self.b, self.n
        raw = self.bytes_of_rows(self.L["sc"] + 64 * j, v, 1)
        signed = self.wt == "q6_k"
        ext = b.sext if signed else b.zext
        if self.isa == "avx2" or self.mode == "lanes":
            dup = b.shuffle_vector(raw, ir.Constant(raw.type, ir.Undefined),
                                   ir.Constant(ir.VectorType(_I32, 2 * n), [i // 2 for i in range(2 * n)]))
            return b.bitcast(ext(dup, self.SHORTS), self.e.INTS)
        return ext(raw, self.e.INTS)

    def q6_pairs(self, k, v):
        """(sc_2k, sc_2k+1) int16 pairs per row (Q6_K's bsum correction)."""
        b, n = self.b, self.n
        a = self.bytes_of_rows(self.L["sc"] + 64 * (2 * k), v, 1)
        c = self.bytes_of_rows(self.L["sc"] + 64 * (2 * k + 1), v, 1)
        inter = [i // 2 + (n if i % 2 else 0) for i in range(2 * n)]
        return b.sext(b.shuffle_vector(a, c, ir.Constant(ir.VectorType(_I32, 2 * n), inter)), self.SHORTS)

    def min_pairs(self, i, v):
        return self.b.zext(self.bytes_of_rows(self.L["mins"] + 128 * i, v, 2), self.SHORTS)

    # -- codes: unit u (Q4/Q5: 32-byte chunk c = u; Q6: ql half h = u // 2, part p = u % 2) at lane k
    def codes(self, u, k, v):
        """[(sub-block j, code bytes of rows of v, token word of j's lane k)] of unit u at lane k (and a
        share of the prefetches, spread over the superblock's loads)."""
        b, n = self.b, self.n
        for _ in range(-(-self.n_prefetch // (32 * len(self.vs)))):
            if self.prefetch_lines:
                self.e.prefetch(self.base, self.b.add(_c64(self.prefetch_lines.pop(0)), self.pf_shift))
        if self.wt in ("q4_k", "q5_k"):
            x = self.codes_of_rows(self.L["codes"] + 2048 * u + 256 * k, v)
            lo, hi = b.and_(x, _vec(_I8, 4 * n, 15)), b.lshr(x, _vec(_I8, 4 * n, 4))
            if self.wt == "q5_k":                   # 5th bit of sub-block j: bit j of qh[element]
                qh = self.codes_of_rows(self.L["qh"] + 256 * k, v)
                lo = b.or_(lo, self.bit4(qh, 2 * u))
                hi = b.or_(hi, self.bit4(qh, 2 * u + 1))
            return [(2 * u, lo, 16 * u + k), (2 * u + 1, hi, 16 * u + 8 + k)]
        h, p = divmod(u, 2)
        x = self.codes_of_rows(self.L["ql"] + 4096 * h + 2048 * p + 256 * k, v)
        qh = self.codes_of_rows(self.L["qh"] + 2048 * h + 256 * k, v)
        out = []
        for nib in range(2):
            g = p + 2 * nib
            low = b.and_(x if nib == 0 else b.lshr(x, _vec(_I8, 4 * n, 4)), _vec(_I8, 4 * n, 15))
            sh = 4 - 2 * g                          # bits 2g, 2g+1 of qh to bits 4, 5
            hb = b.shl(qh, _vec(_I8, 4 * n, sh)) if sh > 0 else (
                b.lshr(qh, _vec(_I8, 4 * n, -sh)) if sh < 0 else qh)
            vv = 4 * h + g
            out.append((2 * vv + (k >= 4), b.or_(low, b.and_(hb, _vec(_I8, 4 * n, 0x30))), 8 * vv + k))
        return out

    def bit4(self, qh, j):
        b, n = self.b, self.n
        sh = 4 - j
        moved = b.shl(qh, _vec(_I8, 4 * n, sh)) if sh > 0 else (b.lshr(qh, _vec(_I8, 4 * n, -sh)) if sh < 0 else qh)
        return b.and_(moved, _vec(_I8, 4 * n, 0x10))

    # -- one superblock
    def emit(self, base, blk, r0, pf_shift, y, dy, sp, bp, acc, accm):
        """The superblock blk at base, rows r0 .. of the pass, prefetching its share of the lines
        (prefetch_lines, shifted by pf_shift bytes)."""
        self.base, self.blk, self.r0, self.pf_shift = base, blk, r0, pf_shift
        self.n_prefetch = len(self.prefetch_lines)
        self.per_blk = {id(y): 64, id(sp): 4, id(bp): 8}
        self.y, self.sp, self.bp = y, sp, bp
        self.floats(self.lanes_ints() if self.mode == "lanes" else self.sums_ints(), dy, acc, accm)

    def ycodes(self, t, w):
        return self.token(self.y, t, w, self.BYTES)

    def q6_corr(self, k, v, t, SP):
        """32 * (sc_2k bsum_2k + sc_2k+1 bsum_2k+1) of token t, rows of v."""
        c = self.maddwd(SP[k, v], self.token(self.bp, t, k, self.SHORTS))
        return self.b.shl(c, ir.Constant(self.e.INTS, [5] * self.n))

    def lanes_ints(self):
        """{(t, v): [lane_0 .. lane_7]} exact int32 vec_dot lanes."""
        b, T, vs = self.b, self.T, self.vs
        nsub = 16 if self.wt == "q6_k" else 8
        S = {(j, v): self.scale(j, v) for j in range(nsub) for v in vs}
        SP = {(k, v): self.q6_pairs(k, v) for k in range(8) for v in vs} if self.wt == "q6_k" else {}
        lanes: dict[tuple[int, int], list] = {(t, v): [] for t in range(T) for v in vs}
        for k in range(8):
            cur = {(t, v): (b.sub(self.zero, self.q6_corr(k, v, t, SP)) if SP else self.zero)
                   for t in range(T) for v in vs}
            for u in range(4):
                for v in vs:
                    for j, x, w in self.codes(u, k, v):
                        for t in range(T):
                            yv = self.ycodes(t, w)
                            if self.isa == "vnni":
                                p = b.bitcast(self.maddubs(x, yv), self.e.INTS)
                                cur[t, v] = self.dpwssd(cur[t, v], p, S[j, v])
                            else:
                                cur[t, v] = b.add(cur[t, v], self.maddwd(self.maddubs(x, yv), S[j, v]))
            for key, val in cur.items():
                lanes[key].append(val)
        return lanes

    def sums_ints(self):
        """{(t, v): buckets} exact int32: gemm [isum of sub-blocks 2c, 2c+1 for c = 0..3], else two partial
        sums of isum; Q6_K's bsum correction included."""
        b, T, vs = self.b, self.T, self.vs
        n_bk = 4 if self.mode == "gemm" else 2
        tot = {(t, v): [self.zero] * n_bk for t in range(T) for v in vs}
        cap = {"q4_k": 8, "q5_k": 4, "q6_k": 2}[self.wt]      # AVX2: int16 pair sums added before vpmaddwd
        for u in range(4):
            for v in vs:
                part: dict[tuple[int, int], list] = {}  # (t, j) -> [running sum, terms]
                S: dict[int, ir.Value] = {}
                for k in range(8):
                    for j, x, w in self.codes(u, k, v):
                        for t in range(T):
                            yv = self.ycodes(t, w)
                            if self.isa == "vnni":
                                s0 = part.get((t, j), [self.zero, 0])[0]
                                part[t, j] = [self.dpbusd(s0, x, yv), 0]
                                continue
                            pr = self.maddubs(x, yv)
                            s0, c = part.get((t, j), [None, 0])
                            part[t, j] = [pr if s0 is None else b.add(s0, pr), c + 1]
                            if c + 1 == cap:
                                self.flush(part, S, tot, t, j, v)
                for t, j in list(part):
                    self.flush(part, S, tot, t, j, v)
        if self.wt == "q6_k":
            for v in vs:
                SP = {(k, v): self.q6_pairs(k, v) for k in range(8)}
                for t in range(T):
                    for k in range(8):
                        tot[t, v][k % 2] = b.sub(tot[t, v][k % 2], self.q6_corr(k, v, t, SP))
        return tot

    def flush(self, part, S, tot, t, j, v):
        """Add sub-block j's running sum of token t (times sc_j) into its bucket."""
        s, _ = part.pop((t, j))
        if j not in S:
            S[j] = self.scale(j, v)
        prod = self.b.mul(s, S[j]) if self.isa == "vnni" else self.maddwd(s, S[j])
        bk = j // 2 if self.mode == "gemm" else j % 2
        tot[t, v][bk] = self.b.add(tot[t, v][bk], prod)

    def mins(self, v, t, MP):
        """Q4_K/Q5_K min lanes i = 0..3 of token t, rows of v."""
        return [self.maddwd(MP[i, v], self.token(self.sp, t, i, self.SHORTS)) for i in range(4)]

    def floats(self, ints, dy, acc, accm):
        b, e, mode = self.b, self.e, self.mode
        has_min = self.wt != "q6_k"
        MP = {(i, v): self.min_pairs(i, v) for i in range(4) for v in self.vs} if has_min else {}
        for v in self.vs:
            dx = self.halves("d", v)
            dmin = self.halves("dmin", v) if has_min else dx     # (Q6_K: not read)
            for t in range(self.T):
                dyt = e.splat(dy[t], self.blk, e.FLOATS)
                a, am = acc[t, v], accm.get((t, v))
                iv = ints[t, v]
                ml = self.mins(v, t, MP) if has_min else []
                if mode == "tiled":
                    isum = b.add(iv[0], iv[1])
                    r = b.fmul(dx, b.sitofp(isum, e.FLOATS))
                    if has_min:
                        msum = b.add(b.add(ml[0], ml[1]), b.add(ml[2], ml[3]))
                        r = e.fma(b.fneg(dmin), b.sitofp(msum, e.FLOATS), r)
                    b.store(e.fma(r, dyt, b.load(a[0])), a[0])
                    continue
                D = b.fmul(dx, dyt)                                     # f32(dy*d)
                if mode == "lanes" and has_min:
                    for k in range(8):
                        b.store(e.fma(D, b.sitofp(iv[k], e.FLOATS), b.load(a[k])), a[k])
                    DMn = b.fneg(b.fmul(dmin, dyt))
                    if self.wt == "q5_k":           # one scalar: summs = fma(-dm, f32(sum of the mins), summs)
                        msum = b.add(b.add(ml[0], ml[1]), b.add(ml[2], ml[3]))
                        b.store(e.fma(DMn, b.sitofp(msum, e.FLOATS), b.load(am[0])), am[0])
                        continue
                    for i in range(4):
                        b.store(e.fma(DMn, b.sitofp(ml[i], e.FLOATS), b.load(am[i])), am[i])
                    continue
                if mode == "lanes":                 # Q6_K: lanes can pass 2^24; fma in f64, as the reference
                    D64 = b.fpext(D, self.DOUBLES)
                    fma64 = e.intrinsic(f"llvm.fma.v{self.n}f64", self.DOUBLES, 3)
                    for k in range(8):
                        r = b.call(fma64, [D64, b.sitofp(iv[k], self.DOUBLES), b.fpext(b.load(a[k]), self.DOUBLES)])
                        b.store(b.fptrunc(r, e.FLOATS), a[k])
                    continue
                DM = b.fmul(dmin, dyt)
                if mode == "chain":
                    steps = [(b.add(iv[0], iv[1]), b.add(b.add(ml[0], ml[1]), b.add(ml[2], ml[3])))]
                else:                                                   # gemm: one step per 64 values
                    steps = list(zip(iv, ml))
                for s, m in steps:
                    b.store(e.fma(b.sitofp(s, e.FLOATS), D, b.load(a[0])), a[0])
                    b.store(e.fma(b.sitofp(m, e.FLOATS), DM, b.load(am[0])), am[0])


def _ha(b, a):
    """ggml's HA of 8 lane vectors (hsum_float_8's order), row by row in the vector lanes."""
    return b.fadd(b.fadd(b.fadd(a[0], a[4]), b.fadd(a[2], a[6])),
                  b.fadd(b.fadd(a[1], a[5]), b.fadd(a[3], a[7])))


@contextmanager
def _passes(b, n_pass):
    """A run-time loop over the passes, yielding the pass index (i64); none for a single pass."""
    if n_pass == 1:
        yield _c64(0)
        return
    with cgutils.for_range(b, _c64(n_pass)) as loop:
        yield loop.index


def _codegen(wt, mode, T, isa, V):
    n = 16 if isa == "vnni" else 8
    size = LAYOUT[wt]["size"]
    n_acc = 8 if mode == "lanes" else 1
    n_accm = (4 if mode == "lanes" and wt == "q4_k" else 1) if wt != "q6_k" else 0
    n_pass = R // n // V
    share = -(-(size // 64) // n_pass)                  # lines of the record ahead each pass prefetches

    def codegen(context, builder, sig, args):
        e, b = Emit(context, builder, sig, args, n), builder
        n0 = args[2]
        q = e.ptr(0, _I8)
        y, dy, sp, bp = (e.rows(i, n0, T, ty) for i, ty in ((1, _I32), (3, _F32), (4, _I32), (5, _I32)))
        res = e.ptr(6, _F32)
        nb = b.extract_value(e.array(3).shape, 1)
        vs = list(range(V))
        zero = ir.Constant(e.FLOATS, None)
        # the accumulators of every pass (V row vectors each), in memory where there are several passes:
        # they run inside the loop over the superblocks, so each record is read in order, once
        mem = {(t, v): ([cgutils.alloca_once(b, e.FLOATS, size=n_pass) for _ in range(n_acc)],
                        [cgutils.alloca_once(b, e.FLOATS, size=n_pass) for _ in range(n_accm)])
               for t in range(T) for v in vs}

        def at(pas):
            """The pass's accumulators ({(t, v): [pointers]} of the lanes, of the mins) and first row."""
            acc = {k: [b.gep(p, [pas]) for p in ps[0]] for k, ps in mem.items()}
            accm = {k: [b.gep(p, [pas]) for p in ps[1]] for k, ps in mem.items()} if n_accm else {}
            return acc, accm, b.mul(pas, _c64(V * n))
        with _passes(b, n_pass) as pas:
            for p in (p for ptrs in at(pas)[:2] for ps in ptrs.values() for p in ps):
                b.store(zero, p)
        blk_ir = _Block(e, wt, mode, isa, T, vs)
        with cgutils.for_range(b, nb) as loop:
            base = b.gep(q, [b.mul(loop.index, _c64(size))])
            with _passes(b, n_pass) as pas:
                acc, accm, r0 = at(pas)
                blk_ir.prefetch_lines = [PREFETCH * size + 64 * j for j in range(share)]
                blk_ir.emit(base, loop.index, r0, b.mul(pas, _c64(64 * share)), y, dy, sp, bp, acc, accm)
        with _passes(b, n_pass) as pas:
            acc, accm, r0 = at(pas)
            for t in range(T):
                for v in vs:
                    lanes = [b.load(p) for p in acc[t, v]]
                    if mode == "lanes":
                        h = _ha(b, lanes)
                        m = [b.load(p) for p in accm.get((t, v), [])]
                        if n_accm == 4:
                            h = b.fadd(h, b.fadd(b.fadd(m[0], m[2]), b.fadd(m[1], m[3])))
                        elif n_accm == 1:
                            h = b.fadd(h, m[0])
                    elif mode == "tiled":
                        h = lanes[0]
                    else:
                        h = b.fsub(lanes[0], b.load(accm[t, v][0]))
                    off = b.add(_c64(t * R + n * v), r0)
                    b.store(h, b.bitcast(b.gep(res, [off]), e.FLOATS.as_pointer()), align=4)
        return context.get_dummy_value()
    return codegen


def group_intrinsic(wt, mode, T, isa, V=None):
    """The numba intrinsic of one group's rows (packed type wt: "q4_k", "q5_k", "q6_k") against tokens
    n0 .. n0+T-1 in `mode` (MODES), V row vectors per pass (default: all with VNNI, one with AVX2)."""
    n = 16 if isa == "vnni" else 8
    V = V or (R // n if isa == "vnni" else 1)

    def group(typingctx, q, y4, n0, dy, sp, bp, res):
        u8, f32 = types.Array(types.uint8, 1, "C"), types.Array(types.float32, 1, "C")
        i32x2, f32x2 = types.Array(types.int32, 2, "C"), types.Array(types.float32, 2, "C")
        ok = (q == u8 and y4 == sp == bp == i32x2 and dy == f32x2 and res == f32 and isinstance(n0, types.Integer))
        sig = types.void(q, y4, types.intp, dy, sp, bp, res)
        return (sig, _codegen(wt, mode, T, isa, V)) if ok else None
    group.__name__ = name = f"{isa}_{wt}_{mode}_x{T}"
    group.__doc__ = (f"{name}(q, y4, n0, dy, sp, bp, res): one group's {R} rows against tokens "
                     f"n0 .. n0+{T - 1} into res[t*{R} + r] (see the module docstring).")
    return intrinsic(group)

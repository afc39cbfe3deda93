"""experts.py: MUL_MAT_ID on packed 3-D expert weights, bound once and replayed, gives exactly the bits of
ops._mul_mat_id (the reference: weights_mul_mat per expert, ggml's MUL_MAT_ID rule for each expert's rows,
ops.mul_mat_id_vec_n) for every packed type, experts of 0, 1, 2, 7, 8 and 9 rows, partial row groups,
M % 8 (ggml's repack rule), shared or per-slot activations, 1 and 2 threads, both int8 kernels and the
batch_invariant option; gate and up (the same activations and ids) run as one call; a non-finite
activation and an id out of range go to the reference path."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.base import BufferUsage, tensor_array
from ggml_dist.backends.cpu import ops as cpu_ops
from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.cpu.backend import BoundGraph, CPUDevice
from ggml_dist.backends.cpu.ops import ComputeOptions, resolve
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType as T
from ggml_dist.core.types import row_size

from .test_quants import random_rows

experts = pytest.importorskip("ggml_dist.backends.cpu.experts")
qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")

F32 = np.float32
QTYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
KTYPES = [T.Q4_K, T.Q5_K, T.Q6_K]
KERNELS = (["avx2"] if qpack.avx2.AVAILABLE else []) + (["vnni"] if qpack.vnni.AVAILABLE else [])
THREADS = [n for n in (1, 2) if n <= kt._numba_num_threads()]
needs_int8 = pytest.mark.skipif(not KERNELS, reason="no int8 kernels on this CPU")

# 9 tokens, 3 slots, 6 experts: expert 0 unused, 1: 1 row, 2: 7, 3: 8, 4: 9, 5: 2 (each token's 3 distinct)
_CHOICE = [[4, 3, 2]] * 7 + [[4, 3, 5], [4, 5, 1]]
E, N_USED, N_TOK = 6, 3, 9


def ids_rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([rng.permutation(c) for c in _CHOICE], np.int32)


class _Host:
    """A host buffer over an array; WEIGHTS usage makes the CPU backend take the packed path."""

    def __init__(self, data: np.ndarray, usage: BufferUsage = BufferUsage.WEIGHTS) -> None:
        self.base, self.usage = data, usage

    def release_pages(self, offset: int, size: int) -> None:
        pass


def weights(t: T, M: int, K: int, seed: int) -> np.ndarray:
    w = random_rows(t, E * M, K, seed=seed).reshape(E, M, -1)
    bs = row_size(t, 32 if t not in KTYPES else 256)
    w[:, ::5, :bs] = 0                                   # zero blocks
    if t == T.MXFP4:
        w[:, 1, -16:] = 0x77                             # a last block of +12s (products past 2^24)
    return w


def activations(n: int, K: int, seed: int) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal((n, K)) * 2).astype(F32)
    x[0, :32] = 0                                        # an all-zero block: d = 0
    x[-1, 7] = 300.0                                     # an outlier
    return x


class MoE:
    """MUL_MAT_ID of n_w 3-D weights [K, M, E] by the same x [K, n_b, N_TOK] and ids (a top-k view of an
    [E, N_TOK] I32 tensor, as ARGSORT's), one graph."""

    def __init__(self, t: T, ws: list[np.ndarray], M: int, K: int, n_b: int) -> None:
        ctx = Context(1 << 20, no_alloc=True)
        self.wts = []
        for w in ws:
            wt = ctx.new_tensor(t, (K, M, E))
            wt.buffer, wt.data = _Host(np.ascontiguousarray(w).reshape(-1)), 0
            self.wts.append(wt)
        self.x = ctx.new_tensor(T.F32, (K, n_b, N_TOK))
        self.full = ctx.new_tensor(T.I32, (E, N_TOK))
        ids = ops.view_2d(ctx, self.full, N_USED, N_TOK, self.full.nb[1], 0)
        self.outs = [ops.mul_mat_id(ctx, wt, self.x, ids) for wt in self.wts]
        self.g = Graph()
        for o in self.outs:
            self.g.build_forward_expand(o)
        size = 4 * (N_TOK * n_b * K + E * N_TOK + len(ws) * N_TOK * N_USED * M) + 256
        buf = CPUDevice().get_buffer_type().alloc_buffer(size)
        off = 0
        for tt in (self.x, self.full, *self.outs):
            tt.buffer, tt.data = buf, off
            off += 4 * int(np.prod(tt.ne)) + 64
        ids.buffer, ids.data = buf, self.full.data
        self.plan: BoundGraph | None = None

    def set(self, x: np.ndarray, ids: np.ndarray) -> None:
        self.x.buffer.set_tensor(self.x, x)
        full = np.zeros((N_TOK, E), np.int32)
        full[:, :N_USED] = ids
        full[:, N_USED:] = -7                            # what the kernel must not read
        self.full.buffer.set_tensor(self.full, full)

    def bound(self, opts: ComputeOptions) -> list[np.ndarray]:
        # the plan kept by its owner (graph_plan_create), replayed: the first run binds, the next are flat
        if self.plan is None or self.plan.opts is not opts:
            self.plan = BoundGraph(self.g, opts)
        self.plan.run()
        return [tensor_array(o).copy() for o in self.outs]

    def reference(self, opts: ComputeOptions) -> list[np.ndarray]:
        res = []
        for o in self.outs:
            dst = np.zeros_like(tensor_array(o))
            cpu_ops._mul_mat_id(o, dst, [tensor_array(s) for s in o.src], opts)
            res.append(dst)
        return res


@pytest.fixture
def threads():
    before = kt.get_threads()
    yield
    kt.set_threads(before)


def _check(t: T, M: int, K: int, n_b: int, kernels: str, n_w: int = 1, seed: int = 0) -> None:
    ws = [weights(t, M, K, seed + 17 * i) for i in range(n_w)]
    moe = MoE(t, ws, M, K, n_b)
    moe.set(activations(N_TOK * n_b, K, seed + 1).reshape(N_TOK, n_b, K), ids_rows(seed))
    for n_threads in THREADS:
        kt.set_threads(n_threads)
        for bi in (False, True):
            opts = resolve(ComputeOptions(kernels=kernels, batch_invariant=bi))
            got, ref = moe.bound(opts), moe.reference(opts)
            for g, r in zip(got, ref):
                where = f"{t.name} M={M} n_b={n_b} {kernels} threads={n_threads} bi={bi}"
                assert np.array_equal(g.view(np.uint32), r.view(np.uint32)), f"{where}: {np.sum(g != r)} differ"
            moe.bound(opts)                               # a flat replay: the same bits
            assert all(np.array_equal(a, b) for a, b in zip(moe.bound(opts), got))
    if experts.packable(t, M, kernels):
        assert all(isinstance(wt.extra, experts.PackedExperts) for wt in moe.wts)


@needs_int8
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("t", QTYPES + KTYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("M", [64, 72, 36])
def test_bound_experts_are_the_reference_bit_for_bit(threads, t, M, kernels):
    # M = 64: whole groups; 72: a partial group, M % 8 == 0 (repacked Q4_0/Q4_K/MXFP4: their chains);
    # 36: the lanes orders (MXFP4 then stays on the reference path: ggml's vec_dot, not packed)
    _check(t, M, 256, 1, kernels)


@needs_int8
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("t", [T.Q4_0, T.Q8_0, T.MXFP4, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_per_slot_activations(threads, t, kernels):
    # the down projection's shape: x [K, n_used, n_tok], slot s of token t reads its own row
    _check(t, 64, 512, N_USED, kernels, seed=3)


@needs_int8
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.MXFP4, T.Q4_K, T.Q5_K], ids=lambda t: t.name)
def test_gate_and_up_in_one_call(threads, t, kernels):
    _check(t, 72, 256, 1, kernels, n_w=2, seed=5)
    ws = [weights(t, 72, 256, i) for i in range(2)]
    moe = MoE(t, ws, 72, 256, 1)
    moe.set(activations(N_TOK, 256, 1).reshape(N_TOK, 1, 256), ids_rows(1))
    moe.bound(resolve(ComputeOptions(kernels=kernels)))
    assert moe.plan is not None and len(moe.plan.calls) == 1                            # fusion.py: both nodes in one call


@needs_int8
def test_non_finite_activations_and_bad_ids_take_the_reference(threads):
    kernels = KERNELS[-1]
    ws = [weights(T.Q4_0, 64, 256, 0)]
    moe = MoE(T.Q4_0, ws, 64, 256, 1)
    x = activations(N_TOK, 256, 2).reshape(N_TOK, 1, 256)
    x[3, 0, 40] = np.inf
    moe.set(x, ids_rows(2))
    opts = resolve(ComputeOptions(kernels=kernels))
    for _ in range(2):                                   # bound, then flat
        got, ref = moe.bound(opts), moe.reference(opts)
        assert np.array_equal(got[0], ref[0], equal_nan=True)
    bad = ids_rows(2)
    bad[4, 1] = E
    moe.set(activations(N_TOK, 256, 2).reshape(N_TOK, 1, 256), bad)
    with pytest.raises(IndexError):
        moe.bound(opts)


@needs_int8
def test_packed_experts_direct(threads):
    # PackedExperts.mul_mat_id against the reference rule expert by expert
    kernels = KERNELS[-1]
    w = weights(T.Q8_0, 40, 64, 9)
    pe = experts.PackedExperts(T.Q8_0, w, kernels=kernels)
    assert (pe.E, pe.M, pe.Gp, pe.K) == (E, 40, 1, 64)
    x = activations(N_TOK, 64, 3)
    ids = ids_rows(3)
    got = pe.mul_mat_id(x, ids, 1).reshape(N_TOK, N_USED, 40)
    for tok in range(N_TOK):
        for s in range(N_USED):
            ref = cpu_ops.weights_mul_mat(T.Q8_0, w[ids[tok, s]], x[tok:tok + 1], ComputeOptions(), vec_n=1)
            assert np.array_equal(got[tok, s], ref[0])


@pytest.mark.parametrize("n_tok", [1, 5])
def test_weighted_sum_of_the_experts_in_one_call(n_tok):
    # model/moe.py's MUL(experts, weights) and the k - 1 ADDs of its slot views: fusion.py's one call, the
    # f32 steps of the unfused ops
    k, n = 8, 96
    ctx = Context(1 << 20, no_alloc=True)
    y = ctx.new_tensor(T.F32, (n, k, n_tok))
    w = ctx.new_tensor(T.F32, (1, k, n_tok))
    m = ops.mul(ctx, y, w)
    g = Graph()
    g.build_forward_expand(m)
    views = [ops.view_2d(ctx, m, n, n_tok, m.nb[2], s * m.nb[1]) for s in range(k)]
    for v in views:
        g.build_forward_expand(v)
    out = views[0]
    for v in views[1:]:
        out = ops.add(ctx, out, v)
        g.build_forward_expand(out)
    size = 4 * (2 * n * k * n_tok + k * n_tok + k * n * n_tok) + 1024
    buf = CPUDevice().get_buffer_type().alloc_buffer(size)
    off = 0
    for tt in g.nodes:
        if tt.view_src is None and tt.op.name != "VIEW":
            tt.buffer, tt.data = buf, off
            off += 4 * int(np.prod(tt.ne)) + 64
    for tt in (y, w):
        tt.buffer, tt.data = buf, off
        off += 4 * int(np.prod(tt.ne)) + 64
    for v in views:
        v.buffer, v.data = buf, m.data + v.view_offs
    rng = np.random.default_rng(0)
    yv = rng.standard_normal((n_tok, k, n)).astype(F32)
    wv = rng.uniform(0, 1, (n_tok, k, 1)).astype(F32)
    buf.set_tensor(y, yv)
    buf.set_tensor(w, wv)
    opts = resolve(ComputeOptions())
    plan = BoundGraph(g, opts)
    plan.run()
    assert len(plan.calls) == 1
    ref = yv[:, 0] * wv[:, 0]
    for s in range(1, k):
        ref = ref + yv[:, s] * wv[:, s]
    got = tensor_array(out).reshape(n_tok, n)
    assert np.array_equal(got.view(np.uint32), ref.astype(F32).view(np.uint32))
    plan.run()                                            # flat
    assert np.array_equal(tensor_array(out).reshape(n_tok, n), got)


def _router(ctx, n_embd: int, n_expert: int, k: int, n_tok: int):
    """model/moe.py's router for softmax gating with norm_w: F32 router product, SOFT_MAX, ARGSORT top k,
    GET_ROWS of the chosen probabilities, SUM_ROWS, CLAMP, DIV."""
    from ggml_dist.model.moe import WEIGHTS_SUM_MIN
    wr, cur = ctx.new_tensor(T.F32, (n_embd, n_expert)), ctx.new_tensor(T.F32, (n_embd, n_tok))
    probs = ops.soft_max_ext(ctx, ops.mul_mat(ctx, wr, cur), None)
    selected = ops.argsort_top_k(ctx, probs, k)
    weights = ops.get_rows(ctx, ops.reshape(ctx, probs, 1, n_expert, n_tok), selected)
    weights = ops.reshape(ctx, weights, k, n_tok)
    total = ops.clamp(ctx, ops.sum_rows(ctx, weights), WEIGHTS_SUM_MIN, float("inf"))
    weights = ops.div(ctx, weights, total)
    return wr, cur, selected, weights


@pytest.mark.parametrize("n_tok", [1, 3, 16])
def test_the_router_s_ops_run_fused_with_the_same_bits(n_tok):
    # the F32 router product (fkernels.bind_mul_mat_f32), ARGSORT + GET_ROWS (moe_ops.bind_topk), SUM_ROWS +
    # CLAMP + DIV (moe_ops.bind_norm) against the numpy kernels node by node; ties among the probabilities
    # keep the reference's order (a stable sort)
    from ggml_dist.backends.cpu.backend import BoundGraph
    from ggml_dist.backends.cpu.reference import ReferenceExecutor

    from .test_fast_ops import _bound_run
    ctx = Context(1 << 24)
    n_embd, n_expert, k = 200, 64, 8                      # 200: a vec_dot tail of 8 (K % 32)
    wr, cur, selected, weights = _router(ctx, n_embd, n_expert, k, n_tok)
    g = Graph()
    g.build_forward_expand(selected)
    g.build_forward_expand(weights)
    rng = np.random.default_rng(n_tok)
    wv = (rng.standard_normal((n_expert, n_embd)) * 0.3).astype(F32)
    wv[5] = wv[9]                                          # two experts with equal scores: a tie
    inputs = {wr: wv, cur: rng.standard_normal((n_tok, n_embd)).astype(F32)}
    want = ReferenceExecutor(ComputeOptions(numba=False)).compute(g, inputs)
    got = _bound_run(g, weights, inputs)
    assert np.array_equal(got.view(np.uint32), want[weights].view(np.uint32))
    assert np.array_equal(tensor_array(selected.view_src), want[selected.view_src])     # the whole sort
    kinds = [getattr(getattr(c, "func", c), "__name__", type(c).__name__) for c in BoundGraph(g, resolve(
        ComputeOptions())).calls]
    assert len(kinds) == 4, kinds                          # product, soft_max, top k, norm


# an id of -1 (expert parallelism: another rank's expert) is not computed and its rows are 0, on the
# packed path (gate and up fused, and a K-quant) and the reference; the other slots keep their bits,
# and a slot's garbage from an earlier step does not survive a replay
@needs_int8
@pytest.mark.parametrize("t, K", [(T.Q8_0, 64), (T.Q4_0, 64), (T.Q4_K, 256)])
def test_skipped_slots(threads, t, K):
    M, kernels = 40, KERNELS[-1]
    ws = [weights(t, M, K, 3), weights(t, M, K, 4)]
    moe = MoE(t, ws, M, K, 1)
    x = activations(N_TOK, K, 5).reshape(N_TOK, 1, K)
    ids = ids_rows(6)
    opts = resolve(ComputeOptions(kernels=kernels))
    moe.set(x, ids)
    whole = moe.bound(opts)
    part = np.where(ids >= 3, ids, -1).astype(np.int32)          # this rank holds experts 3..5 only
    moe.set(x, part)
    for _ in range(2):                                           # bind, then a flat replay
        got, ref = moe.bound(opts), moe.reference(opts)
        skipped = (part == -1)[None]                             # (1, n_tok, n_used) of dst's (1, n_tok, n_used, M)
        for g, r, w in zip(got, ref, whole):
            assert np.array_equal(g, r)
            assert not g[skipped].any()
            assert np.array_equal(g[~skipped], w[~skipped])
    bad = part.copy()
    bad[0, 0] = -2                                               # only -1 means another rank's
    moe.set(x, bad)
    with pytest.raises(IndexError):
        moe.bound(opts)

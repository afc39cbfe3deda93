"""fusion.py: consecutive nodes bound as one kernel call give the separate kernels' bits, and are fused
only where ggml_can_fuse's rule allows (the skipped result read by the next node alone, in the whole
graph, and not an output)."""
import numpy as np
import pytest

from ggml_dist.backends.cpu.backend import BoundGraph, compute_graph
from ggml_dist.backends.cpu.ops import ComputeOptions, resolve
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import TensorFlag
from ggml_dist.core.types import GGMLType

from .test_fast_ops import _bound_run, assert_same_bits, randn

F32 = GGMLType.F32
OPTS = resolve(ComputeOptions())


@pytest.fixture
def ctx():
    return Context(1 << 24)


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def _norm_layer(ctx, n_tok, width, residual):
    """x [+ r] -> rms_norm -> * w, as a llama layer's norm (residual: the add before it)."""
    x, w = ctx.new_tensor(F32, (width, n_tok)), ctx.new_tensor(F32, (width,))
    r = ctx.new_tensor(F32, (width, n_tok)) if residual else None
    s = ops.add(ctx, x, r) if residual else x
    norm = ops.rms_norm(ctx, s, 1e-6)
    return x, r, w, s, norm, ops.mul(ctx, norm, w)


def _run(g, out, inputs):
    want = ReferenceExecutor(ComputeOptions(numba=False)).compute(g, inputs)
    return want, _bound_run(g, out, inputs)


def _run_at(n_threads, g, out, inputs):
    """_run with the kernels at n_threads threads."""
    from ggml_dist.backends.cpu import threads
    before = threads.get_threads()
    threads.set_threads(n_threads)
    try:
        return _run(g, out, inputs)
    finally:
        threads.set_threads(before)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n_tok,width", [(1, 576), (5, 40), (3, 1)])
def test_a_norm_and_its_weight_run_as_one_call_with_the_same_bits(ctx, rng, residual, n_tok, width):
    x, r, w, s, norm, out = _norm_layer(ctx, n_tok, width, residual)
    g = Graph()
    g.build_forward_expand(out)
    inputs = {x: randn(rng, n_tok, width) * 3, w: randn(rng, width)}
    if residual:
        inputs[r] = randn(rng, n_tok, width)
    want, got = _run(g, out, inputs)
    assert_same_bits(got, want[out])
    if residual:                                           # the sum itself is still written
        from ggml_dist.backends.base import tensor_array
        assert_same_bits(tensor_array(s).copy(), want[s])
    assert len(BoundGraph(g, OPTS).calls) == 1


def test_the_norm_is_computed_where_another_node_reads_it(ctx, rng):
    x, _, w, _, norm, out = _norm_layer(ctx, 4, 64, False)
    other = ops.scale(ctx, norm, 2.0)
    g = Graph()
    g.build_forward_expand(out)
    g.build_forward_expand(other)
    inputs = {x: randn(rng, 4, 64), w: randn(rng, 64)}
    want, got = _run(g, other, inputs)
    assert_same_bits(got, want[other])
    assert len(BoundGraph(g, OPTS).calls) == 3


def test_a_split_s_graph_counts_the_whole_graph_s_readers(ctx, rng):
    """A split's graph is a view: a node past it reads the norm through a copy, so its use count
    (the whole graph's) keeps the norm computed even where, in the view, only the MUL reads it."""
    x, _, w, _, norm, out = _norm_layer(ctx, 4, 64, False)
    later = ops.scale(ctx, norm, 2.0)
    g = Graph()
    g.build_forward_expand(out)
    g.build_forward_expand(later)
    _run(g, later, {x: randn(rng, 4, 64), w: randn(rng, 64)})       # allocates every tensor
    first = g.view(0, g.nodes.index(out) + 1)
    assert later not in first.nodes
    assert len(BoundGraph(first, OPTS).calls) == 2


def test_an_output_norm_is_computed(ctx, rng):
    x, _, w, _, norm, out = _norm_layer(ctx, 2, 32, False)
    norm.flags |= TensorFlag.OUTPUT
    g = Graph()
    g.build_forward_expand(out)
    inputs = {x: randn(rng, 2, 32), w: randn(rng, 32)}
    want, got = _run(g, out, inputs)
    assert_same_bits(got, want[out])
    assert len(BoundGraph(g, OPTS).calls) == 2


def test_nodes_are_fused_only_when_consecutive(ctx, rng):
    """Another node computed between the norm and its MUL keeps them apart (the allocator may have put
    that node's memory where the MUL's result goes)."""
    x, _, w, _, norm, out = _norm_layer(ctx, 2, 32, False)
    y = ctx.new_tensor(F32, (32, 2))
    between = ops.scale(ctx, y, 3.0)
    g = Graph()
    g.build_forward_expand(norm)
    g.build_forward_expand(between)
    g.build_forward_expand(out)
    assert [t.op.name for t in g.nodes][-3:] == ["RMS_NORM", "SCALE", "MUL"]
    inputs = {x: randn(rng, 2, 32), w: randn(rng, 32), y: randn(rng, 2, 32)}
    want, got = _run(g, out, inputs)
    assert_same_bits(got, want[out])
    assert len(BoundGraph(g, OPTS).calls) == 3


def test_without_numba_nothing_is_fused(ctx, rng):
    x, r, w, _, _, out = _norm_layer(ctx, 2, 32, True)
    g = Graph()
    g.build_forward_expand(out)
    _run(g, out, {x: randn(rng, 2, 32), r: randn(rng, 2, 32), w: randn(rng, 32)})
    assert len(BoundGraph(g, ComputeOptions(numba=False)).calls) == 3


def test_a_replay_repeats_the_fused_bits(ctx, rng):
    x, r, w, s, norm, out = _norm_layer(ctx, 3, 48, True)
    g = Graph()
    g.build_forward_expand(out)
    inputs = {x: randn(rng, 3, 48), r: randn(rng, 3, 48), w: randn(rng, 48)}
    want, got = _run(g, out, inputs)
    compute_graph(g, ComputeOptions())                      # replayed: same inputs, same bits
    from ggml_dist.backends.base import tensor_array
    assert_same_bits(tensor_array(out).copy(), want[out])


def test_a_plan_is_replayed_until_its_owner_places_a_tensor_elsewhere(ctx, rng):
    """The CPU backend's graph plan (graph_plan_create) is replayed as bound while its tensors stay where
    they were placed, whatever is placed elsewhere; its owner, placing one of them in another buffer,
    makes a new plan, and the result lands in the new place. A plan bound with other options (the
    compiled kernels taking over) binds again in place."""
    from dataclasses import replace

    from ggml_dist.backends.base import tensor_array
    from ggml_dist.backends.cpu.backend import CPUDevice
    from ggml_dist.backends.cpu.reference import _HOST
    from ggml_dist.core.tensor import nbytes
    x, r, w, s, norm, out = _norm_layer(ctx, 3, 48, True)
    g = Graph()
    g.build_forward_expand(out)
    want, _ = _run(g, out, {x: randn(rng, 3, 48), r: randn(rng, 3, 48), w: randn(rng, 48)})
    be = CPUDevice().init_backend(opts=ComputeOptions())
    plan = be.graph_plan_create(g)
    calls = plan.calls
    be.graph_plan_compute(plan)
    other = ctx.new_tensor(F32, (4,))
    other.buffer, other.data = _HOST.alloc_buffer(16), 0     # placed: not one of the graph's
    be.graph_plan_compute(plan)
    assert plan.calls is calls
    assert_same_bits(tensor_array(out).copy(), want[out])
    out.buffer, out.data = _HOST.alloc_buffer(nbytes(out)), 0
    plan = be.graph_plan_create(g)
    be.graph_plan_compute(plan)
    assert_same_bits(tensor_array(out).copy(), want[out])
    be.opts = replace(be.opts, order="fast")
    be.graph_plan_compute(plan)
    assert plan.opts is be.opts and plan.calls is not calls


def _attention(ctx, n_tok, n_head, n_head_kv, cont=True):
    """A llama layer's attention on KV-cache views (test_fast_ops' shapes): K rows of the cache, V^T
    rows of kv_size cells, Q permuted, n_kv cells of which the first 37 are used."""
    d, kv_size, n_kv = 64, 512, 256
    kc = ctx.new_tensor(GGMLType.F16, (d * n_head_kv, kv_size))
    vc = ctx.new_tensor(GGMLType.F16, (kv_size, d * n_head_kv))
    q = ctx.new_tensor(F32, (d, n_head, n_tok))
    m = ctx.new_tensor(F32, (n_kv, n_tok))
    k = ops.view_3d(ctx, kc, d, n_kv, n_head_kv, kc.nb[1], d * 2, 0)
    v = ops.view_3d(ctx, vc, n_kv, d, n_head_kv, vc.nb[1], vc.nb[1] * d, 0)
    kq = ops.mul_mat(ctx, k, ops.permute(ctx, q, 0, 2, 1, 3))
    sm = ops.soft_max_ext(ctx, kq, m, 0.125, 0.0)
    kqv = ops.mul_mat(ctx, v, sm)
    out = ops.cont(ctx, ops.permute(ctx, kqv, 0, 2, 1, 3), (d * n_head, n_tok)) if cont else kqv
    return (kc, vc, q, m), (kq, sm, kqv), out


def _attention_inputs(rng, tensors, n_tok):
    kc, vc, q, m = tensors
    used, kv_size, n_kv = 37, kc.ne[1], m.ne[0]
    xk = np.zeros((kv_size, kc.ne[0]), np.float16)
    xk[:used] = randn(rng, used, kc.ne[0])
    xv = np.zeros((vc.ne[1], kv_size), np.float16)
    xv[:, :used] = randn(rng, vc.ne[1], used)
    mask = np.full((n_tok, n_kv), -np.inf, np.float32)
    mask[:, :used - n_tok + 1] = 0
    for i in range(n_tok):
        mask[i, used - n_tok + 1:used - n_tok + 1 + i] = 0
    return {kc: xk, vc: xv, q: randn(rng, n_tok, q.ne[1], q.ne[0]), m: mask}


@pytest.mark.parametrize("cont", [True, False])
@pytest.mark.parametrize("n_tok,n_head,n_head_kv", [(1, 9, 3), (4, 6, 2), (1, 4, 4), (2, 3, 1)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_the_attention_chain_runs_as_one_call_with_the_same_bits(ctx, rng, cont, n_tok, n_head, n_head_kv,
                                                                  n_threads):
    from ggml_dist.backends.base import tensor_array
    leafs, mids, out = _attention(ctx, n_tok, n_head, n_head_kv, cont)
    g = Graph()
    g.build_forward_expand(out)
    inputs = _attention_inputs(rng, leafs, n_tok)
    want, got = _run_at(n_threads, g, out, inputs)
    assert_same_bits(got, want[out])
    for t in mids:                                          # the chain's own results are written too
        assert_same_bits(tensor_array(t).copy(), want[t])
    assert len(BoundGraph(g, OPTS).calls) == 1


def test_an_attention_chain_whose_results_overlap_runs_call_by_call(ctx, rng):
    """KQV placed over the soft_max's probabilities (threads still read other heads' rows while one
    writes its KQV rows): no fusion. (Over KQ it would fuse: the soft_max, here not in place, has
    read it all by then.)"""
    leafs, (kq, sm, kqv), out = _attention(ctx, 1, 6, 2, cont=False)
    g = Graph()
    g.build_forward_expand(out)
    _run(g, out, _attention_inputs(rng, leafs, 1))
    kqv.buffer, kqv.data = sm.buffer, sm.data
    assert len(BoundGraph(g, OPTS).calls) == 3
    kqv.buffer, kqv.data = kq.buffer, kq.data
    assert len(BoundGraph(g, OPTS).calls) == 1


@pytest.mark.parametrize("n_threads", [1, 2])
def test_kqv_over_the_dead_queries_is_fused(ctx, rng, n_threads):
    """KQV over Q (dead once KQ has read it: a llama layer's placement): every thread's KQ reads are
    done before any KQV row is written, so it fuses, with the same bits."""
    from ggml_dist.backends.base import tensor_array
    from ggml_dist.backends.cpu import threads
    leafs, (kq, sm, kqv), out = _attention(ctx, 1, 9, 3, cont=False)
    g = Graph()
    g.build_forward_expand(out)
    inputs = _attention_inputs(rng, leafs, 1)
    want, _ = _run(g, out, inputs)
    q = leafs[2]
    kqv.buffer, kqv.data = q.buffer, q.data
    for t, v in inputs.items():
        t.buffer.set_tensor(t, v)
    assert len(BoundGraph(g, OPTS).calls) == 1
    before = threads.get_threads()
    threads.set_threads(n_threads)
    try:
        compute_graph(g, OPTS)
    finally:
        threads.set_threads(before)
    assert_same_bits(tensor_array(out).copy(), want[out])


@pytest.mark.parametrize("place,one_loop", [("apart", True), ("over q", True), ("over q, a head on", False)])
def test_the_threads_take_one_loop_only_where_none_writes_what_another_reads(ctx, rng, monkeypatch, place,
                                                                               one_loop):
    """KQV apart from everything the threads read, or over Q exactly (each thread's heads over its own
    heads' queries, read before it writes them): each thread runs KQ, soft_max and KQV in one parallel
    loop (one launch). KQV over Q a head on (a thread's first KQV head lies over the queries of the
    thread before's last head): two loops, all of KQ first. The bits are the reference's either way."""
    from ggml_dist.backends.base import tensor_array
    from ggml_dist.backends.cpu import fkernels as fk
    from ggml_dist.backends.cpu import threads
    from ggml_dist.backends.cpu.reference import _HOST
    leafs, (kq, sm, kqv), out = _attention(ctx, 1, 9, 3, cont=False)
    g = Graph()
    g.build_forward_expand(out)
    inputs = _attention_inputs(rng, leafs, 1)
    want, _ = _run(g, out, inputs)
    q = leafs[2]
    if place != "apart":
        buf = _HOST.alloc_buffer(q.nbytes + 4 * 64)                 # room for a head past Q's end
        q.buffer, q.data = buf, 0
        kq.src[1].buffer, kq.src[1].data = buf, 0                      # Q's permuted view moves with it
        kqv.buffer, kqv.data = buf, 0 if place == "over q" else 4 * 64
    for t, v in inputs.items():
        t.buffer.set_tensor(t, v)
    seen = []
    real = fk.bind_attention
    monkeypatch.setattr(fk, "bind_attention", lambda *a: seen.append(a[12]) or real(*a))
    assert len(BoundGraph(g, OPTS).calls) == 1 and seen == [one_loop]
    before = threads.get_threads()
    threads.set_threads(2)
    try:
        compute_graph(g, OPTS)
    finally:
        threads.set_threads(before)
    assert_same_bits(tensor_array(out).copy(), want[out])


def test_a_cont_over_the_dead_scores_is_fused(ctx, rng):
    """The CONT's destination over KQ's memory (as the allocator places it in a llama layer: the scores
    are dead once KQV has read them): the copy runs after every thread's heads, so it fuses."""
    from ggml_dist.backends.base import tensor_array
    leafs, (kq, sm, kqv), out = _attention(ctx, 1, 9, 3, cont=True)
    g = Graph()
    g.build_forward_expand(out)
    inputs = _attention_inputs(rng, leafs, 1)
    want, _ = _run(g, out, inputs)
    out.buffer, out.data = kq.buffer, kq.data
    for t, v in inputs.items():
        t.buffer.set_tensor(t, v)
    assert len(BoundGraph(g, OPTS).calls) == 1
    compute_graph(g, OPTS)
    assert_same_bits(tensor_array(out).copy(), want[out])


@pytest.mark.parametrize("residual", [False, True])
def test_a_norm_whose_result_overlaps_its_source_shifted_runs_call_by_call(ctx, rng, residual):
    """The MUL's result over its norm's source one row on (the allocator may place it there once the
    norm has read the source): a fused row loop would overwrite rows not read yet, so that fusion is
    declined; over it exactly (in place) it fuses."""
    x, r, w, s, norm, out = _norm_layer(ctx, 4, 32, residual)
    g = Graph()
    g.build_forward_expand(out)
    inputs = {x: randn(rng, 4, 32), w: randn(rng, 32)} | ({r: randn(rng, 4, 32)} if residual else {})
    _run(g, out, inputs)
    from ggml_dist.backends.cpu.reference import _HOST
    buf = _HOST.alloc_buffer(4096)
    x.buffer, x.data = buf, 0
    out.buffer, out.data = buf, 64                              # half a row on: a shifted overlap
    assert len(BoundGraph(g, OPTS).calls) == 2     # (the sum alone, then its norm fused with the MUL)
    out.data = 0
    assert len(BoundGraph(g, OPTS).calls) == 1


# -- products of one activation ----------------------------------------------------------------------
class _Weights:
    """A host buffer marked as holding model weights (the packed path takes only those)."""

    def __init__(self, data: np.ndarray) -> None:
        from ggml_dist.backends.base import BufferUsage
        self.base, self.usage = data.reshape(-1), BufferUsage.WEIGHTS

    def release_pages(self, offset: int, size: int) -> None:
        pass


def _products(ctx, rng, wtype, Ms, K=128, n_tok=3):
    """Weights of wtype [K, M] for each M (their bytes placed in weight buffers) and their products by
    one activation x [K, n_tok]; returns x, the products and the weights' values as inputs."""
    from .test_quants import random_rows
    x = ctx.new_tensor(F32, (K, n_tok))
    ws, outs = [], []
    for k, M in enumerate(Ms):
        w = ctx.new_tensor(wtype, (K, M))
        w.buffer, w.data = _Weights(random_rows(wtype, M, K, seed=k + 1)), 0
        ws.append(w)
        outs.append(ops.mul_mat(ctx, w, x))
    return x, ws, outs


def _run_products(g, x, ws, outs, xv, extra=None):
    """g through the bound replay, every other tensor in its own buffer; the reference values of outs.
    extra: other leafs' values."""
    from ggml_dist.backends.base import tensor_array
    from ggml_dist.backends.cpu.reference import _HOST, _all_tensors
    from ggml_dist.core.tensor import nbytes
    inputs = {x: xv, **(extra or {})}
    want = ReferenceExecutor(ComputeOptions(numba=False)).compute(g, inputs)     # reads ws where they are
    for t in _all_tensors(g):
        if t.view_src is None and t not in ws:
            t.buffer, t.data = _HOST.alloc_buffer(max(nbytes(t), 1)), 0
    for t, v in inputs.items():
        t.buffer.set_tensor(t, v)
    compute_graph(g)
    return [want[o] for o in outs], [tensor_array(o).copy() for o in outs]


@pytest.mark.parametrize("wtype", [GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K])
def test_products_of_one_activation_run_as_one_call(ctx, rng, wtype):
    """A layer's Q, K and V products (consecutive, as model.graph_context.build_qkv places them) are one
    call with the separate products' bits, finite activations or not (then every node takes the generic
    path)."""
    K = 256 if wtype == GGMLType.Q4_K else 128
    x, ws, outs = _products(ctx, rng, wtype, (64, 24, 24), K)
    g = Graph()
    for o in outs:
        g.build_forward_expand(o)
    for bad in (False, True):
        xv = randn(rng, 3, K)
        if bad:
            xv[1, 3] = np.inf
        want, got = _run_products(g, x, ws, outs, xv)
        for a, b in zip(got, want):
            assert_same_bits(a, b)
    assert len(BoundGraph(g, OPTS).calls) == 1


def test_a_later_product_moves_up_past_nodes_that_leave_its_memory_alone(ctx, rng):
    """K's ROPE and cache store sit between a layer's products in llama.cpp's graph order: a product
    moves up to the first past such nodes, unless one of them reads or writes where its result goes
    (the allocator may have placed it over a tensor that dies in between)."""
    x, ws, outs = _products(ctx, rng, GGMLType.Q4_1, (64, 32))
    y = ctx.new_tensor(F32, (32, 2))
    between = ops.scale(ctx, y, 3.0)
    g = Graph()
    for t in (outs[0], between, outs[1]):
        g.build_forward_expand(t)
    want, got = _run_products(g, x, ws, outs, randn(rng, 3, 128), {y: randn(rng, 2, 32)})
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    assert len(BoundGraph(g, OPTS).calls) == 2                 # the products' call, then the SCALE
    between.buffer, between.data = outs[1].buffer, outs[1].data  # the SCALE writes where K's result goes
    assert len(BoundGraph(g, OPTS).calls) == 3
    between.buffer, between.data = y.buffer, y.data             # ... or reads it, in place
    y.buffer, y.data = outs[1].buffer, outs[1].data
    assert len(BoundGraph(g, OPTS).calls) == 3


def test_products_of_kinds_that_cannot_share_a_call_stay_apart(ctx, rng):
    x, ws, outs = _products(ctx, rng, GGMLType.Q4_1, (64,))
    w8 = ctx.new_tensor(GGMLType.Q8_0, (128, 32))
    from .test_quants import random_rows
    w8.buffer, w8.data = _Weights(random_rows(GGMLType.Q8_0, 32, 128, seed=9)), 0
    o8 = ops.mul_mat(ctx, w8, x)
    g = Graph()
    g.build_forward_expand(outs[0])
    g.build_forward_expand(o8)
    want, got = _run_products(g, x, [*ws, w8], [*outs, o8], randn(rng, 3, 128))
    for a, b in zip(got, want):
        assert_same_bits(a, b)
    assert len(BoundGraph(g, OPTS).calls) == 2


def _cache_rows(ctx, rng, n_tok, n_head, n_head_kv, d, cache_type, with_q, itype=GGMLType.I64):
    """A layer's new cache rows as the graph builder makes them: ROPE(K), SET_ROWS of it into the K
    cache, SET_ROWS of V into the V cache (transposed: one element a row, at j * cells + cell), and the
    Q rope after them; (graph, results, inputs)."""
    cells, w = max(16, n_tok), d * n_head_kv
    k, v = ctx.new_tensor(F32, (d, n_head_kv, n_tok)), ctx.new_tensor(F32, (1, w * n_tok))
    q, pos = ctx.new_tensor(F32, (d, n_head, n_tok)), ctx.new_tensor(GGMLType.I32, (n_tok,))
    k_cache, v_cache = ctx.new_tensor(cache_type, (w, cells)), ctx.new_tensor(cache_type, (1, w * cells))
    k_idx, v_idx = ctx.new_tensor(itype, (n_tok,)), ctx.new_tensor(itype, (w * n_tok,))
    k_roped = ops.rope_ext(ctx, k, pos, None, d, ops.ROPE_TYPE_NEOX, 4096, freq_base=10000.0)
    k_rows = ops.set_rows(ctx, k_cache, ops.reshape(ctx, k_roped, w, n_tok), k_idx)
    v_rows = ops.set_rows(ctx, v_cache, v, v_idx)
    q_roped = ops.rope_ext(ctx, q, pos, None, d, ops.ROPE_TYPE_NEOX, 4096, freq_base=10000.0)
    g = Graph()
    for t in (k_rows, v_rows, q_roped) if with_q else (k_rows, v_rows):
        g.build_forward_expand(t)
    slots = rng.permutation(cells)[:n_tok]
    cache = np.float16 if cache_type == GGMLType.F16 else np.float32
    index = np.int64 if itype == GGMLType.I64 else np.int32
    inputs = {k: randn(rng, n_tok, n_head_kv, d) * 3, v: randn(rng, w * n_tok, 1), q: randn(rng, n_tok, n_head, d),
              pos: np.arange(40, 40 + n_tok, dtype=np.int32), k_idx: slots.astype(index),
              v_idx: (np.arange(w)[:, None] * cells + slots[None, :]).astype(index).reshape(-1),
              k_cache: randn(rng, cells, w).astype(cache), v_cache: randn(rng, w * cells, 1).astype(cache)}
    if not with_q:
        del inputs[q]
    return g, [k_roped, k_rows, v_rows, *([q_roped] if with_q else [])], inputs


@pytest.mark.parametrize("cache_type", [GGMLType.F16, F32])
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("n_tok,n_head,n_head_kv,d", [(1, 9, 3, 64), (3, 4, 2, 32)])
def test_a_layer_s_cache_rows_run_as_one_call_with_the_same_bits(ctx, rng, cache_type, with_q, n_tok, n_head,
                                                                   n_head_kv, d):
    from ggml_dist.backends.base import tensor_array
    g, results, inputs = _cache_rows(ctx, rng, n_tok, n_head, n_head_kv, d, cache_type, with_q)
    assert [t.op.name for t in g.nodes if t.op.name in ("ROPE", "SET_ROWS")] == \
        ["ROPE", "SET_ROWS", "SET_ROWS", *(["ROPE"] if with_q else [])]
    want, _ = _run(g, results[-1], inputs)
    for t in results:                                   # every result written, the caches' too
        assert_same_bits(tensor_array(t).copy(), want[t])
    assert len(BoundGraph(g, OPTS).calls) == 1


def test_cache_rows_of_a_prompt_run_call_by_call(ctx, rng):
    """A prompt's rope splits across threads: its ops stay separate calls (each splits on its own)."""
    from ggml_dist.backends.base import tensor_array
    g, results, inputs = _cache_rows(ctx, rng, 64, 4, 4, 64, GGMLType.F16, True)
    want, _ = _run(g, results[-1], inputs)
    for t in results:
        assert_same_bits(tensor_array(t).copy(), want[t])
    assert len(BoundGraph(g, OPTS).calls) == 4


def test_cache_rows_with_i32_indices_run_call_by_call(ctx, rng):
    """The fused call takes I64 indices (the graph builder's); I32 ones keep each op a call of its own."""
    from ggml_dist.backends.base import tensor_array
    g, results, inputs = _cache_rows(ctx, rng, 1, 4, 2, 32, GGMLType.F16, True, itype=GGMLType.I32)
    want, _ = _run(g, results[-1], inputs)
    for t in results:
        assert_same_bits(tensor_array(t).copy(), want[t])
    assert len(BoundGraph(g, OPTS).calls) == 4


@pytest.mark.parametrize("n_tok,n_head,n_head_kv", [(1, 9, 3), (2, 4, 2)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_cache_rows_and_the_attention_that_reads_them_run_as_one_call(ctx, rng, n_tok, n_head, n_head_kv,
                                                                      n_threads):
    """A layer's new cache rows (ROPE K, SET_ROWS K and V, ROPE Q) then the attention over the caches, as
    the graph builder orders them: one call (bind_attention's rows) whose every result, the caches'
    new rows included, has the bits of the calls it replaces."""
    from ggml_dist.backends.base import tensor_array
    (kc, vc, q_in, m), _, _ = _attention(ctx, n_tok, n_head, n_head_kv)
    d, kv_size, w, used = 64, kc.ne[1], kc.ne[0], 37
    k, v = ctx.new_tensor(F32, (d, n_head_kv, n_tok)), ctx.new_tensor(F32, (1, w * n_tok))
    q, pos = ctx.new_tensor(F32, (d, n_head, n_tok)), ctx.new_tensor(GGMLType.I32, (n_tok,))
    k_idx, v_idx = ctx.new_tensor(GGMLType.I64, (n_tok,)), ctx.new_tensor(GGMLType.I64, (w * n_tok,))
    k_rows = ops.set_rows(ctx, kc, ops.reshape(ctx, ops.rope_ext(ctx, k, pos, None, d, ops.ROPE_TYPE_NEOX, 4096,
                                                                 freq_base=10000.0), w, n_tok), k_idx)
    v_rows = ops.set_rows(ctx, ops.reshape(ctx, vc, 1, kv_size * w), v, v_idx)
    q_roped = ops.rope_ext(ctx, q, pos, None, d, ops.ROPE_TYPE_NEOX, 4096, freq_base=10000.0)
    kview = ops.view_3d(ctx, kc, d, m.ne[0], n_head_kv, kc.nb[1], d * 2, 0)
    vview = ops.view_3d(ctx, vc, m.ne[0], d, n_head_kv, vc.nb[1], vc.nb[1] * d, 0)
    kq = ops.mul_mat(ctx, kview, ops.permute(ctx, q_roped, 0, 2, 1, 3))
    kqv = ops.mul_mat(ctx, vview, ops.soft_max_ext(ctx, kq, m, 0.125, 0.0))
    out = ops.cont(ctx, ops.permute(ctx, kqv, 0, 2, 1, 3), (d * n_head, n_tok))
    g = Graph()
    for t in (k_rows, v_rows, out):
        g.build_forward_expand(t)
    slots = np.arange(used - n_tok, used)
    inputs = _attention_inputs(rng, (kc, vc, q_in, m), n_tok)
    del inputs[q_in]
    inputs.update({k: randn(rng, n_tok, n_head_kv, d) * 3, v: randn(rng, w * n_tok, 1),
                   q: randn(rng, n_tok, n_head, d), pos: np.arange(40, 40 + n_tok, dtype=np.int32),
                   k_idx: slots.astype(np.int64),
                   v_idx: (np.arange(w)[:, None] * kv_size + slots[None, :]).reshape(-1).astype(np.int64)})
    want, got = _run_at(n_threads, g, out, inputs)
    assert_same_bits(got, want[out])
    for t in (kc, vc, q_roped, kq, kqv):
        assert_same_bits(tensor_array(t).copy(), want[t])
    assert len(BoundGraph(g, OPTS).calls) == 1

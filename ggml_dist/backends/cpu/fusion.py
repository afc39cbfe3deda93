"""Nodes that a bound replay (cpu.BoundGraph) runs as one kernel call.

A decode step of a small model is ~650 kernel calls of a few microseconds each, and a call's fixed cost
(Python, numba's argument unboxing, a parallel launch) is a good part of that. ggml's CPU path fuses
too: rms_norm takes the MUL by the norm weight into its row loop. For consecutive nodes the rule is
ggml_can_fuse's: the nodes are consecutive in the compute order (so no other node's memory, which the
allocator may have placed where a skipped result would go, is live in between), and each result that
is not written is read by the next node only (its use count in the whole graph is 1: a split's graph is
a view, and a node of a later split may read the result through a copy) and is not a graph output.
Every fused call gives the bits of the kernels it replaces.

    RMS_NORM, MUL(norm, w)                  fkernels.rms_norm(x, eps, w, fused=True)
    ADD, RMS_NORM, MUL(norm, w)             fkernels.add_rms_norm: the sum is written (the residual
                                            stream reads it again), the norm is not
    MUL(experts, weights), k-1 ADDs         moe_ops.bind_combine: a MoE layer's weighted sum of its k
      of its slot views                     experts' outputs; only the last sum is written
    ARGSORT(p) [, GET_ROWS(p, top k)]       moe_ops.bind_topk: a MoE router's choice (every result written)
    SUM_ROWS(w), CLAMP, DIV(w, clamped)     moe_ops.bind_norm: its weights normalised (every result written)
    MUL_MAT(K, Q), SOFT_MAX, MUL_MAT(V, p)  fkernels.bind_attention: every result written, one call
      [, CONT(PERMUTE(KQV))]                (two parallel loops and the copy) instead of four
    ROPE(K), SET_ROWS(K), SET_ROWS(V)       fkernels.bind_cache_rows: a layer's new cache rows, each op
      [, ROPE(Q)]                           as its own call (every result written), where none splits;
      [, the attention chain]               with the attention that follows, bind_attention's rows: one
                                            call that writes them, then runs the chain

Products of packed weights by the same activation need not be consecutive (a layer's K, V and Q
products have their ROPE and SET_ROWS between them): the later ones move up to the first, which is
safe where no node passed over reads or writes memory a moved product writes, or writes its
activation (the allocator may have put a moved product's result over a tensor that dies in between).

    MUL_MAT(W1, x) ... MUL_MAT(W2, x) [... MUL_MAT(W3, x)]
                                            ops.bind_packed_products: x quantized once, the weights'
                                            groups shared among the threads in one launch
    MUL_MAT_ID(E1, x, ids) ... MUL_MAT_ID(E2, x, ids)
                                            ops.bind_packed_experts: a MoE layer's gate and up experts,
                                            routed and quantized once, one launch
"""
from __future__ import annotations

import numpy as np

from ...core.tensor import Op, SortOrder, Tensor, TensorFlag
from ...core.types import GGMLType
from . import ops
from .ops import Binding, Bound, _alibi_slopes_cached, attention_product
from .rope import rope_args


def fuse(nodes: list[Tensor], i: int, b: Binding, taken: set[int]) -> tuple[Bound, list[int]] | None:
    """The call that runs nodes[i] and others with it, and the indices of the nodes it runs (nodes[i]'s
    first); None where no fusion applies (each node is bound on its own). taken: the indices past i
    that an earlier call already runs."""
    fk, array = b.fk, b.array
    if fk is None or array is None or b.opts.exact:
        return None
    if nodes[i].op == Op.MUL_MAT:
        products = _shared_activation(nodes, i, b, taken)
        if products is not None:
            return products
    if nodes[i].op == Op.MUL_MAT_ID:
        return _shared_experts(nodes, i, b, taken)
    run = _consecutive(nodes, i, b)
    if run is None:
        return None
    call, n = run
    assert not taken.intersection(range(i, i + n)), "a consecutive fusion over a node that moved up"
    return call, list(range(i, i + n))


_LOOKAHEAD = 16         # nodes past a product searched for others of its activation


def _shared_activation(nodes: list[Tensor], i: int, b: Binding, taken: set[int]
                       ) -> tuple[Bound, list[int]] | None:
    """nodes[i], a packed product, with the later products of its activation that share its call
    (ops.bind_packed_products) and may move up to it (see the module docstring); None where there is
    no other."""
    array = b.array
    assert array is not None
    t = nodes[i]
    x = t.src[1]
    first = ops.packed_product(t, array(t), _srcs(t, array), b.opts)
    if first is None or first[2].shape[0] == 0:
        return None
    picked, most = [i], first[0].MULTI           # the packing module's (qpack, kpack) most per call
    read_or_written: list[np.ndarray] = []          # by the nodes passed over
    written: list[np.ndarray] = []
    for j in range(i + 1, min(len(nodes), i + _LOOKAHEAD)):
        if len(picked) == most:
            break
        if j in taken:
            continue
        u = nodes[j]
        dst, srcs = array(u), _srcs(u, array)
        if u.op == Op.MUL_MAT and u.src[1] is x:
            p = ops.packed_product(u, dst, srcs, b.opts)
            if (p is not None and p[0] is first[0] and first[1].shares_call(p[1])
                    and not _overlap([dst], read_or_written) and not _overlap(written, [first[2]])):
                picked.append(j)
                continue
        read_or_written += [dst, *(a for a in srcs if a is not None)]
        written.append(dst)
    if len(picked) == 1:
        return None
    call = ops.bind_packed_products([nodes[k] for k in picked], [array(nodes[k]) for k in picked],
                                    [_srcs(nodes[k], array) for k in picked], b.opts)
    return None if call is None else (call, picked)


def _shared_experts(nodes: list[Tensor], i: int, b: Binding, taken: set[int]) -> tuple[Bound, list[int]] | None:
    """nodes[i], a packed MUL_MAT_ID (ops.packed_experts), with the later ones of the same activations and
    ids whose weights share its call (a layer's expert gate and up), moved up to it under
    _shared_activation's rule; None where there is no other."""
    array = b.array
    assert array is not None
    t = nodes[i]
    first = ops.packed_experts(t, array(t), _srcs(t, array), b.opts)
    if first is None:
        return None
    picked = [i]
    read_or_written: list[np.ndarray] = []
    written: list[np.ndarray] = []
    for j in range(i + 1, min(len(nodes), i + _LOOKAHEAD)):
        if len(picked) == 2:
            break
        if j in taken:
            continue
        u = nodes[j]
        dst, srcs = array(u), _srcs(u, array)
        if u.op == Op.MUL_MAT_ID and u.src[1] is t.src[1] and u.src[2] is t.src[2]:
            p = ops.packed_experts(u, dst, srcs, b.opts)
            if (p is not None and first[0].shares_call(p[0]) and not _overlap([dst], read_or_written)
                    and not _overlap(written, [first[1], first[2]])):
                picked.append(j)
                continue
        read_or_written += [dst, *(a for a in srcs if a is not None)]
        written.append(dst)
    if len(picked) == 1:
        return None
    call = ops.bind_packed_experts([nodes[k] for k in picked], [array(nodes[k]) for k in picked],
                                   [_srcs(nodes[k], array) for k in picked], b.opts)
    return None if call is None else (call, picked)


def _srcs(t: Tensor, array) -> list:
    return [array(x) if x is not None else None for x in t.src]


def _consecutive(nodes: list[Tensor], i: int, b: Binding) -> tuple[Bound, int] | None:
    """The call that runs nodes[i], nodes[i+1], ... at once (the table above), and how many nodes it
    runs; None where none applies."""
    fk, array = b.fk, b.array
    assert fk is not None and array is not None
    t = nodes[i]
    if t.op == Op.RMS_NORM:
        w = _norm_weight(nodes, i, b)
        x = t.src[0]
        if w is not None and x is not None:
            a_x, dst = array(x), array(nodes[i + 1])
            if _same_or_apart(dst, a_x):
                return fk.bind_rms_norm(a_x, np.float32(t.op_param(0)), array(w), True, dst), 2
    if t.op == Op.ADD and i + 1 < len(nodes) and nodes[i + 1].op == Op.RMS_NORM:
        norm = nodes[i + 1]
        w = _norm_weight(nodes, i + 1, b)
        a, c = t.src[0], t.src[1]
        if (w is not None and norm.src[0] is t and a is not None and c is not None
                and all(x.type == GGMLType.F32 for x in (t, a, c)) and a.ne == c.ne == t.ne):
            a_a, a_c, dst = array(a), array(c), array(nodes[i + 2])
            if _same_or_apart(dst, a_a) and _same_or_apart(dst, a_c):
                return fk.bind_add_rms_norm(a_a, a_c, array(t), np.float32(norm.op_param(0)), array(w), dst), 3
    if t.op == Op.MUL_MAT:
        return _attention(nodes, i, b)
    if t.op == Op.MUL:
        return _experts_sum(nodes, i, b)
    if t.op == Op.ARGSORT:
        return _router_topk(nodes, i, b)
    if t.op == Op.SUM_ROWS:
        return _router_norm(nodes, i, b)
    if t.op == Op.ROPE:
        return _cache_rows(nodes, i, b)
    return None


def _experts_sum(nodes: list[Tensor], i: int, b: Binding) -> tuple[Bound, int] | None:
    """MUL(y, weights) and the k - 1 ADDs of its slot views (model/moe.py's weighted sum of the experts:
    y [n, k, n_tok], weights [1, k, n_tok], slot s the view of y's ne[1] index s), as moe_ops.bind_combine's
    one call: the MUL's result and the partial sums are not written (each read only by the next ADD,
    not outputs)."""
    array = b.array
    assert array is not None
    m = nodes[i]
    y, w = m.src[0], m.src[1]
    if y is None or w is None or any(x.type != GGMLType.F32 for x in (m, y, w)):
        return None
    n, k, n_tok = y.ne[0], y.ne[1], y.ne[2]
    if k < 2 or y.ne[3] != 1 or w.ne != (1, k, n_tok, 1) or i + k - 1 >= len(nodes) or m.flags & TensorFlag.OUTPUT:
        return None
    views = list(b.consumers.get(m, ()))
    if len(views) != k or b.use_counts.get(m, 0) != k:
        return None
    prev: Tensor | None = None
    for s in range(1, k):
        a = nodes[i + s]
        if a.op != Op.ADD or a.type != GGMLType.F32 or a.ne != (n, n_tok, 1, 1):
            return None
        first, other = a.src[0], a.src[1]
        if first is None or other is None or not _slot(other, m, s) or \
                not (_slot(first, m, 0) if s == 1 else first is prev):
            return None
        if s < k - 1 and (b.use_counts.get(a, 0) != 1 or a.flags & TensorFlag.OUTPUT):
            return None
        prev = a
    assert prev is not None
    from . import moe_ops
    ay, aw, out = _view(array(y), (n_tok, k, n)), _view(array(w), (n_tok, k)), _view(array(prev), (n_tok, n))
    if ay is None or aw is None or out is None:
        return None
    call = moe_ops.bind_combine(ay, aw, out)
    return None if call is None else (call, k)


def _router_topk(nodes: list[Tensor], i: int, b: Binding) -> tuple[Bound, int] | None:
    """ARGSORT(p) of F32 rows [+ the GET_ROWS that follows it: p's rows (reshaped to one value per row)
    at the top-k view of the sort, a MoE router's chosen weights] as moe_ops.bind_topk's one call;
    every result written."""
    array = b.array
    assert array is not None
    t = nodes[i]
    p = t.src[0]
    if p is None or p.type != GGMLType.F32 or t.type != GGMLType.I32 or p.ne[2] != 1 or p.ne[3] != 1:
        return None
    E, n_tok = p.ne[0], p.ne[1]
    g = nodes[i + 1] if i + 1 < len(nodes) else None
    if g is not None:
        src, ids = g.src[0], g.src[1]
        if not (g.op == Op.GET_ROWS and g.type == GGMLType.F32 and src is not None and ids is not None
                and src.view_src is p and src.view_offs == 0 and src.ne[:3] == (1, E, n_tok)
                and ids.view_src is t and ids.view_offs == 0 and ids.ne[1:] == (n_tok, 1, 1)
                and ids.nb[1] == t.nb[1] and g.ne[:3] == (1, ids.ne[0], n_tok)):
            g = None
    from . import moe_ops
    k = 0 if g is None else g.ne[1]
    ap, at = _view(array(p), (n_tok, E)), _view(array(t), (n_tok, E))
    ag = None if g is None else _view(array(g), (n_tok, k))
    if ap is None or at is None or (g is not None and ag is None):
        return None
    call = moe_ops.bind_topk(ap, at, SortOrder(t.op_param(0)) == SortOrder.DESC, ag)
    return None if call is None else (call, 1 if g is None else 2)


def _router_norm(nodes: list[Tensor], i: int, b: Binding) -> tuple[Bound, int] | None:
    """SUM_ROWS(w), CLAMP of the sum, DIV(w, the clamped sum) (a MoE router's weights normalised,
    model/moe.py's norm_w) as moe_ops.bind_norm's one call; every result written."""
    array = b.array
    assert array is not None
    if i + 2 >= len(nodes):
        return None
    sr, cl, dv = nodes[i], nodes[i + 1], nodes[i + 2]
    w = sr.src[0]
    if (w is None or cl.op != Op.CLAMP or cl.src[0] is not sr or dv.op != Op.DIV or dv.src[0] is not w
            or dv.src[1] is not cl or any(x.type != GGMLType.F32 for x in (w, sr, cl, dv))
            or w.ne[2] != 1 or w.ne[3] != 1 or dv.ne != w.ne):
        return None
    k, n_tok = w.ne[0], w.ne[1]
    from . import moe_ops
    views = [_view(array(x), shape) for x, shape in ((w, (n_tok, k)), (sr, (n_tok,)), (cl, (n_tok,)), (dv, (n_tok, k)))]
    if any(v is None for v in views):
        return None
    aw, asr, acl, adv = views
    assert aw is not None and asr is not None and acl is not None and adv is not None
    call = moe_ops.bind_norm(aw, asr, acl, adv, np.float32(cl.op_param(0)), np.float32(cl.op_param(1)))
    return None if call is None else (call, 3)


def _view(a: np.ndarray, shape: tuple[int, ...]) -> np.ndarray | None:
    """a seen with another shape without a copy (the call writes through it), or None where that needs one."""
    v = a.view()
    try:
        v.shape = shape
    except (AttributeError, ValueError):
        return None
    return v


def _slot(v: Tensor, m: Tensor, s: int) -> bool:
    """v is the 2-D view of m's slot s (ne = (m.ne[0], m.ne[2]), rows m.nb[2] apart, offset s * m.nb[1])."""
    return (v.op == Op.VIEW and v.view_src is m and v.ne[:2] == (m.ne[0], m.ne[2]) and v.nb[1] == m.nb[2]
            and v.view_offs == s * m.nb[1])


def _cache_rows(nodes: list[Tensor], i: int, b: Binding) -> tuple[Bound, int] | None:
    """ROPE, SET_ROWS, SET_ROWS [, ROPE] from nodes[i] (a layer's K rope, its K and V cache writes, then
    the Q rope where it follows) as one call, where each would be one serial call of its own: the
    ops run in the graph's order, so what each reads and writes is what it would alone."""
    fk, array = b.fk, b.array
    assert fk is not None and array is not None
    if i + 2 >= len(nodes) or nodes[i + 1].op != Op.SET_ROWS or nodes[i + 2].op != Op.SET_ROWS:
        return None

    def rope(t: Tensor) -> tuple | None:
        args = rope_args(t, array(t), _srcs(t, array), fk, b.prologue, b.shared)
        return args if args is not None and fk.rope_is_serial(args[0]) else None

    def store(t: Tensor) -> tuple | None:
        args = ops.set_rows_args(t, array(t), _srcs(t, array), b)
        return args if args is not None and fk.set_rows_is_serial(args[0]) else None
    rope_k, store_k, store_v = rope(nodes[i]), store(nodes[i + 1]), store(nodes[i + 2])
    if rope_k is None or store_k is None or store_v is None:
        return None
    rope_q = rope(nodes[i + 3]) if i + 3 < len(nodes) and nodes[i + 3].op == Op.ROPE else None
    n = 3 if rope_q is None else 4
    if i + n < len(nodes) and nodes[i + n].op == Op.MUL_MAT:       # the attention that reads them next
        rows = fk.cache_rows_args(rope_k, store_k, store_v, rope_q)
        attention = None if rows is None else _attention(nodes, i + n, b, rows)
        if attention is not None:
            return attention[0], n + attention[1]
    call = fk.bind_cache_rows(rope_k, store_k, store_v, rope_q)
    return None if call is None else (call, n)


def _attention(nodes: list[Tensor], i: int, b: Binding, rows: tuple | None = None) -> tuple[Bound, int] | None:
    """The attention chain from nodes[i] (see ops.attention_product), with the CONT of its permuted
    output where that follows; None where a result overlaps what the threads may read meanwhile (see
    fkernels.bind_attention). rows: the layer's new cache rows just before (fkernels.cache_rows_args),
    which the call writes first."""
    if i + 2 >= len(nodes):
        return None
    kq, sm, kqv = nodes[i], nodes[i + 1], nodes[i + 2]
    if (sm.op != Op.SOFT_MAX or sm.src[0] is not kq or len(sm.src) < 2 or sm.src[1] is None
            or ops._has_sinks(sm) or kqv.op != Op.MUL_MAT or kqv.src[1] is not sm or kq.ne[0] % 8
            or sm.type != GGMLType.F32):
        return None
    array = b.array
    assert array is not None
    pk = attention_product(kq, [array(x) if x is not None else None for x in kq.src[:2]], b)
    pv = attention_product(kqv, [array(x) if x is not None else None for x in kqv.src[:2]], b)
    if pk is None or pv is None or pk[3] != 1 or pv[3] != 2:
        return None
    a_kq, a_sm, a_kqv = array(kq), array(sm), array(kqv)
    n, cont = 3, None
    if i + 3 < len(nodes):
        c = nodes[i + 3]
        perm = c.src[0] if c.op == Op.CONT else None
        if (perm is not None and perm.op == Op.PERMUTE and perm.src[0] is kqv and c.type == GGMLType.F32
                and array(c).flags.c_contiguous):
            n, cont = 4, _in_source_order(array(c), perm)
    mask = array(sm.src[1])
    if not ops._has_unit_rows(a_kq, a_sm, a_kqv, mask):        # (the kernels read rows as slices)
        return None
    in_place = (a_sm.ctypes.data, a_sm.shape, a_sm.strides) == (a_kq.ctypes.data, a_kq.shape, a_kq.strides)
    first = [a_kq] if in_place else [a_kq, a_sm]            # the first loop's results, then what it reads
    if (_overlap(first, [pk[0], pk[1], mask]) or _overlap([a_kqv], [a_sm, pv[0]])
            or (cont is not None and _overlap([cont], [a_kqv]))):
        return None
    scale = np.float32(sm.op_param(0, 1.0))
    slopes = _alibi_slopes_cached(kq.ne[2], float(sm.op_param(1, 0.0)))
    fk = b.fk
    assert fk is not None
    one_loop = (not _overlap(first, [pv[0]]) and not _overlap([a_kqv], [pk[0], mask, a_kq])
                and (_same_rows(a_kqv, pk[1]) or not _overlap([a_kqv], [pk[1]])))
    call = fk.bind_attention(pk[0], pk[1], a_kq, mask, pk[2], scale, slopes, a_sm, pv[0], pv[2], a_kqv, cont,
                             one_loop, rows)
    return None if call is None else (call, n)


def _same_rows(a: np.ndarray, b: np.ndarray) -> bool:
    """a and b are the same memory indexed alike (the same start, shape, and strides along every axis
    longer than 1): each slice of a lies over the same slice of b, which only its own thread reads."""
    return (a.ctypes.data == b.ctypes.data and a.shape == b.shape
            and all(sa == sb for sa, sb, e in zip(a.strides, b.strides, a.shape) if e > 1))


def _same_or_apart(dst: np.ndarray, src: np.ndarray) -> bool:
    """dst is src exactly or shares no memory with it. A fused norm writes its MUL's result row by row
    after reading the row's source; the allocator placed that result when the source may have been
    dead already (the skipped norm read it), so anywhere over it: a shifted overlap would overwrite
    rows not read yet."""
    return (dst.ctypes.data, dst.shape, dst.strides) == (src.ctypes.data, src.shape, src.strides) or \
        not np.may_share_memory(dst, src)


def _overlap(writes: list[np.ndarray], others: list[np.ndarray]) -> bool:
    """Whether some array of writes may share memory with a later one of writes or one of others."""
    return any(np.may_share_memory(w, x) for k, w in enumerate(writes) for x in writes[k + 1:] + others)


def _in_source_order(dst: np.ndarray, perm: Tensor) -> np.ndarray:
    """A contiguous CONT destination of PERMUTE(x) seen with x's shape: element [idx] is where the copy
    puts x[idx]. ggml_permute moves x's dim i to position axes[i]; CONT writes the permuted tensor's
    elements in its ggml order (dim 0 fastest)."""
    x = perm.src[0]
    assert x is not None
    axes = perm.op_params[:4]
    stride, strides = dst.itemsize, [0] * 4                 # the permuted tensor's, contiguous, by ggml dim
    for k in range(4):
        strides[k] = stride
        stride *= perm.ne[k]
    ggml = [strides[axes[i]] for i in range(4)]             # x's ggml dim i lands on permuted dim axes[i]
    return np.lib.stride_tricks.as_strided(dst, shape=tuple(reversed(x.ne)), strides=tuple(reversed(ggml)))


def _norm_weight(nodes: list[Tensor], i: int, b: Binding) -> Tensor | None:
    """The norm weight w where nodes[i] is an F32 RMS_NORM read only by nodes[i+1] = MUL(norm, w) (either
    operand order: f32 products commute), w an F32 row of the norm's width; else None."""
    norm = nodes[i]
    if i + 1 >= len(nodes) or norm.op != Op.RMS_NORM or norm.flags & TensorFlag.OUTPUT:
        return None
    mul = nodes[i + 1]
    x = norm.src[0]
    if mul.op != Op.MUL or b.use_counts.get(norm, 0) != 1 or b.consumers.get(norm) != [mul] or x is None:
        return None
    w = mul.src[1] if mul.src[0] is norm else mul.src[0] if mul.src[1] is norm else None
    if w is None or w is norm or any(t.type != GGMLType.F32 for t in (norm, x, mul, w)):
        return None
    if mul.ne != norm.ne or w.ne[0] != norm.ne[0] or any(n != 1 for n in w.ne[1:]):
        return None
    return w

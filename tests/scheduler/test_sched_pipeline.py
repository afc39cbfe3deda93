"""n_copies > 1: micro-batches over two asynchronous backends (ordering and results, not time)."""
from __future__ import annotations

import numpy as np

from ggml_dist.backends.accel import AccelDevice
from ggml_dist.backends.base import tensor_array
from ggml_dist.backends.cpu.backend import CPUDevice
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import Op
from ggml_dist.core.types import GGMLType
from ggml_dist.scheduler.sched import Sched
from ggml_dist.scheduler.trace import TraceRecorder

from .common import alloc_weights

D, N = 16, 8


def _weights(gpu, cpu_dev):
    ctx = Context(1 << 16, no_alloc=True)
    w1 = ctx.new_tensor(GGMLType.F32, (D, D)).set_name("w1")
    w2 = ctx.new_tensor(GGMLType.F32, (D, D)).set_name("w2")
    alloc_weights(gpu.buft, [w1])
    alloc_weights(cpu_dev.buft, [w2], np.random.default_rng(1))
    return w1, w2


def _build(w1, w2):
    """x (INPUT, CPU) -> GPU0: silu(w1 @ x) -> CPU: scale(w2 @ h). A fresh graph per micro-batch."""
    ctx = Context(1 << 16, no_alloc=True)
    x = ctx.new_tensor(GGMLType.F32, (D, N)).set_name("x").set_input()
    h = ops.silu(ctx, ops.mul_mat(ctx, w1, x)).set_name("h")
    y = ops.scale(ctx, ops.mul_mat(ctx, w2, h), 0.25).set_name("y").set_output()
    g = Graph(64)
    g.build_forward_expand(y)
    return g, x, y


def _run(n_copies: int, n_ubatch: int = 4):
    cpu_dev, gpu = CPUDevice("CPU"), AccelDevice("GPU0")
    backends = [gpu.init_backend(async_compute=True), cpu_dev.init_backend(async_compute=True)]
    sched = Sched(backends, n_copies=n_copies)
    trace = TraceRecorder()
    sched.set_trace(trace)
    w1, w2 = _weights(gpu, cpu_dev)
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal((N, D)).astype(np.float32) for _ in range(n_ubatch)]
    wants, got, copies, x_addrs = [], [], [], []
    for m in range(n_ubatch):
        g, x, y = _build(w1, w2)
        wants.append(ReferenceExecutor().compute(g, {x: inputs[m]})[y].copy())
        sched.reset()
        assert sched.alloc_graph(g)
        copies.append(sched.cur_copy)
        x_addrs.append(x.data)
        if n_copies == 1:
            # one copy: x shares compute memory with micro-batch m-1's tensors, which an asynchronous
            # backend may still be using; without pipeline copies the user must wait before writing
            sched.synchronize()
        x.buffer.set_tensor(x, inputs[m])
        sched.graph_compute_async(g)
        # read the output in the CPU backend's stream order, before micro-batch m+1 overwrites it
        backends[1].submit(lambda y=y: got.append(tensor_array(y).copy()))
    sched.synchronize()
    return sched, trace, wants, got, copies, x_addrs


# 4 micro-batches, 4 copies: copy slots rotate, inputs move, results equal the reference, in order
def test_four_microbatches_four_copies():
    sched, trace, wants, got, copies, x_addrs = _run(4)
    assert copies == [0, 1, 2, 3]
    assert len(set(x_addrs)) == 4                 # the user's input lands in a different slot each time
    # split #0 on GPU0 with the input x, split #1 on CPU with h
    assert [(sched.backends[sp.backend_id].name, [s.name for s in sp.inputs]) for sp in sched.splits] == \
        [("GPU0", ["x"]), ("CPU", ["h"])]
    assert len(got) == 4
    for w, r in zip(wants, got):
        np.testing.assert_array_equal(r, w)
    # per backend, split events appear in micro-batch order and never overlap on one stream
    by_backend: dict[str, list] = {}
    for e in sorted(trace.events, key=lambda e: e.ts_us):
        by_backend.setdefault(e.backend, []).append(e)
    assert set(by_backend) == {"GPU0", "CPU"}
    for evs in by_backend.values():
        assert len(evs) == 4
        for a, b in zip(evs, evs[1:]):
            assert a.ts_us + a.dur_us <= b.ts_us + 1e-3
    doc = trace.to_json()
    assert all(e["ph"] in ("X", "M") for e in doc["traceEvents"])


# n_copies = 2 with 4 micro-batches: slots are reused (0,1,0,1) and results still match
def test_four_microbatches_two_copies():
    sched, trace, wants, got, copies, x_addrs = _run(2)
    assert copies == [0, 1, 0, 1]
    assert x_addrs[0] == x_addrs[2] and x_addrs[0] != x_addrs[1]
    for w, r in zip(wants, got):
        np.testing.assert_array_equal(r, w)


# n_copies = 1 baseline on async backends: same results
def test_four_microbatches_one_copy():
    sched, trace, wants, got, copies, _ = _run(1)
    assert copies == [0, 0, 0, 0]
    for w, r in zip(wants, got):
        np.testing.assert_array_equal(r, w)


# invariants 33/34: synchronize while unallocated restarts at copy 0; compute on an allocated scheduler
# ignores its argument and reruns the stored splits with the same cur_copy
def test_copy_rotation_and_rerun():
    cpu_dev, gpu = CPUDevice("CPU"), AccelDevice("GPU0")
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()], n_copies=3)
    w1, w2 = _weights(gpu, cpu_dev)
    g, x, y = _build(w1, w2)
    assert sched.alloc_graph(g) and sched.cur_copy == 0
    x.buffer.set_tensor(x, np.ones((N, D), np.float32))
    sched.graph_compute(g)
    first = tensor_array(y).copy()
    other, _, _ = _build(w1, w2)
    sched.graph_compute_async(other)               # allocated: `other` is ignored
    sched.synchronize()
    assert sched.cur_copy == 0
    np.testing.assert_array_equal(tensor_array(y), first)
    sched.reset()
    g2, x2, _ = _build(w1, w2)
    assert sched.alloc_graph(g2) and sched.cur_copy == 1
    sched.reset()
    sched.synchronize()                            # not allocated: next alloc uses copy 0
    g3, _, _ = _build(w1, w2)
    assert sched.alloc_graph(g3) and sched.cur_copy == 0


# async backends sharing a buffer type: a split that reads the previous split's output directly (no
# copy) and also has copied inputs must still wait for the previous split (a race in ggml's rules)
def test_shared_buft_direct_read_waits_for_previous_split():
    K, M = 384, 384
    cpu_dev = CPUDevice("CPU")
    acc = AccelDevice("ACC0")
    blas = AccelDevice("BLAS", supported_ops={Op.MUL_MAT}, shares_cpu_buft=True, cpu_buft=cpu_dev.buft)
    backends = [acc.init_backend(True), blas.init_backend(True), cpu_dev.init_backend(True)]
    wctx = Context(1 << 16, no_alloc=True)
    w0 = wctx.new_tensor(GGMLType.F32, (K, K)).set_name("w0")
    wb = wctx.new_tensor(GGMLType.F32, (K, K)).set_name("wb")
    alloc_weights(acc.buft, [w0])
    alloc_weights(cpu_dev.buft, [wb], np.random.default_rng(3))
    for _ in range(3):
        sched = Sched(backends)
        ctx = Context(1 << 16, no_alloc=True)
        x = ctx.new_tensor(GGMLType.F32, (K, M)).set_name("x").set_input()
        z = ops.mul_mat(ctx, w0, x).set_name("z")                 # ACC0 (1.wgt0)
        a = ops.mul_mat(ctx, wb, x).set_name("a")                 # BLAS (1.wgt0), slow
        y = ops.add(ctx, z, a).set_name("y").set_output()         # CPU (usr): copy of z, a read directly
        sched.set_tensor_backend(y, backends[2])
        g = Graph(16)
        g.build_forward_expand(y)
        xv = np.random.default_rng(5).standard_normal((M, K)).astype(np.float32)
        want = ReferenceExecutor().compute(g, {x: xv})[y].copy()
        assert sched.alloc_graph(g)
        x.buffer.set_tensor(x, xv)
        sched.graph_compute(g)
        assert [(sched.backends[sp.backend_id].name, [s.name for s in sp.inputs]) for sp in sched.splits] \
            == [("ACC0", ["x"]), ("BLAS", []), ("CPU", ["z"])]
        np.testing.assert_array_equal(tensor_array(y), want)

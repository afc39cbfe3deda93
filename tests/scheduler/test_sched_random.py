"""Property-based scheduler tests: random graphs over 2-3 backends with random op support.

Checked on every example: every node runs on a backend that supports it, each split has one backend,
every operand on another backend is reached through a copy (§5.1 invariants 22-25), and the scheduled
result equals the reference executor's bit for bit.
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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

from .common import alloc_weights, check_invariants

D, N = 8, 4
OPS = [Op.ADD, Op.MUL, Op.SCALE, Op.MUL_MAT, Op.CONT, Op.RMS_NORM, Op.SOFT_MAX, Op.UNARY]
STEPS = ["add", "mul_w", "scale", "matmul_w", "rms", "silu", "attn", "reshape", "view"]


@st.composite
def scenarios(draw):
    n_acc = draw(st.integers(1, 2))
    accs = []
    for k in range(n_acc):
        ops_k = draw(st.sets(st.sampled_from(OPS), min_size=2))
        shares = draw(st.booleans()) if k == n_acc - 1 else False
        offload = draw(st.sets(st.sampled_from([Op.MUL_MAT, Op.MUL])))
        accs.append((ops_k, shares, offload))
    steps = draw(st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 1000), st.integers(0, 1000),
                                    st.integers(0, n_acc)), min_size=4, max_size=16))
    n_copies = draw(st.sampled_from([1, 1, 2, 4]))
    op_offload = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    async_compute = draw(st.booleans())
    return accs, steps, n_copies, op_offload, seed, async_compute


def _build(accs, steps, seed):
    rng = np.random.default_rng(seed)
    cpu_dev = CPUDevice("CPU")
    devs = [AccelDevice(f"ACC{k}", ops_k, offload, shares, cpu_buft=cpu_dev.buft)
            for k, (ops_k, shares, offload) in enumerate(accs)]
    devs.append(cpu_dev)
    ctx = Context(1 << 22, no_alloc=True)
    x = ctx.new_tensor(GGMLType.F32, (D, N)).set_name("x").set_input()
    pool = [x]

    def weight(ne, b):
        w = ctx.new_tensor(GGMLType.F32, ne).set_name(f"w{len(ctx.tensors)}")
        alloc_weights(devs[b].get_buffer_type(), [w], rng)
        return w

    for i, (kind, i0, i1, wb) in enumerate(steps):
        a, b = pool[i0 % len(pool)], pool[i1 % len(pool)]
        if kind == "add":
            t = ops.add(ctx, a, b)
        elif kind == "mul_w":
            t = ops.mul(ctx, a, weight((D,), wb))
        elif kind == "scale":
            t = ops.scale(ctx, a, 0.5)
        elif kind == "matmul_w":
            t = ops.mul_mat(ctx, weight((D, D), wb), a)
        elif kind == "rms":
            t = ops.rms_norm(ctx, a, 1e-5)
        elif kind == "silu":
            t = ops.silu(ctx, a)
        elif kind == "attn":
            kqs = ops.soft_max_ext(ctx, ops.mul_mat(ctx, a, b), None)      # ne = (N, N)
            t = ops.mul_mat(ctx, ops.cont(ctx, ops.transpose(ctx, a)), kqs)  # ne = (D, N)
        elif kind == "reshape":
            t = ops.scale(ctx, ops.reshape(ctx, ops.reshape(ctx, a, D * N), D, N), 2.0)
        else:
            t = ops.add(ctx, ops.view_2d(ctx, a, D, N, a.nb[1], 0), b)
        t.set_name(f"{kind}-{i}")
        pool.append(t)
    out = pool[-1]
    for t in pool[-3:-1]:
        out = ops.add(ctx, out, t)
    out.set_name("out").set_output()
    g = Graph(512)
    g.build_forward_expand(out)
    return devs, g, x, out


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_graphs_match_reference(sc):
    accs, steps, n_copies, op_offload, seed, async_compute = sc
    devs, g, x, out = _build(accs, steps, seed)
    xv = np.random.default_rng(seed + 1).standard_normal((N, D)).astype(np.float32)
    want = ReferenceExecutor().compute(g, {x: xv})[out].copy()
    sched = Sched([d.init_backend(async_compute) for d in devs], n_copies=n_copies, op_offload=op_offload)
    assert sched.alloc_graph(g)
    x.buffer.set_tensor(x, xv)
    sched.graph_compute(g)
    check_invariants(sched, g)
    for t in g.nodes:
        b = sched.get_tensor_backend(t)
        assert b is not None and b.device.supports_op(t), f"{t.name} on {b}"
    np.testing.assert_array_equal(tensor_array(out), want)

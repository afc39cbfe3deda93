"""The scheduler worked examples of ggml-mechanisms.md §5.3 (fake GPU devices = AccelDevice)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.accel import AccelDevice
from ggml_dist.backends.base import tensor_array
from ggml_dist.backends.cpu.backend import CPUDevice
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core.context import Context
from ggml_dist.core.tensor import Op, TensorFlag
from ggml_dist.scheduler.sched import Sched

from .common import build_llama_like, check_invariants, splits_summary, token_ids

ALL = None


def _ctx() -> Context:
    return Context(1 << 20, no_alloc=True)


def _setup_s0(n_copies: int = 1, async_compute: bool = False):
    cpu_dev = CPUDevice("CPU")
    gpu = AccelDevice("GPU0", supported_ops=set(Op) - {Op.SOFT_MAX})
    backends = [gpu.init_backend(async_compute), cpu_dev.init_backend(async_compute)]
    sched = Sched(backends, n_copies=n_copies)
    g, T = build_llama_like(_ctx(), {"tok_embd": cpu_dev.buft, "L0": gpu.buft, "L1": cpu_dev.buft,
                                     "out": gpu.buft})
    return sched, g, T


S0_ASSIGN = {
    "x_embd": ("CPU", "1.wgt0"), "norm-0": ("GPU0", "2.sup"), "attn_norm-0": ("GPU0", "1.wgt1"),
    "cont-0": ("GPU0", "2.sup"), "q-0": ("GPU0", "1.wgt0"), "kq-0": ("GPU0", "2.sup"),
    "kq_soft-0": ("CPU", "3.best"), "kqv-0": ("GPU0", "2.sup"), "l_out-0": ("GPU0", "2.sup"),
    "norm-1": ("GPU0", "2.sup"), "attn_norm-1": ("CPU", "1.wgt1"), "cont-1": ("CPU", "2.sup"),
    "q-1": ("CPU", "1.wgt0"), "kq-1": ("GPU0", "2.sup"), "kq_soft-1": ("CPU", "3.best"),
    "kqv-1": ("GPU0", "2.sup"), "l_out-1": ("GPU0", "2.sup"), "logits": ("GPU0", "1.wgt0"),
}

S0_SPLITS = [
    ("CPU", 0, 0, []),
    ("GPU0", 1, 6, ["x_embd"]),
    ("CPU", 7, 7, ["kq-0"]),
    ("GPU0", 8, 10, ["kq_soft-0"]),
    ("CPU", 11, 14, ["norm-1"]),
    ("GPU0", 15, 15, ["q-1", "attn_norm-1"]),
    ("CPU", 16, 16, ["kq-1"]),
    ("GPU0", 17, 19, ["cont-1", "kq_soft-1"]),
]


def _assignments(sched, T):
    return {name: (sched.get_tensor_backend(T[name]).name, sched.get_cause(T[name])) for name in S0_ASSIGN}


def _run_and_compare(sched, g, T):
    ref = ReferenceExecutor().compute(g, {T["inp_tokens"]: token_ids()})
    want = ref[T["logits"]].copy()
    assert sched.alloc_graph(g)
    T["inp_tokens"].buffer.set_tensor(T["inp_tokens"], token_ids())
    sched.graph_compute(g)
    check_invariants(sched, g)
    np.testing.assert_array_equal(tensor_array(T["logits"]), want)


# S-0: GPU0 (no SOFT_MAX) + CPU, layer 0 and w_out on GPU0, layer 1 on CPU: 8 splits
def test_s0_assignments_and_splits():
    sched, g, T = _setup_s0()
    _run_and_compare(sched, g, T)
    assert _assignments(sched, T) == S0_ASSIGN
    assert splits_summary(sched) == S0_SPLITS
    assert sched.get_n_splits() == 8
    assert sched.backend_ids_changed                   # the first allocation compares against zeros
    # l_out-0 reads the GPU0 copy of x_embd made for split #1
    assert T["l_out-0"].src[1].name == "GPU0#x_embd#0"
    # §5.1 invariant 32: graph copy sizes
    n_in = sum(sp.n_inputs for sp in sched.splits)
    assert sched.graph.n_nodes == g.n_nodes + 2 * n_in
    assert sched.graph.n_leafs == g.n_leafs


# S-1: GPU0, GPU1, CPU; layer 0 on GPU0, layer 1 and w_out on GPU1; norm-1 stays on GPU0
def test_s1_two_gpus():
    cpu_dev = CPUDevice("CPU")
    g0, g1 = AccelDevice("GPU0"), AccelDevice("GPU1")
    sched = Sched([g0.init_backend(), g1.init_backend(), cpu_dev.init_backend()])
    g, T = build_llama_like(_ctx(), {"tok_embd": cpu_dev.buft, "L0": g0.buft, "L1": g1.buft, "out": g1.buft})
    _run_and_compare(sched, g, T)
    assert splits_summary(sched) == [("CPU", 0, 0, []), ("GPU0", 1, 10, ["x_embd"]),
                                     ("GPU1", 11, 19, ["norm-1", "l_out-0"])]
    assert sched.get_tensor_backend(T["norm-1"]).name == "GPU0"


# S-2: BLAS-like accelerator sharing the CPU buffer type, only MUL_MAT: 10 splits, no inputs
def test_s2_blas_like():
    cpu_dev = CPUDevice("CPU")
    blas = AccelDevice("BLAS", supported_ops={Op.MUL_MAT}, shares_cpu_buft=True, cpu_buft=cpu_dev.buft)
    sched = Sched([blas.init_backend(), cpu_dev.init_backend()])
    assert sched.bufts[0] is sched.bufts[1]
    b = cpu_dev.buft
    g, T = build_llama_like(_ctx(), {"tok_embd": b, "L0": b, "L1": b, "out": b})
    _run_and_compare(sched, g, T)
    assert sched.get_n_splits() == 10
    assert all(sp.n_inputs == 0 for sp in sched.splits)
    for L in (0, 1):
        assert (sched.get_tensor_backend(T[f"q-{L}"]).name, sched.get_cause(T[f"q-{L}"])) == ("BLAS", "1.wgt0")
        for n in (f"kq-{L}", f"kqv-{L}"):
            assert (sched.get_tensor_backend(T[n]).name, sched.get_cause(T[n])) == ("BLAS", "2.sup")
        assert (sched.get_tensor_backend(T[f"kq_soft-{L}"]).name,
                sched.get_cause(T[f"kq_soft-{L}"])) == ("CPU", "3.best")
    assert sched.get_cause(T["l_out-1"]) == "3.best"
    for t in g.nodes:
        if not t.is_view_op:
            assert sched.get_tensor_backend(t).name == ("BLAS" if t.op == Op.MUL_MAT else "CPU"), t.name
    # aliased buffer types share one pool: the second backend reports 0
    assert sched.get_buffer_size(sched.backends[0]) > 0
    assert sched.get_buffer_size(sched.backends[1]) == 0


# S-3: GPU0 + CPU, all weights in host memory, op_offload with MUL_MAT offloaded: 7 splits
def test_s3_op_offload():
    cpu_dev = CPUDevice("CPU")
    gpu = AccelDevice("GPU0", offload_ops={Op.MUL_MAT})
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()], op_offload=True)
    b = cpu_dev.buft
    g, T = build_llama_like(_ctx(), {"tok_embd": b, "L0": b, "L1": b, "out": b})
    _run_and_compare(sched, g, T)
    for n in ("q-0", "q-1", "logits"):
        assert (sched.get_tensor_backend(T[n]).name, sched.get_cause(T[n])) == ("GPU0", "1.off")
    assert splits_summary(sched) == [
        ("CPU", 0, 3, []),
        ("GPU0", 4, 4, ["attn_norm-0 (transposed)"]),
        ("GPU0", 5, 10, ["w0", "attn_norm-0", "x_embd"]),
        # the spec prints this split as CPU[11]; its range includes the transpose at 12, since a split
        # ends where the next non-view node starts (i_end = 13), as split #0 includes the one at 3
        ("CPU", 11, 12, ["norm-1"]),
        ("GPU0", 13, 13, ["attn_norm-1 (transposed)"]),
        ("GPU0", 14, 18, ["w1", "attn_norm-1"]),
        ("GPU0", 19, 19, ["w_out"]),
    ]
    # the copy of a view keeps the view's (transposed) strides
    cp = sched.tensor_id_copy(T["attn_norm-0 (transposed)"], 0, 0)
    assert cp.nb == T["attn_norm-0 (transposed)"].nb and cp.view_src is None


# S-3 without op_offload: the MUL_MATs with host weights stay on the CPU (1.wgt0)
def test_s3_no_offload():
    cpu_dev = CPUDevice("CPU")
    gpu = AccelDevice("GPU0", offload_ops={Op.MUL_MAT})
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()], op_offload=False)
    b = cpu_dev.buft
    g, T = build_llama_like(_ctx(), {"tok_embd": b, "L0": b, "L1": b, "out": b})
    _run_and_compare(sched, g, T)
    assert (sched.get_tensor_backend(T["q-0"]).name, sched.get_cause(T["q-0"])) == ("CPU", "1.wgt0")


# S-4: S-0 with parallel=True: n_copies 4, same splits, inp_tokens becomes 4.cpy, INPUT|OUTPUT copies
def test_s4_parallel():
    cpu_dev = CPUDevice("CPU")
    gpu = AccelDevice("GPU0", supported_ops=set(Op) - {Op.SOFT_MAX})
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()], parallel=True)
    assert sched.get_n_copies() == 4
    g, T = build_llama_like(_ctx(), {"tok_embd": cpu_dev.buft, "L0": gpu.buft, "L1": cpu_dev.buft,
                                     "out": gpu.buft})
    _run_and_compare(sched, g, T)
    assert splits_summary(sched) == S0_SPLITS
    assert sched.get_cause(T["inp_tokens"]) == "4.cpy"
    assert T["inp_tokens"].flags & TensorFlag.OUTPUT
    assert T["l_out-0"].src[1].name == "GPU0#x_embd#0"
    cps = [sched.tensor_id_copy(T["x_embd"], 0, c) for c in range(4)]
    assert [c.name for c in cps] == [f"GPU0#x_embd#{c}" for c in range(4)]
    assert all(c.flags & TensorFlag.INPUT and c.flags & TensorFlag.OUTPUT for c in cps)
    n_in = sum(sp.n_inputs for sp in sched.splits)
    assert sched.graph.n_leafs == g.n_leafs + 4 * (len(sched.graph_inputs) + n_in)   # invariant 32
    # all pipeline copies are resident: pairwise distinct addresses
    addrs = {(id(c.buffer), c.data) for c in cps}
    assert len(addrs) == 4


# S-5: reset and alloc_graph on the same (already split and allocated) graph: 0 inputs, x_embd 1.dst
def test_s5_resplit_same_graph():
    sched, g, T = _setup_s0()
    _run_and_compare(sched, g, T)
    sched.reset()
    assert sched.get_tensor_backend(T["x_embd"]) is None             # invariant 35
    assert sched.alloc_graph(g)
    assert [(b, i0, i1) for b, i0, i1, _ in splits_summary(sched)] == \
        [(b, i0, i1) for b, i0, i1, _ in S0_SPLITS]
    assert all(sp.n_inputs == 0 for sp in sched.splits)
    assert sched.get_cause(T["x_embd"]) == "1.dst"


# user assignments (usr) survive split_graph and reserve; reserve leaves the scheduler reset
def test_user_assignment_and_reserve():
    sched, g, T = _setup_s0()
    sched.set_tensor_backend(T["norm-1"], sched.backends[1])
    sched.reserve(g)
    assert sched.get_buffer_size(sched.backends[0]) > 0
    assert sched.get_tensor_backend(T["norm-1"]) is None       # reserve ends with a reset
    sched2, g2, T2 = _setup_s0()
    sched2.set_tensor_backend(T2["norm-1"], sched2.backends[1])
    _run_and_compare(sched2, g2, T2)
    assert (sched2.get_tensor_backend(T2["norm-1"]).name, sched2.get_cause(T2["norm-1"])) == ("CPU", "usr")


# the debug dump names every split with its inputs and every node with backend and cause
def test_debug_str():
    sched, g, T = _setup_s0()
    _run_and_compare(sched, g, T)
    s = sched.debug_str(2)
    assert s.count("## SPLIT #") == 8
    assert "## SPLIT #1: GPU0 # 1 inputs: [x_embd" in s
    assert "kq_soft-0" in s and "3.best" in s
    assert "## SPLIT" in sched.debug_str(1) and "node #" not in sched.debug_str(1)


def test_debug_env(monkeypatch, capsys):
    monkeypatch.setenv("GGML_SCHED_DEBUG", "2")
    sched, g, T = _setup_s0()
    assert sched.debug == 2
    _run_and_compare(sched, g, T)
    assert "## SPLIT #7" in capsys.readouterr().err


# eval callback returning False in the middle of a split stops that split only; later splits run
def test_eval_callback_stops_split_only():
    sched, g, T = _setup_s0()
    seen = []

    def cb(t, ask):
        if ask:
            return t.name in ("q-0", "logits")
        seen.append(t.name)
        return t.name != "q-0"                       # stop the rest of split #1 after q-0
    sched.set_eval_callback(cb)
    assert sched.alloc_graph(g)
    T["inp_tokens"].buffer.set_tensor(T["inp_tokens"], token_ids())
    sched.graph_compute(g)
    assert seen == ["q-0", "logits"]


# the same scheduled graph on asynchronous backends gives identical results
def test_s0_async_backends():
    sched, g, T = _setup_s0(async_compute=True)
    _run_and_compare(sched, g, T)


# split break (c): a split whose input list is full (30) starts a new split on the same backend when
# the next node needs a new copy; operands already copied to that backend are reused without listing
def test_full_input_list_breaks_split():
    from ggml_dist.core import ops
    from ggml_dist.core.graph import Graph
    from ggml_dist.core.types import GGMLType
    from ggml_dist.scheduler.sched import GGML_SCHED_MAX_SPLIT_INPUTS as MAXIN
    cpu_dev = CPUDevice("CPU")
    gpu = AccelDevice("GPU0", supported_ops=set(Op) - {Op.SCALE})
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()])
    ctx = _ctx()
    x = ctx.new_tensor(GGMLType.F32, (4,)).set_name("x").set_input()
    s = [ops.scale(ctx, x, float(i + 1)).set_name(f"s{i}") for i in range(MAXIN + 1)]
    g = Graph(256)
    for t in s:
        g.build_forward_expand(t)
    acc = s[0]
    adds = []
    for i in range(1, MAXIN + 1):
        acc = ops.add(ctx, acc, s[i]).set_name(f"add{i}")
        adds.append(acc)
        sched.set_tensor_backend(acc, sched.backends[0])
    acc.set_output()
    g.build_forward_expand(acc)
    ref = ReferenceExecutor().compute(g, {x: np.arange(4, dtype=np.float32)})[acc].copy()
    assert sched.alloc_graph(g)
    x.buffer.set_tensor(x, np.arange(4, dtype=np.float32))
    sched.graph_compute(g)
    summary = splits_summary(sched)
    assert [(b, i0, i1) for b, i0, i1, _ in summary] == [
        ("CPU", 0, MAXIN), ("GPU0", MAXIN + 1, 2 * MAXIN - 1), ("GPU0", 2 * MAXIN, 2 * MAXIN)]
    assert summary[1][3] == [f"s{i}" for i in range(MAXIN)]
    assert summary[2][3] == [f"s{MAXIN}"]
    assert sched.get_cause(adds[0]) == "usr"
    check_invariants(sched, g)
    np.testing.assert_array_equal(tensor_array(acc), ref)


# the last backend must be a CPU device (ggml asserts it)
def test_last_backend_must_be_cpu():
    gpu = AccelDevice("GPU0")
    with pytest.raises(ValueError, match="CPU"):
        Sched([CPUDevice("CPU").init_backend(), gpu.init_backend()])


# edge case (§5.4): a graph whose only nodes are views gives one split and computes nothing
def test_views_only_graph():
    from ggml_dist.core import ops
    from ggml_dist.core.graph import Graph
    from ggml_dist.core.types import GGMLType
    cpu_dev, gpu = CPUDevice("CPU"), AccelDevice("GPU0")
    sched = Sched([gpu.init_backend(), cpu_dev.init_backend()])
    ctx = _ctx()
    x = ctx.new_tensor(GGMLType.F32, (4, 2)).set_name("x").set_input()
    v = ops.reshape(ctx, x, 8).set_output()
    g = Graph(16)
    g.build_forward_expand(v)
    assert sched.alloc_graph(g)
    x.buffer.set_tensor(x, np.arange(8, dtype=np.float32))
    sched.graph_compute(g)
    assert sched.get_n_splits() == 1 and sched.splits[0].n_inputs == 0
    np.testing.assert_array_equal(tensor_array(v).ravel(), np.arange(8, dtype=np.float32))


# a saved plan (splits, input copies, graph copy, allocator plan) comes back after another graph ran, and
# computes the same logits; once the allocator's buffers changed it is refused and the scheduler is reset
def test_saved_plan_restores_after_another_graph():
    sched, g, T = _setup_s0()
    _run_and_compare(sched, g, T)
    plan = sched.save_plan()
    want = tensor_array(T["logits"]).copy()
    gpu_buft, cpu_buft = sched.bufts
    g2, T2 = build_llama_like(_ctx(), {"tok_embd": cpu_buft, "L0": gpu_buft, "L1": cpu_buft, "out": gpu_buft},
                              np.random.default_rng(1))   # the same layout, other tensors
    sched.reset()
    _run_and_compare(sched, g2, T2)                       # another graph, planned and computed
    sched.reset()
    assert sched.restore_plan(plan)
    assert splits_summary(sched) == S0_SPLITS
    T["inp_tokens"].buffer.set_tensor(T["inp_tokens"], token_ids())
    sched.graph_compute(g)
    check_invariants(sched, g)
    np.testing.assert_array_equal(tensor_array(T["logits"]), want)
    sched.reset()
    sched.galloc.buffers[0] = object()                    # as if a bigger graph had grown buffer 0
    assert not sched.restore_plan(plan) and not sched.is_alloc

"""The compiled recurrent kernels (backends/cpu/rkernels.py: GATED_DELTA_NET, SSM_CONV, L2_NORM) against
recurrent.py's numpy reference, bit for bit, through the op's node as a graph runs it (numba on and off),
over random shapes: per-key and scalar gates, several sequences, shared key heads and sequences, head
sizes off the 32-element step, one thread and several."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import threads
from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops_hybrid as oh
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.types import GGMLType

F32 = np.float32
NUMPY, NUMBA = ComputeOptions(numba=False), ComputeOptions(numba=True)


def run(out, inputs, opts):
    g = Graph()
    g.build_forward_expand(out)
    return ReferenceExecutor(opts).compute(g, inputs)[out]


def both(out, inputs):
    """The node's result by the numpy reference and by the compiled kernel."""
    return run(out, inputs, NUMPY), run(out, inputs, NUMBA)


def _leaves(ctx, arrays):
    return [ctx.new_tensor(GGMLType.F32, tuple(reversed(a.shape))) for a in arrays]


def _gdn_case(seed, n_s, n_t, Hk, H, S, per_key, ns_qk=None):
    r = np.random.default_rng(seed)
    ns_qk = n_s if ns_qk is None else ns_qk

    def randn(*shape, scale=1.0):
        return (r.standard_normal(shape) * scale).astype(F32)
    q, k = randn(ns_qk, n_t, Hk, S, scale=0.3), randn(ns_qk, n_t, Hk, S, scale=0.3)
    v, s0 = randn(n_s, n_t, H, S), randn(n_s, H, S, S, scale=0.1)
    g = (-np.abs(randn(n_s, n_t, H, S if per_key else 1))).astype(F32)
    beta = (np.abs(randn(n_s, n_t, H, 1)) % 1).astype(F32)
    return q, k, v, g, beta, s0


CASES = [  # n_s, n_t, Hk, H, S, per_key, ns_qk (None: n_s)
    (1, 1, 2, 2, 32, False, None),      # one decode token
    (2, 5, 2, 4, 64, False, None),      # several sequences, value heads over shared key heads
    (3, 4, 1, 3, 40, True, None),       # per-key gate, a tail past the 32-element step
    (2, 3, 2, 2, 20, True, 1),          # shorter than one step; q and k shared by the sequences
    (1, 7, 4, 8, 128, False, None),     # Qwen3.5's head size
    (2, 3, 1, 2, 66, True, None),       # rows past the last whole block of _R, a tail past the 32-step
]


@pytest.mark.parametrize("n_s,n_t,Hk,H,S,per_key,ns_qk", CASES)
@pytest.mark.parametrize("n_threads", [1, 2])
def test_gated_delta_net_compiled_equals_numpy(n_s, n_t, Hk, H, S, per_key, ns_qk, n_threads, monkeypatch):
    monkeypatch.setattr(threads, "_n_threads", n_threads)
    arrays = _gdn_case(n_s * 100 + n_t * 10 + S, n_s, n_t, Hk, H, S, per_key, ns_qk)
    ctx = Context(1 << 24)
    ts = _leaves(ctx, arrays)
    ref, fast = both(oh.gated_delta_net(ctx, *ts), dict(zip(ts, arrays, strict=True)))
    assert np.abs(ref).max() > 0
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))


def test_gated_delta_net_compiled_keeps_inf_and_nan_where_numpy_does():
    """A state holding inf and nan (0 * inf in a dot): nan in the same places on both paths."""
    q, k, v, g, beta, s0 = _gdn_case(7, 1, 2, 1, 2, 32, False)
    s0[0, 0, 3, 5], s0[0, 1, 7, 0] = np.inf, np.nan
    k[0, 0, 0, 5] = 0
    arrays = (q, k, v, g, beta, s0)
    ctx = Context(1 << 22)
    ts = _leaves(ctx, arrays)
    ref, fast = both(oh.gated_delta_net(ctx, *ts), dict(zip(ts, arrays, strict=True)))
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    assert np.array_equal(ref, fast, equal_nan=True)


@pytest.mark.parametrize("n_s,d_inner,d_conv,n_t", [(1, 48, 4, 1), (2, 40, 4, 9), (3, 16, 2, 5)])
def test_ssm_conv_compiled_equals_numpy(n_s, d_inner, d_conv, n_t):
    r = np.random.default_rng(n_s * 10 + n_t)
    sx = (r.standard_normal((n_s, d_inner, d_conv - 1 + n_t)) * r.choice([0.01, 1, 1e4], 1)).astype(F32)
    c = r.standard_normal((d_inner, d_conv)).astype(F32)
    sx[0, 0, 0] = -0.0                                      # -0 * c, added to 0: +0 on both paths
    ctx = Context(1 << 22)
    tsx, tc = _leaves(ctx, (sx, c))
    ref, fast = both(oh.ssm_conv(ctx, tsx, tc), {tsx: sx, tc: c})
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))


@pytest.mark.parametrize("shape", [(3, 5, 7, 128), (1, 1, 4, 33), (2, 1, 3, 1)])
def test_l2_norm_compiled_equals_numpy(shape):
    r = np.random.default_rng(sum(shape))
    x = (r.standard_normal(shape) * r.choice([1e-5, 1, 1e3], shape)).astype(F32)
    x.reshape(-1, shape[-1])[0] = 0                         # a zero row: 0 / eps
    if shape[0] > 1:
        x.reshape(-1, shape[-1])[1, 0] = np.nan             # a nan row stays nan
    ctx = Context(1 << 22)
    (tx,) = _leaves(ctx, (x,))
    ref, fast = both(oh.l2_norm(ctx, tx, 1e-6), {tx: x})
    assert np.array_equal(ref, fast, equal_nan=True)
    assert np.array_equal(ref.view(np.uint32)[~np.isnan(ref)], fast.view(np.uint32)[~np.isnan(ref)])


def test_imrope_with_the_compiled_cache_equals_numpy_and_repeats():
    """IMRoPE's multi-section cos/sin (rope.mrope_cache): by fkernels' rope_cache with numba on, by numpy
    without, the same bits; memoized for the next layer's Q and K (the same result again)."""
    ctx = Context(1 << 22)
    hd, n_head, n_tok, n_rot = 64, 3, 5, 32
    x = np.random.default_rng(8).standard_normal((n_tok, n_head, hd)).astype(F32)
    pos = np.random.default_rng(9).integers(0, 3000, 4 * n_tok).astype(np.int32)
    ta = ctx.new_tensor(GGMLType.F32, (hd, n_head, n_tok))
    tp = ctx.new_tensor(GGMLType.I32, (4 * n_tok,))
    out = oh.rope_multi(ctx, ta, tp, n_rot, (6, 5, 5, 0), oh.ROPE_TYPE_IMROPE, 4096, 1e7)
    ref, fast = both(out, {ta: x, tp: pos})
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))
    assert np.array_equal(run(out, {ta: x, tp: pos}, NUMBA).view(np.uint32), fast.view(np.uint32))

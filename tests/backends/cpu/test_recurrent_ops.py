"""The hybrid models' ops (core/ops_hybrid.py, backends/cpu/recurrent.py, numerics.softplus, rope's
multi-section cache): each against a small case computed by hand (CI), and bit for bit against llama.cpp's
own ggml where llama-cpp-python is installed (tests/ggml_oracle.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.backends.cpu.recurrent import gated_delta_net, vec_dot_f32
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core import ops_hybrid as oh
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.ops import ShapeError
from ggml_dist.core.types import GGMLType
from tests import ggml_oracle as O

F32 = np.float32
T32, I32 = GGMLType.F32, GGMLType.I32
ORACLE = O.unavailable()
needs_oracle = pytest.mark.skipif(ORACLE is not None, reason=ORACLE or "")


def run(out, inputs, opts=ComputeOptions()):
    g = Graph()
    g.build_forward_expand(out)
    return ReferenceExecutor(opts).compute(g, inputs)[out]


def leaf(ctx, x, type=T32):
    """A leaf of x's shape (ggml order: reversed) and its value."""
    t = ctx.new_tensor(type, tuple(reversed(x.shape)))
    return t, x


def rng(seed):
    return np.random.default_rng(seed)


def randn(seed, *shape, scale=1.0):
    return (rng(seed).standard_normal(shape) * scale).astype(F32)


# -- the ops one by one, by hand ----------------------------------------------------------------------
def test_ssm_conv_is_a_causal_convolution_per_channel():
    ctx = Context(1 << 20)
    sx = np.arange(2 * 3 * 5, dtype=F32).reshape(2, 3, 5)          # [n_s, d_inner, d_conv - 1 + n_t]
    c = np.array([[1, 0, 0, 0], [0, 0, 0, 1], [1, 1, 1, 1]], F32)  # [d_inner, d_conv]
    tsx, tc = ctx.new_tensor(T32, (5, 3, 2)), ctx.new_tensor(T32, (4, 3))
    out = oh.ssm_conv(ctx, tsx, tc)
    assert out.ne == (3, 2, 2, 1)
    y = run(out, {tsx: sx, tc: c})[0]                               # [n_s, n_t, d_inner]
    for s in range(2):
        for t in range(2):
            assert y[s, t, 0] == sx[s, 0, t]                        # the oldest tap only
            assert y[s, t, 1] == sx[s, 1, t + 3]                    # the newest tap only
            assert y[s, t, 2] == sx[s, 2, t:t + 4].sum()


def test_l2_norm_divides_each_row_by_its_norm_floored_at_eps():
    ctx = Context(1 << 20)
    x = np.array([[3, 4, 0, 0], [0, 0, 0, 0], [1e-8, 0, 0, 0]], F32)
    tx = ctx.new_tensor(T32, (4, 3))
    y = run(oh.l2_norm(ctx, tx, 1e-6), {tx: x})[0, 0]
    assert np.array_equal(y[0], np.array([0.6, 0.8, 0, 0], F32))
    assert np.array_equal(y[1], np.zeros(4, F32))                   # 0 / eps, not nan
    assert y[2, 0] == F32(F32(1e-8) * F32(1 / F32(1e-6)))           # the norm under eps: divided by eps


def test_softplus_passes_large_inputs_through():
    ctx = Context(1 << 20)
    x = np.array([-30, -1, 0, 1, 19.5, 20, 20.5, 100], F32)
    tx = ctx.new_tensor(T32, (8,))
    y = run(oh.softplus(ctx, tx), {tx: x}).reshape(-1)
    want = [F32(math.log1p(math.exp(float(v)))) if v <= 20 else v for v in x]
    assert np.abs(y - np.array(want, F32)).max() <= 2e-7 * np.abs(want).max()
    assert y[6] == F32(20.5) and y[7] == F32(100)


def test_vec_dot_f32_is_exact_on_small_integers_and_reduces_in_ggml_lanes():
    x = np.arange(64, dtype=F32)
    assert vec_dot_f32(x, np.ones(64, F32)) == F32(64 * 63 / 2)
    # element i goes to lane i % 8 of accumulator (i % 32) // 8: a 1e8 in lane 0 swallows a 1 added to it
    # in f32 but not the 1 in another lane, whose sum is added last
    a = np.zeros(32, F32)
    a[0], a[8], a[1] = 1e8, 1, 1
    assert vec_dot_f32(a, np.ones(32, F32)) == F32(F32(1e8) + F32(1)) + F32(1)


def _delta_net_f64(q, k, v, g, beta, s0):
    """The recurrence in float64, in its textbook form on S (not transposed): S = S * exp(g);
    S += k (x) (v - S^T k) * beta; o = S^T q / sqrt(d)."""
    n_s, n_t, H, d = v.shape
    S = s0.astype(np.float64).transpose(0, 1, 3, 2).copy()          # ggml stores M = S^T
    out = np.zeros(v.shape)
    for s in range(n_s):
        for h in range(H):
            for t in range(n_t):
                S[s, h] *= math.exp(g[s, t, h, 0])
                kv = S[s, h].T @ k[s, t, h]
                S[s, h] += np.outer(k[s, t, h], (v[s, t, h] - kv) * beta[s, t, h, 0])
                out[s, t, h] = S[s, h].T @ q[s, t, h] / math.sqrt(d)
    return out, S.transpose(0, 1, 3, 2)


def test_gated_delta_net_is_the_delta_rule_with_a_decay():
    n_s, n_t, H, d = 2, 3, 2, 32
    q, k, v = randn(1, n_s, n_t, H, d), randn(2, n_s, n_t, H, d, scale=0.2), randn(3, n_s, n_t, H, d)
    g, beta = -np.abs(randn(4, n_s, n_t, H, 1)), np.abs(randn(5, n_s, n_t, H, 1)) % 1
    s0 = randn(6, n_s, H, d, d, scale=0.1)
    out, m = gated_delta_net(q, k, v, g, beta, s0)
    want_out, want_m = _delta_net_f64(q, k, v, g, beta, s0)
    assert np.abs(out - want_out).max() < 1e-5 and np.abs(m - want_m).max() < 1e-5


def test_gated_delta_net_node_packs_output_then_state_and_shares_key_heads():
    ctx = Context(1 << 22)
    n_s, n_t, Hk, H, d = 1, 2, 1, 2, 32
    q, k = randn(1, n_s, n_t, Hk, d), randn(2, n_s, n_t, Hk, d, scale=0.2)
    v, s0 = randn(3, n_s, n_t, H, d), randn(6, n_s, H, d, d, scale=0.1)
    g, beta = np.full((n_s, n_t, H, 1), -0.5, F32), np.full((n_s, n_t, H, 1), 0.5, F32)
    ts = [ctx.new_tensor(T32, tuple(reversed(a.shape))) for a in (q, k, v, g, beta, s0)]
    out = oh.gated_delta_net(ctx, *ts)
    assert out.ne == (d * H, n_t * n_s + d * n_s, 1, 1)
    y = run(out, dict(zip(ts, (q, k, v, g, beta, s0), strict=True))).reshape(-1)
    want_out, want_m = gated_delta_net(np.repeat(q, H, 2), np.repeat(k, H, 2), v, g, beta, s0)
    assert np.array_equal(y[: want_out.size], want_out.reshape(-1))
    assert np.array_equal(y[want_out.size:], want_m.reshape(-1))
    with pytest.raises(ShapeError, match="state"):
        oh.gated_delta_net(ctx, *ts[:5], ctx.new_tensor(T32, (d, d, H + 1, n_s)))


def test_imrope_of_text_positions_is_neox_rope():
    # text tokens have positions (p, p, p, 0): every section rotates by p, as NEOX does
    ctx = Context(1 << 22)
    hd, n_head, n_tok, n_rot = 16, 2, 3, 8
    x = randn(7, n_tok, n_head, hd)
    p = np.array([0, 5, 11], np.int32)
    ta, tp4, tp = ctx.new_tensor(T32, (hd, n_head, n_tok)), ctx.new_tensor(I32, (4 * n_tok,)), \
        ctx.new_tensor(I32, (n_tok,))
    multi = oh.rope_multi(ctx, ta, tp4, n_rot, (2, 1, 1, 0), oh.ROPE_TYPE_IMROPE, 4096, 1e6)
    neox = ops.rope_ext(ctx, ta, tp, None, n_rot, ops.ROPE_TYPE_NEOX, 4096, 1e6)
    p4 = np.concatenate([p, p, p, np.zeros_like(p)])
    assert np.array_equal(run(multi, {ta: x, tp4: p4}), run(neox, {ta: x, tp: p}))
    # another stream's positions move exactly the pairs of its sectors (IMROPE: sector % 3)
    p4h = np.concatenate([p, p + 1, p, np.zeros_like(p)])
    d = run(multi, {ta: x, tp4: p4h}) != run(multi, {ta: x, tp4: p4})
    moved = np.flatnonzero(d[0, 1:, :, :].any(axis=(0, 1)))           # tokens 1, 2 (token 0 x differs too)
    assert set(moved) == {1, 1 + n_rot // 2}                          # pair 1: sector 1 -> height


# -- bit for bit with llama.cpp's ggml ----------------------------------------------------------------
@needs_oracle
def test_ssm_conv_equals_ggml():
    ctx = Context(1 << 22)
    n_s, d_inner, d_conv, n_t = 2, 48, 4, 7
    sx, c = randn(1, n_s, d_inner, d_conv - 1 + n_t), randn(2, d_inner, d_conv)
    (tsx, _), (tc, _) = leaf(ctx, sx), leaf(ctx, c)
    ours = run(oh.ssm_conv(ctx, tsx, tc), {tsx: sx, tc: c})[0]
    theirs = O.run("ssm_conv", sx, c)
    assert np.array_equal(ours, theirs.reshape(ours.shape))


@needs_oracle
def test_l2_norm_and_softplus_equal_ggml():
    ctx = Context(1 << 22)
    x = randn(3, 5, 7, 128, scale=3)
    tx, _ = leaf(ctx, x)
    assert np.array_equal(run(oh.l2_norm(ctx, tx, 1e-6), {tx: x})[0], O.run("l2_norm", x, 1e-6))
    xs = np.concatenate([randn(4, 4096, scale=8), np.array([19.99, 20, 20.01, -90, 88], F32)])
    ty, _ = leaf(ctx, xs)
    assert np.array_equal(run(oh.softplus(ctx, ty), {ty: xs}).reshape(-1), O.run("softplus", xs))


@needs_oracle
@pytest.mark.parametrize("n_s,n_t,Hk,H,d", [(1, 1, 2, 2, 32), (2, 5, 2, 4, 64), (1, 9, 1, 3, 128)])
def test_gated_delta_net_equals_ggml(n_s, n_t, Hk, H, d):
    ctx = Context(1 << 24)
    q, k = randn(1, n_s, n_t, Hk, d, scale=0.2), randn(2, n_s, n_t, Hk, d, scale=0.2)
    v, s0 = randn(3, n_s, n_t, H, d), randn(4, n_s, H, d, d, scale=0.1)
    g, beta = -np.abs(randn(5, n_s, n_t, H, 1)), (np.abs(randn(6, n_s, n_t, H, 1)) % 1).astype(F32)
    arrays = (q, k, v, g, beta, s0)
    ts = [leaf(ctx, a)[0] for a in arrays]
    ours = run(oh.gated_delta_net(ctx, *ts), dict(zip(ts, arrays, strict=True))).reshape(-1)
    theirs = O.run("gated_delta_net", *arrays, 1).reshape(-1)
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs), np.abs(ours - theirs).max()


@needs_oracle
def test_imrope_equals_ggml():
    ctx = Context(1 << 22)
    hd, n_head, n_tok, n_rot = 32, 3, 5, 16
    sections = (3, 3, 2, 0)
    x = randn(8, n_tok, n_head, hd)
    pos = rng(9).integers(0, 300, 4 * n_tok).astype(np.int32)
    ta, _ = leaf(ctx, x)
    tp = ctx.new_tensor(I32, (4 * n_tok,))
    ours = run(oh.rope_multi(ctx, ta, tp, n_rot, sections, oh.ROPE_TYPE_IMROPE, 4096, 1e6), {ta: x, tp: pos})
    sect = (O.c_int * 4)(*sections)
    theirs = O.run("rope_multi", x, pos, None, n_rot, sect, oh.ROPE_TYPE_IMROPE, 4096, 1e6, 1.0, 0.0, 1.0,
                   32.0, 1.0)
    assert np.array_equal(ours[0], theirs)

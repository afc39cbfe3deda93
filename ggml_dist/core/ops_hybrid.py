"""Op builders of the hybrid (recurrent + attention) models, Qwen3.5's: the short causal convolution, the
L2 norm, softplus, the fused Gated DeltaNet and the multi-section rope (ggml.c's ggml_ssm_conv,
ggml_l2_norm, ggml_softplus, ggml_gated_delta_net, ggml_rope_multi). Shapes and op_params as ggml's;
ops.py holds the builders every model uses.
"""
from __future__ import annotations

from collections.abc import Sequence

from .context import Context
from .ops import ShapeError, _check, _node, unary
from .tensor import Op, Tensor, UnaryOp, is_contiguous, is_contiguous_rows
from .types import GGMLType

ROPE_TYPE_MROPE = 8
ROPE_TYPE_IMROPE = 40          # MROPE | 32: the sections interleaved (Qwen3-VL, Qwen3.5)


def softplus(ctx: Context, a: Tensor) -> Tensor:
    """ggml_softplus: log(1 + exp(x)), and x itself where x > 20."""
    return unary(ctx, a, UnaryOp.SOFTPLUS)


def l2_norm(ctx: Context, a: Tensor, eps: float) -> Tensor:
    """ggml_l2_norm: each row divided by max(|row|, eps); a dense result of a's shape."""
    _check(a.type == GGMLType.F32 and a.nb[0] == 4, "L2_NORM", "a must be F32 with dense rows", a)
    return _node(ctx, Op.L2_NORM, a.type, a.ne, [a], (float(eps),))


def ssm_conv(ctx: Context, sx: Tensor, c: Tensor) -> Tensor:
    """ggml_ssm_conv: the causal depthwise convolution of Mamba-style layers. sx [d_conv - 1 + n_t,
    d_inner, n_s] (each channel's previous d_conv - 1 inputs, then the n_t new ones), c [d_conv, d_inner];
    result [d_inner, n_t, n_s]: x[i, t, s] = sum_k sx[t + k, i, s] * c[k, i]."""
    _check(sx.ne[3] == 1 and c.ne[2] == 1 and c.ne[3] == 1, "SSM_CONV", "sx must be 3-D and c a matrix", sx, c)
    d_conv, d_inner = c.ne[0], c.ne[1]
    n_t = sx.ne[0] - d_conv + 1
    _check(n_t >= 0 and sx.ne[1] == d_inner, "SSM_CONV", "sx must be [d_conv - 1 + n_t, d_inner, n_s]", sx, c)
    _check(sx.type == c.type == GGMLType.F32 and sx.nb[0] == 4 and sx.nb[1] == 4 * sx.ne[0], "SSM_CONV",
           "sx and c must be F32, sx with dense rows", sx, c)
    return _node(ctx, Op.SSM_CONV, GGMLType.F32, (d_inner, n_t, sx.ne[2]), [sx, c])


def gated_delta_net(ctx: Context, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                    n_snapshots: int = 1) -> Tensor:
    """ggml_gated_delta_net: the fused Gated DeltaNet recurrence over a ubatch. q, k [S, H_k, n_t, n_s],
    v [S, H_v, n_t, n_s] (value head h reads key head h mod H_k), g (log of the decay) and beta
    [1, H_v, n_t, n_s], state [S, S, H_v, n_s] (each head's matrix stored transposed). One F32 result
    that packs the attention output [S, H_v, n_t, n_s] and, after it, the final state [S, S, H_v, n_s]
    (graphs read both through views). n_snapshots (ggml's K) > 1 keeps the states of the last tokens
    too, for rollback; only 1 is built here."""
    S, H, n_t, n_s = v.ne
    _check(n_snapshots == 1, "GATED_DELTA_NET", f"only one state snapshot is supported (K={n_snapshots})", v)
    _check(q.ne[0] == k.ne[0] == S and q.ne[2] == k.ne[2] == n_t, "GATED_DELTA_NET",
           "q, k and v must share the head size and token count", q, k, v)
    _check(H % q.ne[1] == 0 and H % k.ne[1] == 0 and n_s % q.ne[3] == 0 and n_s % k.ne[3] == 0,
           "GATED_DELTA_NET", "value heads and sequences must be multiples of q's and k's", q, k, v)
    _check(g.ne in ((1, H, n_t, n_s), (S, H, n_t, n_s)) and beta.ne == (1, H, n_t, n_s), "GATED_DELTA_NET",
           "g must be [1 or S, H_v, n_t, n_s] and beta [1, H_v, n_t, n_s]", g, beta, v)
    _check(state.ne == (S, S, H, n_s), "GATED_DELTA_NET", "state must be [S, S, H_v, n_s]", state, v)
    _check(all(is_contiguous_rows(t) for t in (q, k, v)) and all(is_contiguous(t) for t in (g, beta, state)),
           "GATED_DELTA_NET", "q, k, v need dense rows; g, beta and state must be contiguous", q, k, v, g, state)
    _check(all(t.type == GGMLType.F32 for t in (q, k, v, g, beta, state)), "GATED_DELTA_NET",
           "every operand must be F32", q, k, v, g, beta, state)
    return _node(ctx, Op.GATED_DELTA_NET, GGMLType.F32, (S * H, n_t * n_s + S * n_s * n_snapshots, 1, 1),
                 [q, k, v, g, beta, state], (int(n_snapshots),))


def rope_multi(ctx: Context, a: Tensor, pos: Tensor, n_dims: int, sections: Sequence[int], mode: int,
               n_ctx_orig: int, freq_base: float = 10000.0, freq_scale: float = 1.0, ext_factor: float = 0.0,
               attn_factor: float = 1.0, beta_fast: float = 32.0, beta_slow: float = 1.0) -> Tensor:
    """ggml_rope_multi: rope with four position streams (time, height, width, extra: pos holds 4 * n_tok
    I32), each pair of the first n_dims taking its angle from the stream its section names; op_params
    are rope_ext's 11, then the four section sizes."""
    _check(pos.type == GGMLType.I32 and pos.n_dims == 1 and pos.ne[0] == 4 * a.ne[2], "ROPE",
           "multi-rope needs 4 I32 positions per token (a.ne[2])", a, pos)
    _check(mode & ROPE_TYPE_MROPE != 0, "ROPE", f"mode {mode} is not a multi-section rope (MROPE, IMROPE)", a)
    _check(0 < n_dims <= a.ne[0] and n_dims % 2 == 0, "ROPE", f"n_dims={n_dims} must be even and <= ne[0]", a)
    if len(sections) != 4 or sum(sections) <= 0 or sum(sections) > a.ne[0]:
        raise ShapeError(f"ROPE: sections {list(sections)} must be 4 sizes summing to 1..ne[0] ('{a.name}')")
    params = (0, int(n_dims), int(mode), 0, int(n_ctx_orig), float(freq_base), float(freq_scale),
              float(ext_factor), float(attn_factor), float(beta_fast), float(beta_slow), *(int(s) for s in sections))
    return _node(ctx, Op.ROPE, a.type, a.ne, [a, pos], params)

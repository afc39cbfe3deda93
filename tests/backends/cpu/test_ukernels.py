"""The compiled unary kernels (backends/cpu/ukernels.py, dispatched by unary.py) against numerics.py's
numpy functions, bit for bit, through the op's node as a graph runs it (numba on and off)."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import numerics as nm
from ggml_dist.backends.cpu import threads, ukernels
from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.backends.cpu.reference import ReferenceExecutor
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.tensor import UnaryOp
from ggml_dist.core.types import GGMLType

F32 = np.float32


def _values(seed, shape):
    """Normal values at several scales, and the edges of vexp: its big branches (|n| > 126, > 192), 0, -0,
    infinities and a nan."""
    r = np.random.default_rng(seed)
    x = (r.standard_normal(shape) * r.choice([0.1, 3, 40], shape)).astype(F32)
    edges = np.array([0, -0.0, 87.5, -87.5, 89, -89, 100, -100, 150, -150, np.inf, -np.inf, np.nan], F32)
    flat = x.reshape(-1)
    flat[: edges.size] = edges[: flat.size]
    return x


def _silu_node(x):
    ctx = Context(1 << 24)
    a = ctx.new_tensor(GGMLType.F32, tuple(reversed(x.shape)))
    out = ops.unary(ctx, a, UnaryOp.SILU)
    g = Graph()
    g.build_forward_expand(out)
    return [ReferenceExecutor(o).compute(g, {a: x})[out] for o in (ComputeOptions(numba=False),
                                                                   ComputeOptions(numba=True))]


@pytest.mark.parametrize("shape", [(16,), (3, 6144), (2, 5, 64), (1, 40)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_silu_compiled_equals_numpy(shape, n_threads, monkeypatch):
    monkeypatch.setattr(threads, "_n_threads", n_threads)
    ref, fast = _silu_node(_values(len(shape) * 7 + shape[-1], shape))
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))


def test_silu_kernel_in_place_and_on_a_strided_view():
    x = _values(3, (4, 2, 6, 32))
    want = nm.silu(x)
    y = x.copy()
    ukernels.silu(y, y)                                     # dst aliasing x, as gallocr's in-place reuse may
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))
    big = _values(4, (2, 3, 5, 64))
    view = big[:, ::2, 1:4, ::2]                            # rows of 32 with a stride
    out = np.empty(view.shape, F32)
    ukernels.silu(view, out)
    assert np.array_equal(out.view(np.uint32), nm.silu(view).view(np.uint32))


def test_silu_rows_off_the_8_step_take_the_numpy_path():
    ref, fast = _silu_node(_values(5, (3, 13)))             # numerics' expf tail: no compiled twin
    assert np.array_equal(ref.view(np.uint32), fast.view(np.uint32))


def test_softplus_compiled_equals_numpy():
    """Normal values, the x > 20 switch, exp's overflow and underflow, and random bit patterns (nan,
    inf, subnormals among them): numerics.softplus's bits (the C library's expf and logf on both paths)."""
    r = np.random.default_rng(11)
    x = np.concatenate([_values(6, (3999,)), np.array([19.999998, 20, 20.000002, 88.7, 89, -104, -200], F32),
                        r.integers(0, 2**32, 4000, dtype=np.uint64).astype(np.uint32).view(F32)]).reshape(2, -1)
    ctx = Context(1 << 22)
    a = ctx.new_tensor(GGMLType.F32, tuple(reversed(x.shape)))
    out = ops.unary(ctx, a, UnaryOp.SOFTPLUS)
    g = Graph()
    g.build_forward_expand(out)
    ref, fast = [ReferenceExecutor(o).compute(g, {a: x})[out] for o in (ComputeOptions(numba=False),
                                                                         ComputeOptions(numba=True))]
    same = (ref.view(np.uint32) == fast.view(np.uint32)) | (np.isnan(ref) & np.isnan(fast))
    assert same.all()

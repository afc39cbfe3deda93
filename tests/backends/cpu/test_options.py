"""ComputeOptions carries the mode switches: the packed weights' kernels are chosen once, when a CPU
backend is created (GGML_DIST_FORCE_AVX2 / NO_VNNI / NO_AVX2 through qpack.default_kernels()), and a
replayed step reads that choice instead of the module globals."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu.backend import CPUDevice, compute_graph
from ggml_dist.backends.cpu.ops import ComputeOptions, resolve
from ggml_dist.core.types import GGMLType as T

from .test_qpack import _matmul_graph, activations, oracle
from .test_quants import random_rows

qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")


def test_options_that_pack_nothing_stay_as_they_are():
    for o in (ComputeOptions(numba=False), ComputeOptions(exact=True), ComputeOptions(order="fast"),
              ComputeOptions(kernels="float")):
        assert resolve(o) is o


def test_a_backend_makes_the_host_s_choice_once(monkeypatch):
    host = qpack.default_kernels().value
    b = CPUDevice().init_backend(opts=ComputeOptions(numba=True))
    assert b.opts.kernels == host
    monkeypatch.setattr(qpack, "default_kernels", lambda: qpack.Kernels.FLOAT)
    assert CPUDevice().init_backend(opts=ComputeOptions(numba=True)).opts.kernels == "float"
    assert b.opts.kernels == host           # made once: the first backend keeps its choice


def test_the_options_kernels_pack_the_weight():
    M, K = 64, 128
    w = random_rows(T.Q4_1, M, K, seed=5)
    x = activations(3, K, seed=6)
    g, wt, out, buf, _ = _matmul_graph(T.Q4_1, w, M, K, x)
    host = resolve(ComputeOptions(numba=True))
    for opts in (ComputeOptions(numba=True, kernels="float"), host):
        compute_graph(g, opts)          # the same bound graph: the new options repack, same bits
        assert wt.extra.kernels is qpack.Kernels(opts.kernels)
        np.testing.assert_array_equal(buf.get_tensor(out).reshape(-1, M), oracle(T.Q4_1, w, x))

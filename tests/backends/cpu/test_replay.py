"""cpu.BoundGraph's replay (the CPU backend's graph plan): after one replay by a thread at a thread count,
the next ones are flat (entry.flat: each call's entry point and arguments, under one launch): the same
bits as the bound calls, an int8 product's fallback still taken for a non-finite activation, and a new
flat list for another thread count or another thread."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ggml_dist.backends.cpu import threads as kt
from ggml_dist.backends.cpu.backend import BoundGraph
from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.core.types import GGMLType as T

from .test_qpack import _matmul_graph, activations, oracle
from .test_quants import random_rows

qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")


@pytest.fixture
def threads():
    before = kt.get_threads()
    yield [n for n in (1, 2) if n <= kt._numba_num_threads()]
    kt.set_threads(before)


def _product(t=T.Q4_1, M=512, K=512, N=2):
    """A packed product big enough to split across threads (qpack._PARALLEL_WORK)."""
    assert M * K * N >= qpack._PARALLEL_WORK
    w, x = random_rows(t, M, K, seed=11), activations(N, K, seed=12)
    g, wt, out, buf, _ = _matmul_graph(t, w, M, K, x)
    return g, out, buf, w, x


def test_flat_replays_give_the_bound_calls_bits_at_each_thread_count(threads):
    g, out, buf, w, x = _product()
    want = oracle(T.Q4_1, w, x)
    bound = BoundGraph(g, ComputeOptions())
    for n in threads:
        kt.set_threads(n)
        for _ in range(3):                              # bound calls, then flat, then flat again
            buf.set_tensor(out, np.full(out.ne[1] * out.ne[0], np.nan, np.float32))
            bound.run()
            np.testing.assert_array_equal(buf.get_tensor(out).reshape(want.shape), want)
        assert bound._flat_for == (threading.get_ident(), n)
        assert all(f is not call for (f, _, _), call in zip(bound._flat, bound.calls))   # all flattened


def test_a_flat_replay_still_gives_a_non_finite_product_back(threads):
    g, out, buf, w, x = _product()
    for n in threads:
        kt.set_threads(n)
        bound = BoundGraph(g, ComputeOptions())
        buf.set_tensor(g.nodes[0].src[1], x)
        bound.run()
        bound.run()
        assert bound._flat_for is not None
        bad = x.copy()
        bad[1, 7] = np.inf
        buf.set_tensor(g.nodes[0].src[1], bad)
        bound.run()                                     # flat: the kernel says False, the fallback runs
        flat = buf.get_tensor(out).copy()
        BoundGraph(g, ComputeOptions()).run()           # bound calls, the same fallback
        np.testing.assert_array_equal(flat, buf.get_tensor(out))
        assert not np.isfinite(flat.reshape(2, -1)[1]).all()
        np.testing.assert_array_equal(flat.reshape(2, -1)[0], oracle(T.Q4_1, w, x)[0])


def test_another_thread_gets_its_own_flat_list(threads):
    g, out, buf, w, x = _product()
    kt.set_threads(threads[-1])
    bound = BoundGraph(g, ComputeOptions())
    bound.run()
    bound.run()
    mine = bound._flat_for
    seen = []

    def other() -> None:
        bound.run()
        bound.run()
        seen.append(bound._flat_for)
    th = threading.Thread(target=other)
    th.start()
    th.join()
    assert seen and seen[0] != mine and seen[0][0] == th.ident
    np.testing.assert_array_equal(buf.get_tensor(out).reshape(2, -1), oracle(T.Q4_1, w, x))

"""backends/cpu/gather.py: ALL_GATHER's kernel on ranks that are threads, each with its own CPU backend."""
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ggml_dist.backends.base import tensor_array
from ggml_dist.backends.collective import ThreadGroup
from ggml_dist.backends.cpu.backend import BoundGraph, CPUDevice, compute_graph
from ggml_dist.backends.cpu.ops import ComputeOptions
from ggml_dist.core import ops
from ggml_dist.core.context import Context
from ggml_dist.core.graph import Graph
from ggml_dist.core.ops_collective import all_gather
from ggml_dist.core.types import GGMLType


def _rank_graph(n_part: int, n_tokens: int, size: int):
    """x (n_part, n_tokens) -> ALL_GATHER -> scale 2: a graph bound to one host buffer."""
    ctx = Context(1 << 16, no_alloc=True)
    x = ctx.new_tensor(GGMLType.F32, (n_part, n_tokens))
    gathered = all_gather(ctx, x, [n_part] * size)
    y = ops.scale(ctx, gathered, 2.0)
    g = Graph()
    g.build_forward_expand(y)
    buf = CPUDevice().get_buffer_type().alloc_buffer(4 * n_tokens * n_part * (1 + 2 * size) + 128)
    x.buffer, x.data = buf, 0
    gathered.buffer, gathered.data = buf, 4 * n_tokens * n_part + 32
    y.buffer, y.data = buf, gathered.data + 4 * n_tokens * n_part * size + 32
    return g, x, y


# each token column is every rank's part in rank order, on every rank; replayed (flat, under the
# compiled kernels' launch lock) without the ranks blocking each other
@pytest.mark.parametrize("size", [2, 4])
def test_ranks_gather_in_order(size):
    n_part, n_tokens = 3, 5
    colls = ThreadGroup(size, timeout=30).ranks()

    def rank(c):
        g, x, y = _rank_graph(n_part, n_tokens, size)
        plan = BoundGraph(g, ComputeOptions(collective=c))
        outs = []
        for step in range(3):                     # the 2nd and 3rd runs are the flat replay
            tensor_array(x)[0, 0] = np.arange(n_tokens * n_part).reshape(n_tokens, n_part) + 100 * c.rank + step
            plan.run()
            outs.append(tensor_array(y)[0, 0].copy())
        return outs

    with ThreadPoolExecutor(size) as pool:
        results = [f.result() for f in [pool.submit(rank, c) for c in colls]]
    for step in range(3):
        parts = [np.arange(n_tokens * n_part).reshape(n_tokens, n_part) + 100 * r + step for r in range(size)]
        want = 2 * np.concatenate(parts, axis=1).astype(np.float32)       # (n_tokens, size * n_part)
        for outs in results:
            assert np.array_equal(outs[step], want)


# a backend without a collective says what to do
def test_no_collective():
    g, _, _ = _rank_graph(2, 2, 2)
    with pytest.raises(RuntimeError, match="without a collective"):
        compute_graph(g, ComputeOptions())


# expert parallelism's exchange (core/ops_collective.py): each rank computes the slots of its experts
# (EXPERT_IDS: others -1), GATHER_EXPERTS gives every rank every slot's row from its owner, whatever
# the ranks' shares (one rank owning none of a step's slots included)
@pytest.mark.parametrize("bounds", [[0, 4, 8], [0, 1, 3, 4, 6], [0, 5, 6]])
def test_gather_experts(bounds):
    from ggml_dist.core.ops_collective import expert_ids, gather_experts
    size, n, k, n_tok = len(bounds) - 1, 6, 3, 4
    sel = np.array([[0, 2, 3], [1, 0, 2], [3, 1, 0], [2, 3, 1]], np.int32) * (bounds[-1] // 4)
    y_all = np.random.default_rng(0).standard_normal((n_tok, k, n)).astype(np.float32)
    colls = ThreadGroup(size, timeout=30).ranks()

    def rank(c):
        ctx = Context(1 << 16, no_alloc=True)
        s = ctx.new_tensor(GGMLType.I32, (k, n_tok))
        y = ctx.new_tensor(GGMLType.F32, (n, k, n_tok))
        ids = expert_ids(ctx, s, bounds[c.rank], bounds[c.rank + 1])
        out = gather_experts(ctx, y, s, bounds)
        g = Graph()
        g.build_forward_expand(ids)
        g.build_forward_expand(out)
        buf = CPUDevice().get_buffer_type().alloc_buffer(4 * (2 * k * n_tok + 2 * n * k * n_tok) + 256)
        off = 0
        for t in (s, y, ids, out):
            t.buffer, t.data = buf, off
            off += 4 * int(np.prod(t.ne)) + 32
        tensor_array(s)[0, 0] = sel
        mine = (sel >= bounds[c.rank]) & (sel < bounds[c.rank + 1])
        tensor_array(y)[0] = np.where(mine[..., None], y_all, 7.0)   # another rank's slot: not ours to send
        BoundGraph(g, ComputeOptions(collective=c)).run()
        return tensor_array(ids)[0, 0].copy(), tensor_array(out)[0].copy(), mine

    with ThreadPoolExecutor(size) as pool:
        results = [f.result() for f in [pool.submit(rank, c) for c in colls]]
    for r, (ids, out, mine) in enumerate(results):
        assert np.array_equal(ids, np.where(mine, sel - bounds[r], -1))
        assert np.array_equal(out, y_all)

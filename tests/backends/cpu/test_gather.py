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

"""Tensor-parallel ranks as Ray actors (workers/tp_ranks.py): rank 0 the driver's context, ranks 1..K-1
actors whose ALL_GATHER (and a mixture of experts' GATHER_EXPERTS) goes over the socket mesh; logits and
greedy tokens are one process's, bit for bit, and `run --tensor-parallel` on Ray gives one process's tokens."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.synthetic_moe import SyntheticMoESpec, write_moe
from ggml_dist.model.tp_local import TensorParallelContext
from ggml_dist.model.ubatch import Batch

pytest.importorskip("ray")

PROMPT = [1, 5, 9, 33, 70, 100, 7, 300, 12]
# grouped heads as the 1.1B's (32 query heads over 4 KV heads), small
SPEC = SyntheticSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=32, n_head_kv=4, n_ff=512, wtype="Q4_0",
                     embd_type="Q4_0", tied=False, seed=6)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_synthetic(tmp_path_factory.mktemp("tp") / "m.gguf", SPEC))


def _steps(ctx) -> list[np.ndarray]:
    out = [ctx.decode(Batch.from_tokens(PROMPT, all_outputs=True))]
    for i in range(4):
        out.append(ctx.decode(Batch.from_tokens([int(out[-1][-1].argmax())], pos0=len(PROMPT) + i)))
    return out


# experts over 4 ranks, 2 of 8 chosen per token: in a decode step most ranks own none of its slots
MOE = SyntheticMoESpec(arch="qwen3moe", n_embd=128, n_head=8, n_head_kv=4, n_vocab=512, n_expert=8,
                       n_expert_used=2, exp_type="Q4_0", seed=49)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory):
    return str(write_moe(tmp_path_factory.mktemp("ep") / "moe.gguf", MOE))


@pytest.mark.parametrize("size, which", [(2, "dense"), (4, "dense"), (4, "moe")])
def test_ray_ranks_equal_one_process(local_ray, path, moe_path, size, which):
    from ggml_dist.workers.tp_ranks import ray_ranks
    path = moe_path if which == "moe" else path
    model = LlamaModel.load(path)
    want = _steps(LlamaContext(model, ContextParams(n_ctx=256)))
    ctx = TensorParallelContext(model, size, ContextParams(n_ctx=256), ranks=ray_ranks(path, size, num_cpus=0.5))
    try:
        got = _steps(ctx)
        assert all(np.array_equal(a, b) for a, b in zip(want, got, strict=True))
        ctx.seq_rm(0, 5)                                  # every rank cuts its cells the same way
        again = ctx.decode(Batch.from_tokens(PROMPT[5:], pos0=5, all_outputs=True))
        assert np.array_equal(again, want[0][5:])
    finally:
        ctx.close()


def test_runtime_ranks_on_ray(local_ray, path):
    from ggml_dist.runtime import RunConfig, open_runtime
    model = LlamaModel.load(path)
    want = generate(LlamaContext(model, ContextParams(n_ctx=256)), model.tokenizer, PROMPT, 8,
                    stop_at_eog=False).tokens
    rt = open_runtime(RunConfig(path, ContextParams(n_ctx=256), 1, on_ray=True, tensor_parallel=2))
    try:
        from ggml_dist.workers.tp_ranks import RayFollower
        assert isinstance(rt.ctx, TensorParallelContext) and all(isinstance(f, RayFollower) for f in rt.ctx.followers)
        assert len(rt.ctx.followers) == 1
        assert generate(rt.ctx, rt.model.tokenizer, PROMPT, 8, stop_at_eog=False).tokens == want
    finally:
        rt.shutdown()


def test_ranks_on_given_nodes(local_ray, path):
    """node_ids pins rank r to node_ids[r - 1] (bench cluster: a rank per testbed host); a list of the
    wrong length is refused."""
    import ray

    from ggml_dist.workers.tp_ranks import ray_ranks
    node = ray.get_runtime_context().get_node_id()
    model = LlamaModel.load(path)
    with pytest.raises(ValueError, match="1 nodes for the 3 rank actors"):
        ray_ranks(path, 4, node_ids=[node])
    ctx = TensorParallelContext(model, 2, ContextParams(n_ctx=256), ranks=ray_ranks(path, 2, num_cpus=0.5,
                                                                                   node_ids=[node]))
    try:
        want = LlamaContext(model, ContextParams(n_ctx=256)).decode(Batch.from_tokens(PROMPT))
        assert np.array_equal(ctx.decode(Batch.from_tokens(PROMPT)), want)
    finally:
        ctx.close()


# calls travel on the mesh's links (no Ray call a step): a call every rank refuses is refused and the group
# stays usable; a rank that fails answers with its error, and a killed rank is an error naming it, not a hang
def test_refusals_failures_and_a_killed_rank(local_ray, path):
    import ray

    from ggml_dist.backends.collective import CollectiveError
    from ggml_dist.model.ubatch import BatchError
    from ggml_dist.workers.tp_ranks import ray_ranks
    model = LlamaModel.load(path)
    want = LlamaContext(model, ContextParams(n_ctx=256)).decode(Batch.from_tokens(PROMPT))
    ctx = TensorParallelContext(model, 4, ContextParams(n_ctx=256), ranks=ray_ranks(path, 4, num_cpus=0.5))
    try:
        with pytest.raises(BatchError, match="vocabulary"):
            ctx.decode(Batch.from_tokens([1, 10**6]))
        assert np.array_equal(ctx.decode(Batch.from_tokens(PROMPT)), want)

        def fails(r):
            raise RuntimeError(f"rank {r.rank} broke")
        with pytest.raises(RuntimeError, match="rank 2 broke"):
            ctx.followers[1].call(fails).result()
    finally:
        ctx.close()
    ctx = TensorParallelContext(model, 2, ContextParams(n_ctx=256), ranks=ray_ranks(path, 2, num_cpus=0.5))
    try:
        ctx.decode(Batch.from_tokens(PROMPT[:3]))
        ray.kill(ctx.followers[0].actor)
        with pytest.raises(CollectiveError, match="rank 1"):
            for i in range(50):                          # the kill lands within a step or two
                ctx.decode(Batch.from_tokens([5], pos0=3 + i))
    finally:
        ctx.close()


# a lost rank is made anew: new rank actors and mesh, every rank's KV shard replayed from the group's log,
# and the greedy tokens are the ones without the loss (a batch and a seq_rm before, the loss mid-generation,
# two steps in flight)
def test_a_lost_rank_is_replaced_with_the_same_tokens(local_ray, path):
    import ray

    from ggml_dist.workers.tp_ranks import ray_ranks
    model = LlamaModel.load(path)
    params = ContextParams(n_ctx=256)

    def run(ctx, on_token=None) -> list[int]:
        ctx.decode(Batch.from_tokens([7, 8, 9, 10]))
        ctx.seq_rm(0)
        return generate(ctx, model.tokenizer, PROMPT, 10, stop_at_eog=False, lookahead=2, on_token=on_token).tokens

    want = run(LlamaContext(model, params))
    ctx = TensorParallelContext(model, 2, params, ranks=ray_ranks(path, 2, num_cpus=0.5), max_recoveries=2)
    lost, pid = ctx.followers[0].actor, ray.get(ctx.followers[0]._connected)

    def kill(i: int, _: int) -> None:
        if i == 4:                                      # gone before the next step, however loaded the machine
            ray.kill(lost)
            deadline = time.monotonic() + 120
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
    try:
        assert run(ctx, kill) == want
        assert ctx.n_recoveries == 1 and ctx.followers[0].actor != lost
    finally:
        ctx.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# rank actors ask Ray for their memory: ranks no node can hold are refused at once, with the numbers
def test_rank_memory_is_asked_and_checked(local_ray, path):
    from ggml_dist.workers.tp_ranks import ray_ranks
    model = LlamaModel.load(path)
    with pytest.raises(MemoryError, match=r"rank actors need 9536743 MiB; the cluster's nodes have \d+ MiB free"):
        TensorParallelContext(model, 2, ContextParams(n_ctx=256), ranks=ray_ranks(path, 2, memory=[10**13]))
    ctx = TensorParallelContext(model, 2, ContextParams(n_ctx=256), ranks=ray_ranks(path, 2, num_cpus=0.5,
                                                                                   memory=[64 << 20]))
    try:
        want = LlamaContext(model, ContextParams(n_ctx=256)).decode(Batch.from_tokens(PROMPT))
        assert np.array_equal(ctx.decode(Batch.from_tokens(PROMPT)), want)
    finally:
        ctx.close()

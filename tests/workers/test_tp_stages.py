"""Tensor-parallel groups beside a pipeline (workers/tp_stages.py): S stages x K ranks of stage actors on a
local Ray, every stage's ranks exchanging on their own mesh, every rank's pipeline fed its own tokens.
Logits are one process's bit for bit (a dense model with the 1.1B's grouped heads at K = 2 and 4, a
mixture of experts at K = 2), and so are sampled tokens, one sequence and several, and `run --stages 2
--tensor-parallel 2`'s."""
from __future__ import annotations

import json

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate, generate_parallel
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.sampling import SamplingParams
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.synthetic_moe import SyntheticMoESpec, write_moe
from ggml_dist.model.tensor_parallel import TensorParallelError
from ggml_dist.model.ubatch import Batch

ray = pytest.importorskip("ray")

PROMPT = [1, 5, 9, 33, 70, 100, 7, 300, 12]
PARAMS = ContextParams(n_ctx=256, n_seq_max=3)
# grouped heads as the 1.1B's (32 query heads over 4 KV heads), 4 layers for 2 stages
DENSE = SyntheticSpec(n_vocab=512, n_embd=256, n_layer=4, n_head=32, n_head_kv=4, n_ff=512, wtype="Q4_0",
                      embd_type="Q4_0", tied=False, seed=6)
MOE = SyntheticMoESpec(arch="qwen3moe", n_embd=128, n_head=8, n_head_kv=4, n_vocab=512, n_expert=8,
                       n_expert_used=2, exp_type="Q4_0", seed=49)
SAMPLED = SamplingParams(temperature=0.8, seed=3)


@pytest.fixture(scope="module")
def ray_8():
    """A local Ray of 8 CPUs: 2 stages x 4 ranks of one CPU each. A Ray this process still holds (an
    in-process CLI call of an earlier module starts one of 2 CPUs and leaves it) ends first."""
    from ggml_dist.workers.local_ray import connect, shutdown_local
    shutdown_local()
    if ray.is_initialized():
        ray.shutdown()
    connect(num_cpus=8)
    yield
    shutdown_local()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp-stages")
    return {"dense": str(write_synthetic(d / "dense.gguf", DENSE)), "moe": str(write_moe(d / "moe.gguf", MOE))}


def _steps(ctx) -> list[np.ndarray]:
    """The prompt's logits (every row), four greedy steps, then the cells from position 5 on removed and
    the same tokens evaluated again there."""
    out = [ctx.decode(Batch.from_tokens(PROMPT, all_outputs=True))]
    for i in range(4):
        out.append(ctx.decode(Batch.from_tokens([int(out[-1][-1].argmax())], pos0=len(PROMPT) + i)))
    ctx.seq_rm(0, 5)
    out.append(ctx.decode(Batch.from_tokens(PROMPT[5:], pos0=5, all_outputs=True)))
    return out


def _run(ctx, tok):
    """One sampled sequence (the last stages choose, each rank feeding its own first stage), then three."""
    ctx.clear()
    one = generate(ctx, tok, PROMPT, 10, SAMPLED, stop_at_eog=False).tokens
    ctx.clear()
    many = [r.tokens for r in generate_parallel(ctx, tok, PROMPT, 6, 3, SAMPLED, stop_at_eog=False, lookahead=2)]
    return one, many


@pytest.mark.parametrize("which, size", [("dense", 2), ("dense", 4), ("moe", 2)])
def test_stage_group_equals_one_process(ray_8, files, which, size):
    from ggml_dist.workers.tp_stages import launch_stage_group
    path = files[which]
    model = LlamaModel.load(path)
    ref = LlamaContext(model, PARAMS)
    want, want_run = _steps(ref), _run(ref, model.tokenizer)
    _, ctx, pipelines = launch_stage_group(path, 2, size, PARAMS)
    try:
        assert [p.placement.stages[1].layers for p in pipelines] == [pipelines[0].placement.stages[1].layers] * size
        got = _steps(ctx)
        for step, (a, b) in enumerate(zip(want, got, strict=True)):
            assert np.array_equal(a, b), f"step {step}: {np.count_nonzero(a != b)} logits differ"
        assert _run(ctx, model.tokenizer) == want_run
        # each rank's first stage maps its rows only, as its placement counted them
        infos = [ray.get(p.actors[0].info.remote()) for p in pipelines]
        assert [i.weight_bytes for i in infos] == [pipelines[0].placement.stages[0].weight_bytes] * size
    finally:
        ctx.close()
        pipelines[0].shutdown()


# stages whose nodes cannot read the file are sent their rank's rows (not the whole tensors to slice again)
def test_rows_shipped_to_stages_without_the_file(ray_8, files):
    from ggml_dist.workers.tp_stages import launch_stage_group
    path = files["moe"]                              # a tied head: the last stages get their vocabulary rows
    want = _steps(LlamaContext(LlamaModel.load(path), PARAMS))
    _, ctx, pipelines = launch_stage_group(path, 2, 2, PARAMS, stage_model_path="/nonexistent/m.gguf")
    try:
        assert all(not i.needs_weights for p in pipelines for i in p.infos)
        # what each stage was sent is what its placement counted: the last stage, its rows of the head only
        assert [[i.weight_bytes for i in p.infos] for p in pipelines] == \
            [[s.weight_bytes for s in p.placement.stages] for p in pipelines]
        assert all(np.array_equal(a, b) for a, b in zip(want, _steps(ctx), strict=True))
    finally:
        ctx.close()
        pipelines[0].shutdown()


# one stage with a node for every rank: every rank a stage actor, the driver apart (rank 0 is not this process)
def test_one_stage_of_rank_actors(ray_8, files):
    from ggml_dist.model.tp_local import TensorParallelContext
    from ggml_dist.runtime import RunConfig, open_runtime
    node = ray.get_runtime_context().get_node_id()
    want = _steps(LlamaContext(LlamaModel.load(files["dense"]), PARAMS))
    rt = open_runtime(RunConfig(files["dense"], PARAMS, 1, on_ray=True, node_ids=[node, node], tensor_parallel=2,
                                show_plan=False))
    try:
        assert isinstance(rt.ctx, TensorParallelContext) and rt.distributed and len(rt.stage_infos()) == 1
        assert all(np.array_equal(a, b) for a, b in zip(want, _steps(rt.ctx), strict=True))
    finally:
        rt.shutdown()


def test_refused_before_any_actor(ray_8, files):
    from ggml_dist.workers.tp_stages import launch_stage_group
    with pytest.raises(ValueError, match="3 nodes for 2 stages x 2 tensor-parallel ranks"):
        launch_stage_group(files["dense"], 2, 2, PARAMS, node_ids=["a", "b", "c"])
    with pytest.raises(TensorParallelError):
        launch_stage_group(files["dense"], 2, 3, PARAMS)          # 32 heads, 4 kv heads: not over 3 ranks


def test_run_stages_and_tensor_parallel(ray_8, files, capsys):
    from ggml_dist.cli import main
    argv = ["run", "--model", files["dense"], "--prompt", "abc", "-n", "8", "--json", "--ctx", "256",
            "--temp", "0.7", "--seed", "5"]
    outs = []
    for extra in ([], ["--stages", "2", "--tensor-parallel", "2"]):
        assert main([*argv, *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert outs[0] == outs[1]
    from ggml_dist.runtime import RunConfig, open_runtime
    with pytest.raises(ValueError, match="--stages auto: give the number of stages"):   # on a cluster
        open_runtime(RunConfig(files["dense"], PARAMS, None, on_ray=True, tensor_parallel=2))

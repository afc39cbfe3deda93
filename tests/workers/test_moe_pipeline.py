"""Mixtures of experts over a pipeline of Ray stage actors: the experts are a stage's weights like any
other (placed, shipped, replayed after a loss), so the logits and tokens are one process's, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.synthetic import write_synthetic  # noqa: E402
from ggml_dist.model.synthetic_moe import SyntheticMoESpec  # noqa: E402
from ggml_dist.model.ubatch import Batch  # noqa: E402
from ggml_dist.workers.cluster import Pipeline  # noqa: E402

# 4 layers (3 stages: 2 + 1 + 1), experts of the types llama.cpp repacks: Q4_0, and gpt-oss's MXFP4
SPECS = {
    "qwen3moe": SyntheticMoESpec(arch="qwen3moe", exp_type="Q4_0", n_layer=4, tied=False, seed=5),
    "gpt-oss": SyntheticMoESpec(arch="gpt-oss", exp_type="MXFP4", n_layer=4, tied=False, n_swa=8, seed=5),
}
TOKENS = [1, 300, 17, 402, 259, 260, 511, 299, 333, 42]
N = 12


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe-pipe")
    return {a: str(write_synthetic(d / f"{a}.gguf", s)) for a, s in SPECS.items()}


@pytest.fixture(scope="module")
def want(paths):
    """One process: the prompt's logits and a greedy continuation."""
    out = {}
    for a, p in paths.items():
        m = LlamaModel.load(p)
        logits = LlamaContext(m, ContextParams(n_ctx=256)).decode(Batch.from_tokens(TOKENS, all_outputs=True))
        toks = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, TOKENS, N).tokens
        assert len(set(toks)) > 3                   # a varied continuation, so a wrong step shows
        out[a] = (logits, toks)
    return out


@pytest.mark.parametrize("arch,stages", [("qwen3moe", 2), ("qwen3moe", 3), ("gpt-oss", 2), ("gpt-oss", 3)])
def test_moe_pipeline_bitwise(local_ray, paths, want, arch, stages):
    pl = Pipeline.launch(paths[arch], stages, ContextParams(n_ctx=256))
    try:
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), want[arch][0])
        pl.ctx.clear()
        assert generate(pl.ctx, pl.model.tokenizer, TOKENS, N).tokens == want[arch][1]
    finally:
        pl.shutdown()


# a stage killed mid-generation is restarted and its KV cache replayed: the same tokens
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_moe_pipeline_recovers(local_ray, paths, want, arch):
    pl = Pipeline.launch(paths[arch], 2, ContextParams(n_ctx=256))
    try:
        def on_token(i: int, tok: int) -> None:
            if i == 5:
                pl.kill_stage(1)
        assert generate(pl.ctx, pl.model.tokenizer, TOKENS, N, on_token=on_token).tokens == want[arch][1]
        assert pl.ctx.recovery.n_recoveries == 1
    finally:
        pl.shutdown()


# a stage whose node cannot read the file gets its layers' experts from the driver (3-D tensors in chunks)
def test_moe_experts_shipped(local_ray, paths, want):
    pl = Pipeline.launch(paths["qwen3moe"], 2, ContextParams(n_ctx=256), stage_model_path="/nonexistent/m.gguf")
    try:
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), want["qwen3moe"][0])
    finally:
        pl.shutdown()

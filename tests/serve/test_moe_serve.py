"""Serving a mixture of experts (gpt-oss's graph, MXFP4 experts): with `--deterministic` a request's
greedy tokens and logprobs alone, after a prompt-cache hit, and among concurrent others are one and the
same, although the tokens of one step route to different experts and each expert's rows are grouped."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import openai  # noqa: E402

from ggml_dist.model.synthetic import write_synthetic  # noqa: E402
from ggml_dist.model.synthetic_moe import SyntheticMoESpec  # noqa: E402

from .test_app import metric  # noqa: E402

SPEC = SyntheticMoESpec(arch="gpt-oss", exp_type="MXFP4", n_layer=2, tied=False, n_swa=16, seed=7)
PROMPTS = ["ab cd ef", "gh ij", "kl mn op qr", "st uv wx yz ab", "cd", "ef gh ij kl mn"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    path = str(write_synthetic(tmp_path_factory.mktemp("moe-serve") / "gpt-oss.gguf", SPEC))
    cfg = engine_config(path, n_parallel=4, n_ctx=4 * 256, batch_invariant=True)
    with ServerThread(cfg, model_name="moe") as srv:
        yield srv


def _complete(url: str, prompt: str, n: int = 10) -> tuple:
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    r = c.completions.create(model="moe", prompt=prompt, max_tokens=n, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == n
    return tuple(lp.tokens), tuple(lp.token_logprobs)


def test_moe_request_does_not_depend_on_the_batch(server):
    alone = [_complete(server.url, p) for p in PROMPTS]
    cached0 = metric(server, "prompt_tokens_cached_total")
    assert _complete(server.url, PROMPTS[-1]) == alone[-1]                  # again, from the prompt cache
    assert metric(server, "prompt_tokens_cached_total") > cached0
    with ThreadPoolExecutor(len(PROMPTS)) as pool:                          # all at once, 4 slots
        together = list(pool.map(lambda p: _complete(server.url, p), PROMPTS))
    assert together == alone

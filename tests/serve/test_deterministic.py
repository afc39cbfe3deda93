"""`serve --deterministic` (EngineConfig.batch_invariant), one process, SmolLM2: the same greedy request
alone, after a prompt cache hit, and among 7 concurrent others gives the same tokens and the same
logprobs (and top logprobs) to the bit, through the official openai client. The prompt is issue 44's,
whose first logprob llama.cpp's numerics give as -1.568735 fresh and -1.538422 after a cache hit."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import threading  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import openai  # noqa: E402

from .test_app import metric  # noqa: E402

PROMPT = "Zebras are"
OTHERS = ["Once upon a time, in a small village, there lived", "def fibonacci(n):", "Water boils at",
          "List of planets: Mercury, Venus,", "import numpy as np\n\nx = np.arange(10)\n",
          "The three primary colors are", "In machine learning, overfitting means that a model"]
N_TOKENS = 12


@pytest.fixture(scope="module")
def server(smollm2_path):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(smollm2_path, n_parallel=8, n_ctx=8 * 256, batch_invariant=True)
    with ServerThread(cfg, model_name="smollm2") as srv:
        yield srv


def _complete(url: str, prompt: str, n: int = N_TOKENS) -> tuple:
    """(tokens, token logprobs, top logprobs) of a greedy completion: the floats as the JSON gave them."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    r = c.completions.create(model="smollm2", prompt=prompt, max_tokens=n, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == n
    return tuple(lp.tokens), tuple(lp.token_logprobs), tuple(tuple(sorted(t.items())) for t in lp.top_logprobs)


# alone (a fresh prompt, one chunk), again (the slot's cache holds it: only its last token runs), and
# sent while 7 others decode (its prompt a token a step beside them, in a slot another request cached)
def test_a_request_s_tokens_and_logprobs_do_not_depend_on_the_batch(server):
    alone = _complete(server.url, PROMPT)
    cached0 = metric(server, "prompt_tokens_cached_total")
    again = _complete(server.url, PROMPT)
    assert metric(server, "prompt_tokens_cached_total") > cached0          # the cache-hit path ran
    assert again == alone
    with ThreadPoolExecutor(8) as pool:                # 8 others evict every slot's cache of it
        list(pool.map(lambda p: _complete(server.url, p, 4), [*OTHERS, "Zebras live in"]))
    started = threading.Event()

    def other(p: str) -> tuple:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = c.completions.create(model="smollm2", prompt=p, max_tokens=24, temperature=0, stream=True)
        for _ in stream:
            started.set()
        return ()
    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(other, p) for p in OTHERS]
        assert started.wait(60)
        time.sleep(0.05)                               # the others are decoding
        among = pool.submit(_complete, server.url, PROMPT).result()
        for f in busy:
            f.result()
    assert among == alone
    assert alone[1][0] == pytest.approx(-1.538422, abs=1e-6)   # llama.cpp's logprob for the token alone

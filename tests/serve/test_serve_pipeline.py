"""The server over a 2-stage Ray pipeline: concurrent greedy requests give the single-process tokens."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import re  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

ray = pytest.importorskip("ray")

from ggml_dist.workers.cluster import connect  # noqa: E402

from .test_app import PROMPTS, reference  # noqa: E402


@pytest.fixture(scope="module")
def local_ray():
    connect(num_cpus=4)
    yield
    ray.shutdown()


# --stages 2: micro-batches of the active sequences overlap on the stages; tokens match single runs
def test_pipeline_server(local_ray, serve_model):
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import EngineConfig, ServerThread
    model = LlamaModel.load(serve_model)
    lengths = [12, 20, 8, 16, 10]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    with ServerThread(EngineConfig(serve_model, n_stages=2, n_parallel=4, n_ctx=1024)) as srv:
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(i: int) -> str:
            stream = c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                          stream=i % 2 == 0)
            if i % 2 == 0:
                return "".join(ch.choices[0].text for ch in stream)
            return stream.choices[0].text

        with ThreadPoolExecutor(len(lengths)) as ex:
            assert list(ex.map(one, range(len(lengths)))) == want
        text = httpx.get(srv.url + "/metrics").text
        busy = [float(v) for v in re.findall(r'^ggml_dist_stage_busy_seconds_total\{stage="\d"\} (\S+)$', text, re.M)]
        assert len(busy) == 2 and all(b > 0 for b in busy)

"""Chat with the real SmolLM2 GGUF and its own chat template, through the openai client."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import openai  # noqa: E402


# the GGUF's template renders the messages; greedy text equals a single run of the rendered prompt
def test_smollm2_chat(smollm2_path):
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.generate import generate
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    msgs = [{"role": "user", "content": "Hi"}]
    m = LlamaModel.load(smollm2_path)
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(msgs), add_special=True, parse_special=True)
    want = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, ids, 3).text
    with ServerThread(engine_config(smollm2_path, n_parallel=2, n_ctx=512), model_name="smollm2") as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        chunks = list(c.chat.completions.create(model="smollm2", messages=msgs, max_tokens=3, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 3

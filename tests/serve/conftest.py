"""Serve fixtures: a small synthetic model with varied greedy output, and servers on free loopback ports."""
from __future__ import annotations

import pytest

from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic

# untied head: greedy text varies with the prompt and includes byte tokens (UTF-8 streaming)
SPEC = SyntheticSpec(n_layer=2, tied=False, seed=3)
CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="session")
def serve_model(tmp_path_factory) -> str:
    return str(write_synthetic(tmp_path_factory.mktemp("serve") / "m.gguf", SPEC))


@pytest.fixture(scope="module")
def server(serve_model):
    """4 slots of 1024 tokens, a ChatML-like template (the synthetic GGUF has none)."""
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(serve_model, n_parallel=4, n_ctx=4096, max_queue=8, chat_template=CHATML)
    with ServerThread(cfg, model_name="synthetic") as srv:
        yield srv

"""serve with --tensor-parallel: the server's slots, prompt cache and decode loop on a group of ranks
(model/tp_local.py) answer as one process does."""
from __future__ import annotations

from fastapi.testclient import TestClient

from ggml_dist.model.context import ContextParams
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.runtime import RunConfig
from ggml_dist.serve import Engine, EngineConfig, create_app

SPEC = SyntheticSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=32, n_head_kv=4, n_ff=512, wtype="Q4_0",
                     embd_type="Q4_0", tied=False, seed=6)


def _answers(path: str, tensor_parallel: int) -> list[str]:
    cfg = RunConfig(path, ContextParams(n_ctx=512, n_seq_max=2), 1, label="ggml-dist serve",
                    tensor_parallel=tensor_parallel)
    engine = Engine(EngineConfig(cfg, n_parallel=2))
    with TestClient(create_app(engine, "m")) as tc:
        engine.start()
        assert engine.ready.wait(300)
        # the third request hits the first's cached prompt
        return [tc.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0}
                        ).json()["choices"][0]["text"] for p in ("abc", "hello there", "abc")]


# greedy answers over 2 ranks are one process's, a prompt-cache hit included
def test_serve_tensor_parallel(tmp_path):
    path = str(write_synthetic(tmp_path / "m.gguf", SPEC))
    want = _answers(path, 1)
    assert _answers(path, 2) == want and len(set(want)) == 2

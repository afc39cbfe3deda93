"""llama-server's own API (serve/llama_server.py) through plain HTTP, as llama.cpp's scripts call it:
/completion's native fields and answer, /props, /slots, /apply-template, /embedding with pooling none,
timings and llama-server's error type on the OpenAI routes. (benchmarks/llama_server_suite.py runs
llama.cpp's own server tests against `ggml-dist serve`.)"""
from __future__ import annotations

import json

import numpy as np
import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):     # the serve extras
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from .test_app import PROMPTS, reference  # noqa: E402


@pytest.fixture(scope="module")
def model(serve_model):
    from ggml_dist.model.model import LlamaModel
    return LlamaModel.load(serve_model)


def post(srv, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


# /completion, greedy: the text of a single run, the tokens' ids with return_tokens, llama-server's
# fields, n_probs' completion_probabilities with ids, timings counting the prompt
def test_completion_native(server, model):
    want = reference(model, PROMPTS[0], 8)
    r = post(server, "/completion", {"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0, "return_tokens": True,
                                     "n_probs": 3})
    ids = model.tokenizer.encode(PROMPTS[0], add_special=True, parse_special=True)
    assert r["content"] == want and r["stop"] is True and r["stop_type"] == "limit"
    assert r["tokens_predicted"] == 8 and r["tokens_evaluated"] == len(ids) and len(r["tokens"]) == 8
    assert b"".join(model.tokenizer.token_to_piece(t) for t in r["tokens"]).decode("utf-8", "replace") == want
    assert r["timings"]["predicted_n"] == 8 and r["timings"]["prompt_n"] + r["timings"]["cache_n"] == len(ids)
    assert r["tokens_cached"] == len(ids) + 8 - 1             # the slot's cells: the last token never evaluated
    assert r["generation_settings"]["n_predict"] == 8 and isinstance(r["has_new_line"], bool)
    probs = r["completion_probabilities"]
    assert [p["id"] for p in probs] == r["tokens"]
    assert all(len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == p["id"] for p in probs)   # greedy
    # without return_tokens no ids; a stop string: stop_type word and the word
    r = post(server, "/completion", {"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0})
    assert r["tokens"] == [] and "completion_probabilities" not in r
    stop = want[3:6]
    r = post(server, "/completion", {"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0, "stop": [stop]})
    assert r["stop_type"] == "word" and r["stopping_word"] == stop and r["content"] == want[:want.index(stop)]
    # the prompt cache, and cache_prompt false: the whole prompt evaluated again
    post(server, "/completion", {"prompt": PROMPTS[3], "n_predict": 2, "temperature": 0})
    hit = post(server, "/completion", {"prompt": PROMPTS[3], "n_predict": 2, "temperature": 0})
    miss = post(server, "/completion", {"prompt": PROMPTS[3], "n_predict": 2, "temperature": 0, "cache_prompt": False})
    assert hit["timings"]["cache_n"] > 0 and miss["timings"]["cache_n"] == 0
    # response_fields picks (nested) fields
    r = post(server, "/completion", {"prompt": PROMPTS[0], "n_predict": 2, "temperature": 0,
                                     "response_fields": ["content", "generation_settings/n_predict"]})
    assert set(r) == {"content", "generation_settings/n_predict"} and r["generation_settings/n_predict"] == 2


# streamed: a chunk per piece with its token ids, then the final one (stop true, empty content and, as
# llama-server's, no tokens: each was in its piece, return_tokens or not)
@pytest.mark.parametrize("return_tokens", [False, True])
def test_completion_native_stream(server, model, return_tokens):
    want = reference(model, PROMPTS[1], 6)
    with httpx.stream("POST", server.url + "/completion", timeout=120,
                      json={"prompt": PROMPTS[1], "n_predict": 6, "temperature": 0, "stream": True,
                            "return_tokens": return_tokens}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False and e["tokens"] for e in events[:-1])
    assert "".join(e["content"] for e in events[:-1]) == want and sum(len(e["tokens"]) for e in events) == 6
    assert events[-1]["stop"] is True and events[-1]["content"] == "" and events[-1]["timings"]["predicted_n"] == 6


# prompts as token ids, strings mixed into ids, {"prompt_string"}, and a list of prompts (a list of answers)
def test_completion_native_prompts(server, model):
    ids = model.tokenizer.encode(PROMPTS[2], add_special=True, parse_special=True)
    one = post(server, "/completion", {"prompt": ids, "n_predict": 4, "temperature": 0})["content"]
    assert one == reference(model, PROMPTS[2], 4)
    many = post(server, "/completion", {"prompt": [ids, PROMPTS[2], {"prompt_string": PROMPTS[2]}], "n_predict": 4,
                                        "temperature": 0})
    assert isinstance(many, list) and [m["content"] for m in many] == [one] * 3
    mixed = post(server, "/completion", {"prompt": [*ids[:2], "x", *ids[2:3]], "n_predict": 2, "temperature": 0})
    assert mixed["tokens_evaluated"] >= 4
    # refused by name: what would change the answer and is not implemented
    err = post(server, "/completion", {"prompt": "x", "mirostat": 2}, status=400)
    assert err["error"]["param"] == "mirostat"
    assert post(server, "/completion", {"prompt": "x", "mirostat": 0, "n_predict": 1})["tokens_predicted"] <= 1


# /props, /slots (read-only: actions need --api-key), /apply-template, the routes' llama-server names
def test_props_slots_template(server, model):
    p = httpx.get(server.url + "/props").json()
    assert p["total_slots"] == 4 and p["default_generation_settings"]["n_ctx"] == 1024
    slots = httpx.get(server.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and not any(s["is_processing"] for s in slots)
    assert httpx.post(server.url + "/slots/0?action=erase", json={}).status_code == 403
    msgs = [{"role": "user", "content": "hi"}]
    t = post(server, "/apply-template", {"messages": msgs})["prompt"]
    assert t == model.tokenizer.apply_chat_template(msgs, template=server.engine.cfg.chat_template)
    r = post(server, "/chat/completions", {"messages": msgs, "max_tokens": 3, "temperature": 0})
    assert r["object"] == "chat.completion" and r["timings"]["predicted_n"] == r["usage"]["completion_tokens"]
    assert post(server, "/completions", {"prompt": "hi", "max_tokens": 2})["object"] == "text_completion"
    assert httpx.get(server.url + "/models").json()["data"][0]["id"] == "synthetic"


# a prompt past the context: llama-server's exceed_context_size_error with its numbers (OpenAI's code)
def test_context_exceeded_error(server):
    err = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 1500}]},
               status=400)["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == "context_length_exceeded"
    assert err["n_ctx"] == 1024 and err["n_prompt_tokens"] > 1024


@pytest.fixture(scope="module")
def rows_server(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=1024, pooling="none"), model_name="s") as srv:
        yield srv


# --pooling none: /embedding gives each token's final-norm row, not normalized, the same rows as the
# last-token pooling's input; /v1/embeddings refuses (no shape for it)
def test_embedding_pooling_none(rows_server, model):
    ids = model.tokenizer.encode("hello hello hello", add_special=True, parse_special=True)
    r = post(rows_server, "/embedding", {"content": "hello hello hello"})
    rows = np.array(r[0]["embedding"])
    assert rows.shape == (len(ids), model.hp.n_embd)
    assert not np.allclose(np.linalg.norm(rows, axis=1), 1.0)
    same = post(rows_server, "/embeddings", {"content": [{"content": [{"type": "text", "text": "hello hello"},
                                                                       {"type": "text", "text": " hello"}]}]})
    assert np.array_equal(np.array(same[0]["embedding"]), rows)
    assert post(rows_server, "/v1/embeddings", {"input": "hi"}, status=400)["error"]["param"] == "input"


# llama-server's --temp, --seed and --n-predict (EngineConfig.request_defaults): what a request that sets
# none takes, on every route; a request's own value wins
def test_request_defaults(serve_model, model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=1024,
                       request_defaults=(("temperature", 0.0), ("seed", 7), ("n_predict", 5)))
    with ServerThread(cfg, model_name="s") as srv:
        r = post(srv, "/completion", {"prompt": PROMPTS[0]})
        assert r["content"] == reference(model, PROMPTS[0], 5) and r["generation_settings"]["seed"] == 7
        assert post(srv, "/v1/completions", {"prompt": PROMPTS[0]})["choices"][0]["text"] == r["content"]
        assert post(srv, "/completion", {"prompt": PROMPTS[0], "n_predict": 2})["tokens_predicted"] == 2


# /chat/completions/input_tokens counts the prompt a chat request takes; continue_final_message ends the
# prompt inside the last assistant message (vLLM's), which cannot go with add_generation_prompt
def test_input_tokens_and_continue_final_message(server):
    msgs = [{"role": "user", "content": "hi"}]
    n = post(server, "/chat/completions/input_tokens", {"messages": msgs})["input_tokens"]
    assert n == post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})["usage"]["prompt_tokens"]
    cont = [*msgs, {"role": "assistant", "content": "Hel"}]
    r = post(server, "/v1/chat/completions", {"messages": cont, "max_tokens": 2, "add_generation_prompt": False,
                                              "continue_final_message": True, "verbose": True})
    assert r["__verbose"]["prompt"].endswith("assistant\nHel")
    err = post(server, "/v1/chat/completions", {"messages": cont, "add_generation_prompt": True,
                                                "continue_final_message": True}, status=400)
    assert err["error"]["param"] == "continue_final_message"

"""Every request field the server accepts has its effect, asserted through the official openai client;
the OpenAI fields it does not implement are refused with a 400 that names them (README's field table)."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import math  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402

from .test_app import PROMPTS, client, reference  # noqa: E402


@pytest.fixture(scope="module")
def model(serve_model):
    return LlamaModel.load(serve_model)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("best_of", 2),
    ("suffix", "x"),
    ("mirostat", 2),
])
def test_unsupported_fields_are_refused_by_name(server, field, value):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert field in r.json()["error"]["message"]
    # response_format text is the default behaviour, so it is accepted
    ok = httpx.post(server.url + "/v1/completions",
                    json={"prompt": "x", "max_tokens": 2, "response_format": {"type": "text"}})
    assert ok.status_code == 200


def test_completion_logprobs(server, model):
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                          logprobs=2)
    c = r.choices[0]
    assert c.text == reference(model, PROMPTS[0], 8)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8 == r.usage.completion_tokens
    assert "".join(lp.tokens) == c.text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) == 2
        assert math.isclose(chosen, max(top.values()))          # greedy: the chosen one is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_chat_logprobs_streamed_and_not(server):
    msgs = [{"role": "user", "content": "hi"}]
    r = client(server).chat.completions.create(model="synthetic", messages=msgs, max_tokens=6, temperature=0,
                                               logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob == t.logprob for t in content)
    assert all(bytes(t.bytes).decode("utf-8", "replace") == t.token for t in content)
    chunks = list(client(server).chat.completions.create(model="synthetic", messages=msgs, max_tokens=6,
                                                         temperature=0, logprobs=True, stream=True))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    # no logprobs asked, none sent; top_logprobs alone is refused
    assert client(server).chat.completions.create(model="synthetic", messages=msgs, max_tokens=2,
                                                  temperature=0).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model="synthetic", messages=msgs, max_tokens=2, top_logprobs=2)


def test_logit_bias_bans_a_token(server, model):
    ids = model.tokenizer.encode(PROMPTS[2], add_special=True, parse_special=True)
    greedy = generate(LlamaContext(model, ContextParams(n_ctx=1024)), model.tokenizer, ids, 12)
    banned = greedy.tokens[0]
    piece = model.tokenizer.token_to_piece(banned).decode("utf-8", "replace")
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                          logit_bias={str(banned): -100}, logprobs=0)
    assert r.choices[0].text != greedy.text
    assert piece not in r.choices[0].logprobs.tokens
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "logit_bias": {"abc": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_change_a_repetitive_greedy_output(server, model, field):
    plain = client(server).completions.create(model="synthetic", prompt=PROMPTS[4], max_tokens=24, temperature=0,
                                              logprobs=0)
    toks = plain.choices[0].logprobs.tokens
    assert len(set(toks)) < len(toks), "the reference output should repeat a token"
    pen = client(server).completions.create(model="synthetic", prompt=PROMPTS[4], max_tokens=24, temperature=0,
                                            logprobs=0, **{field: 2.0})
    assert pen.choices[0].text != plain.choices[0].text
    ptoks = pen.choices[0].logprobs.tokens
    assert len(set(ptoks)) >= len(set(toks))                # penalised: no fewer distinct tokens


def test_tokenize_detokenize(server, model):
    text = "the quick brown fox"
    r = httpx.post(server.url + "/tokenize", json={"content": text}).json()
    assert r["tokens"] == model.tokenizer.encode(text, add_special=False, parse_special=True)
    # llama-server's pieces and detokenize keep the space SentencePiece put before the first word
    joined = b"".join(model.tokenizer.token_to_piece(t) for t in r["tokens"]).decode()
    assert joined.strip() == text
    pieces = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == r["tokens"] and "".join(p["piece"] for p in pieces) == joined
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["content"] == joined
    assert httpx.post(server.url + "/detokenize", json={"tokens": [10**9]}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"content": 5}).status_code == 400


def test_internal_errors_do_not_leak(server, monkeypatch):
    def boom(req):
        raise RuntimeError("secret internal detail")
    monkeypatch.setattr(server.engine, "submit", boom)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500
    err = r.json()["error"]
    assert "secret" not in err["message"] and "id err-" in err["message"] and err["code"] == "internal_error"


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "size"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"},
                         "size": {"enum": ["s", "m", "l"]}}}


# response_format json_schema: 20 answers (greedy and sampled) parse and validate against the schema
def test_json_schema_answers_validate(server):
    import json

    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for i in range(20):
        r = client(server).chat.completions.create(
            model="synthetic", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            max_tokens=48, temperature=0 if i < 6 else 1.0, seed=i, response_format=fmt)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
    obj = client(server).completions.create(model="synthetic", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].text), dict)


def test_gbnf_grammar_and_bad_schemas(server):
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                          extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    for fmt in ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, {"type": "xml"}):
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "response_format": fmt})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "grammar": "root ::= ("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar"

"""Every request field the server accepts has its effect, asserted through the official openai client;
the OpenAI fields it does not implement are refused with a 400 that names them (docs/api.md's field table)."""
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
    # json_object: an answer that ends is one JSON object; one cut at max_tokens is the start of one (the
    # synthetic model's greedy answers: "{}" for these two prompts, an endless first key for PROMPTS[0])
    for prompt in PROMPTS[1:3]:
        obj = client(server).completions.create(model="synthetic", prompt=prompt, max_tokens=40, temperature=0,
                                                extra_body={"response_format": {"type": "json_object"}})
        assert obj.choices[0].finish_reason == "stop", obj
        assert isinstance(json.loads(obj.choices[0].text), dict)
    cut = client(server).completions.create(model="synthetic", prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                            extra_body={"response_format": {"type": "json_object"}})
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 40
    assert cut.choices[0].text.startswith('{"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.choices[0].text)


def test_gbnf_grammar_and_bad_schemas(server):
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                          extra_body={"grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    for fmt in ({"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}, {"type": "xml"}):
        bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "response_format": fmt})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    bad = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "grammar": "root ::= ("})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar"


# -- tools -------------------------------------------------------------------------------------------
TOOL_TEMPLATE = (
    "{% if tools %}<s>system\nYou may call these tools, as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call>: {{ tools | tojson }}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>\n{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n"
    "</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"enum": ["utc", "cet"]}}}}}


@pytest.fixture(scope="module")
def tool_server(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=4096, chat_template=TOOL_TEMPLATE)
    with ServerThread(cfg, model_name="synthetic") as srv:
        yield srv


def _valid_call(call, tools) -> None:
    import json

    import jsonschema
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in spec
    jsonschema.validate(json.loads(call.function.arguments), spec[call.function.name])


# tool_choice naming a function: the grammar makes the answer that call, with valid arguments
def test_forced_tool_call(tool_server):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        r = client(tool_server).chat.completions.create(model="synthetic", messages=msgs, tools=[WEATHER, TIME],
                                                        tool_choice=forced, temperature=temperature, seed=4,
                                                        max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1 and c.message.tool_calls[0].function.name == "get_weather"
        _valid_call(c.message.tool_calls[0], [WEATHER])
    # required: some tool, streamed: the call arrives as a tool_calls delta with finish_reason tool_calls
    chunks = list(client(tool_server).chat.completions.create(
        model="synthetic", messages=msgs, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
        max_tokens=200, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == ""
    _valid_call(deltas[0], [WEATHER, TIME])


# an earlier call and its result go back through the template; tools without a template that shows them
# to the model, and a bad tool_choice, are refused
def test_tool_history_and_refusals(tool_server, server, model):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client(tool_server).chat.completions.create(model="synthetic", messages=msgs, tools=[WEATHER],
                                                    temperature=0, max_tokens=8)
    # the prompt is the template's rendering of the whole history (the call, its arguments as an object as
    # HF templates read them, its result, the tools), and the answer is that prompt's greedy continuation,
    # cut at max_tokens (no tool call in it)
    as_read = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {**msgs[1]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}}]},
        msgs[2]]
    text = model.tokenizer.apply_chat_template(as_read, template=TOOL_TEMPLATE, tools=[WEATHER])
    assert '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}' in text and "21 C" in text
    ids = model.tokenizer.encode(text, add_special=True, parse_special=True)
    greedy = generate(LlamaContext(model, ContextParams(n_ctx=1024)), model.tokenizer, ids, 8)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.content == greedy.text and r.choices[0].message.tool_calls is None
    # CHATML never renders tools: the generic format (serve/tools.py) makes a forced call all the same
    g = client(server).chat.completions.create(model="synthetic", messages=msgs[:1], tools=[WEATHER],
                                               tool_choice="required", max_tokens=200, temperature=0)
    assert g.choices[0].finish_reason == "tool_calls" and g.choices[0].message.content is None
    _valid_call(g.choices[0].message.tool_calls[0], [WEATHER])
    bad = httpx.post(tool_server.url + "/v1/chat/completions", json={
        "messages": msgs[:1], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
    # tool_choice "none": the tools are not shown and no call is parsed
    none = client(tool_server).chat.completions.create(model="synthetic", messages=msgs[:1], tools=[WEATHER],
                                                       tool_choice="none", temperature=0, max_tokens=4)
    assert none.choices[0].message.tool_calls is None


def test_parse_tool_calls_of_each_family():
    from ggml_dist.serve.tools import held_back, parse_calls
    text, calls = parse_calls('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
                              '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>', "hermes")
    assert text == "ok" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": 2}')]
    assert parse_calls("<tool_call>{not json}</tool_call>", "hermes") == ("<tool_call>{not json}</tool_call>", [])
    _, calls = parse_calls('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', "llama3")
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert parse_calls("plain answer", "llama3") == ("plain answer", [])
    assert held_back("see <tool", "hermes") == 5 and held_back("see", "hermes") == 0
    assert held_back('{"na', "llama3") == 4 and held_back("Hi", "llama3") == 0


# -- n choices and prompt lists --------------------------------------------------------------------
def test_n_choices_share_the_prompt(server, model, monkeypatch):
    ctx = server.engine.ctx
    submit, fed = ctx.submit, []

    def spy(batch, **kw):
        fed.append(batch.n_tokens)
        return submit(batch, **kw)
    monkeypatch.setattr(ctx, "submit", spy)
    n_prompt = len(model.tokenizer.encode(PROMPTS[3]))
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[3], max_tokens=6, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert {c.text for c in r.choices} == {reference(model, PROMPTS[3], 6)}     # greedy: the same text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 18)
    # the prompt once (seq_cp; a cached prefix may skip some of it), then 5 steps of the 3 sequences
    assert fed[0] <= n_prompt and fed[1:] == [3] * 5
    sampled = [client(server).completions.create(model="synthetic", prompt=PROMPTS[3], max_tokens=8,
                                                 temperature=1.5, seed=5, n=3, extra_body={"top_k": 0, "min_p": 0})
               for _ in range(2)]
    texts = [[c.text for c in s.choices] for s in sampled]
    assert texts[0] == texts[1] and len(set(texts[0])) > 1    # seeded: repeatable, and the choices differ


def test_n_choices_streamed_and_prompt_lists(server, model):
    msgs = [{"role": "user", "content": "hi"}]
    kw = dict(model="synthetic", messages=msgs, max_tokens=6, temperature=1.0, seed=11, n=2)
    whole = client(server).chat.completions.create(**kw)
    parts = {0: "", 1: ""}
    finish = {}
    for ch in client(server).chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert parts == {c.index: c.message.content for c in whole.choices} and set(finish) == {0, 1}
    r = client(server).completions.create(model="synthetic", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=5,
                                          temperature=0)
    assert [c.text for c in r.choices] == [reference(model, PROMPTS[0], 5), reference(model, PROMPTS[1], 5)]


def test_long_prompt_refused_before_encoding(server, monkeypatch):
    tok = server.engine.tokenizer
    calls = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or [1])
    huge = "x " * 200_000                        # far past any slot: refused from its length alone
    r = httpx.post(server.url + "/v1/completions", json={"prompt": huge, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded" and not calls


# -- embeddings ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embed_server(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=1024, pooling="mean"),
                      model_name="synthetic") as srv:
        yield srv


def test_embeddings(embed_server, server, model):
    import base64

    import numpy as np
    from ggml_dist.model.ubatch import Batch
    texts = ["the quick brown fox", "zz top", "the quick brown fox"]
    r = client(embed_server).embeddings.create(model="synthetic", input=texts)
    vecs = [np.array(d.embedding) for d in r.data]
    assert [d.index for d in r.data] == [0, 1, 2] and all(len(v) == model.hp.n_embd for v in vecs)
    assert all(abs(np.linalg.norm(v) - 1) < 1e-6 for v in vecs)
    assert np.array_equal(vecs[0], vecs[2]) and not np.allclose(vecs[0], vecs[1])
    ids = [model.tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == sum(len(i) for i in ids)
    # the mean of the final norm's rows, normalized: from a separate context
    ctx = LlamaContext(model, ContextParams(n_ctx=256))
    rows = ctx.submit(Batch(np.array(ids[1], np.int32), np.arange(len(ids[1]), dtype=np.int32),
                            [frozenset({0})] * len(ids[1]), np.ones(len(ids[1]), bool)), embeddings=True).result()
    want = rows.astype(np.float64).mean(0)
    np.testing.assert_allclose(vecs[1], want / np.linalg.norm(want), rtol=1e-6, atol=1e-7)
    # token ids as input; floats in JSON (the openai client itself asks for base64 and decodes it)
    floats = httpx.post(embed_server.url + "/v1/embeddings", json={"input": ids[1], "encoding_format": "float"})
    assert np.array_equal(np.array(floats.json()["data"][0]["embedding"], np.float32), vecs[1].astype(np.float32))
    raw = httpx.post(embed_server.url + "/v1/embeddings", json={"input": "zz top", "encoding_format": "base64"})
    assert np.array_equal(np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4"),
                          vecs[1].astype(np.float32))
    # the server without --pooling, and bad inputs, say why
    no = httpx.post(server.url + "/v1/embeddings", json={"input": "x"})
    assert no.status_code == 400 and "--pooling" in no.json()["error"]["message"]
    for bad in ({"input": 5}, {"input": []}, {"input": "x", "dimensions": 8}, {"input": [10**9]}):
        assert httpx.post(embed_server.url + "/v1/embeddings", json=bad).status_code == 400

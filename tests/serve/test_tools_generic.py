"""Tools on any model (serve/tools.py): the generic format where the chat template renders no tools
(SmolLM2's own), strict calls held to their schema with objects closed, and langchain-openai's
bind_tools through the real client."""
from __future__ import annotations

import json

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai", "jsonschema"):     # the serve and test extras
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

from ggml_dist.serve.tools import call_grammar, close_objects, generic_messages, parse_calls  # noqa: E402

from .test_api_fields import TOOL_TEMPLATE  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "required": ["city"],       # no additionalProperties: closed all the same
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
STRICT = {"type": "function", "function": {
    "name": "get_time", "strict": True, "description": "Get the time in a time zone",
    "parameters": {"type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["utc", "cet"]}},
                   "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def _closed(schema: dict) -> dict:
    return close_objects(schema)


def _valid(call, tool) -> dict:
    assert call.type == "function" and call.function.name == tool["function"]["name"]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, _closed(tool["function"]["parameters"]))      # no property beyond the schema's
    return args


@pytest.fixture(scope="module")
def smol_server(smollm2_path):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(smollm2_path, n_parallel=2, n_ctx=4096), model_name="smol") as srv:
        yield srv


# SmolLM2's template renders no tools: a required call comes back as tool_calls through the generic
# format, its arguments valid and closed; the history of a call and its result goes back as JSON text
def test_generic_format_on_smollm2(smol_server):
    c = _client(smol_server)
    r = c.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice="required",
                                  temperature=0, max_tokens=120)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    args = _valid(ch.message.tool_calls[0], WEATHER)
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [ch.message.tool_calls[0].model_dump()]},
               {"role": "tool", "tool_call_id": ch.message.tool_calls[0].id, "content": "18 C, sunny"}]
    r2 = c.chat.completions.create(model="smol", messages=history, tools=[WEATHER], temperature=0, max_tokens=60)
    content = r2.choices[0].message.content
    # auto: a text response or a call; either way no JSON of the format reaches the content
    assert r2.choices[0].message.tool_calls or r2.choices[0].finish_reason in ("stop", "length")
    assert content is None or ('"response"' not in content and '"tool_call"' not in content)
    rendered = generic_messages([*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}], [WEATHER])
    assert rendered[0]["role"] == "system" and "get_weather" in rendered[0]["content"]
    assert json.loads(rendered[2]["content"])["tool_call"]["name"] == "get_weather"
    assert json.loads(rendered[3]["content"])["tool_response"]["content"] == "18 C"


# streamed, auto and forced: the generic answer's JSON is held until it is parsed, so deltas carry the
# response text or one tool_calls delta, never the format's markup
def test_generic_format_streamed(smol_server):
    c = _client(smol_server)
    for choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        chunks = list(c.chat.completions.create(model="smol", messages=ASK, tools=[WEATHER], tool_choice=choice,
                                                temperature=0, max_tokens=80, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert '"tool_call"' not in text and '"response"' not in text
        if choice != "auto":
            assert len(calls) == 1 and not text
            _valid(calls[0], WEATHER)
        assert bool(calls) or text


# the generic answer's parse: a response, a call, parallel calls, and a cut-off answer (max_tokens)
def test_parse_generic_answers():
    assert parse_calls('{"response": "Hi there"}', "generic") == ("Hi there", [])
    content, calls = parse_calls('{"tool_call": {"name": "f", "arguments": {"a": 1}}}', "generic")
    assert content == "" and [(x.name, x.arguments) for x in calls] == [("f", '{"a": 1}')]
    _, calls = parse_calls('{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]}',
                           "generic")
    assert [x.name for x in calls] == ["f", "g"]
    assert parse_calls('{"response": "Hello, wor', "generic") == ("Hello, wor", [])
    assert parse_calls('{"tool_call": {"name": "f", "argu', "generic") == ("", [])


# an object without additionalProperties is closed, at every level; one that says otherwise keeps it
def test_close_objects():
    s = close_objects({"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                                        "b": {"type": "array", "items": {"properties": {}}},
                                                        "c": {"type": "object", "additionalProperties": True}},
                       "$defs": {"d": {"type": "object"}}})
    assert s["additionalProperties"] is False and s["properties"]["a"]["additionalProperties"] is False
    assert s["properties"]["b"]["items"]["additionalProperties"] is False
    assert s["properties"]["c"]["additionalProperties"] is True and s["$defs"]["d"]["additionalProperties"] is False


@pytest.fixture(scope="module")
def hermes_server(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=4096, chat_template=TOOL_TEMPLATE)
    with ServerThread(cfg, model_name="synthetic") as srv:
        yield srv


# a strict tool under tool_choice auto on a template that renders tools (hermes): whatever the model
# writes, calls are valid against the closed schema and no call markup is left in the content
def test_strict_auto_call_is_held_to_its_schema(hermes_server, serve_model):
    c = _client(hermes_server)
    for seed in range(4):
        r = c.chat.completions.create(model="synthetic", messages=ASK, tools=[STRICT], temperature=1.0, seed=seed,
                                      max_tokens=40)
        msg = r.choices[0].message
        assert "<tool_call>" not in (msg.content or "")
        for call in msg.tool_calls or []:
            _valid(call, STRICT)
    # the grammar: text without the markup, or calls held to the schema
    from ggml_dist.model.model import LlamaModel
    g = call_grammar([STRICT], None, "hermes", LlamaModel.load(serve_model).tokenizer)
    assert "TEXT" in g and '"additionalProperties": false' in g


# langchain-openai's bind_tools(...).invoke on SmolLM2's default template: a tool call, through the
# real client (strict too, which langchain sends as function.strict)
def test_langchain_bind_tools(smol_server):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (the dev extra)")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    llm = lc.ChatOpenAI(model="smol", base_url=smol_server.url + "/v1", api_key="none", temperature=0,
                        max_tokens=120, max_retries=0, timeout=300)
    for strict in (None, True):
        msg = llm.bind_tools([get_weather], tool_choice="get_weather", strict=strict).invoke(
            "What is the weather like in Paris today?")
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
        assert set(msg.tool_calls[0]["args"]) == {"city"} and isinstance(msg.tool_calls[0]["args"]["city"], str)
        assert not msg.content
    r = httpx.post(smol_server.url + "/v1/chat/completions", json={
        "messages": ASK, "tools": [WEATHER], "tool_choice": "required", "grammar": 'root ::= "x"'})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"

"""The fields clients read, through the real openai client: the Responses API (text, streaming, tools,
structured output), system_fingerprint, cached prompt tokens, models.retrieve, and a json_object
response_format with a schema."""
from __future__ import annotations

import json

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai", "jsonschema"):     # the serve and test extras
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}}}


@pytest.fixture(scope="module")
def srv(smollm2_path):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(smollm2_path, n_parallel=2, n_ctx=2048), model_name="smol") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


# a text answer: the same text as the chat completion of the same messages (instructions a system
# message), usage in the Responses' names, incomplete at max_output_tokens
def test_responses_text(client):
    r = client.responses.create(model="smol", instructions="Answer briefly.", input="What is the capital of France?",
                                max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="smol", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the capital of France?"}])
    assert r.output_text == chat.choices[0].message.content
    assert r.object == "response" and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


# streamed: the SDK's events, deltas joining to the whole text, the final response completed
def test_responses_stream(client):
    events = list(client.responses.create(model="smol", input=[{"role": "user", "content": "Say hello."}],
                                          max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(model="smol", input=[{"role": "user", "content": "Say hello."}],
                                    max_output_tokens=10, temperature=0)
    assert whole.output_text == text


# tools: a required call comes back as a function_call item (SmolLM2: the generic format); its output
# goes back as a function_call_output item and the model answers
def test_responses_tools(client):
    r = client.responses.create(model="smol", input="What is the weather in Paris?", tools=[WEATHER],
                                tool_choice="required", temperature=0, max_output_tokens=100)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    follow = client.responses.create(model="smol", tools=[WEATHER], temperature=0, max_output_tokens=30, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C and sunny"}])
    assert follow.status in ("completed", "incomplete") and follow.output
    streamed = list(client.responses.create(model="smol", input="What is the weather in Paris?", tools=[WEATHER],
                                            tool_choice="required", temperature=0, max_output_tokens=100, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments


# structured output: text.format json_schema holds the answer to the schema; built-in tools and stored
# responses are refused by name
def test_responses_structured_and_refusals(client, srv):
    r = client.responses.create(model="smol", input="Invent a person.", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)
    for field, value in (("previous_response_id", "resp_1"), ("tools", [{"type": "web_search"}]),
                         ("background", True)):
        bad = httpx.post(srv.url + "/v1/responses", json={"input": "hi", field: value})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == field, bad.text


# system_fingerprint on every answer, cached prompt tokens counted, GET /v1/models/{id}, a json_object
# response_format with llama-server's schema beside it
def test_fields_clients_read(client, srv):
    msgs = [{"role": "user", "content": "Name three colours."}]
    first = client.chat.completions.create(model="smol", messages=msgs, max_tokens=4, temperature=0)
    again = client.chat.completions.create(model="smol", messages=msgs, max_tokens=4, temperature=0)
    assert first.system_fingerprint and first.system_fingerprint == again.system_fingerprint
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1    # the last is redone
    chunks = list(client.chat.completions.create(model="smol", messages=msgs, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(ch.system_fingerprint == first.system_fingerprint for ch in chunks)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert client.models.retrieve("smol").id == "smol"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=40, temperature=0,
                                       response_format={"type": "json_object", "schema": PERSON})  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    bad = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "response_format": {
        "type": "json_object", "schema": 123}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"

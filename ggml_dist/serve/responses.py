"""OpenAI's Responses API (POST /v1/responses), which current OpenAI SDKs and agent frameworks default to,
served by the chat completions: the request becomes a chat request, its answer a Response.

    input           a string, or items: messages (content a string or input_text/output_text parts),
                    function_call items (an earlier call of the model's) and function_call_output items
                    (its result), which become assistant tool_calls and tool messages
    instructions    a system message before the input
    tools           function tools ({"type": "function", "name", "parameters", "strict"}), tool_choice,
                    parallel_tool_calls: as on the chat route (serve/tools.py: the generic format where
                    the template renders no tools)
    text.format     text, json_object or json_schema: the chat route's response_format
    max_output_tokens, temperature, top_p, stream, user, metadata, truncation "disabled"
    output          a message item (output_text) and/or function_call items; status "incomplete" with
                    reason max_output_tokens when the answer was cut
    streaming       response.created, .in_progress, .output_item.added, .content_part.added,
                    .output_text.delta, .output_text.done, .content_part.done, .output_item.done (and
                    .function_call_arguments.delta/.done for a call), then .completed or .incomplete
Nothing is stored (store: false in the answer), so previous_response_id, conversation and background
runs are refused, as are tools other than functions and reasoning settings: a 400 that names them.
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .protocol import APIError

# request fields that need what this server does not have (stored responses, built-in tools, reasoning)
REFUSED = {"previous_response_id": "stored responses", "conversation": "stored conversations",
           "background": "background responses", "prompt": "stored prompt templates",
           "reasoning": "reasoning models", "include": "extra output (include)",
           "max_tool_calls": "max_tool_calls", "service_tier": "service tiers",
           "top_logprobs": "logprobs in responses", "prompt_cache_key": "prompt_cache_key"}


def _new(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        out = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                    and isinstance(p.get("text"), str)):
                raise APIError(400, f"{where}: only text content parts (input_text, output_text) are supported",
                               param="input")
            out.append(p["text"])
        return "".join(out)
    raise APIError(400, f"{where}: content must be a string or a list of text parts", param="input")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a Responses request: instructions, then the input items."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError(400, "'instructions' must be a string", param="instructions")
        msgs.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty list of items", param="input")
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise APIError(400, f"input[{i}] must be an object", param="input")
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"input[{i}].role must be user, system, developer or assistant", param="input")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _text(it.get("content"), f"input[{i}]")})
        elif kind == "function_call":
            if not isinstance(it.get("name"), str) or not isinstance(it.get("arguments", "{}"), str):
                raise APIError(400, f"input[{i}]: a function_call needs a name and arguments (a JSON string)",
                               param="input")
            call = {"id": it.get("call_id") or _new("call"), "type": "function",
                    "function": {"name": it["name"], "arguments": it.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and msgs[-1].get("tool_calls"):
                msgs[-1]["tool_calls"].append(call)         # consecutive calls: one assistant turn
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": it.get("call_id"),
                         "content": out if isinstance(out, str) else json.dumps(out)})
        else:
            raise APIError(400, f"input[{i}] has type '{kind}': only message, function_call and "
                           f"function_call_output items are supported", param="input")
    return msgs


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, body.get("tool_choice")
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list", param="tools")
    chat_tools = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise APIError(400, f"tools[{i}] has type '{kind}': only function tools are supported", param="tools")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        chat_tools.append({"type": "function", "function": fn})
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice is not None and not isinstance(choice, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                       param="tool_choice")
    return chat_tools, choice


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if body.get("text") is not None and not isinstance(body["text"], dict):
        raise APIError(400, "'text' must be an object", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise APIError(400, f"text.format type '{fmt.get('type')}' is not supported (text, json_object, json_schema)",
                   param="text")


def responses_request(body: dict[str, Any]) -> tuple[dict[str, Any], ResponseAnswer]:
    """(the chat completions body of a Responses request, the writer of its answer)."""
    for name, what in REFUSED.items():
        v = body.get(name)
        if v is not None and v is not False and v != [] and not (name == "reasoning" and not any(v.values())):
            raise APIError(400, f"'{name}' is not supported by this server ({what})", param=name,
                           code="unsupported_parameter")
    if body.get("truncation") not in (None, "disabled"):
        raise APIError(400, "truncation 'auto' is not supported: a prompt past the context is refused",
                       param="truncation", code="unsupported_parameter")
    tools, choice = _tools(body)
    chat: dict[str, Any] = {"messages": _messages(body)}
    for k in ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls"):
        if body.get(k) is not None:
            chat[k] = body[k]
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    if tools is not None:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
    fmt = _response_format(body)
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat, ResponseAnswer(body)


class ResponseAnswer:
    """The Response object of a chat answer: body() from the whole one, stream() as Responses events
    from the chat chunks."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.id = _new("resp")
        self.created = int(time.time())
        self.seq = 0

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  model: str, incomplete: bool = False) -> dict[str, Any]:
        r = self.request
        fmt = (r.get("text") or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": model, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": r.get("instructions"), "max_output_tokens": r.get("max_output_tokens"),
                "metadata": r.get("metadata") or {}, "parallel_tool_calls": r.get("parallel_tool_calls", True),
                "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
                "temperature": r.get("temperature"), "top_p": r.get("top_p"), "text": {"format": fmt},
                "tool_choice": r.get("tool_choice", "auto"), "tools": r.get("tools") or [],
                "truncation": "disabled", "user": r.get("user"), "usage": usage}

    @staticmethod
    def _usage(u: dict[str, Any] | None) -> dict[str, Any] | None:
        if u is None:
            return None
        return {"input_tokens": u["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": u.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
                "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u["total_tokens"]}

    @staticmethod
    def _message(text: str, status: str = "completed", mid: str | None = None) -> dict[str, Any]:
        return {"type": "message", "id": mid or _new("msg"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def _call(call: dict[str, Any], status: str = "completed", fid: str | None = None) -> dict[str, Any]:
        return {"type": "function_call", "id": fid or _new("fc"), "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}

    def body(self, answer: Any) -> dict[str, Any]:
        b = answer.body()
        choice = b["choices"][0]
        msg = choice["message"]
        output = []
        if msg.get("content"):
            output.append(self._message(msg["content"]))
        output += [self._call(c) for c in msg.get("tool_calls") or []]
        cut = choice["finish_reason"] == "length"
        return self._response("incomplete" if cut else "completed", output, self._usage(b.get("usage")),
                              b["model"], incomplete=cut)

    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    async def stream(self, answer: Any, chunks: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[str]:
        model = answer.model
        yield self._event("response.created", response=self._response("in_progress", [], None, model))
        yield self._event("response.in_progress", response=self._response("in_progress", [], None, model))
        output: list[dict[str, Any]] = []
        text, mid, finish, usage = "", None, None, None
        async for ch in chunks:
            if ch is None:
                break
            if "error" in ch:
                err = ch["error"]
                yield self._event("error", code=err.get("code"), message=err.get("message"), param=err.get("param"))
                return
            if not ch.get("choices"):
                usage = ch.get("usage")
                continue
            c = ch["choices"][0]
            delta = c.get("delta") or {}
            piece = delta.get("content")
            if piece:
                if mid is None:
                    mid = _new("msg")
                    yield self._event("response.output_item.added", output_index=0,
                                      item={**self._message("", "in_progress", mid), "content": []})
                    yield self._event("response.content_part.added", item_id=mid, output_index=0, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                text += piece
                yield self._event("response.output_text.delta", item_id=mid, output_index=0, content_index=0,
                                  delta=piece, logprobs=[])
            for call in delta.get("tool_calls") or []:
                if mid is not None and not output:
                    async for e in self._close_message(mid, text):
                        yield e
                    output.append(self._message(text, mid=mid))
                item = self._call(call)
                i = len(output)
                yield self._event("response.output_item.added", output_index=i,
                                  item={**item, "arguments": "", "status": "in_progress"})
                yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                  delta=item["arguments"])
                yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"])
                yield self._event("response.output_item.done", output_index=i, item=item)
                output.append(item)
            if c.get("finish_reason") is not None:
                finish = c["finish_reason"]
        if mid is not None and not any(o["type"] == "message" for o in output):
            async for e in self._close_message(mid, text):
                yield e
            output.insert(0, self._message(text, mid=mid))
        cut = finish == "length"
        final = self._response("incomplete" if cut else "completed", output, self._usage(usage), model, incomplete=cut)
        yield self._event("response.incomplete" if cut else "response.completed", response=final)

    async def _close_message(self, mid: str, text: str) -> AsyncIterator[str]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        yield self._event("response.output_text.done", item_id=mid, output_index=0, content_index=0, text=text,
                          logprobs=[])
        yield self._event("response.content_part.done", item_id=mid, output_index=0, content_index=0, part=part)
        yield self._event("response.output_item.done", output_index=0, item=self._message(text, mid=mid))

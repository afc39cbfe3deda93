"""Tool calls: the request's tools rendered by the model's chat template (or described in a system
message where the template renders none), the model's calls parsed out of its text, and calls made
valid by a grammar: forced ones (tool_choice "required" or a named function), `strict` ones, and every
answer of the generic format.

Three call syntaxes, told apart by what the template renders:
    hermes  (Qwen 2.5/3, Hermes, SmolLM3, ...): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3  (Llama 3.1-3.3): {"name": ..., "parameters": {...}} as the whole answer, after an optional
            <|python_tag|>
    generic a template that never mentions `tools` (SmolLM2, Gemma 3): llama-server's generic format. A
            system message lists the tools and asks for JSON, and the whole answer is held by a grammar
            to {"tool_call": {"name", "arguments"}} ({"tool_calls": [...]} with parallel_tool_calls) or
            {"response": "text"}, the call alone when one is forced; earlier calls and tool results go
            back to the template as JSON text (minja's polyfills, which llama-server applies)
Grammar-held arguments follow the tool's parameters schema with every object closed where the schema
does not say otherwise: an absent additionalProperties reads as false, as llama.cpp's
json-schema-to-grammar reads it and as OpenAI's strict mode requires it (a JSON schema's default would
let the model add properties until max_tokens). A tool marked `strict` under tool_choice auto holds the
answer to text without the call markup, or calls (hermes and llama3 too); other auto calls are free
text, parsed. Markup that does not parse as a call is never passed on as content in the generic format
(its answer is JSON: a cut-off one gives what its `response` had so far).
"""
from __future__ import annotations

import copy
import json
import re
import threading
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from ..model.tokenizer import Tokenizer, TokenType
from .grammar import check_schema
from .protocol import APIError

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                  # a JSON object, as OpenAI sends it

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def style_of(template: str) -> str:
    """Which call syntax the template teaches the model: generic where it renders no tools."""
    if "tools" not in template:
        return "generic"
    return "llama3" if PYTHON_TAG in template or "ipython" in template else "hermes"


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict[str, Any]], str | None]:
    """The tools (OpenAI's [{"type": "function", "function": {...}}]) and the name a call is forced to:
    None for "auto", "*" for "required" (any tool), a function name. tool_choice "none": no tools."""
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "'tools' must be a non-empty list", param="tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}",
                           param="tools")
        if not isinstance(fn.get("parameters", {}), dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names.append(fn["name"])
    if tool_choice in (None, "auto"):
        return tools, None
    if tool_choice == "required":
        return tools, "*"
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise APIError(400, f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
        return tools, name
    raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                   "'function': {'name': ...}}", param="tool_choice")


_SPECIALS: weakref.WeakKeyDictionary[Tokenizer, dict[str, int]] = weakref.WeakKeyDictionary()
_SPECIALS_LOCK = threading.Lock()


def _special_id(tok: Tokenizer, text: str) -> int | None:
    """The id of a single special token spelled `text` (Qwen's <tool_call>), if the vocabulary has one
    (the vocabulary's special tokens indexed once per tokenizer: a pass over 50K tokens takes 10 ms)."""
    with _SPECIALS_LOCK:
        index = _SPECIALS.get(tok)
        if index is None:
            index = _SPECIALS[tok] = {}
            for i in range(tok.n_vocab):
                if tok.token_types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED):
                    index.setdefault(tok.tokens[i], i)
    return index.get(text)


def _rebase_refs(schema: Any, pointer: str) -> Any:
    """A copy of schema whose local $refs ("#", "#/$defs/x") point into it where it now sits (pointer,
    "#/properties/arguments"): a tool's parameters are one schema, embedded in the call's."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        stack.extend(c for c in items if isinstance(c, (dict, list)))
        if isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            node["$ref"] = pointer + node["$ref"][1:]
    return out


_OBJECT_KEYWORDS = ("properties", "patternProperties", "required")
_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")        # name -> schema
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def close_objects(schema: Any) -> Any:
    """A copy of schema where every object schema without additionalProperties gets
    additionalProperties: false (the module docstring: llama.cpp's reading, OpenAI's strict mode)."""
    # differs from JSON Schema, whose absent additionalProperties allows any: see the module docstring
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        is_object = node.get("type") == "object" or (isinstance(node.get("type"), list) and "object" in node["type"]) \
            or any(k in node for k in _OBJECT_KEYWORDS)
        if is_object and "additionalProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = False
        for k in _SUBSCHEMAS:
            if isinstance(node.get(k), dict):
                stack.extend(node[k].values())
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                stack.extend(node[k])
        for k in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
            if isinstance(node.get(k), dict):
                stack.append(node[k])
    return out


def is_strict(tools: list[dict[str, Any]]) -> bool:
    """Whether any tool asks for OpenAI's strict mode (function.strict: true)."""
    return any(t["function"].get("strict") is True for t in tools)


def _call_schemas(tools: list[dict[str, Any]], name: str, key: str, at: str) -> list[dict[str, Any]]:
    """One JSON schema per tool that may be called (name '*': any), {"name": const, key: parameters},
    each tool's parameters checked against serve/grammar.py's limits (a 400 naming tools), closed, and
    their $refs rebased to where they sit: at + "/anyOf/i" (or at, for one tool) + "/properties/key"."""
    chosen = [t["function"] for t in tools if name in ("*", t["function"]["name"])]
    alts = []
    for i, fn in enumerate(chosen):
        params = fn.get("parameters") or {"type": "object"}
        check_schema(params, "tools")
        where = (at if len(chosen) == 1 else f"{at}/anyOf/{i}") + f"/properties/{key}"
        alts.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                     "properties": {"name": {"const": fn["name"]}, key: _rebase_refs(close_objects(params), where)}})
    return alts


def _json_body(schema: dict[str, Any]) -> str:
    check_schema(schema, "tools")
    schema["x-guidance"] = {"whitespace_flexible": False}
    return "%json " + json.dumps(schema)


def call_grammar(tools: list[dict[str, Any]], name: str | None, style: str, tok: Tokenizer,
                 parallel: bool = False) -> str:
    """The grammar of an answer with tools: name is the forced tool ('*': any), or None (auto: either a
    text answer or calls). hermes/llama3 under auto: text that holds no call markup, or calls (the
    grammar a `strict` tool asks for); generic: the format of the module docstring."""
    if style == "generic":
        return _generic_grammar(tools, name, parallel)
    key = "parameters" if style == "llama3" else "arguments"
    alts = _call_schemas(tools, name or "*", key, "#")
    body = _json_body(alts[0] if len(alts) == 1 else {"anyOf": alts})
    if style == "llama3":
        if name is not None:
            return f"%llguidance {{}}\nstart: call\ncall: {body}\n"
        return (f"%llguidance {{}}\nstart: TEXT | call\ncall: {body}\n"
                "TEXT: /(?s:.*)/ & ~/(?s:[ \\t\\n]*\\{.*)/\n")       # a text answer does not start like a call
    sid, eid = _special_id(tok, HERMES_OPEN), _special_id(tok, HERMES_CLOSE)
    open_ = f"<[{sid}]>" if sid is not None else json.dumps(HERMES_OPEN)
    close = f"<[{eid}]>" if eid is not None else json.dumps(HERMES_CLOSE)
    block = f'{open_} "\\n" call "\\n" {close}'
    if name is not None:
        return f"%llguidance {{}}\nstart: {block}\ncall: {body}\n"
    # auto and strict: text (never the markup), then any calls, each one held to its schema
    return (f'%llguidance {{}}\nstart: TEXT | TEXT? block ("\\n" block)*\nblock: {block}\ncall: {body}\n'
            f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(HERMES_OPEN)}.*)/\n")


GENERIC_INSTRUCTION = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with "
                       "`response` reply to the user's request")


def _generic_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """llama-server's generic schema (common_chat_params_init_generic): a call, or calls, of the tools
    that may be called, or (unless one is forced) a text response."""
    if parallel:
        alts = _call_schemas(tools, name or "*", "arguments", "#/anyOf/0/properties/tool_calls/items")
        item = alts[0] if len(alts) == 1 else {"anyOf": alts}
        call: dict[str, Any] = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                                "properties": {"tool_calls": {"type": "array", "items": item, "minItems": 1}}}
    else:
        alts = _call_schemas(tools, name or "*", "arguments", "#/anyOf/0/properties/tool_call")
        call = {"type": "object", "additionalProperties": False, "required": ["tool_call"],
                "properties": {"tool_call": alts[0] if len(alts) == 1 else {"anyOf": alts}}}
    response = {"type": "object", "additionalProperties": False, "required": ["response"],
                "properties": {"response": {"type": "string"}}}
    # the refs were rebased for the call at anyOf/0: a forced call's schema is wrapped the same way
    schema: dict[str, Any] = {"anyOf": [call] if name is not None else [call, response]}
    return f"%llguidance {{}}\nstart: answer\nanswer: {_json_body(schema)}\n"


def generic_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as a template that renders no tools gets them (minja's polyfills): the tools and the
    generic instruction in the system message, an assistant's earlier calls as its JSON content, and a
    tool's result as a user message {"tool_response": ...}."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
    note = (f"You can call any of the following tools to satisfy the user's requests: {listed}\n\n"
            f"{GENERIC_INSTRUCTION}")
    out: list[dict[str, Any]] = []
    for given in messages:
        m = dict(given)
        calls = m.pop("tool_calls", None)
        if m["role"] == "assistant" and calls:
            listed_calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {}),
                             **({"id": c["id"]} if c.get("id") else {})} for c in calls]
            m["content"] = json.dumps({"tool_calls": listed_calls} if len(listed_calls) > 1
                                      else {"tool_call": listed_calls[0]}, ensure_ascii=False)
        elif m["role"] == "tool":
            answer = {"tool": m.get("name") or "", "content": m.get("content") or ""}
            if m.get("tool_call_id"):
                answer["tool_call_id"] = m["tool_call_id"]
            m = {"role": "user", "content": json.dumps({"tool_response": answer}, ensure_ascii=False)}
        m.pop("tool_call_id", None)
        out.append(m)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{note}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": note})
    return out


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(\{.*?\})\s*" + re.escape(HERMES_CLOSE), re.S)


def parse_calls(text: str, style: str) -> tuple[str, list[ToolCall]]:
    """(the content left, the calls) of a generated answer; text that is not a well-formed call stays
    content (the generic format: its response, or what a cut-off one had so far)."""
    calls: list[ToolCall] = []
    if style == "generic":
        return _parse_generic(text)
    if style == "llama3":
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        call = _call_of(body, "parameters")
        return ("", [call]) if call is not None else (text, [])
    rest, last = [], 0
    for m in _HERMES.finditer(text):
        call = _call_of(m.group(1), "arguments")
        if call is None:
            continue
        rest.append(text[last:m.start()])
        last = m.end()
        calls.append(call)
    rest.append(text[last:])
    return "".join(rest).strip() if calls else text, calls


def _call_of(s: str, key: str) -> ToolCall | None:
    try:
        obj = json.loads(s)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):                 # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _parse_generic(text: str) -> tuple[str, list[ToolCall]]:
    try:
        obj = json.loads(text)
    except ValueError:
        return _partial_response(text), []
    if not isinstance(obj, dict):
        return "", []
    many = obj.get("tool_calls")
    listed: list[Any] = many if isinstance(many, list) else [obj["tool_call"]] if "tool_call" in obj else []
    calls = [c for c in (_call_of(json.dumps(x), "arguments") for x in listed if isinstance(x, dict)) if c is not None]
    if calls:
        return "", calls
    response = obj.get("response", "")
    return response if isinstance(response, str) else json.dumps(response, ensure_ascii=False), []


_RESPONSE_START = re.compile(r'\s*\{\s*"response"\s*:\s*"')


def _partial_response(text: str) -> str:
    """The text of a generic answer cut off inside its response string (max_tokens); "" for a cut-off
    call, which is no content."""
    m = _RESPONSE_START.match(text)
    if m is None:
        return ""
    body = text[m.end():]
    for end in range(len(body), -1, -1):         # the longest prefix that closes as a JSON string
        try:
            return str(json.loads('"' + body[:end] + '"'))
        except ValueError:
            continue
    return ""


def held_back(text: str, style: str) -> int:
    """How many characters at the end of streamed text may begin a call and so must wait: from a
    hermes <tool_call> (or a prefix of it) on; a llama3 answer that starts like a call, all of it; a
    generic answer (JSON, parsed at its end), all of it."""
    if style == "generic":
        return len(text)
    if style == "llama3":
        s = text.lstrip()
        return len(text) if not s or s[0] == "{" or PYTHON_TAG.startswith(s[:len(PYTHON_TAG)]) else 0
    i = text.find(HERMES_OPEN)
    if i >= 0:
        return len(text) - i
    for k in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-k:]):
            return k
    return 0

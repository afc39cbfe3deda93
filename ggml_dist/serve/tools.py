"""Tool calls: the request's tools rendered by the model's chat template, the model's calls parsed out of
its text, and a forced call (tool_choice "required" or a named function) made valid by a grammar.

Two families of templates are recognised by what they render:
    hermes  (Qwen 2.5/3, Hermes, SmolLM3, ...): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    llama3  (Llama 3.1-3.3): {"name": ..., "parameters": {...}} as the whole answer, after an optional
            <|python_tag|>
A template that never mentions `tools` cannot show the model the tools: such a request is refused.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..model.tokenizer import Tokenizer, TokenType
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
    """Which call syntax the template teaches the model; APIError if it does not render tools."""
    if "tools" not in template:
        raise APIError(400, "this model's chat template does not render tools; start the server with a "
                       "--chat-template that does", param="tools")
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


def _special_id(tok: Tokenizer, text: str) -> int | None:
    """The id of a single special token spelled `text` (Qwen's <tool_call>), if the vocabulary has one."""
    for i in range(tok.n_vocab):
        if tok.token_types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED) and tok.tokens[i] == text:
            return i
    return None


def forced_grammar(tools: list[dict[str, Any]], name: str, style: str, tok: Tokenizer) -> str:
    """An llguidance Lark grammar whose every sentence is one call of the forced tool ('*': any), its
    arguments valid against the tool's parameters schema (compact JSON)."""
    key = "parameters" if style == "llama3" else "arguments"
    alts = []
    for t in tools:
        fn = t["function"]
        if name not in ("*", fn["name"]):
            continue
        alts.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                     "properties": {"name": {"const": fn["name"]},
                                    key: fn.get("parameters") or {"type": "object"}}})
    schema: dict[str, Any] = alts[0] if len(alts) == 1 else {"anyOf": alts}
    schema["x-guidance"] = {"whitespace_flexible": False}
    body = "%json " + json.dumps(schema)
    if style == "llama3":
        return f"%llguidance {{}}\nstart: call\ncall: {body}\n"
    sid, eid = _special_id(tok, HERMES_OPEN), _special_id(tok, HERMES_CLOSE)
    open_ = f"<[{sid}]>" if sid is not None else json.dumps(HERMES_OPEN)
    close = f"<[{eid}]>" if eid is not None else json.dumps(HERMES_CLOSE)
    return f'%llguidance {{}}\nstart: {open_} "\\n" call "\\n" {close}\ncall: {body}\n'


_HERMES = re.compile(re.escape(HERMES_OPEN) + r"\s*(\{.*?\})\s*" + re.escape(HERMES_CLOSE), re.S)


def parse_calls(text: str, style: str) -> tuple[str, list[ToolCall]]:
    """(the content left, the calls) of a generated answer; text that is not a well-formed call stays
    content."""
    calls: list[ToolCall] = []
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


def held_back(text: str, style: str) -> int:
    """How many characters at the end of streamed text may begin a call and so must wait: from a
    hermes <tool_call> (or a prefix of it) on; a llama3 answer that starts like a call, all of it."""
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

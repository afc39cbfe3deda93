"""The OpenAI wire format: request models (validated with pydantic), response and chunk builders, and
the API error that the app turns into `{"error": {...}}` with an HTTP status.

Every field a request may carry is either implemented or refused: the OpenAI fields this server does
not implement (UNSUPPORTED: best_of, suffix, n > 1, ...) get a 400 that names
them, so an application never gets a silently different answer. Fields that are neither (a newer API's,
unknown to this table) are ignored, for forward compatibility. docs/api.md lists every field.
"""
from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from collections.abc import Sequence as Sequence_
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, ValidationError, model_validator

# -- errors ------------------------------------------------------------------------------------------


class APIError(Exception):
    """An error returned to the client as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, extra: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.extra = extra or {}        # more fields of the error object (llama-server's n_ctx, ...)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code, **self.extra}}


def context_exceeded(message: str, param: str, n_prompt: int, n_ctx: int) -> APIError:
    """A prompt past the context per request: a 400 of llama-server's type (exceed_context_size_error,
    with n_prompt_tokens and n_ctx) and OpenAI's code (context_length_exceeded)."""
    return APIError(400, message, "exceed_context_size_error", param=param, code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (`messages.0.content`)."""
    err = e.errors()[0]
    # drop pydantic's union-member tags ("prompt.str", "prompt.list[int]"): keep indices and field names
    names = {n for m in (CompletionRequest, ChatRequest, ChatMessage) for n in m.model_fields}
    kept: list[str] = []
    for p in err["loc"]:
        if not (isinstance(p, int) or p in names):
            break
        kept.append(str(p))
    param = ".".join(kept) or None
    return APIError(400, f"invalid value for '{param}': {err['msg']}", param=param,
                    code="invalid_value")


# -- bodies ------------------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64      # nested objects and arrays in a body (a chat with tools and a schema: ~30)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"the number {text[:40]} does not fit a double")
    return v


def parse_body(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 that says what is wrong with it: not UTF-8, not JSON
    (NaN and Infinity included, and numbers past a double), nested more than max_depth, a string with a
    lone surrogate (\\ud800: it can be neither tokenized nor sent back), not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8: {e.reason} at byte {e.start}", code="invalid_json") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise APIError(400, f"the body nests more than {max_depth} objects and arrays deep",
                       code="invalid_json") from None
    except ValueError as e:
        raise APIError(400, f"the body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(obj).__name__}", code="invalid_json")
    # the walk only where it can find something: a lone surrogate comes from a \\udXXX escape (strict
    # UTF-8 refused the encoded ones), and nesting past max_depth needs that many brackets
    if _SURROGATE_ESCAPE.search(text) or text.count("[") + text.count("{") > max_depth:
        check_json(obj, max_depth)
    return obj


_SURROGATE_ESCAPE = re.compile(r"\\[uU][dD][89a-fA-F]")


def check_json(obj: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """A 400 for a parsed body nested past max_depth or holding a string (or key) with a lone surrogate;
    the message names where (`messages.0.content`). A stack, not recursion: linear in the body."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        node, path = stack.pop()
        if len(path) > max_depth:
            raise APIError(400, f"the body nests more than {max_depth} objects and arrays deep (at "
                           f"{_path(path[:8])}...)", param=_path(path[:1]), code="invalid_json")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str) and not _encodable(k):
                raise APIError(400, f"a key at '{_path(path) or '(top)'}' holds a lone surrogate, which is "
                               f"not text", param=_path(path[:1]) or None, code="invalid_value")
            if isinstance(v, str):
                if not _encodable(v):
                    where = _path((*path, k))
                    raise APIError(400, f"'{where}' holds a lone surrogate (an unpaired \\ud800-\\udfff "
                                   f"escape), which is not text", param=where, code="invalid_value")
            elif isinstance(v, (dict, list)) and v:
                stack.append((v, (*path, k)))


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _path(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


# -- requests ----------------------------------------------------------------------------------------

# request fields of OpenAI's API (and llama-server's extensions) that change the answer and are not
# implemented here: refused by name rather than ignored
UNSUPPORTED: dict[str, str] = {
    "functions": "the deprecated function calling (use tools)",
    "function_call": "the deprecated function calling (use tool_choice)",
    "best_of": "best_of", "suffix": "insertion (suffix)", "audio": "audio output", "modalities": "audio output",
    "prediction": "predicted outputs", "reasoning_effort": "reasoning models", "web_search_options": "web search",
    "store": "stored completions", "metadata": "stored completions", "service_tier": "service tiers",
    "mirostat": "mirostat sampling",
    "typical_p": "typical sampling", "tfs_z": "tail-free sampling", "dry_multiplier": "DRY sampling",
    "xtc_probability": "XTC sampling", "n_probs": "n_probs (use logprobs)",
}


# chat-only fields, refused on /v1/completions rather than ignored there
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "top_logprobs", "max_completion_tokens")


def refuse_unsupported(body: dict[str, Any], chat: bool = True) -> None:
    """A 400 naming the first field of `body` that this server does not implement (for this endpoint)."""
    if not chat:
        for name in CHAT_ONLY:
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' is a chat completions field (/v1/chat/completions)", param=name,
                               code="unsupported_parameter")
    for name, what in UNSUPPORTED.items():
        v = body.get(name)
        if v is None or v is False:
            continue
        raise APIError(400, f"'{name}' is not supported by this server ({what})", param=name,
                       code="unsupported_parameter")

_TOKEN_ID = re.compile(r"[0-9]{1,10}")      # ASCII digits: "²" is a digit to str.isdigit, not to int()


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # strict types: "5" is not 5; a strict float still takes an int, as JSON does not tell 1 from 1.0
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=40, ge=0, le=2**31 - 1)   # llama.cpp extension (0 = off)
    min_p: StrictFloat = Field(default=0.05, ge=0.0, le=1.0)    # llama.cpp extension
    repeat_penalty: StrictFloat = Field(default=1.0, gt=0.0)    # llama.cpp extension
    presence_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat] | None = None            # token id (as a string) -> -100..100
    # structured output (serve/grammar.py): OpenAI's, or llama-server's GBNF grammar / JSON schema
    response_format: dict[str, Any] | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    seed: StrictInt | None = Field(default=None, ge=-2**63, le=2**63 - 1)    # int64, as OpenAI
    stop: str | list[str] | None = None
    n: StrictInt = Field(default=1, ge=1, le=16)     # at most --parallel (the app checks)
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # clients send `"temperature": null` for "not set"; the field's default applies
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def bias_list(self, n_vocab: int) -> tuple[tuple[int, float], ...]:
        out = []
        for k, v in (self.logit_bias or {}).items():
            if not (_TOKEN_ID.fullmatch(k) and int(k) < n_vocab):
                raise APIError(400, f"logit_bias key {k!r} is not a token id (0..{n_vocab - 1})",
                               param="logit_bias")
            if not -100.0 <= v <= 100.0:
                raise APIError(400, f"logit_bias for token {k} is {v}, outside -100..100", param="logit_bias")
            out.append((int(k), float(v)))
        return tuple(out)

    def stop_list(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4:
            raise APIError(400, f"'stop' takes at most 4 sequences, got {len(stops)}", param="stop")
        return tuple(s for s in stops if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of strings and token-id lists (one choice each: serve/scoring.py)
    prompt: str | list[StrictInt] | list[str | list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=0)        # 0: score the prompt only (echo)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)     # the chosen token's and N top

    def n_logprobs(self) -> int | None:
        return self.logprobs

    def max_tokens_or_default(self) -> int:
        return self.max_tokens if self.max_tokens is not None else 16     # the OpenAI default


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                      # a tool message: the call it answers
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's convention): a call's arguments as an object."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                fn = c.get("function")
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                        and isinstance(fn.get("arguments", "{}"), (str, dict))):
                    raise APIError(400, "a message's tool_calls entry must be {'type': 'function', 'function': "
                                   "{'name': str, 'arguments': a JSON string}}", param="messages",
                                   code="invalid_value")
                fn = dict(fn)
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except ValueError:
                        raise APIError(400, "a tool call's arguments are not JSON", param="messages") from None
                calls.append({**c, "function": fn})
            out["tool_calls"] = calls
        for k in ("tool_call_id", "name"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    def text(self) -> str:
        """Content parts of type text, joined (images and audio are refused by the caller)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        out = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", param="messages")
            out.append(part["text"])
        return "".join(out)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None        # several <tool_call>s are parsed either way

    def n_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_or_default(self, room: int) -> int:
        n = self.max_completion_tokens or self.max_tokens
        return n if n is not None else room          # chat: until EOG or the context is full


# -- responses ---------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(n_prompt: int, n_gen: int, n_cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details.cached_tokens: prompt tokens the prompt cache held."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


Piece = Callable[[int], bytes]       # token id -> its bytes (Tokenizer.token_to_piece)


def completion_logprobs(entries: Sequence_[Any], piece: Piece, offset: int) -> dict[str, Any]:
    """The completions API's logprobs object for engine TokenLogprobs; text_offset counts characters
    from `offset` (the characters before these tokens)."""
    toks, lps, tops, offs = [], [], [], []
    for tok, lp, top in entries:
        s = piece(tok).decode("utf-8", errors="replace")
        toks.append(s)
        lps.append(lp)
        tops.append({piece(t).decode("utf-8", errors="replace"): v for t, v in top})
        offs.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def chat_logprobs(entries: Sequence_[Any], piece: Piece) -> dict[str, Any]:
    """The chat API's logprobs object: per token its text, logprob, bytes and top alternatives."""
    def one(t: int, v: float) -> dict[str, Any]:
        b = piece(t)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": v, "bytes": list(b)}
    return {"content": [{**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]}
                        for tok, lp, top in entries], "refusal": None}


def completion_body(rid: str, model: str, text: str, finish: str | None,
                    use: dict[str, Any] | None, chunk: bool,
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()),
                            "model": model, "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                                         "finish_reason": finish}]}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, text: str, finish: str | None, use: dict[str, Any] | None,
              chunk: bool, first: bool = False, logprobs: dict[str, Any] | None = None,
              tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if chunk:
        delta: dict[str, Any] = {"role": "assistant", "content": text or None} if first else \
            ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        body = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": model, "choices": [choice]}
        if use is not None:
            body["usage"] = use
        return body
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text or None if tool_calls
                                                 else text, **({"tool_calls": tool_calls} if tool_calls else {})},
                         "logprobs": logprobs, "finish_reason": finish}],
            "usage": use}


def usage_chunk(rid: str, model: str, obj: str, use: dict[str, Any]) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: empty choices, usage set."""
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": use}

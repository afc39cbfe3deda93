"""The HTTP face of the engine: OpenAI's completions and chat completions, models, health, metrics.

Bodies are read by hand (size-limited) and validated with the protocol models, so every bad request gets
OpenAI's error object with a 4xx status instead of FastAPI's 422 format. Generated text travels from the
engine thread to the request's handler through an asyncio queue; a step's events reach the loop in one
wake-up (_Deliver).
"""
from __future__ import annotations

import asyncio
import base64
import functools
import json
import sys
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.sampling import SamplingParams
from .engine import Engine, Event, NotReady, QueueFull, Request, ServingEngine
from .grammar import grammar_of, tokenizer_of
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    new_id,
    refuse_unsupported,
    usage,
    usage_chunk,
    validation_error,
)
from .tools import check_tools, forced_grammar, held_back, parse_calls, style_of

MAX_BODY_BYTES = 1 << 20          # a 1 MiB prompt is far past any context this server runs
_DISCONNECT_POLL_S = 0.25         # how often a non-streaming handler asks whether its client left


class _Deliver:
    """Engine events into their requests' queues on one event loop, one wake-up of the loop per burst.

    loop.call_soon_threadsafe writes the loop's self-pipe on every call, and each write lets the loop
    thread take the GIL while the engine thread, between two sampled tokens, waits to get it back: ~3% of
    an 8-sequence step went there. Here the first event of a burst schedules a drain; the step's other
    events join the list that drain will take."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[tuple[int, Event]], tuple[int, Event]]] = []

    def post(self, queue: asyncio.Queue[tuple[int, Event]], item: tuple[int, Event]) -> None:
        """Put item, (choice index, event), on queue, from the engine's thread."""
        with self._lock:
            self._pending.append((queue, item))
            if len(self._pending) > 1:          # a drain is scheduled and has not run yet
                return
        self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, item in batch:
            queue.put_nowait(item)


def _post_choice(deliver: _Deliver, queue: asyncio.Queue[tuple[int, Event]], first: int, ev: Event) -> None:
    """A request's on_event: its event, under the response's choice index (the request's first, plus
    the event's own index among the request's n choices)."""
    deliver.post(queue, (first + ev.index, ev))


_DELIVER: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Deliver] = weakref.WeakKeyDictionary()


def _deliver(loop: asyncio.AbstractEventLoop) -> _Deliver:
    d = _DELIVER.get(loop)
    if d is None:
        d = _DELIVER[loop] = _Deliver(loop)
    return d


def create_app(engine: ServingEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="ggml-dist", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics
    created = int(time.time())

    endpoints = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

    @app.exception_handler(APIError)
    async def _api_error(http: HTTPRequest, e: APIError) -> JSONResponse:
        if http.url.path in endpoints:
            outcome = "rejected" if e.status in (429, 503) else "invalid" if e.status < 500 else "error"
            metrics.count_request(endpoints[http.url.path], outcome)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: HTTPRequest, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: HTTPRequest, e: Exception) -> JSONResponse:
        # the details go to the server's log under an id, never to the client
        eid = new_id("err")
        print(f"ggml-dist serve: internal error {eid}:\n{''.join(traceback.format_exception(e))}",
              file=sys.stderr)
        err = APIError(500, f"internal server error (id {eid}); the server log has the details",
                       "server_error", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    # -- read-only endpoints -------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.load_error:
            return JSONResponse({"status": "error", "error": engine.load_error}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        n_run = engine.n_running()
        st = engine.health()                             # no blocking call on the event loop
        if st["recovering"]:                             # requests wait, none is lost
            return JSONResponse({"status": "degraded",
                                 "reason": "recovering a lost pipeline stage or replica",
                                 "recoveries": st["recoveries"]}, status_code=503)
        return JSONResponse({"status": "ok", "slots_idle": engine.cfg.n_parallel - n_run,
                             "slots_processing": n_run, "queue": engine.queue_length()})

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": created, "owned_by": "ggml_dist"}]})

    @app.get("/metrics")
    def prometheus() -> PlainTextResponse:          # sync: stage stats are a blocking Ray call
        st = engine.status()
        gauges = {
            "queue_length": ("requests waiting for a slot", float(engine.queue_length())),
            "requests_running": ("requests holding a slot", float(engine.n_running())),
            "slots_total": ("sequence slots (--parallel)", float(engine.cfg.n_parallel)),
            "kv_cells_used": ("KV cache cells holding a token", float(st["kv_cells_used"])),
            "kv_cells_cached": ("KV cache cells that free slots keep for a later prompt (cache_prompt)",
                                float(st["kv_cells_cached"])),
            "kv_cells_total": ("KV cache cells", float(st["kv_cells_total"])),
            "ready": ("1 once every stage has loaded", float(engine.ready.is_set() and not engine.load_error)),
            "recovering": ("1 while a lost pipeline stage is being recovered", float(st["recovering"])),
            "recoveries_total": ("lost pipeline stages recovered", float(st["recoveries"])),
            "replayed_tokens_total": ("tokens replayed to rebuild lost KV caches", float(st["replayed_tokens"])),
            "steps_fed_total": ("decode steps queued before their tokens were back (token feedback)",
                                float(st["fed_steps"])),
        }
        busy = engine.stage_busy() if engine.ready.is_set() and not engine.load_error else []
        return PlainTextResponse(metrics.render(gauges, busy),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # -- generation ----------------------------------------------------------------------------------
    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest) -> JSONResponse:
        """llama-server's /tokenize: {"content", "add_special"?, "with_pieces"?} -> {"tokens"}."""
        body = await _read_json(http, max_body_bytes)
        content, add_special = body.get("content"), body.get("add_special", False)
        with_pieces = body.get("with_pieces", False)
        if not isinstance(content, str):
            raise _invalid("'content' must be a string", "content")
        if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
            raise _invalid("'add_special' and 'with_pieces' must be booleans", "add_special")
        tok = _tokenizer(engine)
        ids = await asyncio.to_thread(tok.encode, content, add_special=add_special, parse_special=True)
        if not with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = []
        for t in ids:
            b = tok.token_to_piece(t)
            try:
                pieces.append({"id": t, "piece": b.decode("utf-8")})
            except UnicodeDecodeError:            # a partial character: its bytes, as llama-server
                pieces.append({"id": t, "piece": list(b)})
        return JSONResponse({"tokens": pieces})

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest) -> JSONResponse:
        """llama-server's /detokenize: {"tokens": [ids]} -> {"content"}."""
        body = await _read_json(http, max_body_bytes)
        tok = _tokenizer(engine)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise _invalid("'tokens' must be a list of token ids", "tokens")
        bad = [t for t in ids if not 0 <= t < tok.n_vocab]
        if bad:
            raise _invalid(f"token id {bad[0]} is outside the vocabulary (0..{tok.n_vocab - 1})", "tokens")
        text = b"".join(tok.token_to_piece(t) for t in ids).decode("utf-8", errors="replace")
        return JSONResponse({"content": text})

    @app.post("/v1/embeddings")
    async def embeddings(http: HTTPRequest) -> JSONResponse:
        """OpenAI's embeddings: the server's --pooling of the final norm's rows, L2-normalized."""
        body = await _read_json(http, max_body_bytes)
        for name in ("dimensions",):
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        if engine.cfg.pooling is None:
            raise _invalid("this server computes no embeddings: the model's pooling type is none; start it "
                           "with --pooling mean|last|cls", "input")
        if engine.cfg.n_replicas > 1:
            raise _invalid("embeddings need --replicas 1", "input")
        assert isinstance(engine, Engine), f"one replica, so one Engine, not {type(engine).__name__}"
        tok = _tokenizer(engine)
        inputs = _embedding_inputs(body.get("input"), tok.n_vocab)
        prompts = [await asyncio.to_thread(tok.encode, x, add_special=True, parse_special=True)
                   if isinstance(x, str) else x for x in inputs]
        for ids in prompts:
            if not ids:
                raise _invalid("an input is empty", "input")
            if len(ids) > engine.n_ctx_slot:
                raise APIError(400, f"an input has {len(ids)} tokens; the context per request is "
                               f"{engine.n_ctx_slot}", param="input", code="context_length_exceeded")
        try:
            vecs = [await asyncio.wrap_future(engine.embed(ids)) for ids in prompts]
        except NotReady as e:
            raise APIError(503, str(e), "server_error", code="model_not_ready") from None
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
                 else [float(x) for x in v]} for i, v in enumerate(vecs)]
        n = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        body = await _read_json(http, max_body_bytes)
        refuse_unsupported(body, chat=False)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        tok = _tokenizer(engine)
        prompt = req.prompt
        texts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) else [prompt]
        if len(texts) * req.n > engine.cfg.n_parallel:
            raise _invalid(f"{len(texts)} prompts x n={req.n} choices need more sequences than this server's "
                           f"{engine.cfg.n_parallel} slots (--parallel)", "n" if req.n > 1 else "prompt")
        prompts, echos = [], []
        for p in texts:
            if isinstance(p, str):        # off the event loop: a long prompt takes milliseconds
                _check_length_before_encoding(tok, p, engine.n_ctx_slot, "prompt")
                prompts.append(await asyncio.to_thread(tok.encode, p, add_special=True, parse_special=True))
            else:
                p = cast(list[int], p)      # token ids: a list of strings is `texts` itself
                bad = [t for t in p if not 0 <= t < tok.n_vocab]
                if bad:
                    raise _invalid(f"token id {bad[0]} is outside the vocabulary "
                                   f"(0..{tok.n_vocab - 1})", "prompt")
                prompts.append(list(p))
            echos.append(p if req.echo and isinstance(p, str) else "")
        return await _generate(http, engine, "completions", req, prompts, req.max_tokens_or_default(),
                               model_name, chat=False, echos=echos)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        body = await _read_json(http, max_body_bytes)
        refuse_unsupported(body)
        try:
            req = ChatRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        tok = _tokenizer(engine)
        template = engine.cfg.chat_template or tok.chat_template
        if not template:
            raise _invalid("the model has no chat template (tokenizer.chat_template); start the "
                           "server with --chat-template, or use /v1/completions", "messages")
        messages = [m.for_template() for m in req.messages]
        tools, forced, style = None, None, None
        if req.tools is not None and req.tool_choice != "none":
            style = style_of(template)
            tools, forced = check_tools(req.tools, req.tool_choice)
        extra = {"tools": tools} if tools is not None else {}
        try:                        # rendering and encoding off the event loop
            text = await asyncio.to_thread(tok.apply_chat_template, messages, add_generation_prompt=True,
                                           template=template, **extra)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception (roles out of order): a 400
            raise _invalid(f"the chat template rejected the messages: {e}", "messages") from None
        _check_length_before_encoding(tok, text, engine.n_ctx_slot, "messages")
        ids = await asyncio.to_thread(tok.encode, text, add_special=True, parse_special=True)
        room = max(1, engine.n_ctx_slot - len(ids))
        grammar = None
        if forced is not None:      # a call is required: a grammar makes it one, with valid arguments
            if req.response_format is not None or req.grammar is not None or req.json_schema is not None:
                raise _invalid("a forced tool call cannot take a response_format or grammar too", "tool_choice")
            assert tools is not None and style is not None
            grammar = forced_grammar(tools, forced, style, tok)
        if req.n > engine.cfg.n_parallel:
            raise _invalid(f"n={req.n} choices need more sequences than this server's "
                           f"{engine.cfg.n_parallel} slots (--parallel)", "n")
        return await _generate(http, engine, "chat", req, [ids], req.max_tokens_or_default(room),
                               model_name, chat=True, grammar=grammar, tool_style=style)

    app.state.engine = engine
    return app


# -- helpers ---------------------------------------------------------------------------------------------

def _invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def _embedding_inputs(x: Any, n_vocab: int) -> list:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    def ids(v: Any) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    if isinstance(x, str):
        out: list = [x]
    elif ids(x):
        out = [x]
    elif isinstance(x, list) and x and all(isinstance(v, str) or ids(v) for v in x):
        out = list(x)
    else:
        raise _invalid("'input' must be a string, a list of strings, token ids, or lists of token ids", "input")
    if len(out) > 256:
        raise _invalid(f"at most 256 inputs per request, got {len(out)}", "input")
    for v in out:
        if not isinstance(v, str) and any(not 0 <= t < n_vocab for t in v):
            raise _invalid(f"a token id is outside the vocabulary (0..{n_vocab - 1})", "input")
    return out


_MAX_PIECE: dict[int, int] = {}


def _check_length_before_encoding(tok: Any, text: str, n_slot: int, param: str) -> None:
    """Refuse a prompt that cannot fit before spending the encode on it: n UTF-8 bytes make at least
    n / (the longest token's bytes) tokens."""
    longest = _MAX_PIECE.get(id(tok))
    if longest is None:
        longest = _MAX_PIECE[id(tok)] = max(1, *(len(tok.token_to_piece(i)) for i in range(tok.n_vocab)))
    n_bytes = len(text.encode("utf-8", errors="replace"))
    if n_bytes // longest >= n_slot:
        raise APIError(400, f"the prompt has at least {n_bytes // longest} tokens ({n_bytes} bytes); this "
                       f"server's context per request is {n_slot} tokens", param=param,
                       code="context_length_exceeded")


def _tokenizer(engine: ServingEngine) -> Any:
    try:
        return engine.tokenizer
    except NotReady as e:
        raise APIError(503, str(e), "server_error", code="model_not_ready") from None


async def _read_json(http: HTTPRequest, limit: int) -> Any:
    """The body as JSON, refused with 413 past `limit` bytes (declared or streamed)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="body_too_large")
    buf = bytearray()
    async for chunk in http.stream():
        buf += chunk
        if len(buf) > limit:
            raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        obj = json.loads(buf)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, not {type(obj).__name__}", code="invalid_json")
    return obj


@dataclass
class _Choice:
    """One choice of a response as its events arrive."""
    text: str = ""
    logprobs: list = field(default_factory=list)
    finish: str | None = None
    n_gen: int = 0
    error: str | None = None
    sent: int = 0                 # streaming with tools: characters of `text` already sent
    echo: int = 0                 # completions' echo: the prompt's characters that `text` starts with


async def _generate(http: HTTPRequest, engine: ServingEngine, endpoint: str, req: CompletionRequest | ChatRequest,
                    prompts: list[list[int]], max_tokens: int, model_name: str, chat: bool,
                    echos: list[str] | None = None, grammar: str | None = None,
                    tool_style: str | None = None) -> Response:
    """One engine request per prompt, each of req.n choices (choice c = prompt k * n + j); tool_style:
    the chat template's tool-call syntax (serve/tools.py) when the request has tools: calls in the
    answer become tool_calls. grammar: one the output must follow (a forced tool call)."""
    metrics = engine.metrics
    n_slot = engine.n_ctx_slot
    for ids in prompts:
        if not ids:
            raise _invalid("the prompt is empty", "prompt")
        if len(ids) >= n_slot:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this server's context per request is "
                           f"{n_slot} tokens (--ctx {engine.cfg.n_ctx} / --parallel {engine.cfg.n_parallel}), "
                           f"which must hold the prompt and at least one generated token",
                           param="messages" if chat else "prompt", code="context_length_exceeded")
    if max_tokens > n_slot:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the context per request ({n_slot} tokens)",
                       param="max_tokens", code="invalid_value")
    if req.n > 1 and engine.cfg.n_replicas > 1:
        raise _invalid("n > 1 shares a prompt's KV cells between sequences of one engine: use --replicas 1",
                       "n")
    tok = _tokenizer(engine)
    constraint = grammar if grammar is not None else grammar_of(req.response_format, req.grammar, req.json_schema)
    if constraint is not None:          # the model's llguidance tokenizer, built once, off the loop
        await asyncio.to_thread(tokenizer_of, tok)
    sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                              min_p=req.min_p, repeat_penalty=req.repeat_penalty,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              logit_bias=req.bias_list(tok.n_vocab), seed=req.seed, logprobs=req.n_logprobs(),
                              grammar=constraint)
    deliver = _deliver(asyncio.get_running_loop())
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
    n = req.n
    greqs = []
    for k, ids in enumerate(prompts):
        seed_k = None if req.seed is None else req.seed + k * n
        greqs.append(Request(ids, max_tokens, replace(sampling, seed=seed_k), req.stop_list(),
                             on_event=functools.partial(_post_choice, deliver, queue, k * n), n=n))
    try:
        for g in greqs:
            engine.submit(g)
    except QueueFull as e:
        for g in greqs:
            engine.cancel(g)
        raise APIError(429, f"server busy: {e}", "rate_limit_error", code="queue_full") from None
    except NotReady as e:
        raise APIError(503, str(e), "server_error", code="model_not_ready") from None
    echos = echos or [""] * len(prompts)
    choices = [_Choice(text=echos[c // n], echo=len(echos[c // n])) for c in range(len(prompts) * n)]
    answer = _Answer(rid=new_id("chatcmpl" if chat else "cmpl"), model=model_name, chat=chat, choices=choices,
                     piece=tok.token_to_piece if sampling.logprobs is not None else None,
                     tool_style=tool_style, n_prompt=sum(len(p) for p in prompts))
    if req.stream:
        return StreamingResponse(_sse(engine, endpoint, greqs, queue, answer, req.include_usage),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    t_check = time.monotonic()
    try:
        while any(ch.finish is None for ch in choices):
            try:
                c, ev = await asyncio.wait_for(queue.get(), timeout=_DISCONNECT_POLL_S)
                answer.take(c, ev)
            except TimeoutError:
                pass
            if time.monotonic() - t_check >= _DISCONNECT_POLL_S:
                t_check = time.monotonic()
                if await http.is_disconnected():     # nobody will read the answer: free the slots
                    for g in greqs:
                        engine.cancel(g)
                    metrics.count_request(endpoint, "cancelled")
                    return Response(status_code=499)
    except asyncio.CancelledError:
        for g in greqs:
            engine.cancel(g)
        raise
    failed = next((ch for ch in choices if ch.finish == "error"), None)
    if failed is not None:
        raise APIError(500, f"generation failed: {failed.error}", "server_error")
    metrics.count_request(endpoint, "ok")
    return JSONResponse(answer.body())


@dataclass
class _Answer:
    """A response's choices and how to write them (the API's bodies: serve/protocol.py)."""
    rid: str
    model: str
    chat: bool
    choices: list[_Choice]
    piece: Any                    # token_to_piece when logprobs were asked for
    tool_style: str | None
    n_prompt: int

    def take(self, c: int, ev: Event) -> None:
        ch = self.choices[c]
        ch.text += ev.text
        ch.logprobs += ev.logprobs
        if ev.finish_reason is not None:
            ch.finish, ch.n_gen, ch.error = ev.finish_reason, ev.n_gen, ev.error

    def usage(self) -> dict[str, int]:
        return usage(self.n_prompt, sum(ch.n_gen for ch in self.choices))

    def logprobs_of(self, entries: list, offset: int = 0) -> dict[str, Any] | None:
        if self.piece is None:
            return None
        return chat_logprobs(entries, self.piece) if self.chat else completion_logprobs(entries, self.piece, offset)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] | None = None
        for c, ch in enumerate(self.choices):
            text, finish, calls = ch.text, ch.finish, None
            if self.chat and self.tool_style is not None:
                text, found = parse_calls(text, self.tool_style)
                if found:
                    calls, finish = [t.body() for t in found], "tool_calls"
            lp = self.logprobs_of(ch.logprobs, ch.echo)
            b = chat_body(self.rid, self.model, text, finish, self.usage(), chunk=False, logprobs=lp,
                          tool_calls=calls) if self.chat else \
                completion_body(self.rid, self.model, text, finish, self.usage(), chunk=False, logprobs=lp)
            b["choices"][0]["index"] = c
            if out is None:
                out = b
            else:
                out["choices"].append(b["choices"][0])
        assert out is not None
        return out

    def chunk(self, c: int, text: str, finish: str | None = None, first: bool = False,
              logprobs: dict[str, Any] | None = None, tool_calls: list | None = None) -> dict[str, Any]:
        b = chat_body(self.rid, self.model, text, finish, None, chunk=True, first=first, logprobs=logprobs,
                      tool_calls=tool_calls) if self.chat else \
            completion_body(self.rid, self.model, text, finish, None, chunk=True, logprobs=logprobs)
        b["choices"][0]["index"] = c
        return b


async def _sse(engine: ServingEngine, endpoint: str, greqs: list[Request], queue: asyncio.Queue[tuple[int, Event]],
               answer: _Answer, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events, a chunk per piece of each choice; Starlette cancels this generator when the
    client goes away, and the `finally` then cancels the sequences so their slots are freed at the
    engine's next turn. With tools, text that may begin a call waits until it is known."""
    def sse(body: dict[str, Any]) -> str:
        return f"data: {json.dumps(body)}\n\n"

    style = answer.tool_style if answer.chat else None
    offsets = [ch.echo for ch in answer.choices]   # completions logprobs: characters before each piece
    done = False
    try:
        if answer.chat:     # OpenAI's first chat chunk of a choice carries the role
            for c in range(len(answer.choices)):
                yield sse(answer.chunk(c, "", first=True))
        while any(ch.finish is None for ch in answer.choices):
            c, ev = await queue.get()
            ch = answer.choices[c]
            answer.take(c, ev)
            if ev.finish_reason == "error":
                done = True
                engine.metrics.count_request(endpoint, "error")
                yield sse(APIError(500, f"generation failed: {ev.error}", "server_error").body())
                return
            text = ev.text
            if style is not None:
                tail = ch.text[ch.sent:]
                text = tail[:len(tail) - held_back(tail, style)] if ev.finish_reason is None else ""
                ch.sent += len(text)
            if text or (answer.piece is not None and ev.logprobs):
                lp = answer.logprobs_of(list(ev.logprobs), offsets[c])
                if lp is not None and not answer.chat:
                    offsets[c] += sum(len(t) for t in lp["tokens"])
                yield sse(answer.chunk(c, text, logprobs=lp))
            if ev.finish_reason is None:
                continue
            finish = "stop" if ev.finish_reason == "cancelled" else ev.finish_reason
            calls = None
            if style is not None:       # the held text: content, or the calls it turned out to be
                content, found = parse_calls(ch.text, style)
                if found:               # what was sent is content's start, unless a call came first
                    rest = content[ch.sent:] if content.startswith(ch.text[:ch.sent]) else ""
                else:
                    rest = ch.text[ch.sent:]
                if rest:
                    yield sse(answer.chunk(c, rest))
                if found:
                    calls, finish = [t.body(index=i) for i, t in enumerate(found)], "tool_calls"
            yield sse(answer.chunk(c, "", finish, tool_calls=calls))
        done = True
        if include_usage:
            obj = "chat.completion.chunk" if answer.chat else "text_completion"
            yield sse(usage_chunk(answer.rid, answer.model, obj, answer.usage()))
        yield "data: [DONE]\n\n"
        engine.metrics.count_request(endpoint, "ok")
    finally:
        if not done:
            for g in greqs:
                engine.cancel(g)
            engine.metrics.count_request(endpoint, "cancelled")

"""The HTTP face of the engine: OpenAI's completions and chat completions, models, health, metrics.

Every request passes _Guard first, an ASGI middleware in front of every route (a route added later gets
it too), which answers for the whole server:
    Host        a name other than the bound address's, localhost or --allowed-hosts: 403 (DNS rebinding
                would otherwise let a web page reach a loopback server); an IP literal is always allowed
    draining    after SIGTERM: 503 for every new request (serve's graceful shutdown, server.py)
    API key     --api-key: `Authorization: Bearer KEY` (or `X-Api-Key`) on every path but /health,
                compared in constant time (hmac.compare_digest): else 401
    body        POST/PUT/PATCH: a JSON content type (else 415: a cross-site form sends text/plain or
                form types, which need no CORS preflight), at most max_body_bytes (413), read whole
                within body_timeout_s (408: a Content-Length larger than what is sent cannot hold a
                handler forever)
Bodies are then parsed (protocol.parse_body: depth, surrogates, NaN) and validated with the protocol
models, so every bad request gets OpenAI's error object with a 4xx status instead of FastAPI's 422
format. A grammar is checked and compiled in worker threads and a child process (serve/grammar.py),
never on the event loop. Generated text travels from the engine thread to the request's handler
through an asyncio queue; a step's events reach the loop in one wake-up (_Deliver).
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import functools
import hmac
import ipaddress
import json
import sys
import threading
import time
import traceback
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from typing import Any, cast

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.sampling import SamplingParams
from .engine import Engine, Event, NotReady, QueueFull, Request, ServingEngine
from .grammar import Checker, grammar_of, prepare, tokenizer_of
from .llama_server import Native, NativeCompletion, native_request, prompt_parts, props, slots, timings, tokenize_parts
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_logprobs,
    completion_body,
    completion_logprobs,
    context_exceeded,
    new_id,
    parse_body,
    refuse_unsupported,
    usage,
    usage_chunk,
    validation_error,
)
from .responses import responses_request
from .scoring import check_scoring, echo_text, join_logprobs, prompt_list, prompt_logprobs_body, tokenizer_info
from .tools import call_grammar, check_tools, generic_messages, held_back, is_strict, parse_calls, style_of

MAX_BODY_BYTES = 1 << 20          # a 1 MiB prompt is far past any context this server runs
BODY_TIMEOUT_S = 30.0             # a whole body, from its first byte's wait: 1 MiB at 35 KB/s
_DISCONNECT_POLL_S = 0.25         # how often a non-streaming handler asks whether its client left
_BIG_BODY = 64 << 10              # bodies past this are parsed in a worker thread, not on the loop
_GRAMMAR_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ggml-dist-grammar")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


# -- the guard in front of every route -------------------------------------------------------------------

@dataclass(frozen=True)
class HTTPPolicy:
    """Who may call the server and how a request may arrive (the module docstring's _Guard).
    allowed_hosts: Host names accepted besides IP literals; None accepts any (a wildcard bind without
    --allowed-hosts, or an app made without a policy, as tests' TestClient)."""
    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    public_paths: frozenset[str] = frozenset({"/health"})

    @classmethod
    def for_bind(cls, host: str, api_key: str | None = None, extra_hosts: tuple[str, ...] = (),
                 **kw: Any) -> HTTPPolicy:
        """The policy of a server bound to host: its own name, localhost and extra_hosts ("*": any) for
        a specific address; any Host for a wildcard bind unless extra_hosts are given."""
        if "*" in extra_hosts:
            return cls(api_key=api_key, allowed_hosts=None, **kw)
        if host in ("0.0.0.0", "::", "") and not extra_hosts:
            return cls(api_key=api_key, allowed_hosts=None, **kw)
        names = {"localhost", host.lower().strip("[]"), *(h.lower().strip("[]") for h in extra_hosts)}
        return cls(api_key=api_key, allowed_hosts=frozenset(names), **kw)


class Admission:
    """Whether the server takes new requests (a graceful shutdown closes it), and how many requests
    are being answered now (the shutdown waits for them)."""

    def __init__(self) -> None:
        self.closed = False
        self.active = 0                     # requests inside the app, /health aside (the loop's thread)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header: without the port, brackets or a trailing dot, lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":")[0]
    return v.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class _Guard:
    """The ASGI middleware of the module docstring: checks, in order, Host, admission, the API key and
    the body's type, size and arrival, then hands the app the whole body."""

    def __init__(self, app: ASGIApp, policy: HTTPPolicy, admission: Admission,
                 count: Callable[[str, int], None]) -> None:
        self.app, self.policy, self.admission, self.count = app, policy, admission, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k, v)
        refusal = self._refusal(path, method, headers)
        if refusal is not None:
            await self._answer(send, path, refusal)
            return
        body = b""
        if method in ("POST", "PUT", "PATCH"):
            try:
                got = await self._read_body(receive, headers)
            except APIError as e:
                await self._answer(send, path, e, close=True)
                return
            if got is None:                     # the client left while sending
                return
            body = got
        sent = False

        async def replay() -> Message:          # the body once, then the connection's own events
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        counted = path not in self.policy.public_paths
        self.admission.active += counted
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.active -= counted

    def _refusal(self, path: str, method: str, headers: dict[bytes, bytes]) -> APIError | None:
        p = self.policy
        if p.allowed_hosts is not None and b"host" in headers:
            name = _host_name(headers[b"host"].decode("latin-1"))
            if not _is_ip(name) and name not in p.allowed_hosts:
                return APIError(403, f"Host '{name[:100]}' is not one this server answers to; start it with "
                                f"--allowed-hosts {name[:100]} to allow it", code="host_not_allowed")
        if self.admission.closed:
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        if p.api_key is not None and path not in p.public_paths:
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, p.api_key.encode()):
                what = "a wrong API key" if token else "no API key"
                return APIError(401, f"{what}: send the server's --api-key as 'Authorization: Bearer KEY'",
                                code="invalid_api_key")
        if method in ("POST", "PUT", "PATCH"):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > p.max_body_bytes:
                return APIError(413, f"request body of {int(declared)} bytes exceeds the limit of "
                                f"{p.max_body_bytes} bytes", code="body_too_large")
            if media != b"application/json" and not media.endswith(b"+json"):
                shown = media.decode("latin-1")[:60] or "none"
                return APIError(415, f"the body must be JSON with 'Content-Type: application/json' (got "
                                f"{shown})", code="unsupported_media_type")
        return None

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes | None:
        """The whole body within the size and time limits; None if the client disconnected."""
        p = self.policy
        buf = bytearray()
        try:
            async with asyncio.timeout(p.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    buf += msg.get("body", b"")
                    if len(buf) > p.max_body_bytes:
                        raise APIError(413, f"request body exceeds the limit of {p.max_body_bytes} bytes",
                                       code="body_too_large")
                    if not msg.get("more_body", False):
                        return bytes(buf)
        except TimeoutError:
            declared = headers.get(b"content-length", b"?").decode("latin-1")[:20]
            raise APIError(408, f"the body did not arrive within {p.body_timeout_s:g} s ({len(buf)} of "
                           f"{declared} bytes)", code="request_timeout") from None

    async def _answer(self, send: Send, path: str, e: APIError, close: bool = False) -> None:
        self.count(path, e.status)
        raw = json.dumps(e.body()).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        if e.status == 401:
            hdrs.append((b"www-authenticate", b"Bearer"))
        if close or e.status == 503:
            hdrs.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": e.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": raw})


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


def create_app(engine: ServingEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
               policy: HTTPPolicy | None = None, admission: Admission | None = None) -> FastAPI:
    """The app; policy: who may call it and how (default: anyone, any Host; serve and ServerThread give
    the bound address's); admission: closed by a graceful shutdown. app.state.checker is the grammar
    checker (its child process starts at the first grammar; close() it with the server)."""
    policy = policy or HTTPPolicy(max_body_bytes=max_body_bytes)
    admission = admission or Admission()
    app = FastAPI(title="ggml-dist", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = engine.metrics
    created = int(time.time())
    checker = Checker(engine.cfg.model_path)

    endpoints = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}

    def count(path: str, status: int) -> None:
        if path in endpoints:
            outcome = "rejected" if status in (401, 403, 429, 503) else "invalid" if status < 500 else "error"
            metrics.count_request(endpoints[path], outcome)

    app.add_middleware(cast(Any, _Guard), policy=policy, admission=admission, count=count)

    @app.exception_handler(APIError)
    async def _api_error(http: HTTPRequest, e: APIError) -> JSONResponse:
        count(http.url.path, e.status)
        headers = {"Retry-After": "1"} if e.status in (429, 503) and not admission.closed else None
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
        """llama-server's /tokenize: {"content", "add_special"?, "with_pieces"?} -> {"tokens"}; vLLM's
        {"prompt", "add_special_tokens"?} (lm-eval's remote tokenizer) -> {"tokens", "count", ...}."""
        body = await _read_json(http)
        vllm = "content" not in body and "prompt" in body
        content = body.get("prompt") if vllm else body.get("content")
        add_special = body.get("add_special_tokens", True) if vllm else body.get("add_special", False)
        with_pieces = body.get("with_pieces", False)
        if not isinstance(content, str):
            raise _invalid("'content' must be a string", "content")
        if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
            raise _invalid("'add_special' and 'with_pieces' must be booleans", "add_special")
        tok = _tokenizer(engine)
        ids = await asyncio.to_thread(tok.encode, content, add_special=add_special, parse_special=True)
        if vllm and not with_pieces:
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.n_ctx_slot})
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
        body = await _read_json(http)
        tok = _tokenizer(engine)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise _invalid("'tokens' must be a list of token ids", "tokens")
        bad = [t for t in ids if not 0 <= t < tok.n_vocab]
        if bad:
            raise _invalid(f"token id {bad[0]} is outside the vocabulary (0..{tok.n_vocab - 1})", "tokens")
        text = b"".join(tok.token_to_piece(t) for t in ids).decode("utf-8", errors="replace")
        return JSONResponse({"content": text, "prompt": text})      # llama-server's key, vLLM's

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> JSONResponse:
        """vLLM's /tokenizer_info, which lm-eval's remote tokenizer probes (serve/scoring.py)."""
        tok = _tokenizer(engine)
        return JSONResponse(tokenizer_info(tok, engine.cfg.chat_template or tok.chat_template, engine.n_ctx_slot))

    async def embed_inputs(x: Any, param: str) -> tuple[list[list[int]], list[Any]]:
        """The prompts of an embeddings request (OpenAI's input forms, and llama-server's: llama_server.
        prompt_parts) and their vectors, computed by the engine between steps."""
        if engine.cfg.pooling is None:
            raise _invalid("this server computes no embeddings: the model's pooling type is none; start it "
                           "with --pooling mean|last|cls|none", param)
        if engine.cfg.n_replicas > 1:
            raise _invalid("embeddings need --replicas 1", param)
        assert isinstance(engine, Engine), f"one replica, so one Engine, not {type(engine).__name__}"
        tok = _tokenizer(engine)
        parts = prompt_parts(x, param)
        if len(parts) > 256:
            raise _invalid(f"at most 256 inputs per request, got {len(parts)}", param)
        prompts = [await asyncio.to_thread(tokenize_parts, p, tok, param) for p in parts]
        for ids in prompts:
            if not ids:
                raise _invalid("an input is empty", param)
            if len(ids) > engine.n_ctx_slot:
                raise context_exceeded(f"an input of {len(ids)} tokens is too large for the context per "
                                       f"request ({engine.n_ctx_slot} tokens)", param, len(ids), engine.n_ctx_slot)
        try:
            return prompts, [await asyncio.wrap_future(engine.embed(ids)) for ids in prompts]
        except NotReady as e:
            raise APIError(503, str(e), "server_error", code="model_not_ready") from None

    @app.post("/v1/embeddings")
    async def embeddings(http: HTTPRequest) -> JSONResponse:
        """OpenAI's embeddings: the server's --pooling of the final norm's rows, L2-normalized."""
        body = await _read_json(http)
        for name in ("dimensions",):
            if body.get(name) is not None:
                raise APIError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")
        fmt = body.get("encoding_format", "float")
        if fmt not in ("float", "base64"):
            raise _invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
        if engine.cfg.pooling == "none":
            raise _invalid("with --pooling none an embedding is one vector per token, which OpenAI's API has "
                           "no shape for: use /embedding", "input")
        prompts, vecs = await embed_inputs(body.get("input"), "input")
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
                 else [float(x) for x in v]} for i, v in enumerate(vecs)]
        n = sum(len(p) for p in prompts)
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest) -> Response:
        body = with_defaults(await _read_json(http))
        refuse_unsupported(body, chat=False)
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        tok = _tokenizer(engine)
        texts = prompt_list(req.prompt)
        max_tokens = req.max_tokens_or_default()
        score = check_scoring(req.echo, req.logprobs, max_tokens, req.n, req.stream)
        if len(texts) * req.n > engine.cfg.n_parallel:
            raise _invalid(f"{len(texts)} prompts x n={req.n} choices need more sequences than this server's "
                           f"{engine.cfg.n_parallel} slots (--parallel)", "n" if req.n > 1 else "prompt")
        prompts, echos = [], []
        for p in texts:
            if isinstance(p, str):        # off the event loop: a long prompt takes milliseconds
                _check_length_before_encoding(tok, p, engine.n_ctx_slot, "prompt")
                prompts.append(await asyncio.to_thread(tok.encode, p, add_special=True, parse_special=True))
            else:
                bad = [t for t in p if not 0 <= t < tok.n_vocab]
                if bad:
                    raise _invalid(f"token id {bad[0]} is outside the vocabulary "
                                   f"(0..{tok.n_vocab - 1})", "prompt")
                prompts.append(list(p))
            if req.echo:
                echos.append(p if isinstance(p, str) else echo_text(p, tok.token_to_piece))
            else:
                echos.append("")
        return await _generate(http, engine, "completions", req, prompts, max_tokens,
                               model_name, chat=False, echos=echos, checker=checker, admission=admission,
                               prompt_logprobs=score)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest) -> Response:
        return await run_chat(http, await _read_json(http))

    def with_defaults(body: dict[str, Any], native: bool = False) -> dict[str, Any]:
        """body with the server's request defaults (--temp, --seed, --n-predict) where it sets none."""
        out = dict(body)
        for k, v in engine.cfg.request_defaults:
            if k == "n_predict" and not native:
                if v >= 0 and out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
                    out["max_tokens"] = v
            elif out.get(k) is None:
                out[k] = v
        return out

    async def render_chat(body: dict[str, Any], messages: list[dict[str, Any]], template: str,
                          extra: dict[str, Any]) -> str:
        """The prompt of a chat request: the template's rendering with the generation prompt, or without it
        (add_generation_prompt false), or ending inside the last assistant message, which the answer then
        continues (vLLM's continue_final_message). Off the event loop."""
        cont, gen = body.get("continue_final_message", False), body.get("add_generation_prompt", True)
        if not isinstance(cont, bool) or not isinstance(gen, bool):
            raise _invalid("'add_generation_prompt' and 'continue_final_message' must be booleans",
                           "continue_final_message")
        if cont and gen and "add_generation_prompt" in body:
            raise _invalid("continue_final_message continues the last message: add_generation_prompt must be "
                           "false with it", "continue_final_message")
        if cont and (messages[-1]["role"] != "assistant" or not messages[-1].get("content")):
            raise _invalid("continue_final_message needs a last assistant message with content", "messages")
        tok = _tokenizer(engine)
        try:
            text = await asyncio.to_thread(tok.apply_chat_template, messages, add_generation_prompt=gen and not cont,
                                           template=template, **extra)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception (roles out of order): a 400
            raise _invalid(f"the chat template rejected the messages: {e}", "messages") from None
        if cont:                    # the rendering, cut where the last message's content ends
            last = messages[-1]["content"]
            at = text.rfind(last)
            if at < 0:
                raise _invalid("the chat template does not render the last message's content as given, so it "
                               "cannot be continued", "continue_final_message")
            text = text[:at + len(last)]
        return text

    async def input_tokens(http: HTTPRequest) -> JSONResponse:
        """llama-server's /chat/completions/input_tokens: the prompt tokens a chat request would take."""
        body = await _read_json(http)
        try:
            req = ChatRequest.model_validate({**body, "messages": body.get("messages")})
        except ValidationError as e:
            raise validation_error(e) from None
        tok = _tokenizer(engine)
        template = engine.cfg.chat_template or tok.chat_template
        if not template:
            raise _invalid("the model has no chat template; start the server with --chat-template", "messages")
        messages = [m.for_template() for m in req.messages]
        extra: dict[str, Any] = {}
        if req.tools is not None and req.tool_choice != "none":
            tools, _ = check_tools(req.tools, req.tool_choice)
            if style_of(template) == "generic":
                messages = generic_messages(messages, tools)
            else:
                extra = {"tools": tools}
        text = await render_chat(body, messages, template, extra)
        ids = await asyncio.to_thread(tok.encode, text, add_special=True, parse_special=True)
        return JSONResponse({"input_tokens": len(ids)})
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        app.add_api_route(path, input_tokens, methods=["POST"])

    async def run_chat(http: HTTPRequest, body: dict[str, Any], shape: Shape | None = None) -> Response:
        """A chat completion of body (OpenAI's request), its answer written by shape (OpenAI's by default:
        /v1/responses gives its own)."""
        body = with_defaults(body)
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
        if tools is not None and style == "generic":     # the template renders no tools: a system note
            messages, extra = generic_messages(messages, tools), {}
        text = await render_chat(body, messages, template, extra)
        _check_length_before_encoding(tok, text, engine.n_ctx_slot, "messages")
        ids = await asyncio.to_thread(tok.encode, text, add_special=True, parse_special=True)
        room = max(1, engine.n_ctx_slot - len(ids))
        grammar = None
        # a call that is required, strict, or in the generic format: a grammar makes it one, with valid arguments
        if tools is not None and (forced is not None or style == "generic" or is_strict(tools)):
            if req.response_format is not None or req.grammar is not None or req.json_schema is not None:
                raise _invalid("tool calls held by a grammar (forced, strict, or the generic format of a template "
                               "that renders no tools) cannot take a response_format or grammar too", "tool_choice")
            assert style is not None
            grammar = await asyncio.to_thread(call_grammar, tools, forced, style, tok, bool(req.parallel_tool_calls))
        if req.n > engine.cfg.n_parallel:
            raise _invalid(f"n={req.n} choices need more sequences than this server's "
                           f"{engine.cfg.n_parallel} slots (--parallel)", "n")
        if body.get("verbose") is True and not req.stream and shape is None:    # llama-server's debug field
            shape = Shape(lambda a: {**a.body(), "__verbose": {"prompt": text}}, lambda a, chunks: _sse(chunks))
        return await _generate(http, engine, "chat", req, [ids], req.max_tokens_or_default(room),
                               model_name, chat=True, grammar=grammar, tool_style=style, checker=checker,
                               admission=admission, shape=shape)

    # -- llama-server's own routes (serve/llama_server.py) and names of the OpenAI ones ---------------------
    for path, route in (("/completions", completions), ("/chat/completions", chat_completions)):
        app.add_api_route(path, route, methods=["POST"])
        endpoints[path] = endpoints["/v1" + path]
    app.add_api_route("/models", models, methods=["GET"])

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> JSONResponse:
        if model_id != model_name:
            raise APIError(404, f"the model '{model_id[:200]}' does not exist: this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return JSONResponse({"id": model_name, "object": "model", "created": created, "owned_by": "ggml_dist"})

    @app.post("/completion")
    async def native_completion(http: HTTPRequest) -> Response:
        """llama-server's /completion: its fields, its answer (serve/llama_server.py)."""
        body = await _read_json(http)
        tok = _tokenizer(engine)
        req, prompts, texts = await asyncio.to_thread(native_request, with_defaults(body, native=True), tok)
        if len(prompts) > engine.cfg.n_parallel:
            raise _invalid(f"{len(prompts)} prompts need more sequences than this server's "
                           f"{engine.cfg.n_parallel} slots (--parallel)", "prompt")
        room = max(1, engine.n_ctx_slot - max(len(p) for p in prompts))
        n_predict = min(req.max_tokens_or_default(room), room)     # llama-server stops at the context's end
        native = Native(req, texts, n_predict, model_name, tok.token_to_piece)
        return await _generate(http, engine, "completion", req, prompts, n_predict, model_name, chat=False,
                               checker=checker, admission=admission, shape=Shape(native.body, native.stream),
                               raw=True, cache_prompt=req.cache_prompt)

    @app.get("/props")
    async def props_route() -> JSONResponse:
        tok = _tokenizer(engine)
        return JSONResponse(props(model_name, engine.cfg.model_path, engine.cfg.n_parallel, engine.n_ctx_slot,
                                  engine.cfg.chat_template or tok.chat_template, tok, _fingerprint(engine)))

    @app.post("/props")
    async def props_change() -> JSONResponse:
        raise APIError(403, "this server's properties cannot be changed at run time (llama-server's --props)",
                       "permission_error", code="not_supported")

    @app.get("/slots")
    async def slots_route() -> JSONResponse:
        return JSONResponse(slots(engine.cfg.n_parallel, engine.n_running(), engine.n_ctx_slot))

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: str) -> JSONResponse:
        if policy.api_key is None:
            raise APIError(403, "slot actions change a slot other clients may use: they need the server "
                           "started with --api-key", "permission_error", code="slot_actions_need_api_key")
        raise APIError(501, "slot save, restore and erase are not implemented by this server", "not_supported_error",
                       code="not_supported")

    @app.post("/apply-template")
    async def apply_template(http: HTTPRequest) -> JSONResponse:
        """llama-server's /apply-template: {"messages"} -> {"prompt"}, the chat template's rendering."""
        body = await _read_json(http)
        try:
            req = ChatRequest.model_validate({"messages": body.get("messages")})
        except ValidationError as e:
            raise validation_error(e) from None
        tok = _tokenizer(engine)
        template = engine.cfg.chat_template or tok.chat_template
        if not template:
            raise _invalid("the model has no chat template; start the server with --chat-template", "messages")
        try:
            text = await asyncio.to_thread(tok.apply_chat_template, [m.for_template() for m in req.messages],
                                           add_generation_prompt=True, template=template)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception: a 400
            raise _invalid(f"the chat template rejected the messages: {e}", "messages") from None
        return JSONResponse({"prompt": text})

    async def native_embedding(http: HTTPRequest) -> JSONResponse:
        """llama-server's /embedding: per input [one vector] pooled, or every token's row (--pooling none)."""
        body = await _read_json(http)
        x = body.get("content", body.get("input"))
        _, vecs = await embed_inputs(x, "content" if "content" in body else "input")
        return JSONResponse([{"index": i, "embedding": v.tolist() if v.ndim == 2 else [v.tolist()]}
                             for i, v in enumerate(vecs)])
    for path in ("/embedding", "/embeddings"):
        app.add_api_route(path, native_embedding, methods=["POST"])

    @app.post("/v1/responses")
    async def responses_route(http: HTTPRequest) -> Response:
        """OpenAI's Responses API over the chat completions (serve/responses.py)."""
        body = await _read_json(http)
        chat, answer = responses_request(body)
        return await run_chat(http, chat, Shape(answer.body, answer.stream))
    app.add_api_route("/responses", responses_route, methods=["POST"])

    app.state.engine = engine
    app.state.checker = checker
    app.state.admission = admission
    app.state.policy = policy
    return app


# -- helpers ---------------------------------------------------------------------------------------------

def _invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


_MAX_PIECE: dict[int, int] = {}


def _check_length_before_encoding(tok: Any, text: str, n_slot: int, param: str) -> None:
    """Refuse a prompt that cannot fit before spending the encode on it: n UTF-8 bytes make at least
    n / (the longest token's bytes) tokens."""
    longest = _MAX_PIECE.get(id(tok))
    if longest is None:
        longest = _MAX_PIECE[id(tok)] = max(1, *(len(tok.token_to_piece(i)) for i in range(tok.n_vocab)))
    n_bytes = len(text.encode("utf-8", errors="replace"))
    if n_bytes // longest >= n_slot:
        raise context_exceeded(f"the prompt has at least {n_bytes // longest} tokens ({n_bytes} bytes); this "
                               f"server's context per request is {n_slot} tokens", param, n_bytes // longest, n_slot)


def _fingerprint(engine: ServingEngine) -> str:
    """system_fingerprint: what the answers depend on besides the request (the package, the model file,
    the context per slot, the batch size, the numerics mode), hashed; llama-server's start with "b"."""
    cfg = engine.cfg
    return _fingerprint_of(cfg.model_path, engine.n_ctx_slot, cfg.n_batch, cfg.batch_invariant)


@functools.cache
def _fingerprint_of(model_path: str, n_ctx_slot: int, n_batch: int, invariant: bool) -> str:
    import hashlib
    import importlib.metadata
    import os
    try:
        version = importlib.metadata.version("ggml-dist")
    except importlib.metadata.PackageNotFoundError:
        version = "0"
    try:
        size = os.path.getsize(model_path)
    except OSError:
        size = -1
    key = f"{os.path.basename(model_path)}:{size}:{n_ctx_slot}:{n_batch}:{invariant}"
    return f"b{version}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _tokenizer(engine: ServingEngine) -> Any:
    try:
        return engine.tokenizer
    except NotReady as e:
        raise APIError(503, str(e), "server_error", code="model_not_ready") from None


async def _read_json(http: HTTPRequest) -> dict[str, Any]:
    """The body as a JSON object (protocol.parse_body); _Guard has read it whole, within its limits.
    A large one is parsed in a worker thread, so the loop keeps answering meanwhile."""
    raw = await http.body()
    if len(raw) > _BIG_BODY:
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


async def _grammar(engine: ServingEngine, req: CompletionRequest | ChatRequest | NativeCompletion, forced: str | None,
                   checker: Checker) -> str | None:
    """The request's grammar, checked and compiled off the event loop (serve/grammar.py's three gates),
    or None. A grammar the checker refuses is a 400 naming the field it came from."""
    loop = asyncio.get_running_loop()
    if forced is not None:
        text, param = forced, "tools"
    else:
        given = [n for n in ("response_format", "grammar", "json_schema") if getattr(req, n) is not None]
        if not given:
            return None
        param = given[0]
        found = await loop.run_in_executor(_GRAMMAR_POOL, functools.partial(
            grammar_of, req.response_format, req.grammar, req.json_schema))
        if found is None:
            return None
        text = found
    tok = _tokenizer(engine)
    lltok = await loop.run_in_executor(_GRAMMAR_POOL, tokenizer_of, tok)     # built once
    try:
        verdict = await asyncio.wrap_future(checker.submit(text))
    except RuntimeError as e:
        raise APIError(503, f"the grammar checker is not available: {e}", "server_error",
                       code="grammar_checker_unavailable") from None
    if verdict is not None:
        raise APIError(400, f"invalid {param}: {verdict}", param=param, code="invalid_grammar")
    await loop.run_in_executor(_GRAMMAR_POOL, prepare, lltok, text)
    return text


@dataclass(frozen=True)
class Shape:
    """An answer written as another API's: body(answer) the whole one, stream(answer, chunks) its events
    from OpenAI's chunks (None: the end); answer is the _Answer, which both may read."""
    body: Callable[[Any], Any]
    stream: Callable[[Any, AsyncIterator[dict[str, Any] | None]], AsyncIterator[str]]


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
    prompt_lps: list = field(default_factory=list)   # a scored prompt's TokenLogprobs (its tokens 1..)
    n_cached: int = 0             # prompt tokens the prompt cache held
    t_first: float | None = None  # when its first generated text (or its end) arrived
    t_end: float | None = None


async def _generate(http: HTTPRequest, engine: ServingEngine, endpoint: str,
                    req: CompletionRequest | ChatRequest | NativeCompletion, prompts: list[list[int]],
                    max_tokens: int, model_name: str, chat: bool,
                    echos: list[str] | None = None, grammar: str | None = None,
                    tool_style: str | None = None, checker: Checker | None = None,
                    admission: Admission | None = None, prompt_logprobs: int | None = None,
                    shape: Shape | None = None, raw: bool = False, cache_prompt: bool = True) -> Response:
    """One engine request per prompt, each of req.n choices (choice c = prompt k * n + j); tool_style:
    the chat template's tool-call syntax (serve/tools.py) when the request has tools: calls in the
    answer become tool_calls. grammar: one the output must follow (a forced tool call).
    prompt_logprobs: score the prompts (serve/scoring.py), this many top logprobs per token. shape: the
    answer written as another API's (llama-server's /completion, /v1/responses), from OpenAI's; raw: the
    chunks carry their tokens' engine TokenLogprobs too, as `_entries` (for a shape to read)."""
    metrics = engine.metrics
    n_slot = engine.n_ctx_slot
    for ids in prompts:
        if not ids:
            raise _invalid("the prompt is empty", "prompt")
        if len(ids) >= n_slot:
            raise context_exceeded(f"the prompt has {len(ids)} tokens; this server's context per request is "
                                   f"{n_slot} tokens (--ctx {engine.cfg.n_ctx} / --parallel {engine.cfg.n_parallel}), "
                                   f"which must hold the prompt and at least one generated token",
                                   "messages" if chat else "prompt", len(ids), n_slot)
    if max_tokens > n_slot:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the context per request ({n_slot} tokens)",
                       param="max_tokens", code="invalid_value")
    if req.n > 1 and engine.cfg.n_replicas > 1:
        raise _invalid("n > 1 shares a prompt's KV cells between sequences of one engine: use --replicas 1",
                       "n")
    tok = _tokenizer(engine)
    assert checker is not None and admission is not None, "create_app's routes give both"
    constraint = await _grammar(engine, req, grammar, checker)
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
                             on_event=functools.partial(_post_choice, deliver, queue, k * n), n=n,
                             prompt_logprobs=prompt_logprobs, cache_prompt=cache_prompt))
    if admission.closed:            # it passed the guard before the shutdown began
        raise APIError(503, "the server is shutting down", "server_error", code="shutting_down")
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
                     tool_style=tool_style, n_prompt=sum(len(p) for p in prompts), prompts=prompts, n=n,
                     scored=prompt_logprobs is not None, fingerprint=_fingerprint(engine), raw=raw)
    if req.stream:
        chunks = _chunks(engine, endpoint, greqs, queue, answer, req.include_usage, admission)
        return StreamingResponse(shape.stream(answer, chunks) if shape is not None else _sse(chunks),
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
        raise _failure(failed.error, admission)
    metrics.count_request(endpoint, "ok")
    return JSONResponse(shape.body(answer) if shape is not None else answer.body())


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
    prompts: list[list[int]] = field(default_factory=list)
    n: int = 1                    # choices per prompt
    scored: bool = False          # the prompts' tokens are scored (echo + logprobs)
    fingerprint: str = ""         # system_fingerprint
    raw: bool = False             # chunks carry `_entries`, their tokens' TokenLogprobs
    t0: float = field(default_factory=time.perf_counter)

    def take(self, c: int, ev: Event) -> None:
        ch = self.choices[c]
        ch.text += ev.text
        ch.logprobs += ev.logprobs
        ch.prompt_lps += ev.prompt_logprobs
        if ch.t_first is None and (ev.text or ev.logprobs or ev.finish_reason is not None):
            ch.t_first = time.perf_counter()
        if ev.finish_reason is not None:
            ch.finish, ch.n_gen, ch.error = ev.finish_reason, ev.n_gen, ev.error
            ch.n_cached, ch.t_end = ev.n_cached, time.perf_counter()

    def usage(self) -> dict[str, Any]:
        return usage(self.n_prompt, sum(ch.n_gen for ch in self.choices), sum(ch.n_cached for ch in self.choices))

    def timings(self) -> dict[str, Any]:
        """llama-server's timings: prompt and generation time as the responses arrived."""
        firsts = [ch.t_first for ch in self.choices if ch.t_first is not None]
        ends = [ch.t_end for ch in self.choices if ch.t_end is not None]
        t_first = min(firsts, default=self.t0)
        n_cached = sum(ch.n_cached for ch in self.choices)
        return timings(self.n_prompt - n_cached, n_cached, sum(ch.n_gen for ch in self.choices),
                       t_first - self.t0, max(ends, default=t_first) - t_first)

    def logprobs_of(self, entries: list, offset: int = 0) -> dict[str, Any] | None:
        if self.piece is None:
            return None
        return chat_logprobs(entries, self.piece) if self.chat else completion_logprobs(entries, self.piece, offset)

    def prompt_logprobs(self, c: int) -> dict[str, Any] | None:
        """Choice c's scored prompt as a completions logprobs object (its prompt's first choice holds the
        scores), or None when the prompts are not scored."""
        if not self.scored:
            return None
        k = c // self.n
        return prompt_logprobs_body(self.prompts[k], self.choices[k * self.n].prompt_lps, self.piece)

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] | None = None
        for c, ch in enumerate(self.choices):
            text, finish, calls = ch.text, ch.finish, None
            if self.chat and self.tool_style is not None:
                text, found = parse_calls(text, self.tool_style)
                if found:
                    calls, finish = [t.body() for t in found], "tool_calls"
            lp = self.logprobs_of(ch.logprobs, ch.echo)
            scored = self.prompt_logprobs(c)
            if scored is not None:
                lp = join_logprobs(scored, lp)
            b = chat_body(self.rid, self.model, text, finish, self.usage(), chunk=False, logprobs=lp,
                          tool_calls=calls) if self.chat else \
                completion_body(self.rid, self.model, text, finish, self.usage(), chunk=False, logprobs=lp)
            b["choices"][0]["index"] = c
            if out is None:
                out = b
            else:
                out["choices"].append(b["choices"][0])
        assert out is not None
        out["system_fingerprint"] = self.fingerprint
        out["timings"] = self.timings()
        return out

    def chunk(self, c: int, text: str, finish: str | None = None, first: bool = False,
              logprobs: dict[str, Any] | None = None, tool_calls: list | None = None,
              entries: tuple = ()) -> dict[str, Any]:
        b = chat_body(self.rid, self.model, text, finish, None, chunk=True, first=first, logprobs=logprobs,
                      tool_calls=tool_calls) if self.chat else \
            completion_body(self.rid, self.model, text, finish, None, chunk=True, logprobs=logprobs)
        b["choices"][0]["index"] = c
        b["system_fingerprint"] = self.fingerprint
        if self.raw:
            b["_entries"] = list(entries)
        return b


def _failure(error: str | None, admission: Admission) -> APIError:
    """A choice that ended in an error: the server's shutdown (503), the request's own grammar failing
    past the checker's two tokens (llguidance's parser limits, 400: the request's doing), or its
    generation failed (500)."""
    if admission.closed:
        return APIError(503, f"the server is shutting down: {error}", "server_error", code="shutting_down")
    if error is not None and error.startswith("ValueError: grammar:"):     # grammar.Constraint's errors
        return APIError(400, f"the request's grammar failed during generation: {error}",
                        code="invalid_grammar")
    return APIError(500, f"generation failed: {error}", "server_error", code="generation_failed")


async def _sse(chunks: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[str]:
    """OpenAI's server-sent events: a data line per chunk, then [DONE]."""
    async for body in chunks:
        yield "data: [DONE]\n\n" if body is None else f"data: {json.dumps(body)}\n\n"


async def _chunks(engine: ServingEngine, endpoint: str, greqs: list[Request], queue: asyncio.Queue[tuple[int, Event]],
                  answer: _Answer, include_usage: bool, admission: Admission) -> AsyncIterator[dict[str, Any] | None]:
    """The stream's chunks, one per piece of each choice, then None (OpenAI's [DONE]); Starlette cancels
    this generator when the client goes away, and the `finally` then cancels the sequences so their slots
    are freed at the engine's next turn. With tools, text that may begin a call waits until it is known.
    A choice that fails (or a shutdown past its grace) ends the stream with an error chunk, then None."""
    style = answer.tool_style if answer.chat else None
    offsets = [ch.echo for ch in answer.choices]   # completions logprobs: characters before each piece
    echoed = [answer.chat or (not ch.echo and not answer.scored) for ch in answer.choices]
    done = False
    try:
        if answer.chat:     # OpenAI's first chat chunk of a choice carries the role
            for c in range(len(answer.choices)):
                yield answer.chunk(c, "", first=True)
        while any(ch.finish is None for ch in answer.choices):
            c, ev = await queue.get()
            ch = answer.choices[c]
            answer.take(c, ev)
            if not echoed[c] and (ev.finish_reason is not None or not ev.prompt_logprobs):
                echoed[c] = True            # the prompt's text (and its scores) before what follows it
                yield answer.chunk(c, ch.text[:ch.echo], logprobs=answer.prompt_logprobs(c))
            if ev.finish_reason == "error":
                done = True
                engine.metrics.count_request(endpoint, "error")
                yield _failure(ev.error, admission).body()
                yield None
                for g in greqs:             # the request's other choices, if any, end here too
                    engine.cancel(g)
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
                yield answer.chunk(c, text, logprobs=lp, entries=ev.logprobs)
            if ev.finish_reason is None:
                continue
            finish = "stop" if ev.finish_reason == "cancelled" else ev.finish_reason
            calls = None
            if style is not None:       # the held text: content, or the calls it turned out to be
                content, found = parse_calls(ch.text, style)
                if found or style == "generic":   # what was sent is content's start, unless a call came
                    rest = content[ch.sent:] if content.startswith(ch.text[:ch.sent]) else ""   # first
                else:
                    rest = ch.text[ch.sent:]
                if rest:
                    yield answer.chunk(c, rest)
                if found:
                    calls, finish = [t.body(index=i) for i, t in enumerate(found)], "tool_calls"
            yield answer.chunk(c, "", finish, tool_calls=calls)
        done = True
        if include_usage:
            obj = "chat.completion.chunk" if answer.chat else "text_completion"
            yield {**usage_chunk(answer.rid, answer.model, obj, answer.usage()),
                   "system_fingerprint": answer.fingerprint, "timings": answer.timings()}
        yield None
        engine.metrics.count_request(endpoint, "ok")
    finally:
        if not done:
            for g in greqs:
                engine.cancel(g)
            engine.metrics.count_request(endpoint, "cancelled")

"""The HTTP face of the engine: the app (FastAPI), its guard, its routes over one state.

    guard.py          the ASGI guard in front of every route: Host, draining, API key, the body's limits
    state.py          AppState (app.state.serving): what every route reads, and the helpers they share
    routes_openai.py  OpenAI's completions, chat completions, responses, embeddings, models
    routes_llama.py   llama-server's own routes (/completion, /tokenize, /props, /slots, /apply-template, ...)
    routes_page.py    the page at / (chat and the pipeline live) and its data: /live, /live/events (live.py)
    chat.py           a chat request's prompt, rendered in one place
    answer.py         a generation's answer: engine requests, their events, the body or the stream

create_app registers each route, a plain function over the state, and the error handlers that turn every
failure into OpenAI's error object (a 4xx for a bad request, a 500 with an id for the server's own).
"""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any, cast

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import routes_llama as llama
from . import routes_openai as openai
from . import routes_page as page
from .checkpoints import HELP as CHECKPOINT_HELP
from .engine import ServingEngine
from .grammar import Checker
from .guard import MAX_BODY_BYTES, Admission, Guard, HTTPPolicy
from .protocol import APIError, new_id
from .state import AppState, state_of


async def health(http: HTTPRequest) -> JSONResponse:
    engine = state_of(http).engine
    if engine.load_error:
        return JSONResponse({"status": "error", "error": engine.load_error}, status_code=503)
    if not engine.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503)
    n_run = engine.n_running()
    st = engine.health()                             # no blocking call on the event loop
    if st["recovering"]:                             # requests wait, none is lost
        return JSONResponse({"status": "degraded", "reason": "recovering a lost pipeline stage or replica",
                             "recoveries": st["recoveries"]}, status_code=503)
    return JSONResponse({"status": "ok", "slots_idle": engine.cfg.n_parallel - n_run,
                         "slots_processing": n_run, "queue": engine.queue_length()})


def prometheus(http: HTTPRequest) -> PlainTextResponse:          # sync: stage stats are a blocking Ray call
    engine = state_of(http).engine
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
    gauges.update({k: (help_, st[k]) for k, help_ in CHECKPOINT_HELP.items() if k in st})
    busy = engine.stage_busy() if engine.ready.is_set() and not engine.load_error else []
    return PlainTextResponse(engine.metrics.render(gauges, busy), media_type="text/plain; version=0.0.4; charset=utf-8")


# (method, paths, route): llama-server's names of the OpenAI routes beside theirs
ROUTES: list[tuple[str, tuple[str, ...], Callable[..., Any]]] = [
    ("GET", ("/health",), health),
    ("GET", ("/",), page.index),
    ("GET", ("/page/{name}",), page.page_file),
    ("GET", ("/live",), page.live),
    ("GET", ("/live/events",), page.live_events),
    ("GET", ("/v1/models", "/models"), openai.models),
    ("GET", ("/metrics",), prometheus),
    ("POST", ("/tokenize",), llama.tokenize),
    ("POST", ("/detokenize",), llama.detokenize),
    ("GET", ("/tokenizer_info",), llama.tokenizer_info_route),
    ("POST", ("/v1/embeddings",), openai.embeddings),
    ("POST", ("/v1/completions", "/completions"), openai.completions),
    ("POST", ("/v1/chat/completions", "/chat/completions"), openai.chat_completions),
    ("POST", ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"), llama.input_tokens),
    ("GET", ("/v1/models/{model_id:path}",), openai.model_by_id),
    ("POST", ("/completion",), llama.native_completion),
    ("GET", ("/props",), llama.props_route),
    ("POST", ("/props",), llama.props_change),
    ("GET", ("/slots",), llama.slots_route),
    ("POST", ("/slots/{slot_id}",), llama.slot_action),
    ("POST", ("/apply-template",), llama.apply_template),
    ("POST", ("/embedding", "/embeddings"), llama.native_embedding),
    ("POST", ("/v1/responses", "/responses"), openai.responses),
]


def create_app(engine: ServingEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
               policy: HTTPPolicy | None = None, admission: Admission | None = None) -> FastAPI:
    """The app; policy: who may call it and how (default: anyone, any Host; serve and ServerThread give
    the bound address's); admission: closed by a graceful shutdown. app.state.checker is the grammar
    checker (its child process starts at the first grammar; close() it with the server)."""
    policy = policy or HTTPPolicy(max_body_bytes=max_body_bytes)
    admission = admission or Admission()
    app = FastAPI(title="ggml-dist", docs_url=None, redoc_url=None, openapi_url=None)
    state = AppState(engine, model_name, Checker(engine.cfg.model_path), admission, policy)
    app.add_middleware(cast(Any, Guard), policy=policy, admission=admission, count=state.count)

    @app.exception_handler(APIError)
    async def _api_error(http: HTTPRequest, e: APIError) -> JSONResponse:
        state.count(http.url.path, e.status)
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

    for method, paths, route in ROUTES:
        for path in paths:
            app.add_api_route(path, route, methods=[method])
    app.state.serving = state
    app.state.engine = engine
    app.state.checker = state.checker
    app.state.admission = admission
    app.state.policy = policy
    return app

"""The page at the server's root, and the live view's data (serve/live.py) for it and for scripts.

    GET /                  the page (page/index.html): a chat with the model, the pipeline live
    GET /page/{file}       its script and style sheet; nothing else, nothing from outside (the CSP says so)
    GET /live              JSON: the latest sample, the last minutes' series, the events so far
    GET /live/events       server-sent events: `snapshot` (as /live) once, then a `sample` a second

The page's three files are the only public paths besides /health (guard.PUBLIC_PATHS): they hold no data, and a
browser's navigation cannot carry a bearer key. With --api-key the page asks for the key and sends it on
every request it makes; /live, /live/events and the chat's routes refuse a request without it.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .protocol import APIError
from .state import state_of

# what the page may load: its own files only; frame-ancestors: no other site may frame it
_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
         "page.css": "text/css; charset=utf-8"}
_KEEPALIVE_S = 15.0


def _file(name: str) -> bytes:
    return resources.files(__package__).joinpath("page", name).read_bytes()


def _page_response(name: str) -> Response:
    return Response(_file(name), media_type=FILES[name],
                    headers={"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff",
                             "Cache-Control": "no-cache", "Referrer-Policy": "no-referrer"})


async def index(http: HTTPRequest) -> Response:
    return _page_response("index.html")


async def page_file(http: HTTPRequest, name: str) -> Response:
    if name not in FILES or name == "index.html":
        raise APIError(404, f"no page file '{name[:60]}': the page has {', '.join(FILES)}", "not_found_error")
    return _page_response(name)


def live(http: HTTPRequest) -> JSONResponse:       # sync: a reading is a blocking call to the stages
    return JSONResponse(state_of(http).live.snapshot(), headers={"Cache-Control": "no-store"})


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


async def live_events(http: HTTPRequest) -> StreamingResponse:
    """The snapshot, then each sample the live thread takes, until the client leaves or the server
    drains (a graceful shutdown must not wait for an open page)."""
    state = state_of(http)
    view = state.live
    first = await asyncio.to_thread(view.snapshot)
    q = view.subscribe()

    async def events() -> AsyncIterator[bytes]:
        try:
            yield _sse("snapshot", first)
            while not state.admission.closed:
                try:
                    item = await asyncio.wait_for(q.get(), timeout=_KEEPALIVE_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                yield _sse("sample", item)
        finally:
            view.unsubscribe(q)
    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

"""What every route of the app reads: one AppState (app.state.serving), and the helpers routes share.

    AppState        the engine, the model's name, the grammar checker, the admission (closed by a graceful
                    shutdown), the guard's policy, the request counts by endpoint, and the live view
    state_of(http)  the AppState of the app a request came to
    read_json(http) the body as a JSON object (protocol.parse_body), off the loop when it is large
"""
from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request as HTTPRequest

from .engine import NotReady, ServingEngine
from .grammar import Checker
from .guard import Admission, HTTPPolicy
from .live import Live
from .protocol import APIError, context_exceeded, parse_body

_BIG_BODY = 64 << 10              # bodies past this are parsed in a worker thread, not on the loop


@dataclass(eq=False)
class AppState:
    """The app's serving objects, which every route reads (FastAPI's app.state, as vLLM keeps its own)."""
    engine: ServingEngine
    model_name: str
    checker: Checker
    admission: Admission
    policy: HTTPPolicy
    created: int = field(default_factory=lambda: int(time.time()))
    # the paths whose requests the metrics count, and under which endpoint
    endpoints: dict[str, str] = field(default_factory=lambda: {
        "/v1/completions": "completions", "/v1/chat/completions": "chat",
        "/completions": "completions", "/chat/completions": "chat"})
    live: Live = field(init=False)         # the page's and scripts' samples (live.py)

    def __post_init__(self) -> None:
        self.live = Live(self.engine, self.model_name)

    def count(self, path: str, status: int) -> None:
        """A refused or failed request of a counted endpoint, by its status."""
        if path in self.endpoints:
            outcome = "rejected" if status in (401, 403, 429, 503) else "invalid" if status < 500 else "error"
            self.engine.metrics.count_request(self.endpoints[path], outcome)

    def with_defaults(self, body: dict[str, Any], native: bool = False) -> dict[str, Any]:
        """body with the server's request defaults (--temp, --seed, --n-predict) where it sets none."""
        out = dict(body)
        for k, v in self.engine.cfg.request_defaults:
            if k == "n_predict" and not native:
                if v >= 0 and out.get("max_tokens") is None and out.get("max_completion_tokens") is None:
                    out["max_tokens"] = v
            elif out.get(k) is None:
                out[k] = v
        return out

    def tokenizer(self) -> Any:
        """The model's tokenizer; 503 while it loads."""
        try:
            return self.engine.tokenizer
        except NotReady as e:
            raise APIError(503, str(e), "server_error", code="model_not_ready") from None

    def fingerprint(self) -> str:
        """system_fingerprint: what the answers depend on besides the request (the package, the model file,
        the context per slot, the batch size, the numerics mode), hashed; llama-server's start with "b"."""
        cfg = self.engine.cfg
        return fingerprint_of(cfg.model_path, self.engine.n_ctx_slot, cfg.params.n_batch,
                              cfg.params.batch_invariant)


def state_of(http: HTTPRequest) -> AppState:
    return http.app.state.serving


def invalid(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


async def read_json(http: HTTPRequest) -> dict[str, Any]:
    """The body as a JSON object (protocol.parse_body); the guard has read it whole, within its limits.
    A large one is parsed in a worker thread, so the loop keeps answering meanwhile."""
    raw = await http.body()
    if len(raw) > _BIG_BODY:
        return await asyncio.to_thread(parse_body, raw)
    return parse_body(raw)


_MAX_PIECE: dict[int, int] = {}


def check_length_before_encoding(tok: Any, text: str, n_slot: int, param: str) -> None:
    """Refuse a prompt that cannot fit before spending the encode on it: n UTF-8 bytes make at least
    n / (the longest token's bytes) tokens."""
    longest = _MAX_PIECE.get(id(tok))
    if longest is None:
        longest = _MAX_PIECE[id(tok)] = max(1, *(len(tok.token_to_piece(i)) for i in range(tok.n_vocab)))
    n_bytes = len(text.encode("utf-8", errors="replace"))
    if n_bytes // longest >= n_slot:
        raise context_exceeded(f"the prompt has at least {n_bytes // longest} tokens ({n_bytes} bytes); this "
                               f"server's context per request is {n_slot} tokens", param, n_bytes // longest, n_slot)


@functools.cache
def fingerprint_of(model_path: str, n_ctx_slot: int, n_batch: int, invariant: bool) -> str:
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

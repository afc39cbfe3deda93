"""An OpenAI-compatible HTTP server over a LlamaContext, in one process or on a Ray pipeline.

    engine.py   continuous batching: slots, admission queue, micro-batches, sampling, stop strings
    app.py      FastAPI routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    protocol.py request validation and response shapes (OpenAI's wire format and error object)
    metrics.py  Prometheus text exposition
    server.py   `serve` (blocking, for the CLI) and `ServerThread` (tests, benchmarks)
"""
from __future__ import annotations

from .app import create_app
from .engine import Engine, EngineConfig
from .server import ServerThread, serve

__all__ = ["create_app", "serve", "Engine", "EngineConfig", "ServerThread"]

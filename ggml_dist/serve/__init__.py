"""An OpenAI-compatible HTTP server over a LlamaContext, in one process, in replica processes side by
side, or on a Ray pipeline.

    engine.py   continuous batching: slots, admission queue, micro-batches, sampling, stop strings
    engine_config.py  the server's configuration: the run's (RunConfig, whole) and the server's own
    replicas.py --replicas: engine processes sharing the slots and cores, behind one front (Engine's face)
    app.py      the FastAPI app: its guard (guard.py), the routes over one state (state.py): OpenAI's
                (routes_openai.py: /v1/completions, /v1/chat/completions, /v1/responses, /v1/embeddings,
                /v1/models), llama-server's (routes_llama.py), /health, /metrics; one chat-prompt
                renderer (chat.py); a generation's answer, body or stream (answer.py)
    protocol.py request validation and response shapes (OpenAI's wire format and error object)
    scoring.py  prompt log-likelihoods (echo + logprobs) as lm-eval reads them; the tokenizer it asks for
    responses.py  OpenAI's Responses API (/v1/responses) over the chat route
    llama_server.py  llama-server's own API: /completion, /props, /slots, /apply-template, /embedding
    stop.py     stop strings over streamed text (held back until they can no longer match)
    grammar.py  constrained decoding: response_format, grammar and json_schema as llguidance token masks
                (its limits: grammar_limits.py; GBNF to Lark: gbnf.py)
    tools.py    tool calls: tools rendered by the chat template, calls parsed from the text, forced calls
    metrics.py  Prometheus text exposition
    routes_page.py  the page at / (page/: chat and the pipeline live) and its data, /live and /live/events:
                live.py's samples of what live_probe.py reads from the engine, its metrics and the stages
    server.py   `serve` (blocking, for the CLI) and `ServerThread` (tests, benchmarks)
"""
from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig", "ReplicaSet", "ServerThread", "create_app", "serve"]

_HOME = {"create_app": "app", "serve": "server", "ServerThread": "server", "Engine": "engine",
         "EngineConfig": "engine_config", "ReplicaSet": "replicas"}


def __getattr__(name: str) -> Any:
    """Lazy exports: FastAPI and uvicorn load only when the server is used (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module 'ggml_dist.serve' has no attribute '{name}'")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)

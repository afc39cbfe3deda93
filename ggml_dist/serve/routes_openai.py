"""OpenAI's routes, each a plain function over the app's state (serve/state.py): completions, chat
completions, the Responses API over them, embeddings, models. Bodies are parsed (protocol.parse_body:
depth, surrogates, NaN) and validated with the protocol models, so every bad request gets OpenAI's error
object with a 4xx status instead of FastAPI's 422 format.
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .answer import Shape, _sse, generate
from .chat import render_chat
from .engine import Engine, NotReady
from .llama_server import prompt_parts, tokenize_parts
from .protocol import (
    APIError,
    ChatRequest,
    CompletionRequest,
    context_exceeded,
    refuse_unsupported,
    validation_error,
)
from .responses import responses_request
from .scoring import check_scoring, echo_text, prompt_list
from .state import AppState, check_length_before_encoding, invalid, read_json, state_of
from .tools import call_grammar, is_strict


async def models(http: HTTPRequest) -> JSONResponse:
    st = state_of(http)
    return JSONResponse({"object": "list", "data": [
        {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "ggml_dist"}]})


async def model_by_id(http: HTTPRequest, model_id: str) -> JSONResponse:
    st = state_of(http)
    if model_id != st.model_name:
        raise APIError(404, f"the model '{model_id[:200]}' does not exist: this server serves '{st.model_name}'",
                       param="model", code="model_not_found")
    return JSONResponse({"id": st.model_name, "object": "model", "created": st.created, "owned_by": "ggml_dist"})


async def completions(http: HTTPRequest) -> Response:
    st = state_of(http)
    engine = st.engine
    body = st.with_defaults(await read_json(http))
    refuse_unsupported(body, chat=False)
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    tok = st.tokenizer()
    texts = prompt_list(req.prompt)
    max_tokens = req.max_tokens_or_default()
    score = check_scoring(req.echo, req.logprobs, max_tokens, req.n, req.stream)
    if len(texts) * req.n > engine.cfg.n_parallel:
        raise invalid(f"{len(texts)} prompts x n={req.n} choices need more sequences than this server's "
                      f"{engine.cfg.n_parallel} slots (--parallel)", "n" if req.n > 1 else "prompt")
    prompts, echos = [], []
    for p in texts:
        if isinstance(p, str):        # off the event loop: a long prompt takes milliseconds
            check_length_before_encoding(tok, p, engine.n_ctx_slot, "prompt")
            prompts.append(await asyncio.to_thread(tok.encode, p, add_special=True, parse_special=True))
        else:
            bad = [t for t in p if not 0 <= t < tok.n_vocab]
            if bad:
                raise invalid(f"token id {bad[0]} is outside the vocabulary (0..{tok.n_vocab - 1})", "prompt")
            prompts.append(list(p))
        if req.echo:
            echos.append(p if isinstance(p, str) else echo_text(p, tok.token_to_piece))
        else:
            echos.append("")
    return await generate(http, st, "completions", req, prompts, max_tokens, chat=False, echos=echos,
                          prompt_logprobs=score)


async def chat_completions(http: HTTPRequest) -> Response:
    return await run_chat(http, state_of(http), await read_json(http))


async def run_chat(http: HTTPRequest, st: AppState, body: dict[str, Any], shape: Shape | None = None) -> Response:
    """A chat completion of body (OpenAI's request), its answer written by shape (OpenAI's by default:
    /v1/responses gives its own)."""
    engine = st.engine
    body = st.with_defaults(body)
    refuse_unsupported(body)
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    tok = st.tokenizer()
    prompt = await render_chat(st, body, req, hint=", or use /v1/completions")
    check_length_before_encoding(tok, prompt.text, engine.n_ctx_slot, "messages")
    ids = await asyncio.to_thread(tok.encode, prompt.text, add_special=True, parse_special=True)
    room = max(1, engine.n_ctx_slot - len(ids))
    grammar = None
    tools, forced, style = prompt.tools, prompt.forced, prompt.style
    # a call that is required, strict, or in the generic format: a grammar makes it one, with valid arguments
    if tools is not None and (forced is not None or style == "generic" or is_strict(tools)):
        if req.response_format is not None or req.grammar is not None or req.json_schema is not None:
            raise invalid("tool calls held by a grammar (forced, strict, or the generic format of a template "
                          "that renders no tools) cannot take a response_format or grammar too", "tool_choice")
        assert style is not None
        grammar = await asyncio.to_thread(call_grammar, tools, forced, style, tok, bool(req.parallel_tool_calls))
    if req.n > engine.cfg.n_parallel:
        raise invalid(f"n={req.n} choices need more sequences than this server's "
                      f"{engine.cfg.n_parallel} slots (--parallel)", "n")
    if body.get("verbose") is True and not req.stream and shape is None:    # llama-server's debug field
        text = prompt.text
        shape = Shape(lambda a: {**a.body(), "__verbose": {"prompt": text}}, lambda a, chunks: _sse(chunks))
    return await generate(http, st, "chat", req, [ids], req.max_tokens_or_default(room), chat=True,
                          grammar=grammar, tool_style=style, shape=shape)


async def responses(http: HTTPRequest) -> Response:
    """OpenAI's Responses API over the chat completions (serve/responses.py)."""
    body = await read_json(http)
    chat, answer = responses_request(body)
    return await run_chat(http, state_of(http), chat, Shape(answer.body, answer.stream))


async def embed_inputs(st: AppState, x: Any, param: str) -> tuple[list[list[int]], list[Any]]:
    """The prompts of an embeddings request (OpenAI's input forms, and llama-server's: llama_server.
    prompt_parts) and their vectors, computed by the engine between steps."""
    engine = st.engine
    if engine.cfg.pooling is None:
        raise invalid("this server computes no embeddings: the model's pooling type is none; start it "
                      "with --pooling mean|last|cls|none", param)
    if engine.cfg.n_replicas > 1:
        raise invalid("embeddings need --replicas 1", param)
    assert isinstance(engine, Engine), f"one replica, so one Engine, not {type(engine).__name__}"
    tok = st.tokenizer()
    parts = prompt_parts(x, param)
    if len(parts) > 256:
        raise invalid(f"at most 256 inputs per request, got {len(parts)}", param)
    prompts = [await asyncio.to_thread(tokenize_parts, p, tok, param) for p in parts]
    for ids in prompts:
        if not ids:
            raise invalid("an input is empty", param)
        if len(ids) > engine.n_ctx_slot:
            raise context_exceeded(f"an input of {len(ids)} tokens is too large for the context per "
                                   f"request ({engine.n_ctx_slot} tokens)", param, len(ids), engine.n_ctx_slot)
    try:
        return prompts, [await asyncio.wrap_future(engine.embed(ids)) for ids in prompts]
    except NotReady as e:
        raise APIError(503, str(e), "server_error", code="model_not_ready") from None


async def embeddings(http: HTTPRequest) -> JSONResponse:
    """OpenAI's embeddings: the server's --pooling of the final norm's rows, L2-normalized."""
    st = state_of(http)
    body = await read_json(http)
    for name in ("dimensions",):
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by this server", param=name,
                           code="unsupported_parameter")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise invalid("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if st.engine.cfg.pooling == "none":
        raise invalid("with --pooling none an embedding is one vector per token, which OpenAI's API has "
                      "no shape for: use /embedding", "input")
    prompts, vecs = await embed_inputs(st, body.get("input"), "input")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if fmt == "base64"
             else [float(x) for x in v]} for i, v in enumerate(vecs)]
    n = sum(len(p) for p in prompts)
    return JSONResponse({"object": "list", "data": data, "model": st.model_name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})

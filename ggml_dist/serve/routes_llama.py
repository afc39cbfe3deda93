"""llama-server's own routes (and vLLM's tokenizer routes that lm-eval's remote tokenizer asks for), each a
plain function over the app's state (serve/state.py); their fields and answers are serve/llama_server.py's.
"""
from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .answer import Shape, generate
from .chat import render_chat
from .llama_server import Native, native_request, props, slots
from .protocol import APIError, ChatRequest, validation_error
from .routes_openai import embed_inputs
from .scoring import tokenizer_info
from .state import invalid, read_json, state_of


async def tokenize(http: HTTPRequest) -> JSONResponse:
    """llama-server's /tokenize: {"content", "add_special"?, "with_pieces"?} -> {"tokens"}; vLLM's
    {"prompt", "add_special_tokens"?} (lm-eval's remote tokenizer) -> {"tokens", "count", ...}."""
    st = state_of(http)
    body = await read_json(http)
    vllm = "content" not in body and "prompt" in body
    content = body.get("prompt") if vllm else body.get("content")
    add_special = body.get("add_special_tokens", True) if vllm else body.get("add_special", False)
    with_pieces = body.get("with_pieces", False)
    if not isinstance(content, str):
        raise invalid("'content' must be a string", "content")
    if not isinstance(add_special, bool) or not isinstance(with_pieces, bool):
        raise invalid("'add_special' and 'with_pieces' must be booleans", "add_special")
    tok = st.tokenizer()
    ids = await asyncio.to_thread(tok.encode, content, add_special=add_special, parse_special=True)
    if vllm and not with_pieces:
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": st.engine.n_ctx_slot})
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


async def detokenize(http: HTTPRequest) -> JSONResponse:
    """llama-server's /detokenize: {"tokens": [ids]} -> {"content"}."""
    st = state_of(http)
    body = await read_json(http)
    tok = st.tokenizer()
    ids = body.get("tokens")
    if not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise invalid("'tokens' must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < tok.n_vocab]
    if bad:
        raise invalid(f"token id {bad[0]} is outside the vocabulary (0..{tok.n_vocab - 1})", "tokens")
    text = b"".join(tok.token_to_piece(t) for t in ids).decode("utf-8", errors="replace")
    return JSONResponse({"content": text, "prompt": text})      # llama-server's key, vLLM's


async def tokenizer_info_route(http: HTTPRequest) -> JSONResponse:
    """vLLM's /tokenizer_info, which lm-eval's remote tokenizer probes (serve/scoring.py)."""
    st = state_of(http)
    tok = st.tokenizer()
    return JSONResponse(tokenizer_info(tok, st.engine.cfg.chat_template or tok.chat_template, st.engine.n_ctx_slot))


async def input_tokens(http: HTTPRequest) -> JSONResponse:
    """llama-server's /chat/completions/input_tokens: the prompt tokens a chat request would take."""
    st = state_of(http)
    body = await read_json(http)
    try:
        req = ChatRequest.model_validate({**body, "messages": body.get("messages")})
    except ValidationError as e:
        raise validation_error(e) from None
    prompt = await render_chat(st, body, req)
    ids = await asyncio.to_thread(st.tokenizer().encode, prompt.text, add_special=True, parse_special=True)
    return JSONResponse({"input_tokens": len(ids)})


async def apply_template(http: HTTPRequest) -> JSONResponse:
    """llama-server's /apply-template: {"messages"} -> {"prompt"}, the chat template's rendering (with
    the generation prompt, no tools)."""
    st = state_of(http)
    body = await read_json(http)
    try:
        req = ChatRequest.model_validate({"messages": body.get("messages")})
    except ValidationError as e:
        raise validation_error(e) from None
    return JSONResponse({"prompt": (await render_chat(st, {}, req)).text})


async def native_completion(http: HTTPRequest) -> Response:
    """llama-server's /completion: its fields, its answer (serve/llama_server.py)."""
    st = state_of(http)
    engine = st.engine
    body = await read_json(http)
    tok = st.tokenizer()
    req, prompts, texts = await asyncio.to_thread(native_request, st.with_defaults(body, native=True), tok)
    if len(prompts) > engine.cfg.n_parallel:
        raise invalid(f"{len(prompts)} prompts need more sequences than this server's "
                      f"{engine.cfg.n_parallel} slots (--parallel)", "prompt")
    room = max(1, engine.n_ctx_slot - max(len(p) for p in prompts))
    n_predict = min(req.max_tokens_or_default(room), room)     # llama-server stops at the context's end
    native = Native(req, texts, n_predict, st.model_name, tok.token_to_piece)
    return await generate(http, st, "completion", req, prompts, n_predict, chat=False,
                          shape=Shape(native.body, native.stream), raw=True, cache_prompt=req.cache_prompt)


async def native_embedding(http: HTTPRequest) -> JSONResponse:
    """llama-server's /embedding: per input [one vector] pooled, or every token's row (--pooling none)."""
    body = await read_json(http)
    x = body.get("content", body.get("input"))
    _, vecs = await embed_inputs(state_of(http), x, "content" if "content" in body else "input")
    return JSONResponse([{"index": i, "embedding": v.tolist() if v.ndim == 2 else [v.tolist()]}
                         for i, v in enumerate(vecs)])


async def props_route(http: HTTPRequest) -> JSONResponse:
    st = state_of(http)
    engine, tok = st.engine, st.tokenizer()
    return JSONResponse(props(st.model_name, engine.cfg.model_path, engine.cfg.n_parallel, engine.n_ctx_slot,
                              engine.cfg.chat_template or tok.chat_template, tok, st.fingerprint()))


async def props_change() -> JSONResponse:
    raise APIError(403, "this server's properties cannot be changed at run time (llama-server's --props)",
                   "permission_error", code="not_supported")


async def slots_route(http: HTTPRequest) -> JSONResponse:
    engine = state_of(http).engine
    return JSONResponse(slots(engine.cfg.n_parallel, engine.n_running(), engine.n_ctx_slot))


async def slot_action(http: HTTPRequest, slot_id: str) -> JSONResponse:
    if state_of(http).policy.api_key is None:
        raise APIError(403, "slot actions change a slot other clients may use: they need the server "
                       "started with --api-key", "permission_error", code="slot_actions_need_api_key")
    raise APIError(501, "slot save, restore and erase are not implemented by this server", "not_supported_error",
                   code="not_supported")

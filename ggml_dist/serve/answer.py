"""A generation request's answer: the engine requests of its prompts, their events gathered into
choices, and the body or the stream of server-sent events that carries them (OpenAI's shape, or another
API's through a Shape). Generated text travels from the engine thread to the request's handler through an
asyncio queue; a step's events reach the loop in one wake-up (_Deliver). A grammar is checked and compiled
in worker threads and a child process (serve/grammar.py), never on the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..model.sampling import SamplingParams
from .engine import Event, NotReady, QueueFull, Request, ServingEngine
from .grammar import grammar_of, prepare, tokenizer_of
from .guard import Admission
from .llama_server import NativeCompletion, timings
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
    usage,
    usage_chunk,
)
from .scoring import join_logprobs, prompt_logprobs_body
from .state import AppState, invalid
from .tools import held_back, parse_calls

_DISCONNECT_POLL_S = 0.25         # how often a non-streaming handler asks whether its client left
_GRAMMAR_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ggml-dist-grammar")


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


async def _grammar(st: AppState, req: CompletionRequest | ChatRequest | NativeCompletion,
                   forced: str | None) -> str | None:
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
    tok = st.tokenizer()
    lltok = await loop.run_in_executor(_GRAMMAR_POOL, tokenizer_of, tok)     # built once
    try:
        verdict = await asyncio.wrap_future(st.checker.submit(text))
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


async def generate(http: HTTPRequest, st: AppState, endpoint: str,
                   req: CompletionRequest | ChatRequest | NativeCompletion, prompts: list[list[int]],
                   max_tokens: int, chat: bool, echos: list[str] | None = None, grammar: str | None = None,
                   tool_style: str | None = None, prompt_logprobs: int | None = None,
                   shape: Shape | None = None, raw: bool = False, cache_prompt: bool = True) -> Response:
    """One engine request per prompt, each of req.n choices (choice c = prompt k * n + j); tool_style:
    the chat template's tool-call syntax (serve/tools.py) when the request has tools: calls in the
    answer become tool_calls. grammar: one the output must follow (a forced tool call).
    prompt_logprobs: score the prompts (serve/scoring.py), this many top logprobs per token. shape: the
    answer written as another API's (llama-server's /completion, /v1/responses), from OpenAI's; raw: the
    chunks carry their tokens' engine TokenLogprobs too, as `_entries` (for a shape to read)."""
    engine, admission = st.engine, st.admission
    metrics = engine.metrics
    n_slot = engine.n_ctx_slot
    for ids in prompts:
        if not ids:
            raise invalid("the prompt is empty", "prompt")
        if len(ids) >= n_slot:
            raise context_exceeded(f"the prompt has {len(ids)} tokens; this server's context per request is "
                                   f"{n_slot} tokens (--ctx {engine.cfg.params.n_ctx} / --parallel "
                                   f"{engine.cfg.n_parallel}), "
                                   f"which must hold the prompt and at least one generated token",
                                   "messages" if chat else "prompt", len(ids), n_slot)
    if max_tokens > n_slot:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the context per request ({n_slot} tokens)",
                       param="max_tokens", code="invalid_value")
    if req.n > 1 and engine.cfg.n_replicas > 1:
        raise invalid("n > 1 shares a prompt's KV cells between sequences of one engine: use --replicas 1",
                      "n")
    tok = st.tokenizer()
    constraint = await _grammar(st, req, grammar)
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
    answer = _Answer(rid=new_id("chatcmpl" if chat else "cmpl"), model=st.model_name, chat=chat, choices=choices,
                     piece=tok.token_to_piece if sampling.logprobs is not None else None,
                     tool_style=tool_style, n_prompt=sum(len(p) for p in prompts), prompts=prompts, n=n,
                     scored=prompt_logprobs is not None, fingerprint=st.fingerprint(), raw=raw)
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

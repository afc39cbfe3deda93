"""The server end to end with the official openai client: same tokens as single greedy runs, streaming,
stop strings, cancellation, OpenAI-style errors, /health and /metrics."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import asyncio  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402

from .conftest import CHATML  # noqa: E402

PROMPTS = ["hello world", "the quick brown fox", "a b c", "zz top", "one two three four five six",
           "lorem ipsum"]


@pytest.fixture(scope="module")
def model(serve_model):
    return LlamaModel.load(serve_model)


def reference(model, prompt: str, n: int) -> str:
    """A separate single-sequence greedy run of the same prompt."""
    ids = model.tokenizer.encode(prompt, add_special=True, parse_special=True)
    return generate(LlamaContext(model, ContextParams(n_ctx=1024)), model.tokenizer, ids, n).text


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^ggml_dist_{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def wait_idle(server, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while httpx.get(server.url + "/health").json()["slots_processing"]:
        assert time.monotonic() - t0 < timeout, "a slot stayed busy"
        time.sleep(0.02)


# non-streaming completion: the text of a single greedy run, usage counted
def test_completion(server, model):
    r = client(server).completions.create(model="synthetic", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert r.choices[0].text == reference(model, PROMPTS[0], 12)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(model.tokenizer.encode(PROMPTS[0]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)


# streaming completion: chunks join to the same text; the last carries finish_reason, then usage
def test_completion_stream(server, model):
    chunks = list(client(server).completions.create(
        model="synthetic", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reference(model, PROMPTS[1], 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


# chat, plain and streamed: the template-rendered prompt's greedy text; the first chunk has the role
def test_chat(server, model):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = model.tokenizer.apply_chat_template(msgs, template=CHATML)
    want = reference(model, prompt, 8)
    c = client(server)
    r = c.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="synthetic", messages=msgs, max_tokens=8, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def concurrent_texts(server, lengths: list[int]) -> list[str]:
    """Greedy streams of PROMPTS[i] for lengths[i] tokens, all at once (staggered by 10 ms)."""
    async def one(c: openai.AsyncOpenAI, i: int) -> str:
        await asyncio.sleep(0.01 * i)
        stream = await c.completions.create(model="synthetic", prompt=PROMPTS[i], max_tokens=lengths[i],
                                            temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream])

    async def main() -> list[str]:
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*(one(c, i) for i in range(len(lengths))))
    return asyncio.run(main())


# concurrent greedy streams (more than the 4 slots, arriving staggered) give the separate runs' text
def test_concurrent_greedy_same_as_separate(server, model):
    lengths = [8, 20, 12, 16, 24, 10]
    assert concurrent_texts(server, lengths) == [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    wait_idle(server)
    assert metric(server, "kv_cells_used") == metric(server, "kv_cells_cached")     # nothing else held


# stop strings end the text before the first match, streamed or not
@pytest.mark.parametrize("stream", [False, True])
def test_stop(server, model, stream):
    full = reference(model, PROMPTS[2], 16)
    stop = full[6:9]
    want = full[:full.index(stop)]
    c = client(server)
    r = c.completions.create(model="synthetic", prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop],
                             stream=stream)
    if stream:
        chunks = list(r)
        text, finish = "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert (text, finish) == (want, "stop")


# a finished request's tokens stay in its slot: the same prompt again, or one that continues the first
# request's text, evaluates only what the cache lacks (at least its last token) and gives the text of a
# separate run; with cache_prompt off nothing is kept
def test_prompt_cache(serve_model, model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    from ggml_dist.serve.slots import common_prefix
    enc = lambda p: model.tokenizer.encode(p, add_special=True, parse_special=True)
    prompt = "the cache keeps this prompt"
    run = generate(LlamaContext(model, ContextParams(n_ctx=1024)), model.tokenizer, enc(prompt), 6)
    longer = prompt + run.text + " and more"
    kept = enc(prompt) + run.tokens[:5]             # a finished request's KV: its prompt, 5 of 6 tokens
    cases = [(prompt, 0), (prompt, len(enc(prompt)) - 1),
             (longer, min(common_prefix(kept, enc(longer)), len(enc(longer)) - 1))]
    assert cases[2][1] > len(enc(prompt))
    for cache in (True, False):
        with ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=1024, cache_prompt=cache)) as srv:
            c = client(srv)
            for p, hit in cases:
                before = metric(srv, "prompt_tokens_cached_total")
                r = c.completions.create(model="m", prompt=p, max_tokens=6, temperature=0)
                assert r.choices[0].text == reference(model, p, 6)
                assert metric(srv, "prompt_tokens_cached_total") - before == (hit if cache else 0), p
            wait_idle(srv)
            assert metric(srv, "kv_cells_cached") == metric(srv, "kv_cells_used")
            assert (metric(srv, "kv_cells_used") > 0) == cache


# a seed makes temperature sampling reproducible, and it is sampling: not the greedy text, another
# seed gives another text
def test_seeded_sampling(server, model):
    c = client(server)
    kw = dict(model="synthetic", prompt=PROMPTS[3], max_tokens=12, temperature=0.9, seed=7, extra_body={"top_k": 0})
    a = c.completions.create(**kw).choices[0].text
    assert a == c.completions.create(**kw).choices[0].text
    assert a != reference(model, PROMPTS[3], 12)
    assert a != c.completions.create(**{**kw, "seed": 8}).choices[0].text


# a client that drops a stream mid-way cancels its sequence: the slot and its KV cells free at once
def test_cancel_stream(server):
    check_cancel_stream(server)


def cancelled(server) -> float:
    """requests_total{outcome="cancelled"} summed over endpoints (0 before the first)."""
    text = httpx.get(server.url + "/metrics").text
    return sum(float(m) for m in re.findall(r'^ggml_dist_requests_total\{[^}]*outcome="cancelled"\} (\S+)$', text, re.M))


def check_cancel_stream(server) -> None:
    cancelled_before = cancelled(server)
    before = metric(server, "generated_tokens_total")
    body = {"prompt": PROMPTS[4], "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(g.startswith("data: ") for g in got)
    wait_idle(server)
    assert metric(server, "kv_cells_used") == metric(server, "kv_cells_cached")
    assert metric(server, "generated_tokens_total") - before < 900
    assert cancelled(server) == cancelled_before + 1      # this request, counted once


# a non-streaming client that gives up is noticed too
def test_cancel_nonstream(server, monkeypatch):
    ctx = server.engine.ctx
    submit = ctx.submit

    def slow_submit(batch, **kw):            # 100 ms a step: the client gives up after ~3 steps
        time.sleep(0.1)
        return submit(batch, **kw)
    monkeypatch.setattr(ctx, "submit", slow_submit)
    before = metric(server, "generated_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[5], "max_tokens": 200}, timeout=0.3)
    time.sleep(0.4)
    wait_idle(server)
    assert metric(server, "generated_tokens_total") - before < 100


# malformed or out-of-range requests get OpenAI's error object and a 4xx, and the server carries on
@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 5}, 400, "n"),          # more choices than slots
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
])
def test_bad_requests(server, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + path, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


# a prompt longer than the per-request context is a 400 (context_length_exceeded), not a crash
def test_prompt_too_long(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as ei:
        c.completions.create(model="synthetic", prompt=[300] * 1100, max_tokens=4)
    assert ei.value.code == "context_length_exceeded"
    assert c.completions.create(model="synthetic", prompt="ok", max_tokens=2).usage.completion_tokens == 2


# bodies past the size limit are refused before parsing; unknown routes answer in the same format
def test_body_limit_and_404(server):
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "' + b"a" * (2 << 20) + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# /health, /v1/models and /metrics report what they should (after a request of its own: alone, the test
# must not lean on its neighbours' requests)
def test_health_models_metrics(server):
    assert client(server).completions.create(model="synthetic", prompt="ok", max_tokens=2).usage.completion_tokens
    h = httpx.get(server.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    assert [m.id for m in client(server).models.list().data] == ["synthetic"]
    text = httpx.get(server.url + "/metrics").text
    for name in ["requests_total", "prompt_tokens_total", "generated_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count", "queue_length",
                 "kv_cells_used", "kv_cells_cached", "prompt_tokens_cached_total",
                 "stage_busy_seconds_total"]:
        assert f"ggml_dist_{name}" in text, name
    assert metric(server, "generated_tokens_total") > 0
    assert metric(server, "kv_cells_total") == 4096          # every slot's stream, not one of them
    assert re.search(r'^ggml_dist_stage_busy_seconds_total\{stage="0"\} [0-9.]+$', text, re.M)
    assert float(re.search(r'stage_busy_seconds_total\{stage="0"\} (\S+)', text).group(1)) > 0


# a full queue answers 429 instead of growing, and takes requests again once a slot is free
def test_queue_full(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(serve_model, n_parallel=1, n_ctx=2048, max_queue=0)) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30,
                          json={"prompt": "x", "max_tokens": 1500, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()          # keep a reference: a dropped iterator closes the stream
            next(lines)
            r2 = httpx.post(srv.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2})
            assert r2.status_code == 429 and r2.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                client(srv).completions.create(model="m", prompt="y", max_tokens=2)
        wait_idle(srv)
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}).status_code == 200


# /health is 503 "loading" until the engine has loaded, and "error" if loading failed; requests get 503
def test_health_before_ready(tmp_path):
    from fastapi.testclient import TestClient

    from ggml_dist.serve import Engine, create_app
    from tests.serve.common import engine_config
    engine = Engine(engine_config(str(tmp_path / "missing.gguf")))
    with TestClient(create_app(engine, "m")) as tc:
        assert tc.get("/health").status_code == 503 and tc.get("/health").json()["status"] == "loading"
        r = tc.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready"
        engine.start()
        engine.ready.wait(10)
        h = tc.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "error" and "missing.gguf" in h.json()["error"]


# in one process each slot gets a KV stream; over a pipeline the slots share one cache unless asked
def test_kv_layout_per_engine(serve_model):
    from ggml_dist.serve import Engine
    from tests.serve.common import engine_config
    assert engine_config("m.gguf").kv_unified is False
    assert engine_config("m.gguf", n_stages=2).kv_unified is True
    assert engine_config("m.gguf", n_stages=2, kv_unified=False).kv_unified is False
    engine = Engine(engine_config(serve_model, n_parallel=4, n_ctx=1024)).start()
    try:
        engine.wait_ready(120)
        assert engine.ctx.kv.n_stream == 4 and engine.ctx.kv.kv_size == 256
    finally:
        engine.shutdown()


def _collector(n: int):
    """(texts, done, on_event): on_event(k) is request k's engine callback, appending its text to
    texts[k] and setting done[k] at its last event."""
    texts = [""] * n
    done = [threading.Event() for _ in range(n)]

    def on_event(k):
        def f(ev):
            texts[k] += ev.text
            if ev.finish_reason:
                done[k].set()
        return f
    return texts, done, on_event


# with a KV stream per slot, a short prompt joining decoding sequences goes in one token per step (each
# step stays one ubatch), a prompt longer than TRICKLE still takes one chunk, and a sequence moves down
# into a slot freed below it; the text is unchanged
def test_short_prompts_trickle_in(serve_model, model):
    from ggml_dist.model.sampling import SamplingParams
    from ggml_dist.serve import Engine
    from tests.serve.common import engine_config
    from ggml_dist.serve.engine import Request
    from ggml_dist.model.steps import TRICKLE
    engine = Engine(engine_config(serve_model, n_parallel=3, n_ctx=768)).start()
    engine.wait_ready(120)
    batches: list[list[tuple[int, int]]] = []             # per batch: (slot, tokens) in slot order
    submit = engine.ctx.submit

    def spy(batch, **kw):
        slots = [min(s) for s in batch.seq_ids]
        batches.append([(s, slots.count(s)) for s in sorted(set(slots))])
        return submit(batch, **kw)
    engine.ctx.submit = spy
    moves: list[tuple[int, int]] = []                     # a copy, or a swap with a cached free slot
    seq_cp, seq_swap = engine.ctx.seq_cp, engine.ctx.seq_swap
    engine.ctx.seq_cp = lambda src, dst: (moves.append((src, dst)), seq_cp(src, dst))
    engine.ctx.seq_swap = lambda src, dst: (moves.append((src, dst)), seq_swap(src, dst))
    tok = model.tokenizer
    long_prompt = " ".join(["word"] * (TRICKLE + 8))
    prompts = [PROMPTS[4], PROMPTS[1], long_prompt]
    ids = [tok.encode(p, add_special=True, parse_special=True) for p in prompts]
    assert len(ids[1]) <= TRICKLE < len(ids[2])
    N0 = 32
    n_new = (N0, N0 + 16, 8)
    texts, done, on_event = _collector(len(prompts))
    try:
        engine.submit(Request(ids[0], N0, SamplingParams(), (), on_event(0)))
        t0 = time.monotonic()
        while len(batches) < 3:                            # the first sequence is decoding
            assert time.monotonic() - t0 < 60
            time.sleep(0.005)
        for k in (1, 2):
            engine.submit(Request(ids[k], n_new[k], SamplingParams(), (), on_event(k)))
        while not all(d.is_set() for d in done):
            assert time.monotonic() - t0 < 60
            time.sleep(0.01)
    finally:
        engine.shutdown()
    assert texts == [reference(model, p, n) for p, n in zip(prompts, n_new)]
    # the busy slots stay packed at the bottom: every step is one run of consecutive streams, and a
    # sequence moved down when the one below it finished (the first one's ends before the second's,
    # which wants more tokens than the first has left however far it got before the others joined)
    assert all([s for s, _ in b] == list(range(len(b))) for b in batches)
    assert moves and all(dst < src for src, dst in moves)
    joined = [b for b in batches if (1, 1) in b or any(s == 1 and n > 1 for s, n in b)]
    assert joined and all(dict(b)[1] == 1 for b in joined if 0 in dict(b))   # beside a decode: 1 token
    assert any(n == len(ids[2]) for b in batches for s, n in b if s == 2)   # the long prompt: one chunk


# with a KV stream per slot the engine decodes once with every shape of a one-token-per-sequence step
# before it is ready: requests never wait while such a step's graph is built and planned
def test_step_shapes_planned_before_ready(serve_model, model):
    from ggml_dist.model.sampling import SamplingParams
    from ggml_dist.serve import Engine
    from tests.serve.common import engine_config
    from ggml_dist.serve.engine import Request
    engine = Engine(engine_config(serve_model, n_parallel=3, n_ctx=768)).start()
    engine.wait_ready(120)
    planned = {(key.n_stream, key.n_outputs) for key, _ in engine.ctx._graphs if key.n_tokens == key.n_stream}
    assert planned >= {(k, j) for k in (1, 2, 3) for j in range(k + 1)}
    built = []
    build = engine.ctx.builder.build
    engine.ctx.builder.build = lambda key: (built.append(key), build(key))[1]
    texts, done, on_event = _collector(3)
    ids = [model.tokenizer.encode(p, add_special=True, parse_special=True) for p in PROMPTS[:3]]
    try:
        for k in range(3):
            engine.submit(Request(ids[k], 6 + 3 * k, SamplingParams(), (), on_event(k)))
            time.sleep(0.05)                              # requests joining a decoding batch
        for d in done:
            assert d.wait(60)
    finally:
        engine.shutdown()
    assert texts == [reference(model, p, 6 + 3 * k) for k, p in enumerate(PROMPTS[:3])]
    assert not [key for key in built if key.n_tokens == key.n_stream], built


def test_deliver_one_wakeup_per_burst():
    """Events posted from another thread reach their queues in order, all of them; a burst posted while
    the loop is busy costs one wake-up of the loop, not one per event."""
    from ggml_dist.serve.answer import _Deliver
    from ggml_dist.serve.engine import Event

    async def main():
        loop = asyncio.get_running_loop()
        wakeups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(1), real(*a))[1]
        deliver = _Deliver(loop)
        queues = [asyncio.Queue() for _ in range(3)]

        def burst(k0: int) -> None:
            for k in range(k0, k0 + 30):
                deliver.post(queues[k % 3], Event(str(k)))
        t = threading.Thread(target=burst, args=(0,))
        t.start()
        t.join()                        # the loop is blocked here: the whole burst is one wake-up
        assert len(wakeups) == 1
        for k0 in range(30, 3000, 30):  # bursts while the loop runs: every event, in order
            await asyncio.to_thread(burst, k0)
        got = [[] for _ in queues]
        for i, q in enumerate(queues):
            while len(got[i]) < 1000:
                got[i].append(int((await asyncio.wait_for(q.get(), 5)).text))
        assert got == [list(range(i, 3000, 3)) for i in range(3)]

    asyncio.run(main())

"""No request can hurt another (issue 45): against `ggml-dist serve` in its own process, each class of hostile
request gets a 4xx (or a clamped 2xx), the process lives, and greedy streams running meanwhile end with the
text they would have had alone."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai", "llguidance"):     # the serve extras
    pytest.importorskip(_mod)

import json  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import httpx  # noqa: E402

from ggml_dist.bench.faults import hostile_requests  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402

from .cli_server import CLIServer  # noqa: E402
from .test_api_fields import TOOL_TEMPLATE  # noqa: E402
from .test_app import PROMPTS, reference  # noqa: E402

CASES = {h.name: h for h in hostile_requests()}
N_STREAM = 200


@pytest.fixture(scope="module")
def model(serve_model):
    return LlamaModel.load(serve_model)


@pytest.fixture(scope="module")
def srv(serve_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    (d / "tools.jinja").write_text(TOOL_TEMPLATE)
    with CLIServer(serve_model, ["--parallel", "4", "--ctx", "4096", "--max-queue", "16",
                                 "--chat-template", str(d / "tools.jinja")], d / "serve.log") as s:
        assert s.alive(), s.log()
        yield s


_REFS: dict[tuple[str, int], str] = {}


def solo(model, prompt: str, n: int = N_STREAM) -> str:
    if (prompt, n) not in _REFS:
        _REFS[prompt, n] = reference(model, prompt, n)
    return _REFS[prompt, n]


def stream_text(url: str, body: dict) -> tuple[str, list[dict], bool]:
    """(the streamed text, error events, whether [DONE] came)."""
    text, errors, done = "", [], False
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            else:
                text += chunk["choices"][0]["text"]
    return text, errors, done


@contextmanager
def bystanders(srv, model):
    """Greedy streams, one after another, for as long as the block runs; each must end with its solo
    text (and at least one must have run across the block)."""
    got: list[tuple[str, str, list, bool]] = []
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        i = 0
        try:
            while not stop.is_set() or not got:
                p = PROMPTS[i % len(PROMPTS)]
                got.append((p, *stream_text(srv.url, {"prompt": p, "max_tokens": N_STREAM, "temperature": 0})))
                i += 1
        except BaseException as e:  # noqa: BLE001 - reported by the test
            failure.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.05)
    try:
        yield got
    finally:
        stop.set()
        t.join(120)
    assert not failure, failure
    assert got, "no stream ran"
    for p, text, errors, done in got:
        assert done and not errors, (p, errors)
        assert text == solo(model, p), f"a stream of {p!r} differs from its solo text"


def send(srv, name: str) -> httpx.Response:
    h = CASES[name]
    return srv.post(h.path, content=h.body, headers={"Content-Type": h.content_type}, timeout=60)


def metric(srv, name: str) -> float:
    m = re.search(rf"^ggml_dist_{re.escape(name)} (\S+)$", httpx.get(srv.url + "/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


# grammars and schemas that crashed llguidance's checker, blocked the loop, or failed at run time: a 400 each,
# quickly, with a short message; the server lives and streams running meanwhile are untouched
def test_grammar_bombs(srv, model):
    names = ["defs_chain_1000_94kb", "defs_chain_1000_refs", "gbnf_6000_chained_rules", "gbnf_20000_alternatives",
             "lark_3000_chained_rules", "schema_self_ref", "forced_tool_self_ref"]
    log0 = srv.log_size()
    health: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            health.append(time.perf_counter() - t)
            time.sleep(0.02)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with bystanders(srv, model):
        for name in names:
            t0 = time.monotonic()
            r = send(srv, name)
            err = r.json()["error"]
            assert r.status_code == 400, (name, r.text[:500])
            assert time.monotonic() - t0 < 10 and len(err["message"]) < 800, (name, err["message"])
            assert "Parser" not in err["message"] and "items" not in err["message"]       # no parser state
        crashed = send(srv, "lark_3000_chained_rules").json()["error"]["message"]
        assert "crashed" in crashed
    stop.set()
    poller.join()
    assert srv.alive()
    assert max(health) < 1.0, f"/health took {max(health):.2f} s while grammars were checked"
    assert srv.log_size() - log0 < 20_000, srv.log()[-3000:]          # a line per refusal at most


# degenerate sampling values are clamped as llama.cpp reads them (float32): temperature 1e-300 and 5e-324
# are greedy, repeat_penalty 1e-300 samples; no step fails, so no one else's request and no prompt cache goes
def test_degenerate_sampling(srv, model):
    cached = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0}
    assert srv.post("/v1/completions", cached).status_code == 200
    with bystanders(srv, model):
        for name in ("temperature_1e-300", "temperature_5e-324"):
            r = send(srv, name)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == solo(model, "x", 4)
        r = send(srv, "repeat_penalty_1e-300")
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    before = metric(srv, "prompt_tokens_cached_total")
    assert srv.post("/v1/completions", cached).status_code == 200
    assert metric(srv, "prompt_tokens_cached_total") > before         # the prompt cache survived
    assert srv.alive()


# what answered 500 (UnicodeEncodeError, RecursionError, ValueError) is a 400 naming the field
@pytest.mark.parametrize("name,param", [
    ("lone_surrogate_prompt", "prompt"), ("lone_surrogate_chat", "messages.0.content"),
    ("lone_surrogate_stop", "stop.0"), ("json_nested_1000", None), ("logit_bias_superscript_two", "logit_bias"),
    ("tool_call_function_string", "messages"), ("nan", None), ("number_past_double", None),
    ("huge_seed", "seed"), ("not_json", None), ("text_plain_body", None), ("form_body", None),
])
def test_500s_are_400s(srv, name, param):
    r = send(srv, name)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param and len(err["message"]) < 500, err
    assert srv.alive()


# a forced tool whose parameters recurse through $ref, with a value between the recursions: the call is made
# (its $refs rebased where the parameters sit in the call's schema), valid against the schema
def test_forced_tool_with_recursive_parameters(srv):
    tree = {"type": "object", "required": ["name"], "additionalProperties": False,
            "properties": {"name": {"type": "string", "maxLength": 4},
                           "kids": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}}}
    tool = {"type": "function", "function": {"name": "plant", "parameters": tree}}
    r = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "a tree"}], "tools": [tool],
                                          "tool_choice": "required", "max_tokens": 120, "temperature": 0})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["finish_reason"] == "tool_calls":               # else cut at max_tokens inside the call
        import jsonschema
        jsonschema.validate(json.loads(c["message"]["tool_calls"][0]["function"]["arguments"]), tree)


# a grammar that passes the checker's two tokens and fails at the tenth (llguidance's 2,000 items a row) fails
# its own request only (a 400, or a stream's error event then [DONE]); others' streams and the cache stay
def test_a_failing_grammar_fails_only_its_request(srv, model):
    cached = {"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0}
    assert srv.post("/v1/completions", cached).status_code == 200
    log0 = srv.log_size()
    # the grammar's `v ::= "b" | "c" v`: "c" biased away, so greedy takes "b" and reaches the big rule
    tok = model.tokenizer
    body = {**json.loads(CASES["grammar_fails_at_token_10"].body), "temperature": 0,
            "logit_bias": {str(i): -100 for i in range(tok.n_vocab) if tok.token_to_piece(i) == b"c"}}
    with bystanders(srv, model):
        r = srv.post("/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
        assert len(r.json()["error"]["message"]) < 500
        _, errors, done = stream_text(srv.url, body)
        assert len(errors) == 1 and done and "grammar" in errors[0]["message"]
    before = metric(srv, "prompt_tokens_cached_total")
    assert srv.post("/v1/completions", cached).status_code == 200
    assert metric(srv, "prompt_tokens_cached_total") > before
    assert srv.log_size() - log0 < 5_000                                 # a line, not 300 KB


# over a 2-stage pipeline, where a row is sampled on the last stage: the degenerate temperatures are greedy
# there too (that stage's step raised "Probabilities contain NaN", and every sequence failed), and a stream
# running meanwhile gets its solo text
def test_degenerate_sampling_over_stages(serve_model, model):
    ray = pytest.importorskip("ray")
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    from ggml_dist.workers.local_ray import connect
    connect(num_cpus=4)
    try:
        with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=2048)) as srv:
            want = solo(model, PROMPTS[0], 60)
            got: list = []
            t = threading.Thread(target=lambda: got.append(stream_text(
                srv.url, {"prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0})))
            t.start()
            for temp in (1e-300, 5e-324, 1e-40):
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "temperature": temp,
                                                                   "top_k": 0, "top_p": 1.0, "min_p": 0.0}, timeout=60)
                assert r.status_code == 200, r.text
                if temp < 1e-300:
                    assert r.json()["choices"][0]["text"] == solo(model, "x", 4)
            t.join(60)
            assert got and got[0] == (want, [], True)
    finally:
        ray.shutdown()

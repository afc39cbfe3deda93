"""A fuzzer of our own for the HTTP API (issue 45): hypothesis over request bodies shaped like the protocol's
models (each field plausible, at its edges, or any JSON value), mangled encodings and content types, seeded
with every case of bench/faults.hostile_requests(). The property, for each case: a 2xx or a 4xx, the server
process alive, and greedy streams running across the whole fuzz end with the text they would have had alone.
Bounded: MAX_EXAMPLES cases plus the seeds (about a minute on 2 cores)."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "hypothesis", "llguidance"):
    pytest.importorskip(_mod)

import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402

import httpx  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ggml_dist.bench.faults import hostile_requests  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402

from .cli_server import CLIServer  # noqa: E402
from .test_api_fields import TOOL_TEMPLATE  # noqa: E402
from .test_hostile import bystanders  # noqa: E402

MAX_EXAMPLES = 300
TALLY: collections.Counter[str] = collections.Counter()      # statuses seen, by class and path

# -- strategies ----------------------------------------------------------------------------------------

json_scalar = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
               | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                           max_size=4), max_leaves=12)
# text with what broke the server before: lone surrogates, NULs, control and special-token spellings
text = st.text(alphabet=st.characters(codec=None, categories=None), max_size=24) | st.sampled_from(
    ["\ud800", "a\udfffb", "\x00", "</s>", "<s>", "\u202e", "²", "😀" * 3])
edge_float = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e-38, 1e38, 1e300, -1.0, 2.0, 2.0000001, 1.0, 0.5])
small_float = st.floats(-3, 3, allow_nan=False) | edge_float
short_int = st.integers(-2, 12)
big_int = st.sampled_from([0, 1, -1, 2**31, 2**63, -2**63 - 1, 2**64, 10**30])
tiny_gbnf = st.sampled_from(['root ::= "yes" | "no"', 'root ::= [a-c]+ "."', 'root ::= (', "root ::= x",
                             'root ::= "a" root | "b"', "start: /[0-9]{1,3}/", 'root ::= "\\q"', ""])
tiny_schema = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
                               {"$ref": "#"}, {"type": "bogus"}, {"type": "array", "items": {"type": "integer"},
                                                                  "maxItems": 2}, [], "x"])


# each field's plausible values (in range, at its edges, or just past them); a junk case replaces any of them
# by any JSON value, and adds fields the server refuses by name
SAMPLING = {
    "model": st.just("m"),
    "max_tokens": short_int | big_int,
    "temperature": small_float,
    "top_p": small_float,
    "top_k": short_int | big_int,
    "min_p": small_float,
    "repeat_penalty": small_float,
    "presence_penalty": small_float,
    "frequency_penalty": small_float,
    "logit_bias": st.dictionaries(st.sampled_from(["1", "5", "-1", "99999", "²", "abc", "0x1", "9" * 40]),
                                  small_float | st.sampled_from([100.0, -100.0, 101.0]), max_size=3),
    "seed": short_int | big_int,
    "stop": text | st.lists(text, max_size=6),
    "n": st.integers(-1, 6),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "xml"}]) |
    tiny_schema.map(lambda s: {"type": "json_schema", "json_schema": {"schema": s}}),
    "grammar": tiny_gbnf,
    "json_schema": tiny_schema,
}
REFUSED = {"best_of": json_value, "mirostat": json_value, "suffix": json_value, "functions": json_value}
COMPLETION = {**SAMPLING, "prompt": text | st.lists(st.integers(-5, 600), max_size=8) | st.lists(text, min_size=1,
                                                                                                  max_size=3),
              "echo": st.booleans(), "logprobs": st.integers(-1, 7)}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"])},
    optional={"content": text | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                                "text": text}), max_size=2),
              "tool_calls": st.lists(st.fixed_dictionaries(
                  {"id": text, "type": st.just("function"),
                   "function": json_value | st.fixed_dictionaries({"name": text, "arguments": text | json_value})}),
                  max_size=2),
              "tool_call_id": text, "name": text})
TOOL = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", ""])}, optional={"parameters": tiny_schema})})
CHAT = {**SAMPLING, "messages": st.lists(message, min_size=0, max_size=3),
        "max_completion_tokens": short_int, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 21),
        "tools": st.lists(TOOL, max_size=2),
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
        "parallel_tool_calls": st.booleans()}
OTHER = {"content": text, "tokens": st.lists(st.integers(-3, 600), max_size=6), "input": text,
         "with_pieces": st.booleans(), "add_special": st.booleans(), "encoding_format": st.sampled_from(
             ["float", "base64", "hex"])}


@st.composite
def body(draw: st.DrawFn, fields: dict, junk: bool) -> dict:
    """A few of the fields (a request sets a handful), plausible, or any JSON value for some if junk."""
    names = [k for k in sorted(fields) if draw(st.integers(0, len(fields) - 1)) < 3]     # ~3 of them
    out = {}
    for k in names:
        out[k] = draw(json_value) if junk and draw(st.booleans()) else draw(fields[k])
    if junk:
        out.update(draw(st.dictionaries(st.sampled_from(sorted(REFUSED)), json_value, max_size=1)))
    return out


def encode(obj: dict, how: str) -> bytes:
    raw = json.dumps(obj, allow_nan=True).encode("utf-8", errors="surrogatepass")
    if how == "truncated":
        return raw[:max(1, len(raw) // 2)]
    if how == "nested":
        return raw[:-1] + b', "deep": ' + b"[" * 300 + b"]" * 300 + b"}" if len(raw) > 2 else raw
    return raw


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, str]:
    path = draw(st.sampled_from(["/v1/completions"] * 3 + ["/v1/chat/completions"] * 3 + [
        "/tokenize", "/detokenize", "/v1/embeddings"]))
    fields = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}.get(path, OTHER)
    obj = draw(body(fields, junk=draw(st.integers(0, 3)) == 0))
    if path in ("/v1/completions", "/v1/chat/completions") and draw(st.integers(0, 9)) < 8:
        obj.setdefault("prompt" if path == "/v1/completions" else "messages",
                       "hi" if path == "/v1/completions" else [{"role": "user", "content": "hi"}])
        if not isinstance(obj.get("max_tokens"), int) or not -2 < obj["max_tokens"] < 13:
            obj["max_tokens"] = draw(st.integers(1, 12))          # keep generation short: the fuzz is bounded
        if draw(st.integers(0, 3)) == 0:
            obj["stream"] = True
    how = draw(st.sampled_from(["json"] * 18 + ["truncated", "nested"]))
    ctype = draw(st.sampled_from(["application/json"] * 19 + ["text/plain"]))
    return path, encode(obj, how), ctype


# -- the property ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(serve_model):
    return LlamaModel.load(serve_model)


@pytest.fixture(scope="module")
def srv(serve_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    (d / "tools.jinja").write_text(TOOL_TEMPLATE)
    with CLIServer(serve_model, ["--parallel", "4", "--ctx", "1024", "--max-queue", "32",
                                 "--chat-template", str(d / "tools.jinja")], d / "serve.log") as s:
        assert s.alive(), s.log()
        yield s


@pytest.fixture(scope="module")
def streams(srv, model):
    with bystanders(srv, model) as got:
        yield got
    assert len(got) >= 2, "the bystander streams did not run across the fuzz"
    # the fuzz reached generation as well as the refusals (else it proves little)
    assert TALLY["2xx"] >= 15 and TALLY["4xx"] >= 40 and TALLY["stream"] >= 3, TALLY


def check(srv, path: str, raw: bytes, ctype: str) -> None:
    with httpx.Client(timeout=60) as c, c.stream("POST", srv.url + path, content=raw,
                                                 headers={"Content-Type": ctype}) as r:
        out = r.read()
        assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, (r.status_code, out[:300], raw[:300])
        TALLY[f"{r.status_code // 100}xx"] += 1
        TALLY[f"{r.status_code} {path}"] += 1
        if r.status_code >= 400:
            err = json.loads(out)["error"]
            assert err["message"] and len(err["message"]) < 2000
        elif r.headers.get("content-type", "").startswith("text/event-stream"):
            assert out.rstrip().endswith(b"data: [DONE]"), out[-300:]
            TALLY["stream"] += 1
        else:
            obj = json.loads(out)
            assert all(not (isinstance(v, float) and not math.isfinite(v)) for v in obj.values())
    assert srv.alive(), srv.log()[-3000:]


def _seeded(test):
    for h in hostile_requests():
        test = example(case=(h.path, h.body, h.content_type))(test)
    return test


# hypothesis' cases and the hostile seeds: each a 2xx or a 4xx, the server alive throughout, the bystander
# streams (the `streams` fixture, checked when the module ends) each with its solo text
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@_seeded
@given(case=requests())
def test_fuzz_http_api(srv, streams, case):
    path, raw, ctype = case
    check(srv, path, raw, ctype)


def test_fuzz_tally(streams):
    """(reports what the fuzz saw; the `streams` fixture asserts on it when the module ends)"""
    print(dict(TALLY))

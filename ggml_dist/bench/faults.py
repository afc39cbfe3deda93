"""Fault study: kill stage actors in the middle of generations and check that nothing is lost or wrong;
fuzz the GGUF loader; send hostile HTTP requests while streams run. Prints one JSON object:

    {"kills", "recovered", "lost_requests", "wrong_tokens", "detect_s", "restore_s", "first_token_s",
     "fuzz_cases", "fuzz_failures", "unclear_errors",
     "http": {"streams", "bad_requests", "statuses", "unexpected", "collateral_failures", "crashes",
              "streams_differing", "health_p50_ms", "health_p99_ms", "health_max_ms", "health_polls"}}

fuzz_failures: cases that ended in anything but a valid model or one of the project's own errors
(GGUFError, BatchError, ContextFullError); unclear_errors: such errors whose message does not name the
file (ggml_dist/bench/fuzz_gguf.py has the rules). Both are findings; neither hides in the other.

http (http_study): `ggml-dist serve` in a process of its own; `streams` greedy streams run while every
case of hostile_requests() is sent, over and over, until they end, and /health is polled every 50 ms.
unexpected: a case answered outside what it expects (a 5xx, or a 2xx where a 4xx was due);
collateral_failures: a stream that ended in an error, was cut, or did not finish; crashes: the server
process died; streams_differing: streams whose text is not the text the same request got alone (what
batch invariance promises; counted apart, as hostile requests are not its only cause).

    ggml-dist bench faults [--model M] [--stages 2] [--runs 6] [--tokens 24] [--fuzz-cases 10000]
                           [--sections kill,fuzz,http] [--http-streams 4] --json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import numpy as np


def kill_study(path: str, stages: int, runs: int, n_tokens: int, seed: int = 0) -> dict:
    from ..model.context import ContextParams, LlamaContext
    from ..model.generate import generate
    from ..model.model import LlamaModel
    from ..runtime import RunConfig, open_runtime
    m = LlamaModel.load(path)
    rng = np.random.default_rng(seed)
    prompt = m.tokenizer.encode("The capital of France is")
    want = generate(LlamaContext(m, ContextParams(n_ctx=512)), m.tokenizer, prompt, n_tokens,
                    stop_at_eog=False).tokens
    rt = open_runtime(RunConfig(path, ContextParams(n_ctx=512), stages, on_ray=True, show_plan=False))
    kills = lost = wrong = 0
    detect: list[float] = []
    restore: list[float] = []
    first: list[float] = []
    try:
        for _ in range(runs):
            rt.ctx.clear()
            stage, after = int(rng.integers(0, stages)), int(rng.integers(1, n_tokens))
            n0 = len(rt.ctx.recovery.lost_at)
            killed: list[float] = []              # when this run's kill was made
            after_loss: list[float] = []          # detection -> the first token after it, this run

            def on_token(i: int, tok: int, stage=stage, after=after, n0=n0, killed=killed,
                         after_loss=after_loss) -> None:
                nonlocal kills
                if len(rt.ctx.recovery.lost_at) > n0 and not after_loss:
                    after_loss.append(time.perf_counter() - rt.ctx.recovery.lost_at[n0])
                if i == after:
                    kills += 1
                    killed.append(time.perf_counter())
                    rt.kill_stage(stage)
            try:
                got = generate(rt.ctx, m.tokenizer, prompt, n_tokens, on_token=on_token, stop_at_eog=False).tokens
            except Exception as e:  # noqa: BLE001 - a lost request (any error): counted, never hidden
                print(f"lost: {type(e).__name__}: {e}", file=sys.stderr)
                lost += 1
                continue
            wrong += int(got != want)
            if killed and len(rt.ctx.recovery.lost_at) > n0:
                detect.append(rt.ctx.recovery.lost_at[n0] - killed[0])
            restore.extend(rt.ctx.recovery.recovery_s[n0:])
            first.extend(after_loss)
    finally:
        rt.shutdown()

    def stats(xs: list[float]) -> dict[str, float | None]:
        return {"p50": round(float(np.median(xs)), 3) if xs else None, "max": round(max(xs), 3) if xs else None}
    # three figures, named apart: from the kill to its detection (the driver made the kill, so it is seen at
    # the next call: this is not a cut link's ~7 s), the restart and replay, detection to the next token
    return {"kills": kills, "recovered": len(restore), "lost_requests": lost, "wrong_tokens": wrong,
            "detect_s": stats(detect), "restore_s": stats(restore), "first_token_s": stats(first)}


# -- hostile HTTP requests ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Hostile:
    """One bad request: where it goes, its raw body and content type, and the class of status it is due
    ("4xx"; "2xx" for degenerate values the server clamps; "any" of the two where the model decides:
    a grammar that fails at its tenth token if the model takes the short way there)."""
    name: str
    path: str
    body: bytes
    expect: str = "4xx"
    content_type: str = "application/json"


def _j(obj: object) -> bytes:
    return json.dumps(obj).encode()


def _chat(extra: dict) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


def hostile_requests() -> list[Hostile]:
    """The cases of issue 45 (each once made the server crash, fail others' requests, or answer 500),
    and the usual malformed ones. tests/serve/test_fuzz_api.py seeds its fuzzer with them."""
    chain_obj = {f"d{i}": {"type": "object", "properties": {"next_value": {"$ref": f"#/$defs/d{i + 1}"}},
                           "required": ["next_value"]} for i in range(1000)}
    chain_obj["d1000"] = {"type": "string"}
    chain_ref = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)}
    chain_ref["d1000"] = {"type": "string"}
    gbnf_chain = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(6000)) + 'r6000 ::= "x"\n'
    gbnf_alts = "root ::= " + " | ".join(f'"w{i}"' for i in range(20000)) + "\n"
    lark_chain = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "x"\n'
    alts = [" | ".join(f'"{c}{i}" z' for i in range(900)) for c in "pqs"]
    late = ('root ::= w w w w w big\nw ::= "a" v\nv ::= "b" | "c" v\nbig ::= r1 | r2 | r3\n'
            f"r1 ::= {alts[0]}\nr2 ::= {alts[1]}\nr3 ::= {alts[2]}\n" + 'z ::= "z" z | "y"\n')
    comp = "/v1/completions"
    chat = "/v1/chat/completions"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    return [
        Hostile("defs_chain_1000_94kb", comp, _j({"prompt": "x", "max_tokens": 4,
                                                  "json_schema": {"$defs": chain_obj, "$ref": "#/$defs/d0"}})),
        Hostile("defs_chain_1000_refs", comp, _j({"prompt": "x", "max_tokens": 4,
                                                  "json_schema": {"$defs": chain_ref, "$ref": "#/$defs/d0"}})),
        Hostile("gbnf_6000_chained_rules", comp, _j({"prompt": "x", "max_tokens": 4, "grammar": gbnf_chain})),
        Hostile("gbnf_20000_alternatives", comp, _j({"prompt": "x", "max_tokens": 4, "grammar": gbnf_alts})),
        Hostile("lark_3000_chained_rules", comp, _j({"prompt": "x", "max_tokens": 4, "grammar": lark_chain})),
        Hostile("schema_self_ref", comp, _j({"prompt": "x", "max_tokens": 4, "json_schema": {"$ref": "#"}})),
        Hostile("grammar_fails_at_token_10", comp, _j({"prompt": "x", "max_tokens": 16, "grammar": late}), "any"),
        Hostile("forced_tool_self_ref", chat, _j(_chat({"tools": [tool], "tool_choice": "required"}))),
        Hostile("temperature_1e-300", comp, _j({"prompt": "x", "max_tokens": 4, "temperature": 1e-300}), "2xx"),
        Hostile("temperature_5e-324", comp, _j({"prompt": "x", "max_tokens": 4, "temperature": 5e-324}), "2xx"),
        Hostile("repeat_penalty_1e-300", comp, _j({"prompt": "x y x y", "max_tokens": 4, "temperature": 0.7,
                                                   "repeat_penalty": 1e-300}), "2xx"),
        Hostile("lone_surrogate_prompt", comp, b'{"prompt": "a\\ud800b", "max_tokens": 4}'),
        Hostile("lone_surrogate_chat", chat, b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        Hostile("lone_surrogate_stop", comp, b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 4}'),
        Hostile("json_nested_1000", comp, b'{"prompt": "x", "metadata_x": ' + b"[" * 1000 + b"]" * 1000 + b"}"),
        Hostile("logit_bias_superscript_two", comp, _j({"prompt": "x", "max_tokens": 4, "logit_bias": {"\u00b2": 1}})),
        Hostile("tool_call_function_string", chat, _j({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": "f"}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}], "max_tokens": 4})),
        Hostile("nan", comp, b'{"prompt": "x", "temperature": NaN}'),
        Hostile("number_past_double", comp, b'{"prompt": "x", "top_p": 1e999}'),
        Hostile("not_json", comp, b"{not json"),
        Hostile("not_an_object", comp, b"[1, 2]"),
        Hostile("wrong_type", comp, _j({"prompt": "x", "max_tokens": "5"})),
        Hostile("huge_seed", comp, _j({"prompt": "x", "max_tokens": 2, "seed": 2**80})),
        Hostile("text_plain_body", comp, _j({"prompt": "x", "max_tokens": 4}), content_type="text/plain"),
        Hostile("form_body", comp, b"prompt=x", content_type="application/x-www-form-urlencoded"),
        Hostile("too_large", comp, b'{"prompt": "' + b"a" * (2 << 20) + b'"}'),
        Hostile("token_id_out_of_vocab", comp, _j({"prompt": [1, 10**9], "max_tokens": 2})),
    ]


@dataclass
class _Stream:
    text: str = ""
    error: str | None = None
    finished: bool = False
    done: threading.Event = field(default_factory=threading.Event)


def _stream(url: str, body: dict, out: _Stream) -> None:
    import httpx
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            if r.status_code != 200:
                out.error = f"status {r.status_code}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.finished = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = str(chunk["error"])
                    break
                out.text += chunk["choices"][0]["text"]
    except Exception as e:  # noqa: BLE001 - a cut stream is a collateral failure, counted
        out.error = f"{type(e).__name__}: {e}"
    finally:
        out.done.set()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_study(path: str, n_streams: int = 4, tokens: int = 256) -> dict:
    """The module docstring's http section: `ggml-dist serve` on path with n_streams + 2 slots."""
    port = _free_port()
    fd, log_name = tempfile.mkstemp(prefix="ggml_dist_faults_serve_", suffix=".log")
    with os.fdopen(fd, "wb") as log:
        out = _http_study(path, n_streams, tokens, port, log, log_name)
    if out["crashes"] or out["unexpected"] or out["collateral_failures"]:
        out["server_log"] = log_name            # kept for the findings
    else:
        os.unlink(log_name)
    return out


def _http_study(path: str, n_streams: int, tokens: int, port: int, log: IO[bytes], log_name: str) -> dict:
    import httpx
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "ggml_dist.cli", "serve", "--model", path, "--port", str(port),
                             "--parallel", str(n_streams + 2), "--ctx", str(512 * (n_streams + 2)),
                             "--max-queue", "64"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "GGML_DIST_API_KEY": ""})
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited while loading; see {log_name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 300:
                raise RuntimeError(f"the server did not become ready in 300 s; see {log_name}")
            time.sleep(0.2)
        prompts = [f"Question {i}: what is the capital of France? Answer:" for i in range(n_streams)]
        bodies = [{"prompt": p, "max_tokens": tokens, "temperature": 0} for p in prompts]
        alone = []
        for b in bodies:                # each stream's request alone: the text it is due
            r = httpx.post(url + "/v1/completions", json=b, timeout=300)
            r.raise_for_status()
            alone.append(r.json()["choices"][0]["text"])
        health: list[float] = []
        stop = threading.Event()

        def poll() -> None:
            with httpx.Client(timeout=30) as c:
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        c.get(url + "/health")
                        health.append(time.perf_counter() - t)
                    except httpx.HTTPError:
                        health.append(float("inf"))
                    time.sleep(0.05)
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        streams = [_Stream() for _ in bodies]
        for b, s in zip(bodies, streams):
            threading.Thread(target=_stream, args=(url, b, s), daemon=True).start()
        cases = hostile_requests()
        statuses: dict[str, int] = {}
        unexpected: list[str] = []
        sent = 0
        with httpx.Client(timeout=120) as c:
            while sent < len(cases) or not all(s.done.is_set() for s in streams):
                h = cases[sent % len(cases)]
                sent += 1
                try:
                    r = c.post(url + h.path, content=h.body, headers={"Content-Type": h.content_type})
                    code = r.status_code
                except httpx.HTTPError as e:
                    code = 0
                    unexpected.append(f"{h.name}: {type(e).__name__}")
                key = f"{code // 100}xx" if code else "no answer"
                statuses[key] = statuses.get(key, 0) + 1
                if code and key != h.expect and not (h.expect == "any" and key in ("2xx", "4xx")):
                    unexpected.append(f"{h.name}: {code}")
                if proc.poll() is not None:
                    break
        for s in streams:
            s.done.wait(300)
        stop.set()
        poller.join()
        crashes = int(proc.poll() is not None)
        ms = np.asarray([x for x in health if np.isfinite(x)]) * 1000
        return {"streams": n_streams, "bad_requests": sent, "statuses": statuses,
                "unexpected": sorted(set(unexpected)),
                "collateral_failures": sum(1 for s in streams if s.error or not s.finished),
                "crashes": crashes,
                "streams_differing": sum(1 for s, a in zip(streams, alone) if s.finished and s.text != a),
                "health_p50_ms": round(float(np.percentile(ms, 50)), 1) if len(ms) else None,
                "health_p99_ms": round(float(np.percentile(ms, 99)), 1) if len(ms) else None,
                "health_max_ms": round(float(ms.max()), 1) if len(ms) else None,
                "health_polls": len(health), "health_failed": sum(1 for x in health if not np.isfinite(x))}
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--fuzz-cases", type=int, default=10000)
    ap.add_argument("--sections", default="kill,fuzz,http", help="which studies to run (comma-separated)")
    ap.add_argument("--http-streams", type=int, default=4, help="http: streams running while bad requests arrive")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    sections = {x.strip() for x in a.sections.split(",") if x.strip()}
    if not sections <= {"kill", "fuzz", "http"}:
        ap.error(f"--sections takes kill, fuzz and http, got {a.sections}")
    from ..model.pull import resolve_model
    path = str(resolve_model(a.model))
    out: dict = {}
    if "kill" in sections:
        out.update(kill_study(path, a.stages, a.runs, a.tokens))
    if "fuzz" in sections:
        try:
            from .fuzz_gguf import run_fuzz  # the loader fuzzer
            fz = run_fuzz(a.fuzz_cases, jobs=2)
            out.update({"fuzz_cases": fz.fuzz_cases, "fuzz_failures": fz.fuzz_failures,
                        "unclear_errors": fz.unclear_errors})
        except ImportError as e:
            out.update({"fuzz_cases": 0, "fuzz_failures": None, "unclear_errors": None, "fuzz_note": str(e)})
    if "http" in sections:
        out["http"] = http_study(path, a.http_streams)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

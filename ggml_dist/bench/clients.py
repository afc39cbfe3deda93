"""Closed-loop streaming clients for an OpenAI completions endpoint: what serving benchmarks load a server
with (benchmarks/serve.py on one machine, `ggml-dist bench cluster` on the testbed).

    run_clients(url, n_clients, duration, max_tokens) -> {requests, errors, aggregate_tok_s, ttft, itl, ...}
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np

PROMPTS = ["The capital of France is", "Once upon a time there was", "The three primary colors are",
           "Water boils at a temperature of", "The largest planet in the solar system is",
           "A good way to learn programming is", "The first person to walk on the moon was",
           "In the beginning of the twentieth century"]


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def stream_one(conn: http.client.HTTPConnection, prompt: str, max_tokens: int,
               api_key: str | None = None) -> tuple[float, list[float], int]:
    """(start, chunk arrival times, tokens) of one streaming completion; raises on any failure.

    The client is the standard library's http.client, reading the SSE stream a network read at a time:
    on this 2-core machine the clients share the server's cores, and httpx's per-line machinery took
    6-7% of a core under 8 streams (this takes ~2%)."""
    t0 = time.perf_counter()
    times: list[float] = []
    n_tokens = 0
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn.request("POST", "/v1/completions", body, headers)
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    buf = b""
    while data := r.read1(65536):
        *events, buf = (buf + data).split(b"\n\n")
        now = time.perf_counter()
        for e in events:
            if not e.startswith(b"data: ") or e == b"data: [DONE]":
                continue
            ev = json.loads(e[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                n_tokens = ev["usage"]["completion_tokens"]
            elif ev["choices"] and ev["choices"][0]["text"]:
                times.append(now)
    if not times:
        raise RuntimeError("no text streamed")
    return t0, times, n_tokens


def run_clients(url: str, n_clients: int, duration: float, max_tokens: int, api_key: str | None = None) -> dict:
    """n_clients closed-loop streaming clients for `duration` s. aggregate_tok_s counts the tokens that
    arrived within those seconds (a request running at the deadline counts the share of its chunks that
    came before it): the rate while n_clients are active. The requests running at the deadline still
    finish and count as requests (or errors); aggregate_tok_s_with_drain divides all tokens by the wall
    time to the last one, when fewer and fewer clients remain."""
    ttft: list[float] = []
    itl: list[float] = []
    done = [0]
    errors: list[str] = []
    tokens = [0.0, 0]                   # within the window, all
    lock = threading.Lock()
    host, port = url.removeprefix("http://").split(":")
    t_start = time.perf_counter()
    deadline = t_start + duration

    def client(k: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=600)
        i = k
        while time.perf_counter() < deadline:
            try:
                t0, times, n = stream_one(conn, PROMPTS[i % len(PROMPTS)], max_tokens, api_key)
                inside = sum(t <= deadline for t in times) / len(times)
                with lock:
                    ttft.append(times[0] - t0)
                    itl.extend(np.diff(times))      # a chunk can carry several tokens (held-back UTF-8)
                    tokens[0] += n * inside
                    tokens[1] += n
                    done[0] += 1
            except Exception as e:  # noqa: BLE001 - counted, and the client carries on (on a new connection)
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                conn.close()
            i += n_clients
        conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t_start
    return {"clients": n_clients, "requests": done[0], "errors": len(errors), "error_samples": errors[:3],
            "generated_tokens": tokens[1], "wall_s": round(wall, 2),
            "aggregate_tok_s": round(tokens[0] / duration, 3),
            "aggregate_tok_s_with_drain": round(tokens[1] / wall, 3),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}

"""--replicas: engine processes side by side behind one front. The same tokens as separate greedy runs,
metrics gathered from every replica, cancellation, the queue bound, the cores' split, and a replica
whose process dies: its request fails, the others serve on, and it comes back."""
from __future__ import annotations

import time

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402

from ggml_dist.serve import ServerThread  # noqa: E402
from tests.serve.common import engine_config

from .conftest import CHATML  # noqa: E402
from .test_app import (PROMPTS, check_cancel_stream, client, concurrent_texts, metric, model,  # noqa: E402,F401
                       reference, wait_idle)


@pytest.fixture(scope="module")
def replicated(serve_model):
    """4 slots of 1024 tokens over 2 replica processes."""
    cfg = engine_config(serve_model, n_parallel=4, n_ctx=4096, max_queue=8, chat_template=CHATML,
                       n_replicas=2)
    with ServerThread(cfg, model_name="synthetic") as srv:
        yield srv


def test_config_checks(serve_model):
    with pytest.raises(ValueError, match="--replicas must be 1..--parallel"):
        engine_config(serve_model, n_parallel=2, n_replicas=3)
    with pytest.raises(ValueError, match="does not combine with a pipeline"):
        engine_config(serve_model, n_parallel=4, n_stages=2, n_replicas=2)


# requests spread over both replicas (more than the 4 slots, staggered) give the separate runs' text
def test_concurrent_greedy_same_as_separate(replicated, model):
    lengths = [8, 20, 12, 16, 24, 10]
    assert concurrent_texts(replicated, lengths) == [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    wait_idle(replicated)
    assert metric(replicated, "kv_cells_used") == metric(replicated, "kv_cells_cached")
    r = client(replicated).chat.completions.create(
        model="synthetic", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    assert r.choices[0].message.content == reference(
        model, model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], template=CHATML), 6)


# the front's /metrics adds up the replicas: tokens, TTFT, KV cells of both caches, busy time of each
def test_metrics_from_every_replica(replicated):
    before = metric(replicated, "generated_tokens_total")
    concurrent_texts(replicated, [5, 5, 5, 5])              # at once: both replicas take some
    assert metric(replicated, "generated_tokens_total") - before == 20
    assert metric(replicated, "kv_cells_total") == 4096
    assert metric(replicated, "slots_total") == 4
    text = httpx.get(replicated.url + "/metrics").text
    busy = [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith("ggml_dist_stage_busy_seconds_total{")]
    assert len(busy) == 2 and all(b > 0 for b in busy), busy
    assert metric(replicated, "time_to_first_token_seconds_count") >= 4
    h = httpx.get(replicated.url + "/health").json()
    assert h["status"] == "ok" and h["slots_idle"] == 4


# one busy replica computes with every core; with both busy each gets its share
def test_threads_follow_the_busy_replicas(replicated, model):
    eng = replicated.engine
    wait_idle(replicated)
    assert all(r.threads == eng._threads for r in eng.replicas)
    # both streams must outlast the look below: no end of text (PROMPTS[4] ends after ~160 tokens, and a
    # quiet machine decodes 600 in under a second), and most of a slot's 1024 cells
    body = {"prompt": PROMPTS[4], "max_tokens": 960, "temperature": 0, "stream": True,
            "logit_bias": {str(model.tokenizer.eos_id): -100}}
    with httpx.stream("POST", replicated.url + "/v1/completions", json=body, timeout=30) as a, \
            httpx.stream("POST", replicated.url + "/v1/completions", json={**body, "prompt": PROMPTS[5]},
                         timeout=30) as b:
        la, lb = a.iter_lines(), b.iter_lines()
        next(la), next(lb)
        share = max(1, eng._threads // 2)
        t0 = time.monotonic()              # a stream's first line can come before its request is routed
        while True:                        # one snapshot per look: loads and threads change together
            with eng._lock:
                snap = [(r.load, r.threads) for r in eng.replicas]
            if sorted(load for load, _ in snap) == [1, 1] or time.monotonic() - t0 > 30:
                break
            time.sleep(0.01)
        assert sorted(load for load, _ in snap) == [1, 1] and all(t == share for _, t in snap), snap
    wait_idle(replicated)
    assert all(r.threads == eng._threads for r in eng.replicas)


# a dropped stream cancels its sequence in its replica: the slot and its cells free at once
def test_cancel_stream(replicated):
    check_cancel_stream(replicated)


# the queue bound holds over all replicas: full slots and max_queue=0 answer 429
def test_queue_full(serve_model):
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=2048, max_queue=0, n_replicas=2)
    with ServerThread(cfg) as srv:
        body = {"prompt": "x", "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as a, \
                httpx.stream("POST", srv.url + "/v1/completions", json={**body, "prompt": "y"}, timeout=30) as b:
            la, lb = a.iter_lines(), b.iter_lines()
            next(la), next(lb)
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": "z", "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        wait_idle(srv)
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "z", "max_tokens": 2}).status_code == 200


# a replica killed mid-stream: its client gets an error event, the other replica keeps serving, and the
# lost one is started again
def test_replica_lost_and_restarted(serve_model, model):
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=2048, n_replicas=2)
    with ServerThread(cfg) as srv:
        eng = srv.engine
        body = {"prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            victim = next(x for x in eng.replicas if x.load)
            victim.proc.kill()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert "error" in events[-1] and "exited" in events[-1]["error"]["message"]
        # while the lost replica starts again (it loads the model: seconds) /health says degraded (503)
        # and /metrics recovering 1; the other replica serves meanwhile
        h = httpx.get(srv.url + "/health")
        assert not victim.ready and h.status_code == 503 and h.json()["status"] == "degraded"
        assert metric(srv, "recovering") == 1
        other = client(srv).completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, temperature=0)
        assert other.choices[0].text == reference(model, PROMPTS[1], 6)
        t0 = time.monotonic()
        while not all(x.ready for x in eng.replicas):
            assert time.monotonic() - t0 < 120, "the lost replica did not come back"
            time.sleep(0.1)
        assert httpx.get(srv.url + "/health").json()["status"] == "ok" and metric(srv, "recovering") == 0
        texts = [client(srv).completions.create(model="m", prompt=p, max_tokens=6, temperature=0).choices[0].text
                 for p in PROMPTS[:3]]
        assert texts == [reference(model, p, 6) for p in PROMPTS[:3]]


# replicas do not outlive their front: when its process dies they see their connection end, and exit
def test_replicas_exit_with_their_front(serve_model):
    script = ("import time\n"
              "from tests.serve.common import engine_config\n"
              "from ggml_dist.serve.replicas import ReplicaSet\n"
              f"eng = ReplicaSet(engine_config({serve_model!r}, n_parallel=2, n_ctx=1024, n_replicas=2)).start()\n"
              "eng.wait_ready(120)\n"
              "print(*[r.proc.pid for r in eng.replicas], flush=True)\n"
              "time.sleep(600)\n")
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in front.stdout.readline().split()]
    assert len(pids) == 2
    front.kill()
    front.wait()

    def running(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
        except FileNotFoundError:
            return False
    t0 = time.monotonic()
    while any(running(p) for p in pids):
        assert time.monotonic() - t0 < 60, "a replica outlived its front"
        time.sleep(0.1)


# the live view of replicas (serve/live.py): a lane per replica, each one's busy share from what it
# reports; after a request, a reading counts its tokens
def test_live_view_has_a_lane_per_replica(replicated):
    snap = httpx.get(replicated.url + "/live", timeout=60).json()["latest"]
    assert snap["mode"] == "replicas" and [ln["name"] for ln in snap["lanes"]] == ["replica 0", "replica 1"]
    r = httpx.post(replicated.url + "/v1/completions", json={"prompt": "one two", "max_tokens": 6, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200
    after = httpx.get(replicated.url + "/live", timeout=60).json()["latest"]
    assert after["generated"] - snap["generated"] == r.json()["usage"]["completion_tokens"]
    assert all(ln["busy"] is not None for ln in after["lanes"])

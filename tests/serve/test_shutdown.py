"""SIGTERM drains `ggml-dist serve` (serve/server.py): new requests get 503 at once, a running request that
ends within --shutdown-grace ends as it would have, one that does not gets an error event and [DONE]."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):     # the serve extras
    pytest.importorskip(_mod)

import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from ggml_dist.model.model import LlamaModel  # noqa: E402

from .cli_server import CLIServer  # noqa: E402
from .test_app import reference  # noqa: E402

GRACE = 4


class _Stream(threading.Thread):
    def __init__(self, url: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.text, self.errors, self.done, self.chunks = "", [], False, 0

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", json={**self.body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    self.done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(chunk["error"])
                    else:
                        self.text += chunk["choices"][0]["text"]
                        self.chunks += 1


# SIGTERM: 503 for what comes after, the stream that fits in the grace finishes with its solo text, the one
# that does not ends with an error event then [DONE]; the process exits soon after the grace
def test_sigterm_drains(serve_model, tmp_path):
    model = LlamaModel.load(serve_model)
    with CLIServer(serve_model, ["--parallel", "2", "--ctx", "131072", "--shutdown-grace", str(GRACE)],
                   tmp_path / "serve.log") as srv:
        assert srv.alive(), srv.log()
        short = _Stream(srv.url, {"prompt": "hello world", "max_tokens": 300, "temperature": 0})
        # ~3000 tok/s alone on a quiet 2-core VM: 60000 tokens cannot end within the grace
        long = _Stream(srv.url, {"prompt": "x", "max_tokens": 60000, "temperature": 0})
        short.start()
        long.start()
        t0 = time.monotonic()
        while short.chunks < 5 or long.chunks < 5:
            assert time.monotonic() - t0 < 30 and short.is_alive() and long.is_alive()
            time.sleep(0.01)
        srv.signal(signal.SIGTERM)
        t_term = time.monotonic()
        time.sleep(0.3)
        late = httpx.post(srv.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=10)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 503
        short.join(30)
        long.join(30)
        assert short.done and not short.errors and short.text == reference(model, "hello world", 300)
        assert long.done and len(long.errors) == 1 and "shutting down" in long.errors[0]["message"], (long.errors, long.chunks, srv.log()[-3000:])
        assert long.chunks < 60000                                  # cut, not finished
        srv.proc.wait(GRACE + 20)
        assert time.monotonic() - t_term < GRACE + 15
        assert srv.proc.returncode in (143, -signal.SIGTERM), srv.log()
        assert "still running after" in srv.log()


# --replicas: the front ends the replicas' requests past the grace (ServerThread.stop's drain, as SIGTERM's)
def test_drain_with_replicas(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    srv = ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=131072, n_replicas=2)).start()
    long = _Stream(srv.url, {"prompt": "x", "max_tokens": 60000, "temperature": 0})
    long.start()
    t0 = time.monotonic()
    while long.chunks < 5:
        assert time.monotonic() - t0 < 30 and long.is_alive()
        time.sleep(0.01)
    stopper = threading.Thread(target=srv.stop, kwargs={"grace_s": 1.0})
    stopper.start()
    time.sleep(0.2)
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": "y"}, timeout=10).status_code == 503
    long.join(30)
    stopper.join(60)
    assert long.done and len(long.errors) == 1 and "shutting down" in long.errors[0]["message"], long.errors

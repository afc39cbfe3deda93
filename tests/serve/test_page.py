"""The page at the server's root and the live view's data (serve/routes_page.py, serve/live.py), over HTTP:
the page's files, the JSON snapshot and the server-sent events, the API key, a 2-stage server's lanes.
The page in a real browser: test_page_browser.py."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import itertools  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import httpx  # noqa: E402

from ggml_dist.serve.guard import HTTPPolicy  # noqa: E402
from ggml_dist.serve.server import ServeOptions  # noqa: E402

KEY = "page-key"


def events(resp: httpx.Response) -> Iterator[tuple[str, dict]]:
    """A streamed response's server-sent events as they arrive, (name, data)."""
    buf = b""
    for chunk in resp.iter_raw():             # as it arrives (this httpx's iter_lines held lines back)
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            fields = dict(line.split(": ", 1) for line in block.decode().split("\n") if not line.startswith(":"))
            if "data" in fields:
                yield fields.get("event", "message"), json.loads(fields["data"])


def read_events(resp: httpx.Response, n: int) -> list[tuple[str, dict]]:
    return list(itertools.islice(events(resp), n))


def generate(url: str, n: int, headers: dict | None = None) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "one two three", "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True}, headers=headers, timeout=120)
    assert r.status_code == 200, r.text


# the page is plain files of the package: HTML naming only its own script and style sheet, served with a
# CSP that forbids anything from elsewhere; no other file is served from the page's folder
def test_page_files_are_the_packages_own(server):
    r = httpx.get(server.url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in r.headers["content-security-policy"]
    assert "connect-src 'self'" in r.headers["content-security-policy"]
    refs = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert sorted(refs) == ["/page/page.css", "/page/page.js"]
    for ref, kind in (("/page/page.js", "text/javascript"), ("/page/page.css", "text/css")):
        f = httpx.get(server.url + ref)
        assert f.status_code == 200 and f.headers["content-type"].startswith(kind)
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", f.text), f"{ref} names an outside address"
    assert httpx.get(server.url + "/page/index.html").status_code == 404
    assert httpx.get(server.url + "/page/..%2fapp.py").status_code == 404


# /live of one process: one lane, its layers and memory, the slots; after a request, the tokens it
# counted and the lane's busy seconds turned into a share
def test_live_snapshot_of_one_process(server):
    snap = httpx.get(server.url + "/live").json()
    assert snap["model"] == "synthetic"
    s = snap["latest"]
    assert s["mode"] == "one process" and len(s["lanes"]) == 1
    lane = s["lanes"][0]
    assert lane["layers"] == [0, 2] and lane["planned"]["weights"] > 0 and lane["rss_bytes"] > 0
    assert s["slots"]["total"] == 4
    before = s["generated"]
    generate(server.url, 12)
    s2 = httpx.get(server.url + "/live").json()["latest"]
    assert s2["generated"] - before == 12
    assert s2["lanes"][0]["busy"] is not None and s2["lanes"][0]["busy"] > 0
    assert s2["tok_s"] > 0 and s2["ttft_s"] > 0


# /live/events: the snapshot first, then a sample a second; the sampling thread stops once the last
# stream has closed, and no sample is taken while nobody looks
def test_live_events_stream_and_stop(server):
    view = server.app.state.serving.live
    with httpx.stream("GET", server.url + "/live/events", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = read_events(r, 3)
    assert [n for n, _ in evs] == ["snapshot", "sample", "sample"]
    assert evs[2][1]["t"] > evs[1][1]["t"] and evs[2][1]["lanes"][0]["name"] == "this process"
    deadline = time.monotonic() + 30
    while view.sampling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not view.sampling and view.watching() == 0
    n = view.n_samples
    generate(server.url, 8)
    assert view.n_samples == n, "a sample was taken with no page open"


@pytest.fixture(scope="module")
def keyed(serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    opts = ServeOptions(policy=HTTPPolicy.for_bind("127.0.0.1", KEY))
    with ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=2048), model_name="synthetic", opts=opts) as srv:
        yield srv


# with --api-key: the page's shell (no data in it) loads, and everything it would show or do is refused
# without the key: the snapshot, the stream, the chat, the template; with the key they answer
def test_api_key_guards_the_pages_data(keyed):
    assert httpx.get(keyed.url + "/").status_code == 200
    assert "synthetic" not in httpx.get(keyed.url + "/").text
    refused = [httpx.get(keyed.url + "/live"), httpx.get(keyed.url + "/live/events"),
               httpx.post(keyed.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
               httpx.post(keyed.url + "/apply-template", json={"messages": [{"role": "user", "content": "hi"}]}),
               httpx.get(keyed.url + "/live", headers={"Authorization": "Bearer wrong"})]
    assert [r.status_code for r in refused] == [401] * 5
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(keyed.url + "/live", headers=auth).json()["model"] == "synthetic"
    with httpx.stream("GET", keyed.url + "/live/events", headers=auth, timeout=30) as r:
        assert r.status_code == 200 and read_events(r, 1)[0][0] == "snapshot"


# a 2-stage server: two lanes with their layers, nodes and planned memory; while requests run, both
# stages' busy shares rise above zero, stage 1 has a queue figure, micro-batches are in flight
def test_live_lanes_of_two_stages(local_ray, serve_model):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=2, n_ctx=2048)) as srv:
        idle = httpx.get(srv.url + "/live").json()["latest"]
        assert idle["mode"] == "pipeline" and [ln["layers"] for ln in idle["lanes"]] == [[0, 1], [1, 2]]
        assert all(ln["state"] == "ok" and ln["planned"]["weights"] > 0 and ln["rss_bytes"] > 0 for ln in idle["lanes"])
        with Load(srv.url, clients=2, n=48):
            busy: list[list[float]] = []
            in_flight = 0
            with httpx.stream("GET", srv.url + "/live/events", timeout=60) as r:
                for name, s in itertools.islice(events(r), 60):
                    if name == "sample" and s["dt"] > 0:
                        busy.append([ln["busy"] or 0.0 for ln in s["lanes"]])
                        in_flight = max(in_flight, s["in_flight"])
                        assert s["lanes"][0]["queue"] is None and s["lanes"][1]["queue"] is not None
                    if busy and all(max(b[k] for b in busy) > 0 for k in range(2)) and in_flight > 0:
                        break
    assert busy and all(max(b[k] for b in busy) > 0 for k in range(2)), busy
    assert in_flight > 0


class Load:
    """clients threads sending requests of n tokens one after another until the block ends: the server
    is generating whenever the block looks, however fast it is."""

    def __init__(self, url: str, clients: int, n: int, headers: dict | None = None) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url, n, headers)) for _ in range(clients)]

    def _run(self, url: str, n: int, headers: dict | None) -> None:
        while not self.stop.is_set():
            generate(url, n, headers)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()

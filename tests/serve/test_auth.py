"""Who may call the server and how a request may arrive (serve/app.py's _Guard, serve/server.py): --api-key
through the real openai client, the Host check against DNS rebinding, JSON content types only, the body and
header deadlines, the connection cap, a non-loopback --host, --replicas' front, Ray's token file."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

from ggml_dist.serve.guard import HTTPPolicy  # noqa: E402
from ggml_dist.serve.server import ServeOptions, protect_ray_token  # noqa: E402

from .cli_server import CLIServer  # noqa: E402

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed(serve_model):
    """A server with an API key, answering Host docs.internal besides its own; short deadlines."""
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    opts = ServeOptions(policy=HTTPPolicy.for_bind("127.0.0.1", KEY, ("docs.internal",), body_timeout_s=1.0),
                        header_timeout_s=1.0, max_connections=8)
    with ServerThread(engine_config(serve_model, n_parallel=2, n_ctx=2048), model_name="synthetic", opts=opts) as srv:
        yield srv


def _client(srv, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


# --api-key through the openai client: the right key is served, a wrong one and none are refused (401)
def test_api_key_with_the_openai_client(keyed):
    ok = _client(keyed, KEY).completions.create(model="synthetic", prompt="hi", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3
    assert [m.id for m in _client(keyed, KEY).models.list().data] == ["synthetic"]
    with pytest.raises(openai.AuthenticationError) as wrong:
        _client(keyed, "not-the-key").completions.create(model="synthetic", prompt="hi", max_tokens=3)
    assert wrong.value.status_code == 401 and "wrong API key" in wrong.value.message
    with pytest.raises(openai.AuthenticationError) as missing:
        _client(keyed, KEY).models.list(extra_headers={"Authorization": openai.Omit()})
    assert "no API key" in missing.value.message


# every endpoint but /health needs the key; X-Api-Key works too; a key is compared whole
def test_api_key_on_every_endpoint(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    for path in ("/metrics", "/v1/models"):
        assert httpx.get(keyed.url + path).status_code == 401
    for path in ("/v1/completions", "/tokenize", "/v1/embeddings", "/v1/chat/completions"):
        assert httpx.post(keyed.url + path, json={"prompt": "x"}).status_code == 401
    assert httpx.get(keyed.url + "/v1/models", headers={"X-Api-Key": KEY}).status_code == 200
    for bad in (f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Bearer {KEY.upper()}", "Bearer", f"Basic {KEY}", KEY):
        r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": bad})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", bad
    assert httpx.get(keyed.url + "/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404


# a Host name other than the bound address, localhost or --allowed-hosts is refused (DNS rebinding); an IP
# literal is a page the user opened by address, not a rebound name, and is served
def test_host_header(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    port = keyed.port
    for host, status in ((f"evil.example:{port}", 403), ("evil.example", 403), (f"127.0.0.1:{port}", 200),
                         (f"localhost:{port}", 200), ("LOCALHOST.", 200), (f"docs.internal:{port}", 200),
                         (f"[::1]:{port}", 200), ("10.1.2.3", 200)):
        r = httpx.get(keyed.url + "/v1/models", headers={**auth, "Host": host})
        assert r.status_code == status, (host, r.text)
    r = httpx.get(keyed.url + "/health", headers={"Host": "rebound.attacker.test"})
    assert r.status_code == 403 and "--allowed-hosts" in r.json()["error"]["message"]


# a body needs a JSON content type: a cross-site form (text/plain, urlencoded, multipart) or a typeless fetch
# body cannot start generation
def test_json_content_type(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for ctype in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                  "multipart/form-data; boundary=x", None):
        headers = {**auth, **({"Content-Type": ctype} if ctype else {})}
        r = httpx.post(keyed.url + "/v1/completions", content=body, headers=headers)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
    for ctype in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
        r = httpx.post(keyed.url + "/v1/completions", content=body, headers={**auth, "Content-Type": ctype})
        assert r.status_code == 200, (ctype, r.text)


def _raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """What the server sends back on a connection that sends data and then waits, until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                got = s.recv(65536)
            except TimeoutError:
                return out + b"<still open>"
            except ConnectionResetError:
                return out
            if not got:
                return out
            out += got


# a Content-Length larger than the body sent: 408 after the body deadline, not a handler held for ever
def test_body_deadline(keyed):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    t0 = time.monotonic()
    got = _raw(keyed.port, head + b'{"prompt": "x"')
    assert got.startswith(b"HTTP/1.1 408") and b"did not arrive within 1 s" in got, got[:300]
    assert time.monotonic() - t0 < 4


# headers that never end, or a connection that sends nothing, are closed after the header deadline
def test_header_deadline(keyed):
    t0 = time.monotonic()
    assert _raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") == b""
    assert _raw(keyed.port, b"") == b""
    assert time.monotonic() - t0 < 6
    assert httpx.get(keyed.url + "/health").status_code == 200


# past max_connections open at once, a new connection is closed at once; the server keeps serving
def test_connection_cap(keyed):
    idle = [socket.create_connection(("127.0.0.1", keyed.port)) for _ in range(8)]
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _raw(keyed.port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") == b""
        assert time.monotonic() - t0 < 1
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert httpx.get(keyed.url + "/health").status_code == 200


# --replicas: the front checks the key for every replica, and checks grammars in its own child process (the
# $defs chain that crashed the front, and so every replica's service, is a 400; a good grammar still works)
def test_api_key_and_grammars_with_replicas(serve_model):
    from ggml_dist.bench.faults import hostile_requests
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    opts = ServeOptions(policy=HTTPPolicy.for_bind("127.0.0.1", KEY))
    cfg = engine_config(serve_model, n_parallel=2, n_ctx=2048, n_replicas=2)
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    with ServerThread(cfg, model_name="synthetic", opts=opts) as srv:
        assert httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 401
        r = _client(srv, KEY).completions.create(model="synthetic", prompt="x", max_tokens=2)
        assert r.usage.completion_tokens == 2
        bomb = next(h for h in hostile_requests() if h.name == "defs_chain_1000_refs")
        assert httpx.post(srv.url + bomb.path, content=bomb.body, headers=auth, timeout=60).status_code == 400
        ok = _client(srv, KEY).completions.create(model="synthetic", prompt="x", max_tokens=8, temperature=0,
                                                  extra_body={"grammar": 'root ::= "yes" | "no"'})
        assert ok.choices[0].text in ("yes", "no")


# `ggml-dist serve --host 0.0.0.0` without a key does not start; with GGML_DIST_API_KEY it does, warns, and
# wants the key; --insecure-no-api-key starts it open, with a warning
def test_non_loopback_host(serve_model, tmp_path):
    r = subprocess.run([sys.executable, "-m", "ggml_dist.cli", "serve", "--model", serve_model, "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "GGML_DIST_API_KEY": ""},
                       check=False)
    assert r.returncode == 1 and "--api-key" in r.stderr and "--insecure-no-api-key" in r.stderr, r.stderr
    with CLIServer(serve_model, ["--host", "0.0.0.0", "--parallel", "2", "--ctx", "1024"], tmp_path / "a.log",
                   env={"GGML_DIST_API_KEY": KEY}) as srv:
        assert srv.alive(), srv.log()
        assert "warning: listening on 0.0.0.0" in srv.log()
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(srv.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}",
                                                         "Host": "any.name"}).status_code == 200
    with CLIServer(serve_model, ["--host", "0.0.0.0", "--insecure-no-api-key", "--parallel", "2", "--ctx", "1024"],
                   tmp_path / "b.log") as srv:
        assert srv.alive() and "WITHOUT an API key" in srv.log()
        assert httpx.get(srv.url + "/v1/models").status_code == 200


# Ray's token file: written 0600 before a local Ray would write it 0644; one found open is made 0600
def test_ray_token_file_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    said: list[str] = []
    assert protect_ray_token(joining=True, say=said.append) is None         # a cluster's own token: not ours
    p = protect_ray_token(joining=False, say=said.append)
    assert p == tmp_path / ".ray" / "auth_token" and p.stat().st_mode & 0o777 == 0o600
    assert len(p.read_text()) == 64 and not said
    token = p.read_text()
    p.chmod(0o644)
    assert protect_ray_token(joining=True, say=said.append) == p and p.stat().st_mode & 0o777 == 0o600
    assert p.read_text() == token and "was mode 644" in said[0]
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    p.chmod(0o644)
    assert protect_ray_token(joining=False) is None and p.stat().st_mode & 0o777 == 0o644

"""The guard in front of every route: an ASGI middleware (a route added later gets it too) that answers
for the whole server, before any route runs:
    Host        a name other than the bound address's, localhost or --allowed-hosts: 403 (DNS rebinding
                would otherwise let a web page reach a loopback server); an IP literal is always allowed
    draining    after SIGTERM: 503 for every new request (serve's graceful shutdown, server.py)
    API key     --api-key: `Authorization: Bearer KEY` (or `X-Api-Key`) on every path but /health and
                the page's files (PUBLIC_PATHS: they hold no data; the page sends the key), compared in
                constant time (hmac.compare_digest): else 401
    body        POST/PUT/PATCH: a JSON content type (else 415: a cross-site form sends text/plain or
                form types, which need no CORS preflight), at most max_body_bytes (413), read whole
                within body_timeout_s (408: a Content-Length larger than what is sent cannot hold a
                handler forever)
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .protocol import APIError

MAX_BODY_BYTES = 1 << 20          # a 1 MiB prompt is far past any context this server runs
BODY_TIMEOUT_S = 30.0             # a whole body, from its first byte's wait: 1 MiB at 35 KB/s
# answered without the key: /health, and the page's shell (routes_page.py), which a browser's navigation
# fetches without a bearer header and which shows nothing until the page has the key
PUBLIC_PATHS = frozenset({"/health", "/", "/page/page.js", "/page/page.css"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


@dataclass(frozen=True)
class HTTPPolicy:
    """Who may call the server and how a request may arrive (the module docstring's Guard).
    allowed_hosts: Host names accepted besides IP literals; None accepts any (a wildcard bind without
    --allowed-hosts, or an app made without a policy, as tests' TestClient)."""
    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    public_paths: frozenset[str] = PUBLIC_PATHS

    @classmethod
    def for_bind(cls, host: str, api_key: str | None = None, extra_hosts: tuple[str, ...] = (),
                 **kw: Any) -> HTTPPolicy:
        """The policy of a server bound to host: its own name, localhost and extra_hosts ("*": any) for
        a specific address; any Host for a wildcard bind unless extra_hosts are given."""
        if "*" in extra_hosts:
            return cls(api_key=api_key, allowed_hosts=None, **kw)
        if host in ("0.0.0.0", "::", "") and not extra_hosts:
            return cls(api_key=api_key, allowed_hosts=None, **kw)
        names = {"localhost", host.lower().strip("[]"), *(h.lower().strip("[]") for h in extra_hosts)}
        return cls(api_key=api_key, allowed_hosts=frozenset(names), **kw)


class Admission:
    """Whether the server takes new requests (a graceful shutdown closes it), and how many requests
    are being answered now (the shutdown waits for them)."""

    def __init__(self) -> None:
        self.closed = False
        self.active = 0                     # requests inside the app, /health aside (the loop's thread)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_name(value: str) -> str:
    """The name in a Host header: without the port, brackets or a trailing dot, lower case."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    if v.count(":") == 1:
        v = v.split(":")[0]
    return v.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """The ASGI middleware of the module docstring: checks, in order, Host, admission, the API key and
    the body's type, size and arrival, then hands the app the whole body."""

    def __init__(self, app: ASGIApp, policy: HTTPPolicy, admission: Admission,
                 count: Callable[[str, int], None]) -> None:
        self.app, self.policy, self.admission, self.count = app, policy, admission, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        headers: dict[bytes, bytes] = {}
        for k, v in scope.get("headers", ()):
            headers.setdefault(k, v)
        refusal = self._refusal(path, method, headers)
        if refusal is not None:
            await self._answer(send, path, refusal)
            return
        body = b""
        if method in ("POST", "PUT", "PATCH"):
            try:
                got = await self._read_body(receive, headers)
            except APIError as e:
                await self._answer(send, path, e, close=True)
                return
            if got is None:                     # the client left while sending
                return
            body = got
        sent = False

        async def replay() -> Message:          # the body once, then the connection's own events
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        counted = path not in self.policy.public_paths
        self.admission.active += counted
        try:
            await self.app(scope, replay, send)
        finally:
            self.admission.active -= counted

    def _refusal(self, path: str, method: str, headers: dict[bytes, bytes]) -> APIError | None:
        p = self.policy
        if p.allowed_hosts is not None and b"host" in headers:
            name = _host_name(headers[b"host"].decode("latin-1"))
            if not _is_ip(name) and name not in p.allowed_hosts:
                return APIError(403, f"Host '{name[:100]}' is not one this server answers to; start it with "
                                f"--allowed-hosts {name[:100]} to allow it", code="host_not_allowed")
        if self.admission.closed:
            return APIError(503, "the server is shutting down", "server_error", code="shutting_down")
        if p.api_key is not None and path not in p.public_paths:
            given = headers.get(b"authorization", b"")
            token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(token, p.api_key.encode()):
                what = "a wrong API key" if token else "no API key"
                return APIError(401, f"{what}: send the server's --api-key as 'Authorization: Bearer KEY'",
                                code="invalid_api_key")
        if method in ("POST", "PUT", "PATCH"):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            declared = headers.get(b"content-length", b"")
            if declared.isdigit() and int(declared) > p.max_body_bytes:
                return APIError(413, f"request body of {int(declared)} bytes exceeds the limit of "
                                f"{p.max_body_bytes} bytes", code="body_too_large")
            if media != b"application/json" and not media.endswith(b"+json"):
                shown = media.decode("latin-1")[:60] or "none"
                return APIError(415, f"the body must be JSON with 'Content-Type: application/json' (got "
                                f"{shown})", code="unsupported_media_type")
        return None

    async def _read_body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes | None:
        """The whole body within the size and time limits; None if the client disconnected."""
        p = self.policy
        buf = bytearray()
        try:
            async with asyncio.timeout(p.body_timeout_s):
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        return None
                    buf += msg.get("body", b"")
                    if len(buf) > p.max_body_bytes:
                        raise APIError(413, f"request body exceeds the limit of {p.max_body_bytes} bytes",
                                       code="body_too_large")
                    if not msg.get("more_body", False):
                        return bytes(buf)
        except TimeoutError:
            declared = headers.get(b"content-length", b"?").decode("latin-1")[:20]
            raise APIError(408, f"the body did not arrive within {p.body_timeout_s:g} s ({len(buf)} of "
                           f"{declared} bytes)", code="request_timeout") from None

    async def _answer(self, send: Send, path: str, e: APIError, close: bool = False) -> None:
        self.count(path, e.status)
        raw = json.dumps(e.body()).encode()
        hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
        if e.status == 401:
            hdrs.append((b"www-authenticate", b"Bearer"))
        if close or e.status == 503:
            hdrs.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": e.status, "headers": hdrs})
        await send({"type": "http.response.body", "body": raw})

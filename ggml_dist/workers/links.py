"""Framed messages over TCP between the driver and the stage actors, and between stages (the direct
transport, workers/direct.py and workers/stage_loop.py).

    frame   = u32 header length | msgpack header (a dict, "t" its type) | body (header["n"] bytes, or none)
    Link    one connected socket: send(header, body) under a lock (several threads send on one link),
            recv() -> (header, body) from the one thread that reads it

A connection starts with a "hello" frame carrying the pipeline's secret (random, handed to every stage
through Ray, which guards its own ports with its token); a peer that does not know it is dropped before
anything it sends is read. Bodies are the wire messages of workers/wire.py (bytes, no pickle), read
straight into one buffer.
"""
from __future__ import annotations

import hmac
import socket
import struct
import threading
from typing import Any

import msgpack

_LEN = struct.Struct("<I")
MAX_HEADER = 64 << 20          # a plan description rides in the header the first time it is sent
MAX_BODY = 4 << 30
HELLO_MAX = 1024               # what an unauthenticated peer may send


class LinkClosed(ConnectionError):
    """The other end closed the connection (or it broke)."""


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise LinkClosed("connection closed")
        got += k
    return buf


class Link:
    """One end of a framed connection."""

    def __init__(self, sock: socket.socket, name: str = "") -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)     # a frame goes out at once
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()
        self.closed = False

    @classmethod
    def connect(cls, address: str, secret: bytes, who: Any, timeout: float = 10.0) -> Link:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=timeout)
        sock.settimeout(None)
        link = cls(sock, address)
        link.send({"t": "hello", "secret": secret.hex(), "who": who})
        return link

    def send(self, header: dict[str, Any], body: bytes | bytearray | memoryview | None = None) -> None:
        if body is not None:
            header["n"] = len(body)
        h = msgpack.packb(header, use_bin_type=True)
        with self._send_lock:
            try:
                if body is None or len(body) < 16384:         # small: one write
                    self.sock.sendall(_LEN.pack(len(h)) + h + (bytes(body) if body is not None else b""))
                else:
                    self.sock.sendall(_LEN.pack(len(h)) + h)
                    self.sock.sendall(body)
            except OSError as e:
                self.closed = True
                raise LinkClosed(f"{self.name}: {e}") from e

    def recv(self, max_header: int = MAX_HEADER) -> tuple[dict[str, Any], bytearray | None]:
        try:
            (hlen,) = _LEN.unpack(_recv_exact(self.sock, 4))
            if hlen > max_header:
                raise LinkClosed(f"{self.name}: a {hlen}-byte frame header (at most {max_header})")
            header = msgpack.unpackb(_recv_exact(self.sock, hlen), raw=False, strict_map_key=False)
            if not isinstance(header, dict) or not isinstance(header.get("t"), str):
                raise LinkClosed(f"{self.name}: a frame without a type")
            n = header.get("n")
            if n is None:
                return header, None
            if not isinstance(n, int) or not 0 <= n <= MAX_BODY:
                raise LinkClosed(f"{self.name}: a frame body of {n!r} bytes")
            return header, _recv_exact(self.sock, n)
        except OSError as e:
            self.closed = True
            raise LinkClosed(f"{self.name}: {e}") from e
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            self.closed = True
            raise LinkClosed(f"{self.name}: a malformed frame ({e})") from e

    def accept_hello(self, secret: bytes) -> Any:
        """The peer's "who" if its hello carries the secret; else LinkClosed (and the socket closed)."""
        try:
            header, _ = self.recv(max_header=HELLO_MAX)
            given = header.get("secret")
            if header["t"] != "hello" or not isinstance(given, str) or not hmac.compare_digest(given, secret.hex()):
                raise LinkClosed(f"{self.name}: a peer without the pipeline's secret")
            return header.get("who")
        except LinkClosed:
            self.close()
            raise

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

"""An all-gather among the K ranks of a tensor-parallel group, on persistent TCP links (issue 54 item 3).

    listener = MeshListener(host)             # rank r listens first; listener.address is "ip:port"
    ...the ranks' addresses travel however the caller likes (Ray, a pipe)...
    coll = mesh_connect(rank, addresses, secret, listener)
    parts = coll.all_gather(part)             # every rank's part, in rank order (own included)
    coll.close()

Each pair of ranks shares one Link (workers/links.py: its authenticated hello), opened once: rank r
connects to every lower rank and accepts every higher one, so the mesh forms the same way
whichever rank starts first, and K(K-1)/2 connections exist in all. One exchange is one step, as in
distributed-llama for K <= 4: a rank sends its part to every peer and then reads every peer's part, with
no Ray call and no coordinator in between. After the hello an exchange's frame is a fixed 24-byte header
(the round, ndim, the shape) and the part's bytes: read exactly, the body straight into its array (a
msgpack frame and three reads cost 82 us of CPU an exchange, this 42-57 us: tensor parallelism makes 89 of
them a token on a 22-layer model).

Sends must not wait on a peer that is itself sending. A small part (<= INLINE_MAX: a decode step's
activations, 8 KiB per token at n_embd 2048) is written inline: each socket's send buffer is set to hold
two rounds of it, and a rank cannot be more than one round ahead of any peer (round r+1 starts after it
read the peer's round r), so the write never waits on the reader. A larger part (a prompt's) is sent by a
pool thread per peer while the caller reads.

Nothing here knows Ray: the addresses and the secret are passed in, so plain processes (the tests,
benchmarks/collective_latency.py) and stage actors set the mesh up the same way.
"""
from __future__ import annotations

import socket
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

# the protocol ALL_GATHER's kernel calls, and its error (here: a peer closed, broke the protocol, or was not
# reached; the error names the rank), defined once beside the in-process group
from ..backends.collective import Collective as Collective
from ..backends.collective import CollectiveError as CollectiveError
from .links import Link, LinkClosed

INLINE_MAX = 256 << 10          # bytes of a part sent from the caller's thread
MAX_NDIM = 4
_HEAD = struct.Struct("<6I")    # an exchange's frame: round (mod 2^32), ndim, the shape padded to 4 dims
SOCKBUF = 1 << 20               # send and receive buffer asked per socket (Linux doubles it): two rounds of
                                # INLINE_MAX fit the send buffer, and a part is not held up by a receive
                                # window still growing (K=4, 32 tokens across hosts: 5.4 -> 3.1 ms)


# ---------------------------------------------------------------------------------------------- mesh


class MeshCollective:
    """The all-gather over one Link per peer; links[j] is the link to rank j (None at j == rank)."""

    def __init__(self, rank: int, links: list[Link | None]) -> None:
        assert links[rank] is None and all(lk is not None for j, lk in enumerate(links) if j != rank), \
            "one link to every other rank"
        self.rank, self.size = rank, len(links)
        self.links = links
        self.peers = [j for j in range(self.size) if j != rank]
        self.n_rounds = 0
        self._heads = [memoryview(bytearray(_HEAD.size)) for _ in links]  # each peer's frame header
        self._pool: ThreadPoolExecutor | None = None       # made on the first large part
        self._closed = False

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        """Every rank's part in rank order: the own entry is `part` itself, the others fresh arrays."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the collective is closed")
        if part.dtype != np.float32 or not part.flags.c_contiguous or part.ndim > MAX_NDIM:
            raise ValueError(f"rank {self.rank}: a part must be a C-contiguous float32 array of at most "
                             f"{MAX_NDIM} dimensions (got {part.dtype}, {part.ndim}-d, "
                             f"c_contiguous={part.flags.c_contiguous})")
        seq = self.n_rounds
        self.n_rounds += 1
        header = _HEAD.pack(seq & 0xFFFFFFFF, part.ndim, *part.shape, *[0] * (MAX_NDIM - part.ndim))
        body = memoryview(part.data).cast("B") if part.size else memoryview(b"")  # its own bytes, no copy
        sends = self._send_all(header, body)
        out: list[np.ndarray] = [part] * self.size
        try:
            for j in self.peers:
                out[j] = self._recv_part(j, seq, part.ndim)
        finally:
            for j, f in sends:
                self._check_send(j, f)
        return out

    def _send(self, j: int, header: bytes, body: memoryview) -> None:
        """One frame to rank j on its link's socket: the fixed header, then the part's bytes."""
        sock = self.links[j].sock                           # type: ignore[union-attr]
        try:
            if len(body) <= INLINE_MAX:
                sock.sendall(header + body.tobytes())       # small: one write
            else:
                sock.sendall(header)
                sock.sendall(body)
        except OSError as e:
            raise CollectiveError(f"rank {self.rank}: sending to rank {j} failed: {e}") from e

    def _send_all(self, header: bytes, body: memoryview) -> list[tuple[int, Future]]:
        if len(body) <= INLINE_MAX:
            for j in self.peers:
                self._send(j, header, body)
            return []
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=len(self.peers), thread_name_prefix=f"ag{self.rank}")
        return [(j, self._pool.submit(self._send, j, header, body)) for j in self.peers]

    def _check_send(self, j: int, f: Future) -> None:
        e = f.exception()                                   # waits: the caller may reuse its part after
        if isinstance(e, CollectiveError):
            raise e
        if e is not None:
            raise CollectiveError(f"rank {self.rank}: sending to rank {j} failed: {e}") from e

    def _recv_part(self, j: int, seq: int, ndim: int) -> np.ndarray:
        """Rank j's part of round seq: exactly its fixed header, then its body read straight into the array
        (never past it: the peer may have sent its next round already)."""
        sock, head = self.links[j].sock, self._heads[j]     # type: ignore[union-attr]
        try:
            self._read_exact(sock, head, j)
            h = _HEAD.unpack_from(head)
            if h[0] != seq & 0xFFFFFFFF or h[1] != ndim or any(h[2 + ndim:]):
                raise CollectiveError(f"rank {self.rank}: rank {j} sent a {h[1]}-d part of round {h[0]} in round "
                                      f"{seq} (expected an {ndim}-d part)")
            out = np.empty(h[2:2 + ndim], np.float32)
            if out.size:                                    # a part may be empty (a rank's expert rows)
                self._read_exact(sock, out.data.cast("B"), j)
            return out
        except OSError as e:
            raise CollectiveError(f"rank {self.rank}: rank {j}'s link failed ({e})") from e

    def _read_exact(self, sock: socket.socket, into: memoryview, j: int) -> None:
        got, n = 0, len(into)
        while got < n:
            k = sock.recv_into(into[got:])
            if k == 0:
                raise CollectiveError(f"rank {self.rank}: rank {j} closed its link")
            got += k

    def close(self) -> None:
        self._closed = True
        for lk in self.links:
            if lk is not None:
                lk.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------- setup


class MeshListener:
    """Rank r's server socket, opened before the addresses are exchanged. `advertise` is the IP the
    others reach it at (default: the bound host, or this host's name when bound to all interfaces)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> None:
        self.sock = socket.create_server((host, port), backlog=64)
        ip = advertise or (host if host not in ("", "0.0.0.0") else socket.gethostbyname(socket.gethostname()))
        self.address = f"{ip}:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()


def _tune(link: Link, exchange_timeout_s: float | None) -> Link:
    link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
    link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
    link.sock.settimeout(exchange_timeout_s)
    return link


def mesh_connect(rank: int, addresses: list[str], secret: bytes, listener: MeshListener,
                 timeout_s: float = 30.0, exchange_timeout_s: float | None = None) -> MeshCollective:
    """Open rank `rank`'s links: connect to every lower rank, then accept every higher one (a hello with
    the secret and the peer's rank). Closes the listener. A peer without the secret is dropped, as the
    stages' loop drops one, and the mesh waits on; a rank that has not connected within timeout_s raises
    CollectiveError. exchange_timeout_s bounds each read and write of an exchange (None: a peer that
    vanishes without closing its socket, a cut cable, is waited for; a killed process is seen at once)."""
    size = len(addresses)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} of {size} addresses")
    links: list[Link | None] = [None] * size
    try:
        deadline = time.monotonic() + timeout_s
        for j in range(rank):
            links[j] = _tune(_connect(rank, j, addresses[j], secret, deadline), exchange_timeout_s)
        _accept_higher(rank, links, secret, listener, timeout_s, exchange_timeout_s)
    except BaseException:
        for opened in links:
            if opened is not None:
                opened.close()
        raise
    finally:
        listener.close()
    return MeshCollective(rank, links)


def _connect(rank: int, j: int, address: str, secret: bytes, deadline: float) -> Link:
    """Rank j's link; a refused connection is tried again until the deadline (addresses known in
    advance, a fixed port on each host, may be dialled before rank j listens)."""
    while True:
        try:
            return Link.connect(address, secret, who=rank, timeout=max(0.1, deadline - time.monotonic()))
        except ConnectionRefusedError as e:
            if time.monotonic() > deadline:
                raise CollectiveError(f"rank {rank}: rank {j} at {address} refused the connection until "
                                      "the timeout") from e
            time.sleep(0.05)
        except OSError as e:
            raise CollectiveError(f"rank {rank}: cannot reach rank {j} at {address}: {e}") from e


def _accept_higher(rank: int, links: list[Link | None], secret: bytes, listener: MeshListener,
                   timeout_s: float, exchange_timeout_s: float | None) -> None:
    size, refused = len(links), list[str]()
    deadline = time.monotonic() + timeout_s
    while any(links[j] is None for j in range(rank + 1, size)):
        listener.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            sock, peer = listener.sock.accept()
        except TimeoutError as e:
            missing = [j for j in range(rank + 1, size) if links[j] is None]
            why = f"; refused {len(refused)} peer(s) ({'; '.join(refused)})" if refused else ""
            raise CollectiveError(f"rank {rank}: ranks {missing} did not connect within {timeout_s} s{why}") from e
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        lk = Link(sock, f"{peer[0]}:{peer[1]}")
        try:
            who = lk.accept_hello(secret)              # closes the socket of a peer without the secret
        except LinkClosed as e:
            refused.append(str(e))
            continue
        if not isinstance(who, int) or not rank < who < size or links[who] is not None:
            lk.close()
            refused.append(f"{lk.name} said it was rank {who!r}")
            continue
        links[who] = _tune(lk, exchange_timeout_s)

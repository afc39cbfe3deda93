"""The direct transport's frames (workers/links.py) and its door: a peer without the pipeline's secret
is dropped before it can send a call, and the pipeline goes on."""
from __future__ import annotations

import socket
import struct

import msgpack
import numpy as np
import pytest

from ggml_dist.workers.links import MAX_HEADER, Link, LinkClosed


def _pair() -> tuple[Link, Link]:
    a, b = socket.socketpair()
    return Link(a, "a"), Link(b, "b")


@pytest.mark.parametrize("n", [0, 1, 16383, 16384, 3 << 20])
def test_frames_carry_header_and_body(n):
    a, b = _pair()
    body = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    import threading
    t = threading.Thread(target=a.send, args=({"t": "result", "frm": 1, "seq": 7}, body))
    t.start()
    h, got = b.recv()
    t.join()
    assert h == {"t": "result", "frm": 1, "seq": 7, "n": n} and bytes(got) == body
    a.send({"t": "done", "seq": 8})
    assert b.recv() == ({"t": "done", "seq": 8}, None)


def test_hello_without_the_secret_is_refused():
    secret = b"0123456789abcdef"
    a, b = _pair()
    a.send({"t": "hello", "secret": secret.hex(), "who": "driver"})
    assert b.accept_hello(secret) == "driver"
    c, d = _pair()
    c.send({"t": "hello", "secret": (b"x" * 16).hex(), "who": "driver"})
    with pytest.raises(LinkClosed, match="secret"):
        d.accept_hello(secret)
    e, f = _pair()                                     # a big first frame is not even read
    e.send({"t": "hello", "secret": "y" * 2000})
    with pytest.raises(LinkClosed, match="frame header"):
        f.accept_hello(secret)


@pytest.mark.parametrize("raw", [struct.pack("<I", MAX_HEADER + 1),
                                 struct.pack("<I", 3) + b"\xc1\xc1\xc1",              # not msgpack
                                 struct.pack("<I", 1) + msgpack.packb(5),               # not a dict
                                 struct.pack("<I", 8) + msgpack.packb({"t": "x", "n": -1}).ljust(8, b"\0")])
def test_malformed_frames_close_the_link(raw):
    a, b = _pair()
    a.sock.sendall(raw)
    a.sock.shutdown(socket.SHUT_WR)
    with pytest.raises(LinkClosed):
        b.recv()


def test_a_stranger_cannot_drive_a_stage(tmp_path):
    ray = pytest.importorskip("ray")
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    from ggml_dist.model.ubatch import Batch
    from ggml_dist.workers.cluster import Pipeline
    from ggml_dist.workers.local_ray import connect
    path = str(write_synthetic(tmp_path / "m.gguf", SyntheticSpec(wtype="Q4_0", n_layer=2, seed=3)))
    want = LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=64)).decode(Batch.from_tokens([1, 2, 3]))
    connect(num_cpus=2)
    try:
        pl = Pipeline.launch(path, 2, ContextParams(n_ctx=64), calls="direct")
        try:
            assert pl.direct is not None
            host, _, port = pl.direct.addresses[0].rpartition(":")
            s = socket.create_connection((host, int(port)), timeout=10)
            stranger = Link(s, "stranger")
            stranger.send({"t": "hello", "secret": "00" * 16, "who": "driver"})
            stranger.send({"t": "call", "seq": 0, "pid": "x", "desc": None, "ups": []}, b"")
            s.settimeout(10)
            assert s.recv(1) == b""                      # closed on it, nothing answered
            assert np.array_equal(pl.ctx.decode(Batch.from_tokens([1, 2, 3])), want)
        finally:
            pl.shutdown()
    finally:
        ray.shutdown()

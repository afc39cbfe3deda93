"""The msgpack wire codec: round trips, zero-copy decode, and rejection of malformed messages."""
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ggml_dist.core.types import GGMLType
from ggml_dist.workers.wire import WireError, WireTensor, decode, encode


def _msg():
    a = np.arange(24, dtype=np.float32).reshape(1, 2, 3, 4)
    b = np.arange(6, dtype=np.int32).reshape(1, 1, 1, 6)
    q = np.random.default_rng(0).integers(0, 255, (1, 1, 2, 18), dtype=np.uint8)  # 2 rows of Q4_0
    return [WireTensor("a", GGMLType.F32, (4, 3, 2, 1), a), WireTensor("ids", GGMLType.I32, (6, 1, 1, 1), b),
            WireTensor("w", GGMLType.Q4_0, (32, 2, 1, 1), q)]


# round trip of float, int and block types, with the meta map
def test_round_trip():
    ts = _msg()
    out, meta = decode(encode(ts, {"plan": 3}))
    assert meta == {"plan": 3}
    for a, b in zip(ts, out):
        assert (a.name, a.type, a.ne) == (b.name, b.type, b.ne)
        assert np.array_equal(a.data, b.data)


# decoded arrays are views into the message, not copies
def test_decode_is_zero_copy():
    msg = encode(_msg())
    out, _ = decode(msg)
    assert all(np.shares_memory(t.data, np.frombuffer(msg, np.uint8)) for t in out)


# a non-contiguous array is packed densely
def test_encode_non_contiguous():
    a = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4).transpose(0, 1, 3, 2)
    (t,), _ = decode(encode([WireTensor("t", GGMLType.F32, (4, 4, 1, 1), a)]))
    assert np.array_equal(t.data, a)


# data whose size disagrees with ne is refused at encode time
def test_encode_size_mismatch():
    with pytest.raises(WireError):
        encode([WireTensor("x", GGMLType.F32, (5, 1, 1, 1), np.zeros(4, np.float32))])


def _tamper(field, value):
    msg = encode(_msg())
    hlen = int.from_bytes(msg[:4], "little")
    header = msgpack.unpackb(bytes(msg[4:4 + hlen]))
    header["tensors"][0][field] = value
    h2 = msgpack.packb(header)
    return len(h2).to_bytes(4, "little") + h2 + bytes(msg[4 + hlen:])


# every header field is checked against the payload before use
@pytest.mark.parametrize("field,value", [
    ("type", 999), ("ne", [4, 3, 2]), ("ne", [4, 3, 2, -1]), ("ne", [2**50, 1, 1, 1]),
    ("nb", [4, 16, 48, 1]), ("nbytes", 10**12), ("offs", -5), ("offs", 10**9), ("name", "x" * 300),
    ("name", 5),
])
def test_tampered_header_rejected(field, value):
    with pytest.raises(WireError):
        decode(_tamper(field, value))


# truncated messages are rejected at any length
def test_truncated():
    msg = bytes(encode(_msg()))
    for n in range(0, len(msg) - 1, 7):
        with pytest.raises(WireError):
            decode(msg[:n])


# random bytes never crash the decoder: WireError or a valid result
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=256))
def test_garbage(data):
    try:
        decode(data)
    except WireError:
        pass


# an empty tensor (a ubatch with no output rows) round-trips
def test_empty_tensor():
    (t,), _ = decode(encode([WireTensor("e", GGMLType.F32, (8, 0, 1, 1), np.zeros((1, 1, 0, 8), np.float32))]))
    assert t.data.shape == (1, 1, 0, 8)

"""The wire codec for tensors between driver and stage actors: a msgpack header plus raw bytes.

    message = u32 header_len | msgpack header | payload bytes of every tensor, back to back
    header  = {"v": 1, "tensors": [{"name", "type", "ne", "nb", "offs", "nbytes"}, ...], "meta": {...}}

Encoding copies each tensor's bytes exactly once, from a memoryview of the array into the message (no
tobytes() intermediate); decoding returns numpy views into the message (no copy) after validating every
header field against the message: a malformed or hostile message is rejected with WireError, never
trusted. No pickle anywhere.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ..core.tensor import MAX_DIMS
from ..core.types import TYPE_TRAITS, GGMLType

VERSION = 1
MAX_TENSORS = 4096
MAX_HEADER = 1 << 20
MAX_KEY = 256           # a tensor's key on the wire (a name, or a plan's export key)
_LEN = struct.Struct("<I")
_NP = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16,
       GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32, GGMLType.I64: np.int64,
       GGMLType.F64: np.float64}


# a message as it arrives: bytes, or a uint8 array (cluster.StageActor passes on the zero-copy arrays of Ray)
Message = bytes | bytearray | memoryview | np.ndarray


SMALL_MESSAGE = 64 << 10     # below Ray's inline limit (100 KB): kept in the caller's memory, not plasma


def ray_payload(msg: bytearray | bytes) -> bytes | np.ndarray:
    """A message as a Ray call's argument or result. Small: bytes, which Ray packs with msgpack (an
    ndarray goes through cloudpickle: ~0.2 ms more per call on each side, measured on a 2-core VM, which
    a decode step pays per stage). Large (prompt activations, logits): a uint8 array, which Ray stores
    and hands on without a copy."""
    return bytes(msg) if len(msg) < SMALL_MESSAGE else np.frombuffer(msg, dtype=np.uint8)


class WireError(ValueError):
    """A message that does not describe its tensors consistently."""


@dataclass(frozen=True, slots=True)
class WireTensor:
    """One tensor on the wire: ggml metadata (dense strides) and its bytes."""
    name: str
    type: GGMLType
    ne: tuple[int, int, int, int]
    data: np.ndarray           # numpy order (ne reversed); uint8 rows of blocks for block types

    @property
    def nb(self) -> tuple[int, int, int, int]:
        tt = TYPE_TRAITS[self.type]
        nb0 = tt.type_size
        nb1 = nb0 * (self.ne[0] // tt.blck_size)
        return (nb0, nb1, nb1 * self.ne[1], nb1 * self.ne[1] * self.ne[2])


def _dense_nbytes(type: GGMLType, ne: Sequence[int]) -> int:
    tt = TYPE_TRAITS[type]
    return ne[0] // tt.blck_size * tt.type_size * ne[1] * ne[2] * ne[3]


def encode(tensors: Sequence[WireTensor], meta: dict[str, Any] | None = None) -> bytearray:
    """Pack tensors (made contiguous if they are not) and a small metadata dict into one message."""
    arrays = [np.ascontiguousarray(t.data) for t in tensors]
    entries: list[dict[str, Any]] = []
    offs = 0
    for t, a in zip(tensors, arrays):
        n = _dense_nbytes(t.type, t.ne)
        if a.nbytes != n:
            raise WireError(f"'{t.name}': {a.nbytes} B of data for {t.type.name}{list(t.ne)} ({n} B)")
        entries.append({"name": t.name, "type": int(t.type), "ne": list(t.ne), "nb": list(t.nb),
                        "offs": offs, "nbytes": n})
        offs += n
    header = msgpack.packb({"v": VERSION, "tensors": entries, "meta": meta or {}}, use_bin_type=True)
    out = bytearray(_LEN.size + len(header) + offs)
    _LEN.pack_into(out, 0, len(header))
    base = _LEN.size + len(header)
    out[_LEN.size:base] = header
    view = memoryview(out)
    for e, a in zip(entries, arrays):
        if e["nbytes"]:                          # an empty tensor (no output rows) has no bytes
            view[base + e["offs"]: base + e["offs"] + e["nbytes"]] = a.data.cast("B")   # a.data is memoryview(a)
    return out


def decode(msg: Message) -> tuple[list[WireTensor], dict[str, Any]]:
    """Validate and unpack a message; tensors are zero-copy views into msg."""
    # an array's .data is memoryview(array); numpy's stubs type arrays as buffers only from Python 3.12
    view = (msg.data if isinstance(msg, np.ndarray) else memoryview(msg)).cast("B")
    if len(view) < _LEN.size:
        raise WireError(f"message of {len(view)} B is shorter than its length prefix")
    (hlen,) = _LEN.unpack_from(view, 0)
    if hlen > MAX_HEADER or _LEN.size + hlen > len(view):
        raise WireError(f"header length {hlen} does not fit in a {len(view)} B message")
    try:
        header = msgpack.unpackb(view[_LEN.size:_LEN.size + hlen], raw=False, strict_map_key=True,
                                 max_array_len=MAX_TENSORS * 8, max_map_len=64, max_str_len=4096)
    except Exception as e:  # noqa: BLE001  (msgpack raises several unrelated types on garbage; re-raised)
        raise WireError(f"header is not valid msgpack: {e}") from None
    if not isinstance(header, dict) or header.get("v") != VERSION:
        raise WireError(f"unknown header (version {header.get('v') if isinstance(header, dict) else '?'})")
    entries, meta = header.get("tensors"), header.get("meta", {})
    if not isinstance(entries, list) or len(entries) > MAX_TENSORS or not isinstance(meta, dict):
        raise WireError("header 'tensors' must be a list (at most 4096) and 'meta' a map")
    payload = view[_LEN.size + hlen:]
    return [_decode_one(e, payload) for e in entries], meta


def _decode_one(e: Any, payload: memoryview) -> WireTensor:
    if not isinstance(e, dict):
        raise WireError("tensor entry is not a map")
    name, ne, nb = e.get("name"), e.get("ne"), e.get("nb")
    type_id: Any = e.get("type")        # any msgpack value: GGMLType() refuses a non-member with ValueError
    offs, nbytes = e.get("offs"), e.get("nbytes")
    if not isinstance(name, str) or len(name) > MAX_KEY:
        raise WireError(f"tensor key {str(name)[:40]!r} is not a string of at most {MAX_KEY} characters")
    try:
        type = GGMLType(type_id)
    except ValueError:
        raise WireError(f"'{name}': unknown type id {type_id!r}") from None
    if type not in TYPE_TRAITS:
        raise WireError(f"'{name}': type {type.name} has no block layout")
    if not (isinstance(ne, list) and len(ne) == MAX_DIMS and all(isinstance(n, int) and 0 <= n < 2**40
                                                                 for n in ne)):
        raise WireError(f"'{name}': ne {ne!r} is not 4 non-negative integers")
    if ne[0] % TYPE_TRAITS[type].blck_size:
        raise WireError(f"'{name}': ne[0]={ne[0]} is not a multiple of the {type.name} block size")
    wt = WireTensor(name, type, tuple(ne), np.empty(0))
    if nb != list(wt.nb):
        raise WireError(f"'{name}': strides {nb!r} are not the dense strides {list(wt.nb)}")
    want = _dense_nbytes(type, ne)
    if not (isinstance(offs, int) and isinstance(nbytes, int)) or nbytes != want or offs < 0 \
            or offs + nbytes > len(payload):
        raise WireError(f"'{name}': {nbytes!r} B at offset {offs!r} (expected {want} B) does not fit "
                        f"the {len(payload)} B payload")
    raw = np.frombuffer(payload, dtype=np.uint8, count=nbytes, offset=offs)
    shape = (ne[3], ne[2], ne[1], ne[0])
    if type in _NP:
        data = raw.view(_NP[type]).reshape(shape)
    else:
        tt = TYPE_TRAITS[type]
        data = raw.reshape((*shape[:3], ne[0] // tt.blck_size * tt.type_size))
    return WireTensor(name, type, wt.ne, data)

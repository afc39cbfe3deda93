"""GGUF loading: a small, defensive parser over a read-only memory map (mirrors gguf.cpp's gguf_init).

The file is untrusted input. Every count and length is checked against the bytes that remain before
anything is allocated, so a corrupt or hostile file raises GGUFError (naming the file, the field and the
numbers) instead of crashing, hanging or allocating more memory than the file holds. Tensor data is never
read here: `GGUFFile.data` returns a zero-copy uint8 view of the mapped bytes.

Layout (little-endian, versions 2 and 3):
    magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x (string key | u32 value type | value)
    n_tensors x (string name | u32 n_dims | n_dims x u64 ne | u32 type | u64 offset)
    padding to `general.alignment` | tensor data (offsets are relative to here)
"""
from __future__ import annotations

import enum
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ggml_dist.core.types import TYPE_TRAITS, GGMLType

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
MAX_ARRAY_NESTING = 8   # gguf.cpp allows no nesting at all; a little is harmless, unbounded recursion is not


class GGUFError(ValueError):
    """A GGUF file is malformed or does not hold what the caller needs."""


class GGUFValueType(enum.IntEnum):
    """gguf_type: the type tag of a metadata value."""
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# scalar value types: struct format and numpy dtype (both little-endian)
_SCALAR_FMT: dict[GGUFValueType, tuple[str, np.dtype]] = {
    GGUFValueType.UINT8: ("<B", np.dtype("<u1")),
    GGUFValueType.INT8: ("<b", np.dtype("<i1")),
    GGUFValueType.UINT16: ("<H", np.dtype("<u2")),
    GGUFValueType.INT16: ("<h", np.dtype("<i2")),
    GGUFValueType.UINT32: ("<I", np.dtype("<u4")),
    GGUFValueType.INT32: ("<i", np.dtype("<i4")),
    GGUFValueType.FLOAT32: ("<f", np.dtype("<f4")),
    GGUFValueType.BOOL: ("<?", np.dtype("?")),
    GGUFValueType.UINT64: ("<Q", np.dtype("<u8")),
    GGUFValueType.INT64: ("<q", np.dtype("<i8")),
    GGUFValueType.FLOAT64: ("<d", np.dtype("<f8")),
}

# smallest encoding of one array element / kv pair / tensor info, used to bound counts by the file size
_MIN_STRING = 8                       # u64 length, empty text
_MIN_ARRAY = 4 + 8                    # u32 element type + u64 count
_MIN_KV = _MIN_STRING + 4 + 1         # key, type, smallest value
_MIN_TENSOR_INFO = _MIN_STRING + 4 + 4 + 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's header: ne in ggml order padded to 4 with 1, offset absolute in the file."""
    name: str
    type: GGMLType
    ne: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def n_dims(self) -> int:
        n = GGML_MAX_DIMS
        while n > 1 and self.ne[n - 1] == 1:
            n -= 1
        return n


# ---------------------------------------------------------------------------------------------------
# reader: a cursor over the mapped bytes that checks every read against the end of the file

class _Reader:
    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf = buf
        self.size = len(buf)
        self.path = path
        self.pos = 0

    def fail(self, msg: str) -> GGUFError:
        return GGUFError(f"{self.path}: {msg}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated reading {what}: need {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")

    def scalar(self, t: GGUFValueType, what: str) -> Any:
        fmt, dt = _SCALAR_FMT[t]
        self.need(dt.itemsize, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += dt.itemsize
        return v

    def u32(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(GGUFValueType.UINT64, what)

    def string(self, what: str) -> str:
        n = self.u64(f"{what} length")
        if n > self.size - self.pos:
            raise self.fail(f"{what}: string length {n} at offset {self.pos - 8} runs past the end of "
                            f"the file ({self.size} bytes)")
        s = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        # surrogateescape keeps invalid UTF-8 bytes recoverable (s.encode("utf-8", "surrogateescape"))
        return s.decode("utf-8", errors="surrogateescape")

    def value_type(self, what: str) -> GGUFValueType:
        t = self.u32(f"{what} type")
        try:
            return GGUFValueType(t)
        except ValueError:
            raise self.fail(f"{what}: unknown value type {t} at offset {self.pos - 4}") from None

    def value(self, t: GGUFValueType, what: str, depth: int = 0) -> Any:
        if t == GGUFValueType.STRING:
            return self.string(what)
        if t != GGUFValueType.ARRAY:
            return self.scalar(t, what)
        if depth >= MAX_ARRAY_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_ARRAY_NESTING}")
        et = self.value_type(f"{what} element")
        n = self.u64(f"{what} count")
        min_elem = (_MIN_STRING if et == GGUFValueType.STRING else
                    _MIN_ARRAY if et == GGUFValueType.ARRAY else _SCALAR_FMT[et][1].itemsize)
        if n * min_elem > self.size - self.pos:
            raise self.fail(f"{what}: array of {n} {et.name} elements needs at least {n * min_elem} bytes "
                            f"at offset {self.pos}, only {self.size - self.pos} remain")
        if et in _SCALAR_FMT:
            dt = _SCALAR_FMT[et][1]
            arr = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos).copy()
            self.pos += n * dt.itemsize
            return arr
        if et == GGUFValueType.STRING:
            return self._string_array(n, what)
        return [self.value(et, f"{what}[{i}]", depth + 1) for i in range(n)]

    def _string_array(self, n: int, what: str) -> list[str]:
        """Vocabularies hold ~10^5 strings: the same checks as string(), in one tight loop."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = struct.Struct("<Q").unpack_from
        out = []
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"truncated reading {what}[{i}] length at offset {pos}, file has {size}")
            (ln,) = unpack(buf, pos)
            pos += 8
            if ln > size - pos:
                raise self.fail(f"{what}[{i}]: string length {ln} at offset {pos - 8} runs past the end "
                                f"of the file ({size} bytes)")
            out.append(str(buf[pos:pos + ln], "utf-8", "surrogateescape"))
            pos += ln
        self.pos = pos
        return out


# ---------------------------------------------------------------------------------------------------
# file

class GGUFFile:
    """A parsed GGUF file: metadata, tensor infos, and mapped tensor data.

    metadata values: scalars as Python int/float/bool, strings as str, numeric arrays as numpy arrays
    (e.g. token scores), string and nested arrays as lists.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        size = os.path.getsize(self.path)
        if size < 4 + 4 + 8 + 8:
            raise GGUFError(f"{self.path}: file is {size} bytes, too small for a GGUF header (24 bytes)")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self.metadata: dict[str, Any] = {}
        self.metadata_types: dict[str, GGUFValueType] = {}
        self.tensors: dict[str, TensorInfo] = {}
        # .data is memoryview(self._mm): numpy's stubs type arrays as buffers only from Python 3.12
        self._parse(_Reader(self._mm.data, self.path))

    def _parse(self, r: _Reader) -> None:
        magic = bytes(r.buf[0:4])
        r.pos = 4
        if magic != GGUF_MAGIC:
            raise r.fail(f"bad magic {magic!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
        self.version = r.u32("version")
        if self.version not in (2, 3):
            hint = " (a big-endian file?)" if self.version & 0xFFFF == 0 else ""
            raise r.fail(f"unsupported GGUF version {self.version}{hint}; supported: 2, 3")
        n_tensors = r.u64("n_tensors")
        n_kv = r.u64("n_kv")
        remain = r.size - r.pos
        if n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO > remain:
            raise r.fail(f"header counts n_kv={n_kv}, n_tensors={n_tensors} need at least "
                         f"{n_kv * _MIN_KV + n_tensors * _MIN_TENSOR_INFO} bytes, only {remain} remain")

        for i in range(n_kv):
            key = r.string(f"key of kv {i}")
            if key in self.metadata:
                raise r.fail(f"duplicate metadata key '{key}' (kv {i})")
            t = r.value_type(f"kv '{key}'")
            self.metadata[key] = r.value(t, f"kv '{key}'")
            self.metadata_types[key] = t

        self.alignment = GGUF_DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a, at = self.metadata["general.alignment"], self.metadata_types["general.alignment"]
            if at != GGUFValueType.UINT32 or a <= 0 or a & (a - 1):
                raise r.fail(f"general.alignment must be a power-of-two u32, got {a!r} ({at.name})")
            self.alignment = a

        seen: set[str] = set()
        infos = [self._read_tensor_info(r, i, seen) for i in range(n_tensors)]
        data_start = -(-r.pos // self.alignment) * self.alignment
        self.data_offset = data_start
        for name, ttype, ne, rel in infos:
            nbytes = ne[0] // TYPE_TRAITS[ttype].blck_size * TYPE_TRAITS[ttype].type_size
            for n in ne[1:]:
                nbytes *= n
            if rel % self.alignment:
                raise r.fail(f"tensor '{name}': data offset {rel} is not a multiple of the alignment "
                             f"{self.alignment}")
            if data_start + rel + nbytes > r.size:
                raise r.fail(f"tensor '{name}': data [{data_start + rel}, {data_start + rel + nbytes}) "
                             f"runs past the end of the file ({r.size} bytes)")
            self.tensors[name] = TensorInfo(name, ttype, ne, data_start + rel, nbytes)

    def _read_tensor_info(self, r: _Reader, i: int, seen: set[str]) -> tuple[str, GGMLType, tuple[int, ...], int]:
        name = r.string(f"name of tensor {i}")
        if name in seen:
            raise r.fail(f"duplicate tensor name '{name}' (tensor {i})")
        seen.add(name)
        n_dims = r.u32(f"tensor '{name}' n_dims")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise r.fail(f"tensor '{name}': n_dims {n_dims} outside 1..{GGML_MAX_DIMS}")
        ne = [r.u64(f"tensor '{name}' ne[{d}]") for d in range(n_dims)]
        ne += [1] * (GGML_MAX_DIMS - n_dims)
        for d, n in enumerate(ne):
            if n <= 0 or n >= 2**62:
                raise r.fail(f"tensor '{name}': ne[{d}] = {n} is not a sane positive size (ne={ne})")
        n_elements = ne[0] * ne[1] * ne[2] * ne[3]
        if n_elements >= 2**62:
            raise r.fail(f"tensor '{name}': {n_elements} elements (ne={ne}) overflow int64")
        type_id = r.u32(f"tensor '{name}' type")
        try:
            ttype = GGMLType(type_id)
        except ValueError:
            raise r.fail(f"tensor '{name}': unknown ggml type id {type_id}") from None
        if ttype not in TYPE_TRAITS:
            raise r.fail(f"tensor '{name}': ggml type {ttype.name} ({type_id}) has no block layout "
                         f"(removed from ggml)")
        blck = TYPE_TRAITS[ttype].blck_size
        if ne[0] % blck:
            raise r.fail(f"tensor '{name}': ne[0] = {ne[0]} is not a multiple of the {ttype.name} "
                         f"block size {blck}")
        offset = r.u64(f"tensor '{name}' offset")
        return name, ttype, tuple(ne), offset

    # -- access ------------------------------------------------------------------------------------

    def data(self, name: str) -> np.ndarray:
        """Zero-copy uint8 view of a tensor's bytes in the memory map."""
        try:
            ti = self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named '{name}'") from None
        return self._mm[ti.offset:ti.offset + ti.nbytes]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, n_kv={len(self.metadata)}, "
                f"n_tensors={len(self.tensors)})")


def load_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse a GGUF file's header and map its data; raises GGUFError if the file is malformed."""
    return GGUFFile(path)


# ---------------------------------------------------------------------------------------------------
# layout: where each field of a file lives, for tools that edit GGUF files (bench/fuzz_gguf.py)

@dataclass
class GGUFField:
    """One field of a file's header. kind: magic, version, n_tensors, n_kv; per kv key_len, key, vtype and
    its value (str_len, str; scalar; arr_etype, arr_len, then arr_data for a numeric array's elements as
    one field, else each element's, prefixed elem_); per tensor info tname_len, tname, n_dims, dim, ttype,
    toffset. value: a fixed-size field's bytes as an unsigned little-endian integer."""
    kind: str
    offset: int
    size: int                # bytes of the fixed-size field, or of the string's bytes
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class GGUFLayout:
    """Where every field of a (valid) GGUF file lives: read with the parser's own cursor (_Reader, every
    read checked against the end), in the order GGUFFile._parse reads them."""
    raw: bytes
    fields: list[GGUFField]
    header_end: int                                   # end of the last tensor info
    data_start: int                                   # at the default alignment (32)
    kv_spans: list[tuple[str, int, int, int]]         # key, start, end, value type
    tensor_spans: list[tuple[str, int, int]]          # name, start, end

    def by_kind(self, *kinds: str) -> list[GGUFField]:
        return [f for f in self.fields if f.kind in kinds]

    @classmethod
    def walk(cls, raw: bytes) -> GGUFLayout:
        r = _Reader(memoryview(raw), "<layout>")
        fields: list[GGUFField] = []

        def fixed(kind: str, t: GGUFValueType, **info: Any) -> int:
            pos = r.pos
            r.scalar(t, kind)
            v = int.from_bytes(raw[pos:r.pos], "little")
            fields.append(GGUFField(kind, pos, r.pos - pos, dict(info, value=v)))
            return v

        def string(prefix: str, **info: Any) -> str:
            n = fixed(prefix + "_len", GGUFValueType.UINT64, **info)
            fields.append(GGUFField(prefix, r.pos, n, info))
            r.need(n, prefix)
            r.pos += n
            return raw[r.pos - n:r.pos].decode("utf-8", "surrogateescape")

        def value(t: int, key: str, elem: bool = False) -> None:
            p = "elem_" if elem else ""
            if t == GGUFValueType.STRING:
                string(p + "str", key=key)
            elif t == GGUFValueType.ARRAY:
                et = fixed("arr_etype", GGUFValueType.UINT32, key=key)
                n = fixed("arr_len", GGUFValueType.UINT64, key=key, etype=et)
                if et in _SCALAR_FMT:      # numeric arrays: one field for the block, not per element
                    size = n * _SCALAR_FMT[GGUFValueType(et)][1].itemsize
                    fields.append(GGUFField("arr_data", r.pos, size, {"key": key, "etype": et}))
                    r.need(size, key)
                    r.pos += size
                else:
                    for _ in range(n):
                        value(et, key, elem=True)
            else:
                fixed(p + "scalar", GGUFValueType(t), key=key, vtype=t)

        fixed("magic", GGUFValueType.UINT32)
        fixed("version", GGUFValueType.UINT32)
        n_tensors = fixed("n_tensors", GGUFValueType.UINT64)
        n_kv = fixed("n_kv", GGUFValueType.UINT64)
        kv_spans = []
        for _ in range(n_kv):
            start = r.pos
            key = string("key")
            t = fixed("vtype", GGUFValueType.UINT32, key=key)
            value(t, key)
            kv_spans.append((key, start, r.pos, t))
        tensor_spans = []
        for _ in range(n_tensors):
            start = r.pos
            name = string("tname")
            nd = fixed("n_dims", GGUFValueType.UINT32, name=name)
            for d in range(nd):
                fixed("dim", GGUFValueType.UINT64, name=name, d=d)
            fixed("ttype", GGUFValueType.UINT32, name=name)
            fixed("toffset", GGUFValueType.UINT64, name=name)
            tensor_spans.append((name, start, r.pos))
        data_start = -(-r.pos // GGUF_DEFAULT_ALIGNMENT) * GGUF_DEFAULT_ALIGNMENT
        return cls(raw, fields, r.pos, data_start, kv_spans, tensor_spans)

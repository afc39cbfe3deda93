"""The GGUF fuzzer's cases (bench/fuzz_gguf.py): structure-aware mutations of a valid small model file.

The seed file is a synthetic llama model (seed_file). Its layout is walked once (model/gguf.py's
GGUFLayout: where every field lives), and each case applies one or a few mutations that know those
fields: counts and lengths set to 0 / 1 / huge / random, value and tensor type ids set to unknown ids,
dims set to 0 / "negative" / huge, offsets past EOF or misaligned, general.alignment inserted as 0 / 3 /
2**40 / ..., keys and tensor names duplicated, string values replaced, truncation, appended bytes and
plain byte flips. make_case(seed, index, layout) is a pure function of its arguments.
"""
from __future__ import annotations

import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from ..model.gguf import _SCALAR_FMT, GGUFField, GGUFLayout, GGUFValueType

# the seed file's layout is read through model/gguf.py's cursor (GGUFLayout.walk), once, on a valid file
Field = GGUFField
Layout = GGUFLayout
VT_STRING, VT_ARRAY, VT_UINT32, VT_UINT64 = (int(t) for t in (GGUFValueType.STRING, GGUFValueType.ARRAY,
                                                            GGUFValueType.UINT32, GGUFValueType.UINT64))
_VT_SIZE = {int(t): dt.itemsize for t, (_, dt) in _SCALAR_FMT.items()}


class _SeedSpec(TypedDict):
    """The SyntheticSpec fields the seed file sets, typed so that `SyntheticSpec(**SEED_SPEC)` checks."""
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int


SEED_SPEC: _SeedSpec = {"n_vocab": 300, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_head_kv": 1, "n_ff": 64}


# ---------------------------------------------------------------------------------------------------
# mutations: each takes (rng, bytearray, layout) and returns a short description

def _special_u64(rng: random.Random, size: int) -> int:
    choices = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 255, 256, 4096, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
               2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64 - 8, size - 1, size, size + 1, size * 2]
    r = rng.random()
    if r < 0.7:
        return rng.choice(choices)
    if r < 0.85:
        return rng.randrange(0, max(2, size * 2))
    return rng.getrandbits(64)


def _put(buf: bytearray, f: Field, v: int) -> None:
    bits = 8 * f.size
    buf[f.offset:f.offset + f.size] = (v % (1 << bits)).to_bytes(f.size, "little")


def _set_fields(*kinds: str) -> Callable[[random.Random, bytearray, Layout], str]:
    def mut(rng: random.Random, buf: bytearray, lay: Layout) -> str:
        f = rng.choice(lay.by_kind(*kinds))
        v = _special_u64(rng, len(lay.raw))
        _put(buf, f, v)
        return f"{f.kind}@{f.offset}={v}"
    return mut


def _mut_string_len(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    # pick the kind of string first so the 300 vocabulary entries do not drown the rest
    kind = rng.choice(["key_len", "str_len", "elem_str_len", "tname_len"])
    f = rng.choice(lay.by_kind(kind))
    r = rng.random()
    v = (f.info["value"] + rng.choice([-2, -1, 1, 2, 8])) if r < 0.3 else _special_u64(rng, len(lay.raw))
    _put(buf, f, v)
    return f"{kind}@{f.offset}={v % 2**64}"


_UNKNOWN_U32 = [13, 14, 100, 255, 256, 2**16, 2**31, 2**32 - 1]


def _mut_vtype(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    f = rng.choice(lay.by_kind("vtype", "arr_etype"))
    v = rng.choice(_UNKNOWN_U32) if rng.random() < 0.5 else rng.randrange(13)
    _put(buf, f, v)
    return f"{f.kind}[{f.info['key']}]={v}"


def _mut_ttype(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    f = rng.choice(lay.by_kind("ttype"))
    # 4, 5: removed Q4_2 / Q4_3; 31..: unknown or without block layout in this ggml
    v = rng.choice([4, 5, 31, 36, 39, 40, 64, 255, 2**31, 2**32 - 1]) if rng.random() < 0.5 \
        else rng.randrange(42)
    _put(buf, f, v)
    return f"ttype[{f.info['name']}]={v}"


def _mut_n_dims(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    f = rng.choice(lay.by_kind("n_dims"))
    v = rng.choice([0, 1, 2, 3, 4, 5, 8, 2**31, 2**32 - 1])
    _put(buf, f, v)
    return f"n_dims[{f.info['name']}]={v}"


def _mut_dim(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    f = rng.choice(lay.by_kind("dim"))
    r = rng.random()
    if r < 0.5:
        v = rng.choice([0, 1, 2**64 - 1, 2**64 - 32, 2**63, 2**63 - 1, 2**62, 2**62 - 32, 2**40, 2**32,
                        2**31, 2**32 - 32])
    elif r < 0.8:
        v = f.info["value"] * rng.choice([2, 4, 1 << 20]) if rng.random() < 0.5 else f.info["value"] // 2
    else:
        v = rng.randrange(1, 1 << rng.randrange(1, 64))
    _put(buf, f, v)
    return f"ne{f.info['d']}[{f.info['name']}]={v}"


def _mut_offset(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    f = rng.choice(lay.by_kind("toffset"))
    size, rel = len(lay.raw), f.info["value"]
    data = size - lay.data_start
    choices = [rel + 1, rel + 16, rel + 31, rel - 32, data, data - 32, data + 32, size, 2**63, 2**64 - 1,
               2**64 - 32, 2**62, 0, rng.choice(lay.by_kind("toffset")).info["value"],
               rng.randrange(0, data + 64)]
    v = rng.choice(choices)
    _put(buf, f, v)
    return f"offset[{f.info['name']}]={v % 2**64}"


def _mut_scalar_value(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    """Hyperparameters and token ids: 0, 1, -1, huge, NaN / inf for floats."""
    f = rng.choice(lay.by_kind("scalar"))
    t = f.info["vtype"]
    if t in (6, 12):
        fmt = "<f" if t == 6 else "<d"
        v = rng.choice([0.0, -1.0, 1e-30, 1e30, float("inf"), float("-inf"), float("nan"), 2.0**40])
        buf[f.offset:f.offset + f.size] = struct.pack(fmt, v)
        return f"value[{f.info['key']}]={v}"
    v = rng.choice([0, 1, 2, 3, 2**f.size * 4 - 1, 2**(8 * f.size - 1), 2**(8 * f.size) - 1, 300, 299, 301,
                    16, 17, 2**31, 2**24, rng.getrandbits(8 * f.size)])
    _put(buf, f, v)
    return f"value[{f.info['key']}]={v % 2 ** (8 * f.size)}"


def _mut_arr_data(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    """Token scores / types: random values (unknown token types, NaN scores)."""
    f = rng.choice(lay.by_kind("arr_data"))
    n = rng.randrange(1, 16)
    for _ in range(n):
        p = f.offset + rng.randrange(max(1, f.size))
        buf[p] = rng.randrange(256)
    return f"arr_data[{f.info['key']}] x{n}"


def _mut_flip(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    end = lay.header_end if rng.random() < 0.8 else len(buf)
    n = rng.choice([1, 1, 2, 4, 8, 32])
    for _ in range(n):
        p = rng.randrange(end)
        if rng.random() < 0.5:
            buf[p] ^= 1 << rng.randrange(8)
        else:
            buf[p] = rng.randrange(256)
    return f"flip x{n} in [0,{end})"


def _mut_magic_version(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    if rng.random() < 0.3:
        buf[0:4] = rng.choice([b"GGML", b"FUGG", b"\0\0\0\0", b"GGUf"])
        return f"magic={bytes(buf[0:4])!r}"
    v = rng.choice([0, 1, 2, 4, 3 << 24, 2 << 24, 2**32 - 1])
    buf[4:8] = struct.pack("<I", v)
    return f"version={v}"


IN_PLACE: dict[str, Callable[[random.Random, bytearray, Layout], str]] = {
    "header_count": _set_fields("n_tensors", "n_kv"),
    "string_len": _mut_string_len,
    "array_len": _set_fields("arr_len"),
    "value_type": _mut_vtype,
    "tensor_type": _mut_ttype,
    "n_dims": _mut_n_dims,
    "dim": _mut_dim,
    "tensor_offset": _mut_offset,
    "scalar_value": _mut_scalar_value,
    "array_data": _mut_arr_data,
    "byte_flip": _mut_flip,
    "magic_version": _mut_magic_version,
}


# splices: rewrite the header (which moves everything after the edit) and re-pad to the data section

def _rebuild(header: bytes, lay: Layout, align: int = 32) -> bytearray:
    data = lay.raw[lay.data_start:]
    pad = (-len(header)) % align if align > 0 and align < 2**20 else (-len(header)) % 32
    return bytearray(header + b"\0" * pad + data)


def _gguf_str(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _bump_n_kv(header: bytearray, by: int) -> None:
    (n,) = struct.unpack_from("<Q", header, 16)
    struct.pack_into("<Q", header, 16, n + by)


def _kv_end(lay: Layout) -> int:
    return lay.kv_spans[-1][2]


def _mut_alignment(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    a = rng.choice([0, 1, 2, 3, 8, 16, 24, 32, 48, 64, 4096, 2**31, 2**32 - 1, 2**40, 2**63])
    vt = VT_UINT32 if a < 2**32 and rng.random() < 0.8 else rng.choice([VT_UINT64, 5, 6, VT_STRING])
    if vt == VT_STRING:
        val = _gguf_str(str(a).encode())
    elif vt == 6:
        val = struct.pack("<f", float(a))
    else:
        val = (a % 2 ** (8 * _VT_SIZE[vt])).to_bytes(_VT_SIZE[vt], "little")
    kv = _gguf_str(b"general.alignment") + struct.pack("<I", vt) + val
    if rng.random() < 0.2:     # the alignment twice
        kv += kv
    header = bytearray(lay.raw[:_kv_end(lay)]) + kv + lay.raw[_kv_end(lay):lay.header_end]
    _bump_n_kv(header, kv.count(b"general.alignment"))
    # the data keeps its 32-aligned position when the new alignment is not usable
    out = _rebuild(bytes(header), lay, a if a and not a & (a - 1) else 32)
    buf[:] = out
    return f"alignment={a} type={vt}"


def _mut_dup_key(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    (k1, s1, _, _), (k2, _, _, _) = rng.sample(lay.kv_spans, 2)
    f1 = next(f for f in lay.by_kind("key_len") if f.offset == s1)
    header = bytearray(lay.raw[:s1]) + _gguf_str(k2.encode()) + lay.raw[s1 + 8 + f1.info["value"]:lay.header_end]
    buf[:] = _rebuild(bytes(header), lay)
    return f"key {k1} -> {k2}"


def _mut_dup_tensor(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    (n1, s1, _), (n2, _, _) = rng.sample(lay.tensor_spans, 2)
    f1 = next(f for f in lay.by_kind("tname_len") if f.offset == s1)
    header = bytearray(lay.raw[:s1]) + _gguf_str(n2.encode()) + lay.raw[s1 + 8 + f1.info["value"]:lay.header_end]
    buf[:] = _rebuild(bytes(header), lay)
    return f"tensor {n1} -> {n2}"


_WORDS = [b"", b"llama", b"gpt2", b"qwen2", b"default", b"llama3", b"llama-bpe", b"bert", b"none", b"linear",
          b"yarn", b"\xff\xfe", b"\xed\xa0\x80", b"a" * 300, b"<0xZZ>", b"<0x", b"\0", b"blk.0.attn_q.weight",
          b"blk.x.attn_q.weight", "\u2581".encode()]


def _mut_string_value(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    """Replace a string (value, vocabulary entry, key or tensor name) with a dictionary word."""
    kind = rng.choice(["str", "str", "elem_str", "key", "tname"])
    f = rng.choice(lay.by_kind(kind))
    w = rng.choice(_WORDS) if rng.random() < 0.8 else bytes(rng.randrange(256) for _ in range(rng.randrange(9)))
    header = bytearray(lay.raw[:f.offset - 8]) + _gguf_str(w) + lay.raw[f.offset + f.size:lay.header_end]
    buf[:] = _rebuild(bytes(header), lay)
    return f"{kind}@{f.offset}={w[:20]!r}"


def _mut_change_kv_type(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    """Re-encode a kv with another (well-formed) value type: u32 -> i64, string -> u32, scalar -> array."""
    key, start, end, _ = rng.choice(lay.kv_spans)
    choice = rng.randrange(5)
    if choice == 0:
        val = struct.pack("<I", VT_UINT64) + struct.pack("<Q", rng.choice([1, 2, 300, 2**40, 2**64 - 1]))
    elif choice == 1:
        val = struct.pack("<I", 11) + struct.pack("<q", rng.choice([-1, 0, 1, 2, -(2**63)]))
    elif choice == 2:
        val = struct.pack("<I", 7) + bytes([rng.randrange(2)])
    elif choice == 3:
        val = struct.pack("<I", VT_STRING) + _gguf_str(b"2")
    else:   # array of u32 / of strings / empty array
        et = rng.choice([VT_UINT32, VT_STRING, 6])
        n = rng.choice([0, 1, 3])
        body = b"".join(_gguf_str(b"x") if et == VT_STRING else struct.pack("<I", 1) for _ in range(n))
        val = struct.pack("<I", VT_ARRAY) + struct.pack("<IQ", et, n) + body
    header = lay.raw[:start] + _gguf_str(key.encode("utf-8", "surrogateescape")) + val + \
        lay.raw[end:lay.header_end]
    buf[:] = _rebuild(header, lay)
    return f"retype {key} ({choice})"


def _mut_drop(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    """Remove one kv or one tensor info (and fix the count): a well-formed file that lacks something."""
    if rng.random() < 0.6:
        key, start, end, _ = rng.choice(lay.kv_spans)
        header = bytearray(lay.raw[:start] + lay.raw[end:lay.header_end])
        _bump_n_kv(header, -1)
        buf[:] = _rebuild(bytes(header), lay)
        return f"drop kv {key}"
    name, start, end = rng.choice(lay.tensor_spans)
    header = bytearray(lay.raw[:start] + lay.raw[end:lay.header_end])
    (n,) = struct.unpack_from("<Q", header, 8)
    struct.pack_into("<Q", header, 8, n - 1)
    buf[:] = _rebuild(bytes(header), lay)
    return f"drop tensor {name}"


def _mut_truncate(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    r = rng.random()
    if r < 0.4:      # at a field boundary
        n = rng.choice(lay.fields).offset
    elif r < 0.8:
        n = rng.randrange(lay.header_end + 1)
    else:
        n = rng.randrange(len(buf))
    del buf[n:]
    return f"truncate at {n}"


def _mut_extend(rng: random.Random, buf: bytearray, lay: Layout) -> str:
    n = rng.choice([1, 31, 32, 4096])
    buf += bytes(rng.randrange(256) for _ in range(n)) if n < 100 else b"\0" * n
    return f"append {n}"


SPLICE: dict[str, Callable[[random.Random, bytearray, Layout], str]] = {
    "alignment": _mut_alignment,
    "duplicate_key": _mut_dup_key,
    "duplicate_tensor": _mut_dup_tensor,
    "string_value": _mut_string_value,
    "kv_retype": _mut_change_kv_type,
    "drop_entry": _mut_drop,
}
TAIL: dict[str, Callable[[random.Random, bytearray, Layout], str]] = {
    "truncate": _mut_truncate,
    "extend": _mut_extend,
}
MUTATIONS = list(IN_PLACE) + list(SPLICE) + list(TAIL) + ["multi"]


def make_case(seed: int, index: int, lay: Layout) -> tuple[str, bytes, list[str]]:
    """The index-th case of a run: (mutation name, file bytes, descriptions). A pure function of its args."""
    rng = random.Random(seed * 1_000_003 + index)
    name = MUTATIONS[index % len(MUTATIONS)]       # round robin: every mutation gets its share
    buf = bytearray(lay.raw)
    descs: list[str] = []
    if name in IN_PLACE:
        descs.append(IN_PLACE[name](rng, buf, lay))
    elif name in SPLICE:
        descs.append(SPLICE[name](rng, buf, lay))
    elif name in TAIL:
        descs.append(TAIL[name](rng, buf, lay))
    else:   # a few in-place mutations on top of each other, sometimes a truncation last
        for m in rng.sample(list(IN_PLACE), rng.randrange(2, 5)):
            descs.append(f"{m}: " + IN_PLACE[m](rng, buf, lay))
        if rng.random() < 0.2:
            descs.append(_mut_truncate(rng, buf, lay))
    return name, bytes(buf), descs



def seed_file(path: str | Path) -> Path:
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    return write_synthetic(path, SyntheticSpec(**SEED_SPEC))

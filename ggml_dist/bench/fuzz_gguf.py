"""GGUF loader fuzzer: structure-aware mutations of a valid small model file, each loaded in a guarded worker.

The seed file is a synthetic llama model (ggml_dist.model.synthetic). Its layout is walked once to learn
where every field lives (magic, version, counts, each kv's key / type / value / array length, each string
length, each tensor info's name / n_dims / ne / type / offset, the data section), and each case applies
one or a few mutations that know those fields: counts and lengths set to 0 / 1 / huge / random, value and
tensor type ids set to unknown ids, dims set to 0 / "negative" / huge, offsets past EOF or misaligned,
general.alignment inserted as 0 / 3 / 2**40 / ..., keys and tensor names duplicated, string values
replaced, truncation, appended bytes and plain byte flips.

Each case is written to a file and loaded with load_gguf and LlamaModel.load (metadata, hparams, tensor
checks, weights mapping, tokenizer) in a worker process; a file that loads then encodes a short text and
runs a forward pass (forward_probe: a LlamaContext of 64 cells, the prompt as one batch, two greedy
steps). The project's own errors are GGUFError (and its subclasses), BatchError and ContextFullError
(project_errors()); the case is classified as

    ok          the file loads, its tokenizer encodes, and its forward pass runs
    clean       one of the project's own errors, its message naming the file
    unclear     one of the project's own errors whose message does not name the file (`unclear_errors`;
                failures with --strict-path)
    failure     anything else: another exception type (a ValueError from numpy, an IndexError, int() on a
                bad value, a core-layer error such as ShapeError from a graph the loader let through), a
                case using more than --case-time-limit CPU seconds (a hang; a worker stuck for
                --hard-timeout wall seconds is killed), a worker that dies (a crash), or a traced
                allocation peak above file size + --mem-overhead-mb

Memory is measured with tracemalloc inside the worker (numpy reports its buffers to tracemalloc, so
arrays count too; the file's memory map does not, it is the file): the per-case peak of traced memory
above what was live before the case, minus the file size, is `peak_mem_over_file_mb`. The worker also
runs under RLIMIT_AS (its address space after imports + --as-headroom-mb) so an allocation that escaped
tracing still fails (MemoryError) instead of exhausting the machine; the workers' maxrss growth is
reported as a second, independent number.

The workers run the numpy reference kernels, which check every index. --compiled-share F runs that
share of the cases (drawn per case) through the compiled numba kernels instead, the ones users run,
which check no bounds: the workers are then spawned (fresh interpreters with their own OpenMP, one
kernel thread each), so a kernel that crashes takes down a worker, not the run. Such a case is a failure
of kind "crash" (counted in `crashes`), saved like any other, and the worker is started again; `by_path`
gives every outcome per kernel path. A compiled case that meets a kernel the warm-up did not compile,
and is slow or too big only on that account, is measured again (`jit_reruns`).

Failing inputs are written to --failures-dir as case-NNNNN-<mutation>.gguf with a .txt beside each (its
kernel path included); `--replay PATH` reloads one file (or every .gguf in a directory) in this process,
with the compiled kernels, and prints the outcome.

    ggml-dist bench fuzz-gguf --cases 10000 --json
    ggml-dist bench fuzz-gguf --cases 2000 --compiled-share 0.25 --json
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import os
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import tracemalloc
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, TypedDict

# value types (gguf_type) and their sizes, duplicated here so the layout walker does not depend on the
# parser under test
_VT_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VT_STRING, VT_ARRAY, VT_UINT32, VT_UINT64 = 8, 9, 4, 10


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
# layout of the valid seed file

@dataclass
class Field:
    kind: str          # see Layout.walk
    offset: int
    size: int          # bytes of the fixed-size field (4 or 8) or of the string bytes
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Layout:
    """Where every field of a (valid) GGUF file lives."""
    raw: bytes
    fields: list[Field]
    header_end: int                   # end of the last tensor info
    data_start: int
    kv_spans: list[tuple[str, int, int, int]]       # key, start, end, value type
    tensor_spans: list[tuple[str, int, int]]        # name, start, end

    def by_kind(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]

    @classmethod
    def walk(cls, raw: bytes) -> Layout:
        fields: list[Field] = []
        pos = 0

        def fixed(kind: str, size: int, **info: Any) -> int:
            nonlocal pos
            v = int.from_bytes(raw[pos:pos + size], "little")
            fields.append(Field(kind, pos, size, dict(info, value=v)))
            pos += size
            return v

        def string(prefix: str, **info: Any) -> str:
            nonlocal pos
            n = fixed(prefix + "_len", 8, **info)
            fields.append(Field(prefix, pos, n, info))
            s = raw[pos:pos + n].decode("utf-8", "surrogateescape")
            pos += n
            return s

        def value(t: int, key: str, elem: bool = False) -> None:
            nonlocal pos
            p = "elem_" if elem else ""
            if t == VT_STRING:
                string(p + "str", key=key)
            elif t == VT_ARRAY:
                et = fixed("arr_etype", 4, key=key)
                n = fixed("arr_len", 8, key=key, etype=et)
                if et in _VT_SIZE:       # numeric arrays: one field for the block, not per element
                    fields.append(Field("arr_data", pos, n * _VT_SIZE[et], {"key": key, "etype": et}))
                    pos += n * _VT_SIZE[et]
                else:
                    for _ in range(n):
                        value(et, key, elem=True)
            else:
                fixed(p + "scalar", _VT_SIZE[t], key=key, vtype=t)

        fixed("magic", 4)
        fixed("version", 4)
        n_tensors = fixed("n_tensors", 8)
        n_kv = fixed("n_kv", 8)
        kv_spans = []
        for _ in range(n_kv):
            start = pos
            key = string("key")
            t = fixed("vtype", 4, key=key)
            value(t, key)
            kv_spans.append((key, start, pos, t))
        tensor_spans = []
        for _ in range(n_tensors):
            start = pos
            name = string("tname")
            nd = fixed("n_dims", 4, name=name)
            for d in range(nd):
                fixed("dim", 8, name=name, d=d)
            fixed("ttype", 4, name=name)
            fixed("toffset", 8, name=name)
            tensor_spans.append((name, start, pos))
        header_end = pos
        data_start = -(-pos // 32) * 32
        return cls(raw, fields, header_end, data_start, kv_spans, tensor_spans)


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


# ---------------------------------------------------------------------------------------------------
# running one case (in the worker)

# The project's own error types: GGUFError (and its subclasses), what the loader raises for a file it
# refuses, and the two errors of ggml_dist.model a batch can meet in the forward probe (BatchError: a token
# outside the model's vocabulary; ContextFullError: no free KV cells). Anything else a file provokes -- a
# ValueError from numpy, an IndexError, a KeyError, int() on a bad value, or a core-layer error such as
# ShapeError or AllocError deep inside a graph the loader let through -- is a failure.
def project_errors() -> tuple[type[BaseException], ...]:
    from ggml_dist.model.gguf import GGUFError
    from ggml_dist.model.kv_cache import ContextFullError
    from ggml_dist.model.ubatch import BatchError
    return GGUFError, BatchError, ContextFullError


PROBE_TEXT = "Hello world, 123!"
PROBE_N_CTX = 64            # KV cells of the probe's context: a few tokens, never n_ctx_train
PROBE_N_PROMPT = 8          # prompt tokens decoded as one batch
PROBE_N_DECODE = 2          # then this many single-token steps


def forward_probe(model: Any, tokens: list[int], compiled: bool = True) -> None:
    """A model that loads must also run: decode the probe's prompt (its first PROBE_N_PROMPT tokens, or
    token 0 when the text gave none), then PROBE_N_DECODE greedy steps, each chosen token turned back into
    text, with the compiled (numba) kernels or the numpy reference ones. The logits must have the model's
    shape; their values are the file's business (random bytes in the data section give NaNs, and that is
    no error)."""
    import numpy as np

    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.ubatch import Batch

    n_vocab = model.hp.n_vocab
    prompt = list(tokens[:PROBE_N_PROMPT]) or [0]
    lctx = LlamaContext(model, ContextParams(n_ctx=PROBE_N_CTX, n_batch=PROBE_N_CTX, n_ubatch=PROBE_N_CTX,
                                             numba=compiled))
    logits = lctx.decode(Batch.from_tokens(prompt, all_outputs=True))
    if logits.shape != (len(prompt), n_vocab):
        raise AssertionError(f"logits of shape {logits.shape} for {len(prompt)} tokens, n_vocab {n_vocab}")
    for i in range(PROBE_N_DECODE):
        tok = int(np.argmax(logits[-1]))
        model.tokenizer.token_to_piece(tok)          # what generate() does with each chosen token
        logits = lctx.decode(Batch.from_tokens([tok], pos0=len(prompt) + i))
        if logits.shape != (1, n_vocab):
            raise AssertionError(f"logits of shape {logits.shape} for one token, n_vocab {n_vocab}")


_warmed: set[bool] = set()         # the kernel paths (compiled or not) warm_up has run in this process


def warm_up(compiled: bool = True) -> None:
    """Load and run the seed model once per process and kernel path, outside any case's time and memory:
    the first forward pass loads (or compiles) the numba kernels, which is not the case's cost. The numpy
    path compiles nothing: either path's warm-up (its imports, first allocations) serves it."""
    if compiled in _warmed or (not compiled and _warmed):
        return
    from ggml_dist.model.model import LlamaModel
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-warm-") as d:
        model = LlamaModel.load(seed_file(os.path.join(d, "seed.gguf")))
        forward_probe(model, model.tokenizer.encode(PROBE_TEXT), compiled=compiled)
        del model
    _warmed.add(compiled)


def run_case(path: str, case_time_limit: float = 2.0, mem_overhead: int = 64 << 20,
             strict_path: bool = False, compiled: bool = True) -> dict[str, Any]:
    """Load one file, encode PROBE_TEXT and run forward_probe (with the compiled kernels or the numpy
    reference ones); classify the outcome (module docstring).

    Traces memory itself when tracemalloc is not already on. With strict_path an unclear error (one of
    project_errors() whose message does not name the file) is a failure. A compiled case can reach a
    kernel (or a specialisation of one) that the warm-up did not, and numba then compiles it inside the
    case (seconds, and the compiler's memory): a case that compiled and was judged slow or too big on
    that account alone is run once more, now compiled, and that run is its result ("jit_rerun": the
    compiles the first run made; its CPU seconds in "jit_first_elapsed").
    """
    warm_up(compiled)
    if not compiled:
        return _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    try:
        from numba.core import event
    except ImportError:                 # no numba: the compiled path is the numpy one (NUMBA_DEFAULT)
        return _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    with event.install_recorder("numba:compile") as rec:
        res = _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    n_compiles = sum(1 for _, ev in rec.buffer if ev.is_start)
    if n_compiles and res["kind"] in ("slow", "memory"):
        first = res
        res = _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
        res["jit_rerun"], res["jit_first_elapsed"] = n_compiles, first["elapsed"]
    return res


def _run_case_once(path: str, case_time_limit: float, mem_overhead: int, strict_path: bool,
                   compiled: bool) -> dict[str, Any]:
    from ggml_dist.model.gguf import load_gguf
    from ggml_dist.model.model import LlamaModel

    own = project_errors()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    size = os.path.getsize(path)
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    stage, outcome, kind, msg = "gguf", "ok", "", ""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        load_gguf(path)
        stage = "model"
        model = LlamaModel.load(path)
        stage = "encode"
        tokens = model.tokenizer.encode(PROBE_TEXT)          # the vocabulary is usable
        stage = "forward"
        forward_probe(model, tokens, compiled=compiled)      # and so are the weights
        del model
    except own as e:
        kind, msg = type(e).__name__, str(e)
        if path in msg:
            outcome = "clean"
        else:
            outcome = "failure" if strict_path else "unclear"
            kind += " (message does not name the file)"
    except BaseException as e:    # every other exception is a finding
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome, kind, msg = "failure", type(e).__name__, str(e)
    # CPU seconds decide "slow": wall time also counts other processes on a busy machine (a case that
    # really hangs is still killed by the parent after hard_timeout of wall time)
    elapsed, wall = time.process_time() - c0, time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    if started:
        tracemalloc.stop()
    over = peak - base - size
    if outcome != "failure" and elapsed > case_time_limit:
        outcome, kind, msg = "failure", "slow", f"took {elapsed:.2f} CPU s (limit {case_time_limit} s); {msg}"
    if outcome != "failure" and over > mem_overhead:
        outcome, kind, msg = "failure", "memory", f"traced peak {peak - base} B for a {size} B file; {msg}"
    return {"outcome": outcome, "kind": kind, "msg": msg[:500], "stage": stage, "elapsed": elapsed, "wall": wall,
            "peak_over_file": over}


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass(frozen=True)
class _CaseDone:
    """Worker -> parent: the case's result (run_case's dict)."""
    index: int
    res: dict[str, Any]


@dataclass(frozen=True)
class _JitStarted:
    """Worker -> parent: numba started compiling a kernel inside a case (a kernel or specialisation the
    warm-up did not reach): seconds to minutes of wall time on a busy host that are not a hang."""
    index: int


def _notify_jit(conn: Any, index: list[int]) -> Any:
    """Send _JitStarted for each compile numba starts from now on in this process (index[0]: the case);
    returns the listener (numba.core.event.unregister takes it off)."""
    from numba.core import event

    class Notice(event.Listener):
        def on_start(self, ev: Any) -> None:
            conn.send(_JitStarted(index[0]))

        def on_end(self, ev: Any) -> None:
            pass

    listener = Notice()
    event.register("numba:compile", listener)
    return listener


def _worker(conn: Any, tmpdir: str, case_time_limit: float, mem_overhead: int, as_headroom: int,
            strict_path: bool, compiled: bool) -> None:
    """A fuzz worker: (index, file bytes, compiled) in, _CaseDone out (and _JitStarted during a compiled
    case whose kernels numba compiles). A forked worker (compiled False) must not start numba's OpenMP
    threads: after a parent that ran kernels (bench faults decodes first, pytest ran other tests) GNU
    OpenMP terminates the child ("fork() called from a process already using GNU OpenMP"), so it runs
    the numpy reference kernels only. A spawned worker (compiled True) is a fresh interpreter with its
    own OpenMP and one kernel thread (the workers are the parallelism, and a second thread spinning
    would count as the case's CPU time), and runs either path, as each case says."""
    if compiled:
        os.environ["NUMBA_NUM_THREADS"] = "1"          # before numba is imported (warm_up imports it)
    warm_up(False)                # imports and first allocations before the address-space limit
    kernels = "numpy"
    if compiled:
        warm_up(True)
        from ggml_dist.backends.cpu import qpack
        kernels = qpack.default_kernels().value
    # a corrupt file's weights overflow and its special ids are "bad": numpy's warnings and the
    # tokenizer's log lines are expected here, once per case, and say nothing the outcome does not
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    vm = _vm_size()
    if vm and as_headroom > 0:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (vm + as_headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
        except (ValueError, OSError):
            pass
    tracemalloc.start()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    current = [-1]
    if compiled:
        _notify_jit(conn, current)
    conn.send(("ready", rss0, kernels))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, data, case_compiled = msg
        current[0] = index
        assert compiled or not case_compiled, "a forked worker runs the numpy reference kernels only"
        path = os.path.join(tmpdir, f"fuzz-{os.getpid()}-{index:06d}.gguf")
        with open(path, "wb") as fh:
            fh.write(data)
        res = run_case(path, case_time_limit, mem_overhead, strict_path, compiled=case_compiled)
        os.unlink(path)
        res["maxrss_growth_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
        conn.send(_CaseDone(index, res))


class _Worker:
    def __init__(self, ctx: Any, tmpdir: str, args: tuple, compiled: bool) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, tmpdir, *args, compiled), daemon=True)
        # a forked worker must never collect the parent's objects: after `bench faults` the parent holds
        # Ray handles in garbage cycles, whose finalizers, run by the child's first full collection (a
        # forward pass allocates enough), write to the parent's GCS connection and break it ("Missing
        # :authority header"); frozen objects are left alone by every collection in the child
        gc.freeze()
        try:
            self.proc.start()
        finally:
            gc.unfreeze()
        child.close()
        try:
            _, self.rss0, self.kernels = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"a fuzz worker died while starting (exit code {self.proc.exitcode}); run "
                               f"`ggml-dist bench fuzz-gguf --cases 1 --jobs 1` to see its error") from None
        self.case: tuple[int, str, bytes, list[str], bool] | None = None
        self.t0 = self.deadline = 0.0

    def submit(self, case: tuple[int, str, bytes, list[str], bool], hard_timeout: float) -> None:
        self.case, self.t0 = case, time.perf_counter()
        self.deadline = self.t0 + hard_timeout
        self.conn.send((case[0], case[2], case[4]))

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


def _death(exitcode: int | None) -> str:
    """How a worker ended, for a crash's message: "killed by SIGSEGV (exit code -11)"."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name} (exit code {exitcode})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


# ---------------------------------------------------------------------------------------------------
# the run

PATHS = ("numpy", "compiled")       # the kernel paths a case can run: the numpy reference, numba's


def compiled_case(seed: int, index: int, share: float) -> bool:
    """Whether the index-th case of a run takes the compiled kernels: a draw of its own (not the case's
    mutation stream, so a case's bytes do not depend on the share), a pure function of its args."""
    return share >= 1.0 or (share > 0.0 and random.Random(f"compiled {seed} {index}").random() < share)


@dataclass
class FuzzReport:
    fuzz_cases: int = 0
    fuzz_failures: int = 0                  # every failure, crashes included
    crashes: int = 0                        # failures where the worker died (a signal: SIGSEGV, SIGBUS...)
    ok: int = 0
    clean_errors: int = 0                   # one of project_errors(), its message naming the file
    unclear_errors: int = 0                 # one of project_errors(), its message not naming the file
    max_case_s: float = 0.0                 # CPU seconds of the slowest case
    max_case_wall_s: float = 0.0            # wall seconds of the slowest case (includes waiting for a CPU)
    peak_mem_over_file_mb: float = 0.0
    maxrss_growth_mb: float = 0.0
    seed: int = 0
    seed_file_bytes: int = 0
    wall_s: float = 0.0
    compiled_share: float = 0.0             # the share of cases drawn for the compiled kernels
    jit_reruns: int = 0                     # compiled cases measured again after a JIT compile (run_case)
    # per kernel path ("numpy", "compiled"): cases, each outcome, crashes, and the kernels it ran
    # ("numpy"; "vnni", "avx2" or "float": qpack's choice on this host)
    by_path: dict[str, dict[str, Any]] = field(default_factory=dict)
    by_mutation: dict[str, dict[str, int]] = field(default_factory=dict)
    failure_kinds: dict[str, int] = field(default_factory=dict)
    unclear_messages: dict[str, int] = field(default_factory=dict)  # stage: type: message head -> count
    failures: list[dict[str, Any]] = field(default_factory=list)
    failures_dir: str | None = None

    def to_json(self, max_failures: int = 20) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["failures"] = self.failures[:max_failures]
        return d


def _head(msg: str) -> str:
    """A message without its quoted values and numbers, to group errors by the check that raised them."""
    import re
    return re.sub(r"'[^']*'|\d+", "_", msg)[:60]


def seed_file(path: str | Path) -> Path:
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    return write_synthetic(path, SyntheticSpec(**SEED_SPEC))


def run_fuzz(n_cases: int, seed: int = 0, jobs: int = 1, failures_dir: str | Path | None = None,
             case_time_limit: float = 2.0, hard_timeout: float = 20.0, mem_overhead_mb: float = 64.0,
             as_headroom_mb: float = 2048.0, strict_path: bool = False, progress: bool = False,
             compiled_share: float = 0.0, jit_timeout: float = 600.0) -> FuzzReport:
    """Run n_cases cases over `jobs` worker processes. compiled_share > 0 draws that share of the cases
    (compiled_case) for the compiled kernels, the ones users run, which have no bounds checks: the workers
    are then spawned, fresh interpreters that run either path, so that a kernel that crashes (SIGSEGV)
    takes down a worker, not the run; the case is a failure of kind "crash" (counted in `crashes` and per
    path), saved to failures_dir like any other, and the worker is started again. A compiled case in
    which numba starts compiling a kernel has jit_timeout wall seconds from that start instead of
    hard_timeout (a compile on a busy 2-core host took over 20 s). With compiled_share 0 the workers are
    forked and run the numpy reference only."""
    if not 0.0 <= compiled_share <= 1.0:
        raise ValueError(f"compiled_share = {compiled_share}: must be in [0, 1]")
    t_start = time.perf_counter()
    rep = FuzzReport(seed=seed, compiled_share=compiled_share)
    by_mut: dict[str, Counter] = defaultdict(Counter)
    by_path: dict[str, Counter] = {k: Counter() for k in PATHS}
    path_kernels = {"numpy": "numpy"}
    kinds: Counter = Counter()
    unclear: Counter = Counter()
    mem_overhead = int(mem_overhead_mb * (1 << 20))
    spawned = compiled_share > 0.0
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-") as tmpdir:
        lay = Layout.walk(seed_file(os.path.join(tmpdir, "seed.gguf")).read_bytes())
        rep.seed_file_bytes = len(lay.raw)
        method = "spawn" if spawned or "fork" not in mp.get_all_start_methods() else "fork"
        ctx = mp.get_context(method)
        wargs = (case_time_limit, mem_overhead, int(as_headroom_mb * (1 << 20)), strict_path)

        def new_worker() -> _Worker:
            w = _Worker(ctx, tmpdir, wargs, spawned)
            if spawned:
                path_kernels["compiled"] = w.kernels
            return w

        workers = [new_worker() for _ in range(max(1, jobs))]
        next_index = 0

        def record(w: _Worker, res: dict[str, Any]) -> None:
            index, name, data, descs, compiled = w.case  # type: ignore[misc]
            path = PATHS[compiled]
            w.case = None
            rep.fuzz_cases += 1
            by_mut[name][res["outcome"]] += 1
            by_path[path]["cases"] += 1
            by_path[path][res["outcome"]] += 1
            rep.jit_reruns += bool(res.get("jit_rerun"))
            rep.max_case_s = max(rep.max_case_s, res.get("elapsed", 0.0))
            rep.max_case_wall_s = max(rep.max_case_wall_s, res.get("wall", res.get("elapsed", 0.0)))
            rep.peak_mem_over_file_mb = max(rep.peak_mem_over_file_mb, res.get("peak_over_file", 0) / 2**20)
            rep.maxrss_growth_mb = max(rep.maxrss_growth_mb, res.get("maxrss_growth_kb", 0) / 1024)
            if res["outcome"] == "ok":
                rep.ok += 1
            elif res["outcome"] == "clean":
                rep.clean_errors += 1
            elif res["outcome"] == "unclear":
                rep.unclear_errors += 1
                unclear[f"{res['stage']}: {res['kind'].split(' ')[0]}: {_head(res['msg'])}"] += 1
            else:
                rep.fuzz_failures += 1
                kinds[res["kind"]] += 1
                if res["kind"] == "crash":
                    rep.crashes += 1
                    by_path[path]["crash"] += 1
                info = {"index": index, "mutation": name, "mutations": descs, "path": path, "kind": res["kind"],
                        "msg": res["msg"], "stage": res.get("stage"), "elapsed": round(res.get("elapsed", 0.0), 3)}
                if failures_dir is not None:
                    d = Path(failures_dir)
                    d.mkdir(parents=True, exist_ok=True)
                    p = d / f"case-{index:05d}-{name}.gguf"
                    p.write_bytes(data)
                    p.with_suffix(".txt").write_text(json.dumps(info, indent=1) + "\n")
                    info["file"] = str(p)
                rep.failures.append(info)
            if progress and rep.fuzz_cases % 1000 == 0:
                print(f"{rep.fuzz_cases} cases, {rep.fuzz_failures} failures", file=sys.stderr)

        def crashed(i: int, now: float) -> None:
            """Worker i died with a case: record the crash, start another worker."""
            w = workers[i]
            w.proc.join(5)
            record(w, {"outcome": "failure", "kind": "crash", "msg": f"worker {_death(w.proc.exitcode)}",
                       "elapsed": now - w.t0})
            w.kill()
            workers[i] = new_worker()

        def feed(i: int) -> None:
            """Give worker i the next case, if any (a worker found dead on sending crashed with it)."""
            nonlocal next_index
            while next_index < n_cases and workers[i].case is None:
                name, data, descs = make_case(seed, next_index, lay)
                case = (next_index, name, data, descs, spawned and compiled_case(seed, next_index, compiled_share))
                next_index += 1
                try:
                    workers[i].submit(case, hard_timeout)
                except OSError:                         # it died after its last answer
                    crashed(i, time.perf_counter())

        try:
            for i in range(len(workers)):
                feed(i)
            while any(w.case is not None for w in workers):
                busy = [w for w in workers if w.case is not None]
                ready = wait([w.conn for w in busy], timeout=0.5)
                now = time.perf_counter()
                for i, w in enumerate(workers):
                    if w.case is None:
                        continue
                    if w.conn in ready:
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):
                            crashed(i, now)
                        else:
                            if isinstance(msg, _JitStarted):
                                w.deadline = max(w.deadline, now + jit_timeout)
                                continue
                            record(w, msg.res)
                    elif now > w.deadline:
                        record(w, {"outcome": "failure", "kind": "hang",
                                   "msg": f"killed after {now - w.t0:.1f} s (hard timeout {hard_timeout} s, "
                                          f"{jit_timeout} s after a JIT compile starts)",
                                   "elapsed": now - w.t0})
                        w.kill()
                        workers[i] = new_worker()
                    else:
                        continue
                    feed(i)
        finally:
            for w in workers:
                try:
                    w.conn.send(None)
                except OSError:
                    pass
                w.proc.join(2)
                if w.proc.is_alive():
                    w.kill()
    rep.by_mutation = {k: dict(by_mut[k]) for k in MUTATIONS if k in by_mut}
    rep.by_path = {k: {"kernels": path_kernels[k], **dict(by_path[k])} for k in PATHS if by_path[k]}
    rep.failure_kinds = dict(kinds)
    rep.unclear_messages = dict(unclear.most_common())
    rep.failures_dir = str(failures_dir) if failures_dir is not None and rep.fuzz_failures else None
    rep.max_case_s = round(rep.max_case_s, 4)
    rep.max_case_wall_s = round(rep.max_case_wall_s, 4)
    rep.peak_mem_over_file_mb = round(rep.peak_mem_over_file_mb, 3)
    rep.maxrss_growth_mb = round(rep.maxrss_growth_mb, 1)
    rep.wall_s = round(time.perf_counter() - t_start, 1)
    return rep


def replay(path: str | Path) -> list[dict[str, Any]]:
    """Re-run saved inputs (one file or every .gguf in a directory) in this process."""
    p = Path(path)
    files = sorted(p.glob("*.gguf")) if p.is_dir() else [p]
    return [dict(file=str(f), **run_case(str(f))) for f in files]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--failures-dir", default="gguf-fuzz-failures",
                    help="where failing inputs are written (only if there are any)")
    ap.add_argument("--case-time-limit", type=float, default=2.0,
                    help="a case using more CPU seconds than this is a hang")
    ap.add_argument("--hard-timeout", type=float, default=20.0, help="kill a worker stuck this long")
    ap.add_argument("--mem-overhead-mb", type=float, default=64.0,
                    help="allowed traced peak above the file size")
    ap.add_argument("--as-headroom-mb", type=float, default=2048.0,
                    help="RLIMIT_AS of a worker: its size after imports plus this (0: no limit)")
    ap.add_argument("--strict-path", action="store_true",
                    help="an unclear error (a project error not naming the file) is a failure")
    ap.add_argument("--compiled-share", type=float, default=0.0,
                    help="share of the cases (0..1) run through the compiled (numba) kernels, in spawned "
                         "workers, where a crash is a counted failure; the rest run the numpy reference")
    ap.add_argument("--replay", help="re-run a saved failing input (file or directory) and exit")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.replay:
        for r in replay(args.replay):
            print(json.dumps(r))
        return 0
    rep = run_fuzz(args.cases, args.seed, args.jobs, args.failures_dir, args.case_time_limit,
                   args.hard_timeout, args.mem_overhead_mb, args.as_headroom_mb, args.strict_path,
                   progress=not args.json, compiled_share=args.compiled_share)
    if args.json:
        print(json.dumps(rep.to_json()))
    else:
        print(f"{rep.fuzz_cases} cases: {rep.ok} ok, {rep.clean_errors} clean errors, "
              f"{rep.unclear_errors} unclear errors (the file not named), {rep.fuzz_failures} failures "
              f"({rep.crashes} crashes); "
              f"max case {rep.max_case_s:.3f} s, traced peak over file "
              f"{rep.peak_mem_over_file_mb:.2f} MB, maxrss growth {rep.maxrss_growth_mb:.1f} MB, "
              f"{rep.wall_s:.0f} s")
        for k, v in rep.by_path.items():
            print(f"  {k + ' kernels':18s} {v}")
        for k, v in rep.by_mutation.items():
            print(f"  {k:18s} {v}")
        for m, n in list(rep.unclear_messages.items())[:20]:
            print(f"  UNCLEAR x{n} {m}")
        for f in rep.failures[:20]:
            print(f"  FAIL {f}")
    return 1 if rep.fuzz_failures or rep.unclear_errors else 0


if __name__ == "__main__":
    sys.exit(main())

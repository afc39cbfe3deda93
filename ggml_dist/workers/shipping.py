"""Weights for a stage whose node cannot read the GGUF file: sent in bounded chunks, cached on the node.

    driver  manifest(model, names)        the stage's tensors laid out back to back (32-byte aligned)
                                          and the blake2b checksum of those bytes, which names the cache
            ship(model, m, actor, label)  ask the stage to open its cache; if it has no valid copy, send
                                          the bytes in chunks of at most CHUNK_BYTES, two in flight, read
                                          from the driver's mapping of the file (never the whole stage in
                                          one object, never the model in the driver's memory), with a
                                          progress line on stderr
    stage   WeightReceiver(root)          writes the chunks to <root>/<checksum>.bin.tmp in order, checks
                                          size and checksum, renames it into place; `open` of a manifest
                                          whose file is there (an earlier run, a restarted stage) verifies
                                          the checksum and maps it without a byte on the wire

The cache root is $GGML_DIST_CACHE/stage-weights (default ~/.cache/ggml_dist/stage-weights) on the
stage's node. Weights stay quantized as stored in the file.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.base import tensor_array
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model.weights import MappedBuffer

CHUNK_BYTES = 64 * 2**20
ALIGN = 32
_HASH_BLOCK = 16 * 2**20


class ShippingError(RuntimeError):
    """Weights that arrived incomplete or corrupted, or a cache that cannot be written."""


@dataclass(frozen=True)
class WeightManifest:
    tensors: list[tuple[str, int, list[int], int, int]]   # (name, type, ne, offset in the cache file, nbytes)
    total: int
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {"tensors": [list(t) for t in self.tensors], "total": self.total, "checksum": self.checksum}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WeightManifest:
        try:
            ts = [(str(n), int(ty), [int(x) for x in ne], int(off), int(nb)) for n, ty, ne, off, nb in d["tensors"]]
            m = cls(ts, int(d["total"]), str(d["checksum"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ShippingError(f"malformed weight manifest: {e}") from None
        if not all(c in "0123456789abcdef" for c in m.checksum) or len(m.checksum) != 32:
            raise ShippingError(f"malformed weight manifest: checksum '{m.checksum}'")
        if any(off < 0 or nb < 0 or off + nb > m.total for _, _, _, off, nb in ts):
            raise ShippingError("malformed weight manifest: a tensor lies outside the file")
        return m


def cache_root() -> Path:
    base = os.environ.get("GGML_DIST_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "ggml_dist") / "stage-weights"


# -- driver ---------------------------------------------------------------------------------------------
def _pieces(weights: dict[str, Tensor], names: list[str]) -> Iterator[tuple[int, np.ndarray]]:
    """(offset in the stream, bytes) of each tensor, in order, as views of the driver's mapping."""
    off = 0
    for n in names:
        a = tensor_array(weights[n]).reshape(-1).view(np.uint8)
        off = -(-off // ALIGN) * ALIGN
        yield off, a
        off += a.nbytes


def manifest(weights: dict[str, Tensor], names: list[str]) -> WeightManifest:
    h = hashlib.blake2b(digest_size=16)
    ts: list[tuple[str, int, list[int], int, int]] = []
    end = 0
    for off, a in _pieces(weights, names):
        h.update(bytes(off - end))                      # the alignment padding, zeros in the file
        for i in range(0, a.nbytes, _HASH_BLOCK):
            # .data is memoryview(...): numpy's stubs type arrays as buffers only from Python 3.12
            h.update(a[i:i + _HASH_BLOCK].data)
        t = weights[names[len(ts)]]
        ts.append((t.name, int(t.type), list(t.ne), off, a.nbytes))
        end = off + a.nbytes
    return WeightManifest(ts, end, h.hexdigest())


def _chunks(weights: dict[str, Tensor], names: list[str], chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """The stream in chunks of at most `chunk` bytes, each filled into one reused buffer."""
    buf = np.zeros(chunk, np.uint8)
    start = fill = 0                                    # stream offset of buf[0]; bytes in buf
    for off, a in _pieces(weights, names):
        pad = off - (start + fill)
        i = 0
        while pad or i < a.nbytes:
            if fill == chunk:
                yield start, buf
                start, fill = start + chunk, 0
            if pad:
                n = min(pad, chunk - fill)
                buf[fill:fill + n] = 0
                pad -= n
            else:
                n = min(a.nbytes - i, chunk - fill)
                buf[fill:fill + n] = a[i:i + n]
                i += n
            fill += n
    if fill:
        yield start, buf[:fill]


def ship(weights: dict[str, Tensor], names: list[str], m: WeightManifest, actor: Any, label: str,
         chunk: int = CHUNK_BYTES, log: Any = None) -> bool:
    """Give a Ray stage actor its weights. Returns True if they were sent, False if it had them cached.
    log: where the progress lines go (None: sys.stderr as it is at the call, not at this module's import:
    a stream bound then may be closed since, as a test's captured stderr is)."""
    import ray
    log = sys.stderr if log is None else log
    if ray.get(actor.open_weights.remote(m.to_dict())):
        print(f"ggml-dist: {label}: weights from the node's cache ({m.total / 2**20:.1f} MiB, "
              f"checksum {m.checksum[:12]})", file=log, flush=True)
        return False
    t0, sent, inflight, last = time.time(), 0, [], 0.0
    for off, data in _chunks(weights, names, chunk):
        inflight.append(actor.weights_chunk.remote(off, data))     # serialised now: buf can be refilled
        sent += data.nbytes
        if len(inflight) > 1:
            ray.get(inflight.pop(0))
        if time.time() - last > 1.0 or sent == m.total:
            last = time.time()
            print(f"ggml-dist: {label}: sending weights {sent / 2**20:.0f}/{m.total / 2**20:.0f} MiB "
                  f"({sent / 2**20 / max(1e-3, last - t0):.0f} MiB/s)", file=log, flush=True)
    ray.get(inflight)
    ray.get(actor.finish_weights.remote())
    return True


# -- stage ----------------------------------------------------------------------------------------------
class WeightReceiver:
    """A stage's side: the node-local cache file of one manifest, written in order and verified."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_root()
        self.m: WeightManifest | None = None
        self._f: Any = None
        self._h: Any = None
        self._written = 0

    def path(self, m: WeightManifest) -> Path:
        return self.root / f"{m.checksum}.bin"

    def open(self, m: WeightManifest) -> bool:
        """True if a verified copy is cached (map it with `mapped`); else get ready for chunks."""
        self.m = m
        p = self.path(m)
        if p.exists() and p.stat().st_size == m.total and _file_checksum(p) == m.checksum:
            return True
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            # not a `with`: the file stays open across weights_chunk calls, and finish() closes it
            self._f = open(p.with_suffix(f".bin.tmp{os.getpid()}"), "wb")  # noqa: SIM115
        except OSError as e:
            raise ShippingError(f"cannot write the weight cache under {self.root}: {e}") from None
        self._h, self._written = hashlib.blake2b(digest_size=16), 0
        return False

    def write(self, offset: int, data: Any) -> int:
        if self._f is None or self.m is None:
            raise ShippingError("a weight chunk arrived before its manifest")
        b = memoryview(data).cast("B")
        if offset != self._written or offset + b.nbytes > self.m.total:
            raise ShippingError(f"weight chunk at {offset} (+{b.nbytes}) out of order: {self._written} of "
                                f"{self.m.total} bytes written")
        self._f.write(b)
        self._h.update(b)
        self._written += b.nbytes
        return self._written

    def finish(self) -> Path:
        assert self.m is not None and self._f is not None
        tmp = Path(self._f.name)
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        if self._written != self.m.total or self._h.hexdigest() != self.m.checksum:
            tmp.unlink(missing_ok=True)
            raise ShippingError(f"weights arrived corrupted: {self._written} of {self.m.total} bytes, checksum "
                                f"{self._h.hexdigest()[:12]} instead of {self.m.checksum[:12]}")
        os.replace(tmp, self.path(self.m))
        return self.path(self.m)

    def mapped(self) -> dict[str, Tensor]:
        """The cached file's tensors, bound in place to its read-only mapping."""
        assert self.m is not None
        buf = MappedBuffer(str(self.path(self.m)))
        ctx = Context(len(self.m.tensors) * 400 + 1024, no_alloc=True, name="cached-weights")
        out = {}
        for name, ty, ne, off, nb in self.m.tensors:
            t = ctx.new_tensor(GGMLType(ty), ne).set_name(name)
            if t.nbytes != nb:
                raise ShippingError(f"weight manifest: '{name}' is {nb} bytes, its type and shape say {t.nbytes}")
            t.buffer, t.data = buf, off
            out[name] = t
        return out


def _file_checksum(p: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(p, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()

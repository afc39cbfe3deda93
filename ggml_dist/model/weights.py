"""Model weights as tensors bound to the memory-mapped GGUF file: zero-copy, quantized as stored.

The whole file is one host buffer ("CPU_Mapped", as llama.cpp's mmap buffer): a weight tensor is the
file's bytes at its offset, so a 4-bit model costs 4 bits per weight of page cache and nothing else. A
device that cannot read host memory gets them copied into a buffer of its own (upload_weights), as
llama.cpp's loader reads into a device buffer where the mapping cannot serve it.
"""
from __future__ import annotations

import mmap
from collections.abc import Iterable

import numpy as np

from ..backends.base import Buffer, BufferType, BufferUsage
from ..core.context import Context, pad
from ..core.tensor import Tensor
from .gguf import GGUFFile


class MappedBufferType(BufferType):
    """Host memory backed by a file mapping; readable by every host backend."""
    name = "CPU_Mapped"
    alignment = 32
    max_size = 2**62
    is_host = True

    def alloc_buffer(self, size: int):
        raise RuntimeError("a mapped buffer is created from a file, not allocated")


MAPPED_BUFT = MappedBufferType()


class MappedBuffer(Buffer):
    """The GGUF file's bytes, read-only, as a host buffer (`base`); its release_pages drops pages."""
    base: np.memmap

    def __init__(self, path: str) -> None:
        self.path = path
        self.base = np.memmap(path, dtype=np.uint8, mode="r")
        self.size = int(self.base.nbytes)
        self.buft = MAPPED_BUFT
        self.usage = BufferUsage.WEIGHTS

    def __repr__(self) -> str:
        return f"CPU_Mapped({self.path})"

    def set_tensor(self, t: Tensor, data: np.ndarray, offset: int = 0) -> None:
        raise PermissionError(f"'{t.name}' lives in the read-only mapping of {self.path}")

    def get_tensor(self, t: Tensor) -> np.ndarray:
        from ..backends.base import array_at
        return array_at(self.base, t.data, t).copy()  # type: ignore[arg-type]

    def clear(self, value: int = 0) -> None:
        raise PermissionError("the mapped weights buffer is read-only")

    def release_pages(self, offset: int, size: int) -> None:
        """Drop the resident pages of [offset, offset+size) (whole pages inside it): a backend that keeps
        its own packed copy of a weight calls this, so that copy replaces the mapping's pages in memory
        instead of doubling them. A later read faults the bytes back in from the file."""
        mm = getattr(self.base, "_mmap", None)
        page = mmap.PAGESIZE
        lo, hi = -(-offset // page) * page, (offset + size) // page * page
        if mm is None or hi <= lo or not hasattr(mmap, "MADV_DONTNEED"):
            return
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass                                  # only memory is at stake


def load_weights(f: GGUFFile, names: Iterable[str] | None = None,
                 buffer: MappedBuffer | None = None) -> dict[str, Tensor]:
    """Tensors for the named weights (all by default), bound in place to the file mapping."""
    buffer = buffer or MappedBuffer(str(f.path))
    wanted = list(f.tensors) if names is None else list(names)
    ctx = Context(len(wanted) * 400 + 1024, no_alloc=True, name="weights")
    out: dict[str, Tensor] = {}
    for name in wanted:
        info = f.tensors[name]
        t = ctx.new_tensor(info.type, info.ne)
        t.set_name(name)
        t.buffer, t.data = buffer, info.offset
        out[name] = t
    return out


def upload_weights(weights: dict[str, Tensor], buft: BufferType) -> dict[str, Tensor]:
    """The weights moved into one buffer of buft (usage WEIGHTS): each tensor placed anew, its bytes
    copied from where it was (a tensor listed under two names is moved once). Returns `weights`."""
    unique = list({id(t): t for t in weights.values()}.values())
    offs, size = [], 0
    for t in unique:
        offs.append(size)
        size += pad(buft.get_alloc_size(t), buft.alignment)
    buf = buft.alloc_buffer(size)
    buf.usage = BufferUsage.WEIGHTS
    for t, o in zip(unique, offs):
        data = t.buffer.get_tensor(t)
        t.buffer, t.data = buf, o
        buf.set_tensor(t, data)
    return weights

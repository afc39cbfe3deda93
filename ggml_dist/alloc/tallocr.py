"""Tensor allocators over byte offsets (ggml-alloc.c: ggml_tallocr, ggml_dyn_tallocr).

`Tallocr` is the bump allocator used once for weights and the KV cache. `DynTallocr` is the planner used
by `Gallocr`: it hands out (chunk, offset) addresses in a virtual buffer made of up to 16 chunks and
records each chunk's high-water mark, which becomes the physical buffer size (ggml-mechanisms.md §2.2).
Neither touches memory: an address is just numbers until `Gallocr.alloc_graph` binds it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..core.tensor import Tensor

SIZE_MAX = 2**64 - 1
MAX_CHUNKS = 16          # GGML_VBUFFER_MAX_CHUNKS
MAX_FREE_BLOCKS = 256


class AllocError(MemoryError):
    """A buffer that cannot hold what is asked of it."""


def aligned_size(size: int, alignment: int) -> int:
    """aligned_offset(NULL, size, alignment): round up to a multiple of alignment."""
    return (size + alignment - 1) // alignment * alignment


# -- ggml_tallocr: bump allocation into one existing buffer -------------------------------------------
class Tallocr:
    """Mirrors ggml_tallocr: places tensors one after another in `buffer`, each padded to the alignment.

    `buffer` is a backend buffer (backends/base.py's Buffer: `size`, `buft`, `init_tensor`); its buffer
    type supplies `get_alloc_size`, and `alignment` unless given here. Used for weights and the KV cache,
    never freed.
    """

    def __init__(self, buffer: Any, alignment: int | None = None) -> None:
        buft = buffer.buft
        if alignment is None:
            alignment = buft.alignment
        assert alignment > 0 and alignment & (alignment - 1) == 0, \
            f"alignment must be a power of two, got {alignment}"
        self.buffer = buffer
        self.buft = buft
        self.alignment = alignment
        self.offset = 0

    def alloc(self, t: Tensor) -> None:
        """ggml_tallocr_alloc: bind t at the current offset, then bump by its padded size."""
        assert t.data is None and t.buffer is None and t.view_src is None, \
            f"'{t.name}' is already allocated or is a view"
        size = aligned_size(self.buft.get_alloc_size(t), self.alignment)
        if self.offset + size > self.buffer.size:
            raise AllocError(f"tallocr: '{t.name}' needs {size} B at offset {self.offset}, but the buffer "
                             f"holds {self.buffer.size} B; allocate a larger buffer")
        t.buffer, t.data = self.buffer, self.offset
        self.buffer.init_tensor(t)
        self.offset += size


# -- ggml_dyn_tallocr: the planner's offset allocator ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class BufferAddress:
    """struct buffer_address: a chunk of a virtual buffer and a byte offset inside it."""
    chunk: int
    offset: int


INVALID_ADDR = BufferAddress(-1, SIZE_MAX)


@dataclass(slots=True)
class FreeBlock:
    offset: int
    size: int


@dataclass(slots=True)
class TallocrChunk:
    """struct tallocr_chunk: free blocks sorted by offset, and the high-water mark."""
    free_blocks: list[FreeBlock] = field(default_factory=list)
    max_size: int = 0


class DynTallocr:
    """Mirrors ggml_dyn_tallocr: best fit among interior blocks, then the tail-block reuse rule.

    Linear scans throughout: a chunk rarely has more than a handful of free blocks, and ggml caps them at
    256 anyway.
    """

    def __init__(self, alignment: int, max_chunk_size: int = SIZE_MAX // 2) -> None:
        assert alignment > 0 and alignment & (alignment - 1) == 0, \
            f"alignment must be a power of two, got {alignment}"
        self.alignment = alignment
        self.max_chunk_size = min(max_chunk_size, SIZE_MAX // 2)
        self.chunks: list[TallocrChunk] = []

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def reset(self) -> None:
        """ggml_dyn_tallocr_reset: forget every chunk (done at the start of each reserve)."""
        self.chunks = []

    def max_size(self, chunk: int) -> int:
        """ggml_dyn_tallocr_max_size: the high-water mark of one chunk."""
        return self.chunks[chunk].max_size if chunk < len(self.chunks) else 0

    def total_max_size(self) -> int:
        return sum(c.max_size for c in self.chunks)

    def _new_chunk(self, min_size: int) -> int:
        """ggml_dyn_tallocr_new_chunk: one block of max(min_size, max_chunk_size); the 16th is unbounded."""
        if len(self.chunks) >= MAX_CHUNKS:
            raise AllocError(f"graph allocation: all {MAX_CHUNKS} chunks are in use and none has "
                             f"{min_size} B free; raise the buffer type's max_size")
        size = max(min_size, self.max_chunk_size)
        if len(self.chunks) == MAX_CHUNKS - 1:
            size = SIZE_MAX // 2
        self.chunks.append(TallocrChunk([FreeBlock(0, size)], 0))
        return len(self.chunks) - 1

    def alloc(self, size: int) -> BufferAddress:
        """ggml_dyn_tallocr_alloc (§2.2 steps 1-4)."""
        size = aligned_size(size, self.alignment)
        best_chunk, best_block = -1, -1
        # 1. best fit among non-tail blocks; best_fit_size resets per chunk, ties go to the later block
        for c, chunk in enumerate(self.chunks):
            best_fit_size = SIZE_MAX
            blocks = chunk.free_blocks
            for i in range(len(blocks) - 1):
                bsize = blocks[i].size
                if bsize >= size and bsize <= best_fit_size:
                    best_chunk, best_block, best_fit_size = c, i, bsize
        # 2. the tail blocks: prefer no growth with the least waste, else the least growth
        if best_block == -1:
            best_reuse: float = float("-inf")
            for c, chunk in enumerate(self.chunks):
                if not chunk.free_blocks:
                    continue
                block = chunk.free_blocks[-1]
                reuse = chunk.max_size - block.offset - size
                better_reuse = best_reuse < 0 and reuse > best_reuse
                better_fit = reuse >= 0 and reuse < best_reuse
                if block.size >= size and (better_reuse or better_fit):
                    best_chunk, best_block, best_reuse = c, len(chunk.free_blocks) - 1, reuse
        # 3. nothing fits: open a chunk
        if best_block == -1:
            best_chunk, best_block = self._new_chunk(size), 0
        # 4. carve from the front of the block
        chunk = self.chunks[best_chunk]
        block = chunk.free_blocks[best_block]
        addr = BufferAddress(best_chunk, block.offset)
        block.offset += size
        block.size -= size
        if block.size == 0:
            del chunk.free_blocks[best_block]
        chunk.max_size = max(chunk.max_size, addr.offset + size)
        return addr

    def free_bytes(self, addr: BufferAddress, size: int) -> None:
        """ggml_dyn_tallocr_free_bytes: merge with a neighbour block, or insert keeping offset order."""
        size = aligned_size(size, self.alignment)
        if size == 0:
            # differs from ggml: a zero-size free is a no-op instead of possibly inserting an empty block,
            # because an empty block would break "no two consecutive blocks touch" (invariant 17)
            return
        chunk = self.chunks[addr.chunk]
        blocks = chunk.free_blocks
        for i, block in enumerate(blocks):
            if block.offset + block.size == addr.offset:          # freed range follows this block
                block.size += size
                if i + 1 < len(blocks) and block.offset + block.size == blocks[i + 1].offset:
                    block.size += blocks[i + 1].size
                    del blocks[i + 1]
                return
            if addr.offset + size == block.offset:                # freed range precedes this block
                block.offset = addr.offset
                block.size += size
                if i > 0 and blocks[i - 1].offset + blocks[i - 1].size == block.offset:
                    blocks[i - 1].size += block.size
                    del blocks[i]
                return
        assert len(blocks) < MAX_FREE_BLOCKS, "too many free blocks in one chunk"
        pos = 0
        while pos < len(blocks) and blocks[pos].offset < addr.offset:
            pos += 1
        blocks.insert(pos, FreeBlock(addr.offset, size))

    # alias kept for readers coming from older ggml (ggml_dyn_tallocr_free_tensor)
    free = free_bytes

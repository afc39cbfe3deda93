"""Tests for alloc/tallocr.py: DynTallocr traces T1/T2 (ggml-mechanisms.md §5.2) and Tallocr."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from ggml_dist.alloc.tallocr import (MAX_CHUNKS, SIZE_MAX, AllocError, BufferAddress, DynTallocr,
                                     FreeBlock, Tallocr)
from ggml_dist.core.context import Context
from ggml_dist.core.types import GGMLType

from .fakes import FakeBufferType


def blocks(a: DynTallocr, c: int = 0) -> list[tuple[int, int]]:
    return [(b.offset, b.offset + b.size) for b in a.chunks[c].free_blocks]


# T1: interior best fit, tail reuse 0, tail growth; high-water mark 288
def test_t1_trace():
    a = DynTallocr(32)
    assert a.alloc(40) == BufferAddress(0, 0)
    assert a.alloc(100) == BufferAddress(0, 64)
    assert a.alloc(10) == BufferAddress(0, 192)
    a.free_bytes(BufferAddress(0, 0), 40)
    a.free_bytes(BufferAddress(0, 192), 10)
    assert blocks(a)[0] == (0, 64) and blocks(a)[1][0] == 192 and len(blocks(a)) == 2
    assert a.alloc(64) == BufferAddress(0, 0)
    assert a.alloc(32) == BufferAddress(0, 192)
    assert a.alloc(64) == BufferAddress(0, 224)
    assert a.max_size(0) == 288


# T2: max chunk 256: a new chunk when no tail fits; reuse factor picks chunk 0; chunk 1 ends with no block
def test_t2_trace():
    a = DynTallocr(32, max_chunk_size=256)
    assert a.alloc(200) == BufferAddress(0, 0)
    assert a.alloc(100) == BufferAddress(1, 0)
    a.free_bytes(BufferAddress(0, 0), 200)
    assert blocks(a, 0) == [(0, 256)]
    assert a.alloc(64) == BufferAddress(0, 0)
    assert a.alloc(96) == BufferAddress(0, 64)
    assert a.alloc(128) == BufferAddress(1, 128)
    assert (a.max_size(0), a.max_size(1)) == (224, 256)
    assert a.chunks[1].free_blocks == []


# best fit resets per chunk: a later chunk's fitting interior block beats a tighter one in an earlier chunk
def test_best_fit_prefers_last_chunk_with_a_fit():
    a = DynTallocr(32, max_chunk_size=256)
    a.chunks = []
    c0 = a._new_chunk(256)
    c1 = a._new_chunk(256)
    a.chunks[c0].free_blocks = [FreeBlock(0, 64), FreeBlock(192, 64)]
    a.chunks[c1].free_blocks = [FreeBlock(0, 128), FreeBlock(192, 64)]
    assert a.alloc(64) == BufferAddress(1, 0)


# ties among interior blocks go to the later (higher-offset) block
def test_best_fit_ties_go_to_later_block():
    a = DynTallocr(32)
    a._new_chunk(0)
    a.chunks[0].free_blocks = [FreeBlock(0, 64), FreeBlock(128, 64), FreeBlock(256, 1 << 40)]
    assert a.alloc(64) == BufferAddress(0, 128)


# a tensor bigger than max_chunk_size gets its own chunk of exactly that size; the 16th chunk is unbounded
def test_oversize_and_sixteenth_chunk():
    a = DynTallocr(32, max_chunk_size=64)
    assert a.alloc(100) == BufferAddress(0, 0)
    assert a.chunks[0].free_blocks == [] and a.max_size(0) == 128
    for i in range(1, MAX_CHUNKS - 1):
        assert a.alloc(64).chunk == i
    addr = a.alloc(64)
    assert addr.chunk == MAX_CHUNKS - 1
    assert a.chunks[-1].free_blocks[0].size == SIZE_MAX // 2 - 64
    assert a.alloc(1 << 30).chunk == MAX_CHUNKS - 1


# zero-size requests consume nothing
def test_zero_size():
    a = DynTallocr(32)
    assert a.alloc(0) == BufferAddress(0, 0)
    assert a.alloc(10) == BufferAddress(0, 0)
    a.free_bytes(BufferAddress(0, 0), 0)
    assert a.max_size(0) == 32


# random alloc/free sequences keep the free list sorted, merged and disjoint from live ranges (inv. 17)
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([16, 32, 64]), st.sampled_from([SIZE_MAX, 512, 2048]))
def test_random_free_list_invariants(seed, alignment, max_chunk):
    rng = random.Random(seed)
    a = DynTallocr(alignment, max_chunk)
    live: list[tuple[BufferAddress, int]] = []
    for _ in range(120):
        if live and rng.random() < 0.45:
            addr, size = live.pop(rng.randrange(len(live)))
            a.free_bytes(addr, size)
        else:
            size = rng.choice([0, 1, 7, 32, 100, 300, 700])
            addr = a.alloc(size)
            assert addr.offset % alignment == 0
            live.append((addr, size))
        for c, chunk in enumerate(a.chunks):
            fb = chunk.free_blocks
            assert all(fb[i].offset + fb[i].size < fb[i + 1].offset for i in range(len(fb) - 1)), fb
            assert all(b.size > 0 for b in fb)
            spans = sorted((ad.offset, ad.offset + -(-s // alignment) * alignment)
                           for ad, s in live if ad.chunk == c and s > 0)
            for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
                assert e0 <= s1, f"live ranges overlap in chunk {c}"
            for s0, e0 in spans:
                assert e0 <= chunk.max_size
                assert all(e0 <= b.offset or s0 >= b.offset + b.size for b in fb)
    for addr, size in live:
        a.free_bytes(addr, size)
    for chunk in a.chunks:           # everything freed: each chunk is one block again (or empty chunk 0-size)
        assert len(chunk.free_blocks) <= 1


# Tallocr: bump allocation padded to the alignment, AllocError when full
def test_tallocr_bump():
    ctx = Context(1 << 16)
    buf = FakeBufferType(alignment=16).alloc_buffer(256)
    ta = Tallocr(buf, alignment=32)                     # the alignment given wins over the buffer type's
    t1 = ctx.new_tensor(GGMLType.F32, (10,))
    t2 = ctx.new_tensor(GGMLType.F32, (16,))
    t3 = ctx.new_tensor(GGMLType.F32, (64,))
    ta.alloc(t1)
    ta.alloc(t2)
    assert (t1.buffer, t1.data, t2.data, ta.offset) == (buf, 0, 64, 128)
    with pytest.raises(AllocError):
        ta.alloc(t3)


# Tallocr takes alignment and alloc size from the buffer's buffer type
def test_tallocr_uses_buft():
    bt = FakeBufferType(alignment=64, extra=8)
    buf = bt.alloc_buffer(1024)
    ta = Tallocr(buf)
    ctx = Context(1 << 16)
    t1, t2 = ctx.new_tensor(GGMLType.F32, (16,)), ctx.new_tensor(GGMLType.F32, (4,))
    ta.alloc(t1)
    ta.alloc(t2)
    assert (t1.data, t2.data, ta.offset) == (0, 128, 192)

"""The KV cache: per-layer K and V tensors plus the cell bookkeeping (llama_kv_cache, unified stream).

Cells carry a position and a bit set of sequence ids. A ubatch finds a slot (llama.cpp's non-contiguous
search from the head), commits into it, and the graph writes the new K/V rows there with SET_ROWS before
attention reads the first n_kv cells (ggml-mechanisms.md §4.6). V is stored transposed, as llama.cpp does
without flash attention, so that P·V is a plain MUL_MAT over contiguous rows.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np

from ..core import ops
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType, row_size

N_KV_PAD = 256          # n_kv granularity: keeps graph shapes stable for 256 decode steps


class ContextFullError(RuntimeError):
    """No free cells for a ubatch: the context (KV cache) is full."""


def pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


class KVCells:
    """Positions and sequence sets of the cache's cells (llama_kv_cells)."""

    def __init__(self, size: int, n_seq_max: int) -> None:
        if not 1 <= n_seq_max <= 64:
            raise ValueError(f"n_seq_max must be in 1..64, got {n_seq_max}")
        self.size = size
        self.n_seq_max = n_seq_max
        self.pos = np.full(size, -1, dtype=np.int32)
        self.seq = np.zeros(size, dtype=np.uint64)        # bit s set: the cell holds sequence s
        self.head = 0

    @property
    def used(self) -> int:
        return int((self.pos >= 0).sum())

    @property
    def used_max_p1(self) -> int:
        nz = np.nonzero(self.pos >= 0)[0]
        return int(nz[-1]) + 1 if len(nz) else 0

    def n_kv(self) -> int:
        """get_n_kv: the graph-visible length, padded to 256 and capped at the cache size."""
        return min(self.size, max(N_KV_PAD, pad(self.used_max_p1, N_KV_PAD)))

    def seq_pos_max(self, seq_id: int) -> int:
        m = self._seq_mask(seq_id)
        return int(self.pos[m].max()) if m.any() else -1

    def _seq_mask(self, seq_id: int) -> np.ndarray:
        return (self.seq & np.uint64(1 << seq_id)) != 0

    # -- slots ---------------------------------------------------------------------------------------
    def find_slot(self, n_tokens: int) -> np.ndarray:
        """Cells for n_tokens new tokens: empty cells scanned cyclically from the head."""
        if n_tokens > self.size:
            raise ContextFullError(f"a ubatch of {n_tokens} tokens exceeds the context of {self.size}")
        head = self.head if self.head <= self.used + 2 * n_tokens else 0
        order = np.concatenate([np.arange(head, self.size), np.arange(0, head)])
        free = order[self.pos[order] < 0][:n_tokens]
        if len(free) < n_tokens:
            raise ContextFullError(
                f"context full: {n_tokens} cells needed, {self.size - self.used} free of {self.size}; "
                f"start a new sequence, remove old tokens, or use a larger --ctx")
        return free.astype(np.int64)

    def apply(self, slot: np.ndarray, pos: np.ndarray, seq_ids: list[frozenset[int]]) -> None:
        """apply_ubatch: commit positions and sequences into the chosen cells."""
        for cell, p, s in zip(slot, pos, seq_ids):
            self.pos[cell] = p
            self.seq[cell] = np.uint64(sum(1 << q for q in s))
        self.head = int(slot[-1]) + 1 if len(slot) else self.head
        if self.head >= self.size:
            self.head = 0

    # -- sequence edits --------------------------------------------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Remove seq_id (all sequences if < 0) from cells with p0 <= pos < p1 (p1 < 0: no end)."""
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        in_range = (self.pos >= p0) & (self.pos < p1)
        if seq_id < 0:
            self.seq[in_range] = 0
        else:
            self.seq[in_range] &= ~np.uint64(1 << seq_id)
        emptied = in_range & (self.seq == 0)
        self.pos[emptied] = -1
        if emptied.any():
            self.head = min(self.head, int(np.nonzero(emptied)[0][0]))

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        m = self._seq_mask(src) & (self.pos >= p0) & (self.pos < p1)
        self.seq[m] |= np.uint64(1 << dst)

    def seq_keep(self, seq_id: int) -> None:
        keep = self._seq_mask(seq_id)
        self.seq[~keep] = 0
        self.seq[keep] = np.uint64(1 << seq_id)
        self.pos[~keep] = -1
        self.head = 0

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = 0
        self.head = 0

    # -- graph inputs ----------------------------------------------------------------------------------
    def kq_mask(self, n_kv: int, pos: np.ndarray, seq_ids: list[frozenset[int]]) -> np.ndarray:
        """[n_tokens, n_kv] f32 (numpy order): 0 where the cell holds the token's sequence at a position
        <= the token's, -inf elsewhere (empty cells and padding included)."""
        cpos, cseq = self.pos[:n_kv], self.seq[:n_kv]
        mask = np.full((len(pos), n_kv), -np.inf, dtype=np.float32)
        for i, (p, s) in enumerate(zip(pos, seq_ids)):
            q = np.uint64(1 << min(s))
            ok = (cpos >= 0) & ((cseq & q) != 0) & (cpos <= p)
            mask[i, ok] = 0.0
        return mask


class KVCache:
    """Per-layer K [n_embd_k_gqa, kv_size] and transposed V [kv_size, n_embd_v_gqa] tensors."""

    def __init__(self, n_embd_k_gqa: int, n_embd_v_gqa: int, kv_size: int, layers: Iterable[int],
                 type_k: GGMLType = GGMLType.F16, type_v: GGMLType = GGMLType.F16,
                 n_seq_max: int = 1) -> None:
        self.kv_size = pad(kv_size, N_KV_PAD)
        self.n_embd_k_gqa, self.n_embd_v_gqa = n_embd_k_gqa, n_embd_v_gqa
        self.type_k, self.type_v = type_k, type_v
        self.cells = KVCells(self.kv_size, n_seq_max)
        self.layers = list(layers)
        self.ctx = Context(len(self.layers) * 2 * 400 + 1024, no_alloc=True, name="kv_cache")
        self.k_l: dict[int, Tensor] = {}
        self.v_l: dict[int, Tensor] = {}
        for il in self.layers:
            self.k_l[il] = self.ctx.new_tensor(type_k, (n_embd_k_gqa, self.kv_size)).set_name(f"cache_k_l{il}")
            self.v_l[il] = self.ctx.new_tensor(type_v, (self.kv_size, n_embd_v_gqa)).set_name(f"cache_v_l{il}")
        self.buffers: list = []

    def tensors(self) -> list[Tensor]:
        return [t for il in self.layers for t in (self.k_l[il], self.v_l[il])]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def allocate(self, buft, layer_buft=None) -> None:
        """Place K and V in zeroed buffers (llama.cpp clears the cache at creation): one buffer of buft,
        or, with layer_buft(il) -> buft, one buffer per distinct buffer type (a pipeline's stages)."""
        groups: dict[int, tuple[object, list[Tensor]]] = {}
        for il in self.layers:
            b = layer_buft(il) if layer_buft is not None else buft
            groups.setdefault(id(b), (b, []))[1].extend((self.k_l[il], self.v_l[il]))
        self.buffers = []
        for b, ts in groups.values():
            offs, size = [], 0
            for t in ts:
                offs.append(size)
                size += pad(b.get_alloc_size(t), b.alignment)
            buf = b.alloc_buffer(size)
            buf.clear(0)
            for t, o in zip(ts, offs):
                t.buffer, t.data = buf, o
            self.buffers.append(buf)

    # -- graph pieces (llama_kv_cache::get_k / get_v / cpy_k / cpy_v) -----------------------------------
    def get_k(self, ctx: Context, il: int, n_kv: int, n_head_kv: int) -> Tensor:
        k = self.k_l[il]
        d = self.n_embd_k_gqa // n_head_kv
        # ne = (head_dim, n_kv, n_head_kv)
        return ops.view_3d(ctx, k, d, n_kv, n_head_kv, k.nb[1], row_size(k.type, d), 0)

    def get_v(self, ctx: Context, il: int, n_kv: int, n_head_kv: int) -> Tensor:
        v = self.v_l[il]
        d = self.n_embd_v_gqa // n_head_kv
        # ne = (n_kv, head_dim, n_head_kv): transposed V, rows of kv_size cells
        return ops.view_3d(ctx, v, n_kv, d, n_head_kv, v.nb[1], v.nb[1] * d, 0)

    def cpy_k(self, ctx: Context, il: int, k_cur: Tensor, k_idxs: Tensor) -> Tensor:
        k = self.k_l[il]
        n_tokens = k_cur.nelements // self.n_embd_k_gqa
        return ops.set_rows(ctx, k, ops.reshape(ctx, k_cur, self.n_embd_k_gqa, n_tokens), k_idxs)

    def cpy_v(self, ctx: Context, il: int, v_cur: Tensor, v_idxs: Tensor) -> Tensor:
        """One row of one element per value: row j*kv_size + cell receives dim j of the token."""
        v = self.v_l[il]
        v_flat = ops.reshape(ctx, v, 1, self.kv_size * self.n_embd_v_gqa)
        return ops.set_rows(ctx, v_flat, ops.reshape(ctx, v_cur, 1, v_cur.nelements), v_idxs)

    def k_idxs(self, slot: np.ndarray) -> np.ndarray:
        return slot.astype(np.int64)

    def v_idxs(self, slot: np.ndarray) -> np.ndarray:
        """Element e = j + n_embd_v_gqa * i (token i, dim j) goes to row j * kv_size + slot[i]."""
        j = np.arange(self.n_embd_v_gqa, dtype=np.int64)
        return (slot.astype(np.int64)[:, None] + j[None, :] * self.kv_size).reshape(-1)

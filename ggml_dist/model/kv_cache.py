"""The KV cache: per-layer K and V tensors plus the cell bookkeeping (llama_kv_cache).

Cells carry a position and a bit set of sequence ids. A ubatch finds a slot (llama.cpp's non-contiguous
search from the head), commits into it, and the graph writes the new K/V rows there with SET_ROWS before
attention reads the first n_kv cells (ggml-mechanisms.md §4.6). V is stored transposed, as llama.cpp does
without flash attention, so that P·V is a plain MUL_MAT over contiguous rows.

Unified (one stream), every sequence shares the cells, and a token's attention spans the cells of all of
them. Without a unified cache (kv_unified=False) sequence s owns stream s: kv_size cells of its own, so
the attention of a batch of sequences is one product per stream over that stream's cells only. A cell is
then addressed by its absolute index stream * kv_size + cell, in the bookkeeping as in the K/V tensors
([n_embd, kv_size, n_stream]; V transposed per stream).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from ..backends.base import Buffer, BufferType, tensor_array, tensor_get, tensor_set
from ..core import ops
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType, row_size

N_KV_PAD = 256          # n_kv granularity: keeps graph shapes stable for 256 decode steps


def kv_cells(n_ctx: int, n_seq_max: int = 1, unified: bool = True) -> tuple[int, int]:
    """(cells per stream, streams): the context padded to 256 in one stream, or without a unified cache
    n_ctx / n_seq_max padded to 256 in each of n_seq_max streams (ggml-mechanisms.md §4.7)."""
    n_ctx = pad(n_ctx, N_KV_PAD)
    return (n_ctx, 1) if unified else (pad(n_ctx // n_seq_max, N_KV_PAD), n_seq_max)


class ContextFullError(RuntimeError):
    """No free cells for a ubatch: the context (KV cache) is full."""


def pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


class KVCells:
    """Positions and sequence sets of the cache's cells (llama_kv_cells), for n_stream streams of `size`
    cells each (absolute cell = stream * size + cell); one stream is the unified cache."""

    def __init__(self, size: int, n_seq_max: int, n_stream: int = 1) -> None:
        if not 1 <= n_seq_max <= 64:
            raise ValueError(f"n_seq_max must be in 1..64, got {n_seq_max}")
        if n_stream not in (1, n_seq_max):
            raise ValueError(f"n_stream must be 1 (unified) or n_seq_max={n_seq_max}, got {n_stream}")
        self.size = size
        self.n_seq_max = n_seq_max
        self.n_stream = n_stream
        self.pos = np.full(size * n_stream, -1, dtype=np.int32)
        self.seq = np.zeros(size * n_stream, dtype=np.uint64)   # bit s set: the cell holds sequence s
        self.heads = [0] * n_stream

    @property
    def head(self) -> int:
        return self.heads[0]

    def stream_of(self, seq_id: int) -> int:
        """seq_to_stream: sequence s owns stream s, or all share stream 0 (unified)."""
        return 0 if self.n_stream == 1 else seq_id

    def _cells(self, stream: int) -> slice:
        return slice(stream * self.size, (stream + 1) * self.size)

    @property
    def used(self) -> int:
        return int((self.pos >= 0).sum())

    def used_in(self, stream: int) -> int:
        return int((self.pos[self._cells(stream)] >= 0).sum())

    @property
    def used_max_p1(self) -> int:
        return self.used_max_p1_in(0)

    def used_max_p1_in(self, stream: int) -> int:
        nz = np.nonzero(self.pos[self._cells(stream)] >= 0)[0]
        return int(nz[-1]) + 1 if len(nz) else 0

    def n_kv(self, streams: Iterable[int] = (0,)) -> int:
        """get_n_kv: the graph-visible length, padded to 256 and capped at the stream size; the max over
        the ubatch's streams."""
        return max(min(self.size, max(N_KV_PAD, pad(self.used_max_p1_in(s), N_KV_PAD))) for s in streams)

    def seq_pos_max(self, seq_id: int) -> int:
        pos = self._seq_positions(seq_id)
        return int(pos.max()) if len(pos) else -1

    def seq_pos_min(self, seq_id: int) -> int:
        pos = self._seq_positions(seq_id)
        return int(pos.min()) if len(pos) else -1

    def _seq_positions(self, seq_id: int) -> np.ndarray:
        """The positions of the cells holding seq_id, looked up in its own stream only."""
        c = self._cells(self.stream_of(seq_id))
        return self.pos[c][(self.seq[c] & np.uint64(1 << seq_id)) != 0]

    def _seq_mask(self, seq_id: int) -> np.ndarray:
        return (self.seq & np.uint64(1 << seq_id)) != 0

    # -- slots ---------------------------------------------------------------------------------------
    def find_slot(self, n_tokens: int, stream: int = 0) -> np.ndarray:
        """Absolute cells for n_tokens new tokens of one stream: empty cells scanned cyclically from the
        stream's head (restarting from 0 when the head is beyond used + 2 * n_tokens)."""
        if n_tokens > self.size:
            raise ContextFullError(f"a ubatch of {n_tokens} tokens exceeds the context of {self.size}"
                                   + (" cells per sequence" if self.n_stream > 1 else ""))
        pos = self.pos[self._cells(stream)]
        used = int((pos >= 0).sum())
        head = self.heads[stream] if self.heads[stream] <= used + 2 * n_tokens else 0
        order = np.concatenate([np.arange(head, self.size), np.arange(0, head)])
        free = order[pos[order] < 0][:n_tokens]
        if len(free) < n_tokens:
            where = f"sequence {stream}'s stream" if self.n_stream > 1 else "the context"
            raise ContextFullError(
                f"context full: {n_tokens} cells needed, {self.size - used} free of {self.size} in {where}; "
                f"start a new sequence, remove old tokens, or use a larger --ctx")
        return (free + stream * self.size).astype(np.int64)

    def find_slot_ubatch(self, seq_ids: list[frozenset[int]], n_seqs: int) -> np.ndarray:
        """find_slot for a whole ubatch: unified, one search; with streams, the ubatch is n_seqs groups of
        equal length, one sequence each (split_equal), and each group searches its own stream."""
        n = len(seq_ids)
        if self.n_stream == 1:
            return self.find_slot(n)
        g = n // n_seqs
        return np.concatenate([self.find_slot(g, self.stream_of(min(seq_ids[i * g])))
                               for i in range(n_seqs)])

    def apply(self, slot: np.ndarray, pos: np.ndarray, seq_ids: list[frozenset[int]]) -> None:
        """apply_ubatch: commit positions and sequences into the chosen cells; each stream's head moves
        past the last cell written to it."""
        for cell, p, s in zip(slot, pos, seq_ids):
            self.pos[cell] = p
            self.seq[cell] = np.uint64(sum(1 << q for q in s))
        for cell in slot:
            st, c = divmod(int(cell), self.size)
            self.heads[st] = c + 1 if c + 1 < self.size else 0

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
        for cell in np.nonzero(emptied)[0]:
            st, c = divmod(int(cell), self.size)
            self.heads[st] = min(self.heads[st], c)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst joins src's cells with p0 <= pos < p1. Across streams (llama_kv_cache::seq_cp), the
        whole sequence only: dst's stream is reset to src's cells, cell for cell, and its head to src's;
        the caller copies the stream's K and V (KVCache.copy_stream)."""
        ss, sd = self.stream_of(src), self.stream_of(dst)
        if ss != sd:
            if p0 > 0 or p1 >= 0:
                raise ValueError(f"seq_cp({src}, {dst}, {p0}, {p1}): the sequences own different KV "
                                 f"streams, and a copy between streams takes the whole sequence "
                                 f"(p0=0, p1=-1), as llama.cpp's")
            src_cells, dst_cells = self._cells(ss), self._cells(sd)
            has = (self.seq[src_cells] & np.uint64(1 << src)) != 0
            self.pos[dst_cells] = np.where(has, self.pos[src_cells], -1)
            self.seq[dst_cells] = np.where(has, np.uint64(1 << dst), np.uint64(0))
            self.heads[sd] = self.heads[ss]
            return
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        m = self._seq_mask(src) & (self.pos >= p0) & (self.pos < p1)
        self.seq[m] |= np.uint64(1 << dst)

    def seq_swap(self, a: int, b: int) -> None:
        """Sequences a and b, each alone in its own KV stream, trade streams, cell for cell with their
        heads (the caller swaps the streams' K and V: KVCache.swap_streams). Not a llama.cpp call: the
        server's slot compaction (serve.engine) moves a busy sequence down without losing the cached
        prompt of the free slot it lands on."""
        sa, sb = self.stream_of(a), self.stream_of(b)
        if sa == sb:
            raise ValueError(f"seq_swap({a}, {b}): the sequences share a KV stream (unified cache)")
        ca, cb = self._cells(sa), self._cells(sb)
        for x, cx in ((a, ca), (b, cb)):
            others = self.seq[cx] & ~np.uint64(1 << x)
            if np.any(others):
                raise ValueError(f"seq_swap({a}, {b}): stream {self.stream_of(x)} holds other sequences")
        pa, pb = self.pos[ca].copy(), self.pos[cb].copy()
        self.pos[ca], self.pos[cb] = pb, pa
        self.seq[ca] = np.where(pb >= 0, np.uint64(1 << a), np.uint64(0))
        self.seq[cb] = np.where(pa >= 0, np.uint64(1 << b), np.uint64(0))
        self.heads[sa], self.heads[sb] = self.heads[sb], self.heads[sa]

    def seq_keep(self, seq_id: int) -> None:
        keep = self._seq_mask(seq_id)
        self.seq[~keep] = 0
        self.seq[keep] = np.uint64(1 << seq_id)
        self.pos[~keep] = -1
        self.heads = [0] * self.n_stream

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = 0
        self.heads = [0] * self.n_stream

    # -- graph inputs ----------------------------------------------------------------------------------
    def kq_mask(self, n_kv: int, pos: np.ndarray, seq_ids: list[frozenset[int]],
                n_seqs: int = 1, n_swa: int = 0) -> np.ndarray:
        """[n_tokens, n_kv] f32 (numpy order), or with streams [n_seqs, n_tokens / n_seqs, n_kv] (one
        group of tokens per stream): 0 where the cell of the token's stream holds the token's sequence at a
        position <= the token's, -inf elsewhere (empty cells and padding included). n_swa > 0: also -inf
        where the token's position minus the cell's is >= n_swa (is_masked_swa, LLAMA_SWA_TYPE_STANDARD)."""
        mask = np.full((len(pos), n_kv), -np.inf, dtype=np.float32)
        seq_of = np.array([min(s) for s in seq_ids])
        for q in np.unique(seq_of):                     # all the rows of one sequence at once
            rows = np.flatnonzero(seq_of == q)
            c0 = self.stream_of(int(q)) * self.size
            cpos, cseq = self.pos[c0:c0 + n_kv], self.seq[c0:c0 + n_kv]
            held = (cpos >= 0) & ((cseq & np.uint64(1 << int(q))) != 0)
            p1 = np.asarray(pos)[rows, None]
            ok = held[None, :] & (cpos[None, :] <= p1)
            if n_swa:
                ok &= (p1 - cpos[None, :]) < n_swa
            mask[rows] = np.where(ok, 0.0, -np.inf)
        return mask if self.n_stream == 1 else mask.reshape(n_seqs, -1, n_kv)


class KVCache:
    """Per-layer K [n_embd_k_gqa, kv_size, n_stream] and transposed V [kv_size, n_embd_v_gqa, n_stream]
    tensors. kv_size is the context padded to 256, or without a unified cache n_ctx / n_seq_max padded to
    256 per stream (ggml-mechanisms.md §4.7)."""

    def __init__(self, n_embd_k_gqa: int, n_embd_v_gqa: int, kv_size: int, layers: Iterable[int],
                 type_k: GGMLType = GGMLType.F16, type_v: GGMLType = GGMLType.F16,
                 n_seq_max: int = 1, unified: bool = True) -> None:
        self.kv_size, self.n_stream = kv_cells(kv_size, n_seq_max, unified)
        self.n_embd_k_gqa, self.n_embd_v_gqa = n_embd_k_gqa, n_embd_v_gqa
        self.type_k, self.type_v = type_k, type_v
        self.cells = KVCells(self.kv_size, n_seq_max, self.n_stream)
        self.layers = list(layers)
        self.ctx = Context(len(self.layers) * 2 * 400 + 1024, no_alloc=True, name="kv_cache")
        self.k_l: dict[int, Tensor] = {}
        self.v_l: dict[int, Tensor] = {}
        ns = self.n_stream
        for il in self.layers:
            k = self.ctx.new_tensor(type_k, (n_embd_k_gqa, self.kv_size, ns))
            v = self.ctx.new_tensor(type_v, (self.kv_size, n_embd_v_gqa, ns))
            self.k_l[il], self.v_l[il] = k.set_name(f"cache_k_l{il}"), v.set_name(f"cache_v_l{il}")
        self.buffers: list[Buffer] = []

    @property
    def unified(self) -> bool:
        return self.n_stream == 1

    @property
    def n_cells(self) -> int:
        """Cells in all streams."""
        return self.kv_size * self.n_stream

    def tensors(self) -> list[Tensor]:
        return [t for il in self.layers for t in (self.k_l[il], self.v_l[il])]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def allocate(self, buft: BufferType, layer_buft: Callable[[int], BufferType] | None = None) -> None:
        """Place K and V in zeroed buffers (llama.cpp clears the cache at creation): one buffer of buft,
        or, with layer_buft(il) -> buft, one buffer per distinct buffer type (a pipeline's stages)."""
        groups: dict[int, tuple[BufferType, list[Tensor]]] = {}
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

    def copy_stream(self, src: int, dst: int, n_cells: int | None = None) -> None:
        """Stream src's K and V into stream dst (the buffer half of a cross-stream seq_cp)."""
        self._move_streams([src], [dst], n_cells)

    def swap_streams(self, a: int, b: int, n_cells: int | None = None) -> None:
        """Streams a and b exchange their K and V (the buffer half of seq_swap)."""
        self._move_streams([b, a], [a, b], n_cells)

    def _move_streams(self, src: list[int], dst: list[int], n_cells: int | None) -> None:
        """K and V of streams src into streams dst in every layer (all of src is read first), in place on
        host buffers, through get/set_tensor on others. Only cells 0 .. n_cells-1 (all if None): callers
        pass the cells up to the last one used, past which cells are empty and masked in every graph, so
        what they hold never reaches a result."""
        c = slice(0, self.kv_size if n_cells is None else n_cells)
        # K is [1, n_stream, cell, row], the transposed V [1, n_stream, dim, cell]
        k_idx = (0, dst, c), (0, src, c)
        v_idx = (0, dst, slice(None), c), (0, src, slice(None), c)
        for il in self.layers:
            for t, (to, frm) in ((self.k_l[il], k_idx), (self.v_l[il], v_idx)):
                host = t.buffer.base is not None
                arr = tensor_array(t) if host else tensor_get(t)
                arr[to] = arr[frm]
                if not host:
                    tensor_set(t, arr)

    # -- graph pieces (llama_kv_cache::get_k / get_v / cpy_k / cpy_v) -----------------------------------
    # s0, ns: the ubatch's streams s0 .. s0+ns-1 (one per group of its tokens); dim 3 of the views
    def get_k(self, ctx: Context, il: int, n_kv: int, n_head_kv: int, s0: int = 0, ns: int = 1) -> Tensor:
        k = self.k_l[il]
        d = self.n_embd_k_gqa // n_head_kv
        # ne = (head_dim, n_kv, n_head_kv, ns)
        if self.n_stream == 1:
            return ops.view_3d(ctx, k, d, n_kv, n_head_kv, k.nb[1], row_size(k.type, d), 0)
        return ops.view_4d(ctx, k, d, n_kv, n_head_kv, ns, k.nb[1], row_size(k.type, d), k.nb[2],
                           k.nb[2] * s0)

    def get_v(self, ctx: Context, il: int, n_kv: int, n_head_kv: int, s0: int = 0, ns: int = 1) -> Tensor:
        v = self.v_l[il]
        d = self.n_embd_v_gqa // n_head_kv
        # ne = (n_kv, head_dim, n_head_kv, ns): transposed V, rows of kv_size cells
        if self.n_stream == 1:
            return ops.view_3d(ctx, v, n_kv, d, n_head_kv, v.nb[1], v.nb[1] * d, 0)
        return ops.view_4d(ctx, v, n_kv, d, n_head_kv, ns, v.nb[1], v.nb[1] * d, v.nb[2], v.nb[2] * s0)

    def cpy_k(self, ctx: Context, il: int, k_cur: Tensor, k_idxs: Tensor) -> Tensor:
        """Row stream * kv_size + cell receives the token's K."""
        k = self.k_l[il]
        n_tokens = k_cur.nelements // self.n_embd_k_gqa
        if self.n_stream > 1:
            k = ops.reshape(ctx, k, self.n_embd_k_gqa, self.n_cells)
        return ops.set_rows(ctx, k, ops.reshape(ctx, k_cur, self.n_embd_k_gqa, n_tokens), k_idxs)

    def cpy_v(self, ctx: Context, il: int, v_cur: Tensor, v_idxs: Tensor) -> Tensor:
        """One row of one element per value: row (stream * n_embd_v_gqa + j) * kv_size + cell receives
        dim j of the token."""
        v = self.v_l[il]
        v_flat = ops.reshape(ctx, v, 1, self.n_cells * self.n_embd_v_gqa)
        return ops.set_rows(ctx, v_flat, ops.reshape(ctx, v_cur, 1, v_cur.nelements), v_idxs)

    def k_idxs(self, slot: np.ndarray) -> np.ndarray:
        return slot.astype(np.int64)

    def v_idxs(self, slot: np.ndarray) -> np.ndarray:
        """Element e = j + n_embd_v_gqa * i (token i, dim j) goes to row (stream * n_embd_v_gqa + j) *
        kv_size + cell of its absolute cell slot[i] = stream * kv_size + cell."""
        st, cell = np.divmod(slot.astype(np.int64), self.kv_size)
        j = np.arange(self.n_embd_v_gqa, dtype=np.int64)
        return ((st[:, None] * self.n_embd_v_gqa + j[None, :]) * self.kv_size + cell[:, None]).reshape(-1)

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

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable

import numpy as np

from ..backends.base import Buffer, BufferType, tensor_array, tensor_get, tensor_set
from ..backends.host import attn_inputs
from ..core import ops
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType, row_size

N_KV_PAD = 256          # n_kv granularity: keeps graph shapes stable for 256 decode steps
SEQ_BITS = 64           # the sequence ids a cell's bit set can hold
_NO_SWA_MASK = np.empty((0, 0), np.float32)  # attn_inputs_into's mask_swa without a sliding window


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
    cells each (absolute cell = stream * size + cell); one stream is the unified cache.

    The arrays `pos` (-1: empty) and `seq` (bit s: the cell holds sequence s; an empty cell holds none)
    are the state. Like llama_kv_cells (its `used` set and `seq_pos` maps), every method that changes them
    also keeps two summaries of them, so that a decode step reads them without scanning the cells:
    per stream its used cells, and per sequence the positions of its cells (one entry per cell), both
    ascending lists. apply updates them cell by cell; the bulk edits recount what they touched."""

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
        self.used_cells: list[list[int]] = [[] for _ in range(n_stream)]     # per stream, cell in stream
        self.seq_pos: list[list[int]] = [[] for _ in range(SEQ_BITS)]        # per sequence, with repeats

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
        return sum(len(u) for u in self.used_cells)

    def used_in(self, stream: int) -> int:
        return len(self.used_cells[stream])

    @property
    def used_max_p1(self) -> int:
        return self.used_max_p1_in(0)

    def used_max_p1_in(self, stream: int) -> int:
        u = self.used_cells[stream]
        return u[-1] + 1 if u else 0

    def n_kv(self, streams: Iterable[int] = (0,)) -> int:
        """get_n_kv: the graph-visible length, padded to 256 and capped at the stream size; the max over
        the ubatch's streams."""
        return max(min(self.size, max(N_KV_PAD, pad(self.used_max_p1_in(s), N_KV_PAD))) for s in streams)

    def seq_pos_max(self, seq_id: int) -> int:
        ps = self.seq_pos[seq_id]
        return ps[-1] if ps else -1

    def seq_pos_min(self, seq_id: int) -> int:
        ps = self.seq_pos[seq_id]
        return ps[0] if ps else -1

    # -- the summaries, recounted from the arrays -------------------------------------------------------
    def _seq_positions(self, seq_id: int) -> np.ndarray:
        """The positions of the cells holding seq_id, looked up in its own stream only."""
        c = self._cells(self.stream_of(seq_id))
        return self.pos[c][(self.seq[c] & np.uint64(1 << seq_id)) != 0]

    def _recount_seq(self, seq_id: int) -> None:
        self.seq_pos[seq_id] = sorted(self._seq_positions(seq_id).tolist())

    def _recount_used(self, stream: int) -> None:
        self.used_cells[stream] = np.flatnonzero(self.pos[self._cells(stream)] >= 0).tolist()

    def _seq_mask(self, seq_id: int) -> np.ndarray:
        return (self.seq & np.uint64(1 << seq_id)) != 0

    # -- slots ---------------------------------------------------------------------------------------
    def find_slot(self, n_tokens: int, stream: int = 0) -> np.ndarray:
        """Absolute cells for n_tokens new tokens of one stream: empty cells scanned cyclically from the
        stream's head (restarting from 0 when the head is beyond used + 2 * n_tokens), found as the gaps
        between its used cells."""
        if n_tokens > self.size:
            raise ContextFullError(f"a ubatch of {n_tokens} tokens exceeds the context of {self.size}"
                                   + (" cells per sequence" if self.n_stream > 1 else ""))
        used = self.used_cells[stream]
        head = self.heads[stream] if self.heads[stream] <= len(used) + 2 * n_tokens else 0
        c0 = stream * self.size
        free: list[int] = []
        for lo, hi in ((head, self.size), (0, head)):
            # the free cells of lo .. hi-1 are the gaps between the used ones
            c, i = lo, bisect_left(used, lo)
            while c < hi and len(free) < n_tokens:
                nxt = min(used[i] if i < len(used) else hi, hi)     # the next used cell, or the end
                free.extend(range(c0 + c, c0 + min(nxt, c + n_tokens - len(free))))
                c, i = nxt + 1, i + 1
        if len(free) < n_tokens:
            where = f"sequence {stream}'s stream" if self.n_stream > 1 else "the context"
            raise ContextFullError(
                f"context full: {n_tokens} cells needed, {self.size - len(used)} free of {self.size} in "
                f"{where}; start a new sequence, remove old tokens, or use a larger --ctx")
        return np.array(free, dtype=np.int64)

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
        """apply_ubatch: commit positions and sequences into the chosen cells (a cell still held is
        emptied first); each stream's head moves past the last cell written to it."""
        for cell, p, s in zip(np.asarray(slot).tolist(), np.asarray(pos).tolist(), seq_ids):
            st, c = divmod(cell, self.size)
            if self.pos[cell] >= 0:
                self._empty_cell(cell)
            self.pos[cell] = p
            self.seq[cell] = sum(1 << q for q in s)
            insort(self.used_cells[st], c)
            for q in s:
                insort(self.seq_pos[q], p)
            self.heads[st] = c + 1 if c + 1 < self.size else 0

    def _empty_cell(self, cell: int) -> None:
        """A held cell becomes empty (its position leaves each of its sequences)."""
        p, bits = int(self.pos[cell]), int(self.seq[cell])
        for q in range(bits.bit_length()):
            if bits >> q & 1:
                ps = self.seq_pos[q]
                del ps[bisect_left(ps, p)]
        u = self.used_cells[cell // self.size]
        del u[bisect_left(u, cell % self.size)]
        self.pos[cell], self.seq[cell] = -1, 0

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
        streams: set[int] = set()
        for cell in np.nonzero(emptied)[0]:
            st, c = divmod(int(cell), self.size)
            self.heads[st] = min(self.heads[st], c)
            streams.add(st)
        for st in streams:
            self._recount_used(st)
        for q in range(SEQ_BITS) if seq_id < 0 else (seq_id,):
            ps = self.seq_pos[q]
            del ps[bisect_left(ps, p0):bisect_left(ps, p1)]

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
            held = int(np.bitwise_or.reduce(self.seq[dst_cells]))    # the sequences dst's stream loses
            has = (self.seq[src_cells] & np.uint64(1 << src)) != 0
            self.pos[dst_cells] = np.where(has, self.pos[src_cells], -1)
            self.seq[dst_cells] = np.where(has, np.uint64(1 << dst), np.uint64(0))
            self.heads[sd] = self.heads[ss]
            self._recount_used(sd)
            for q in range((held | 1 << dst).bit_length()):
                if (held | 1 << dst) >> q & 1:
                    self._recount_seq(q)
            return
        p1 = np.iinfo(np.int32).max if p1 < 0 else p1
        m = self._seq_mask(src) & (self.pos >= p0) & (self.pos < p1)
        self.seq[m] |= np.uint64(1 << dst)
        self._recount_seq(dst)

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
        self.used_cells[sa], self.used_cells[sb] = self.used_cells[sb], self.used_cells[sa]
        self.seq_pos[a], self.seq_pos[b] = self.seq_pos[b], self.seq_pos[a]

    def seq_keep(self, seq_id: int) -> None:
        keep = self._seq_mask(seq_id)
        self.seq[~keep] = 0
        self.seq[keep] = np.uint64(1 << seq_id)
        self.pos[~keep] = -1
        self.heads = [0] * self.n_stream
        for st in range(self.n_stream):
            self._recount_used(st)
        self.seq_pos = [ps if q == seq_id else [] for q, ps in enumerate(self.seq_pos)]

    def clear(self) -> None:
        self.pos[:] = -1
        self.seq[:] = 0
        self.heads = [0] * self.n_stream
        self.used_cells = [[] for _ in range(self.n_stream)]
        self.seq_pos = [[] for _ in range(SEQ_BITS)]

    # -- graph inputs ----------------------------------------------------------------------------------
    def kq_mask(self, n_kv: int, pos: np.ndarray, seq_ids: list[frozenset[int]],
                n_seqs: int = 1, n_swa: int = 0) -> np.ndarray:
        """[n_tokens, n_kv] f32 (numpy order), or with streams [n_seqs, n_tokens / n_seqs, n_kv] (one
        group of tokens per stream): 0 where the cell of the token's stream holds the token's sequence at a
        position <= the token's, -inf elsewhere (empty cells and padding included). n_swa > 0: also -inf
        where the token's position minus the cell's is >= n_swa (is_masked_swa, LLAMA_SWA_TYPE_STANDARD)."""
        groups = 1 if self.n_stream == 1 else n_seqs
        g = len(pos) // groups
        streams = [self.stream_of(min(seq_ids[k * g])) for k in range(groups)]
        cpos = self.pos.reshape(self.n_stream, self.size)[streams, None, :n_kv]     # [groups, 1, n_kv]
        cseq = self.seq.reshape(self.n_stream, self.size)[streams, None, :n_kv]
        p = np.asarray(pos).reshape(groups, g, 1)
        bit = np.array([1 << min(s) for s in seq_ids], dtype=np.uint64).reshape(groups, g, 1)
        ok = ((cseq & bit) != 0) & (cpos <= p)          # an empty cell holds no sequence
        if n_swa:
            ok &= (p - cpos) < n_swa
        mask = np.where(ok, np.float32(0), np.float32(-np.inf))
        return mask.reshape(-1, n_kv) if self.n_stream == 1 else mask


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
        self.v_dim_rows = np.arange(n_embd_v_gqa, dtype=np.int64) * self.kv_size   # row j * kv_size: dim j

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

    def attn_inputs_into(self, n_kv: int, pos: np.ndarray, seq_ids: list[frozenset[int]], n_seqs: int,
                         slot: np.ndarray, n_swa: int, mask: np.ndarray, mask_swa: np.ndarray | None,
                         k_idxs: np.ndarray, v_idxs: np.ndarray) -> None:
        """KVCells.kq_mask (and with n_swa its sliding-window mask), k_idxs and v_idxs written into the
        given arrays (f32 [n_tokens, n_kv] each mask, int64 [n_tokens] and [n_tokens * n_embd_v_gqa]) by
        one compiled call of the host backend (backends/host.py; the same numbers). pos int32, slot int64."""
        cells = self.cells
        unified = cells.n_stream == 1
        attn_inputs(mask, _NO_SWA_MASK if mask_swa is None else mask_swa, n_swa, cells.pos, cells.seq,
                    0 if unified else cells.size, 1 if unified else n_seqs, pos,
                    np.array([min(s) for s in seq_ids], np.int64), k_idxs, v_idxs, slot, self.kv_size,
                    self.n_embd_v_gqa)

    def k_idxs(self, slot: np.ndarray) -> np.ndarray:
        return slot.astype(np.int64)

    def v_idxs(self, slot: np.ndarray) -> np.ndarray:
        """Element e = j + n_embd_v_gqa * i (token i, dim j) goes to row (stream * n_embd_v_gqa + j) *
        kv_size + cell of its absolute cell slot[i] = stream * kv_size + cell."""
        kv, n_embd = self.kv_size, self.n_embd_v_gqa
        dim0 = [(c // kv * n_embd) * kv + c % kv for c in np.asarray(slot).tolist()]      # the row of j = 0
        return np.add.outer(np.array(dim0, dtype=np.int64), self.v_dim_rows).reshape(-1)

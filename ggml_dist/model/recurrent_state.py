"""The recurrent state of Qwen3.5's Gated DeltaNet layers, beside the KV cache (llama.cpp's
llama_memory_recurrent, for one process).

Per recurrent layer two F32 tensors with two rows per sequence: r_l [n_embd_r, 2 n_seq_max], the last
d_conv - 1 inputs of every conv channel, and s_l [n_embd_s, 2 n_seq_max], each value head's delta-rule
state. Sequence s owns rows s and s + n_seq_max, one holding its state (row(s)). A ubatch's graph reads
that row with GET_ROWS at the row id s_copy (a graph input) and writes the new state with SET_ROWS into the
other at s_dst, as llama.cpp's build_rs and its copies into the cache do (its spare cells), so the graph's
topology does not depend on which sequence it runs, and the state from before the last ubatch is kept:
seq_rm of exactly that ubatch's positions takes it back (token feedback's step queued past a stop).

Unlike KV cells, a state holds no positions: it is the sum of everything its sequence saw. So it can be
continued (the next ubatch starts at the position after the last one), restarted (a ubatch at position 0
begins from zeros), copied or removed whole, or its last ubatch taken back, but never cut back further:
seq_rm of a longer tail, or a ubatch that does not continue the sequence, raises StateTrimError instead of
running on a wrong state.
A ubatch holds n_seqs sequences of as many tokens each (split_equal), a state row read and one written each.

On a pipeline each stage owns the rows of its own recurrent layers (workers/stage.py allocates them in its
device's buffer type, as its KV layers); the driver keeps the positions. A row operation (zero a row, copy
or swap rows, clear) on rows in another process is sent to their stage with its next call, which applies
it before it computes (PipelineHooks.state_op): in the place of the sequence's timeline where it was asked,
without waiting for the calls in flight.

Checkpoints (the only way back to a prefix) are copies of a sequence's row kept where the rows are: in
this process, or on each stage for its own layers. snapshot() asks for a copy ("save" under a new key),
restore() writes one back ("load"), release() lets it go ("drop"); the driver holds only the key, the
position and the size (StateSnapshot). On a pipeline these ride with the stages' next calls like every row
operation, so a copy is taken exactly after the ubatches asked before it. A lost stage loses its copies:
lost() drops every copy on every stage and makes the older snapshots stale (their epoch), so a restore
from one is refused instead of loading nothing.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..backends.base import Buffer, BufferType, tensor_array, tensor_get, tensor_set
from ..core import ops
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType
from .archs import LlamaHParams
from .ubatch import Ubatch

if TYPE_CHECKING:
    from .hooks import PipelineHooks

# a row operation: ("zero", row), ("cp", src, dst), ("swap", a, b), ("clear",); and on the copies kept
# for checkpoints: ("save", row, key), ("load", key, row), ("drop", key) (key -1: every copy)
RowOp = tuple
# where rows live in another process: state_op(buft, op) sends op to the stage of buffer type buft
StateOpHook = Callable[[BufferType, RowOp], None]


class StateTrimError(ValueError):
    """An operation would need a recurrent state cut back to a prefix, which no state can give."""


@dataclass(frozen=True, eq=False)
class StateSnapshot:
    """A copy of one sequence's state rows (every recurrent layer's r and s row) after its first n_past
    tokens, kept under key where the rows are (this process or the stages): what a checkpoint holds, and
    what restore() writes back while epoch is the state's."""
    n_past: int
    key: int
    nbytes: int
    epoch: int = 0


def recurrent_state(hp: LlamaHParams, n_seq_max: int, buft: Callable[[], BufferType],
                    pipeline: PipelineHooks | None = None) -> RecurrentState | None:
    """The state of a hybrid model's recurrent layers, allocated in buft(), or on a pipeline (its hooks:
    model/hooks.py) each layer's rows in its stage's buffer type; None for other models."""
    if not hp.spec.hybrid:
        return None
    rs = RecurrentState.of(hp, n_seq_max)
    if pipeline is None:
        rs.allocate(buft())
    else:
        rs.allocate(buft(), pipeline.layer_buft, pipeline.state_op)
    return rs


def recurrent_layers(hp: LlamaHParams, layers: Iterable[int]) -> tuple[int, ...]:
    """Of the given layers, the recurrent ones (a stage's rows)."""
    return tuple(il for il in layers if hp.is_recurrent(il))


class RecurrentState:
    """The rows of the given recurrent layers (one process: all of them; a stage: its own)."""

    def __init__(self, layers: Iterable[int], n_embd_r: int, n_embd_s: int, n_seq_max: int) -> None:
        self.layers = list(layers)
        self.n_embd_r, self.n_embd_s, self.n_seq_max = n_embd_r, n_embd_s, n_seq_max
        self.ctx = Context(len(self.layers) * 2 * 400 + 1024, no_alloc=True, name="recurrent_state")
        self.r_l: dict[int, Tensor] = {}
        self.s_l: dict[int, Tensor] = {}
        for il in self.layers:
            r = self.ctx.new_tensor(GGMLType.F32, (self.n_embd_r, 2 * n_seq_max))
            s = self.ctx.new_tensor(GGMLType.F32, (self.n_embd_s, 2 * n_seq_max))
            self.r_l[il], self.s_l[il] = r.set_name(f"cache_r_l{il}"), s.set_name(f"cache_s_l{il}")
        self.pos = np.full(n_seq_max, -1, np.int64)      # per sequence: the last position in its state, -1 empty
        self.half = np.zeros(n_seq_max, np.int64)        # per sequence: its state is in row s + half * n_seq_max
        self.prev = np.full(n_seq_max, -2, np.int64)     # the other row's state's last position (-2: none kept)
        # per buffer: its buffer type, buffer and tensors (one; on a pipeline one per stage with such layers)
        self.groups: list[tuple[BufferType, Buffer, list[Tensor]]] = []
        self.state_op: StateOpHook | None = None
        self.kept: dict[int, tuple[np.ndarray, ...]] = {}  # the checkpoints' copies of rows held here, by key
        self._keys = itertools.count()
        self.epoch = 0                                   # lost() counts the copies lost with a stage

    @classmethod
    def of(cls, hp: LlamaHParams, n_seq_max: int) -> RecurrentState:
        return cls(recurrent_layers(hp, range(hp.n_layer)), hp.n_embd_r, hp.n_embd_s, n_seq_max)

    def tensors(self) -> list[Tensor]:
        return [t for il in self.layers for t in (self.r_l[il], self.s_l[il])]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def allocate(self, buft: BufferType, layer_buft: Callable[[int], BufferType] | None = None,
                 state_op: StateOpHook | None = None) -> None:
        """Zeroed buffers for every layer's rows: one of buft, or with layer_buft(il) -> buft one per
        distinct buffer type (a pipeline's stages; their rows are edited through state_op)."""
        by_buft: dict[int, tuple[BufferType, list[Tensor]]] = {}
        for il in self.layers:
            b = layer_buft(il) if layer_buft is not None else buft
            by_buft.setdefault(id(b), (b, []))[1].extend((self.r_l[il], self.s_l[il]))
        self.groups, self.state_op = [], state_op
        for b, ts in by_buft.values():
            offs, size = [], 0
            for t in ts:
                offs.append(size)
                size += -(-b.get_alloc_size(t) // b.alignment) * b.alignment
            buf = b.alloc_buffer(size)
            buf.clear(0)
            for t, o in zip(ts, offs, strict=True):
                t.buffer, t.data = buf, o
            self.groups.append((b, buf, ts))

    # -- row operations: here on host memory, through the stage that holds them elsewhere ---------------
    def _rows(self, op: RowOp) -> None:
        for b, buf, ts in self.groups:
            if buf.base is None and self.state_op is not None:
                self.state_op(b, op)
            else:
                apply_row_op(ts, op, self.kept)

    def apply(self, row_ops: list[RowOp]) -> None:
        """Row operations sent by the driver (a stage's rows)."""
        for op in row_ops:
            apply_row_op(self.tensors(), tuple(op), self.kept)

    def row(self, seq: int) -> int:
        """The row that holds sequence seq's state."""
        return seq + int(self.half[seq]) * self.n_seq_max

    def _forget(self, seq: int) -> None:
        """The sequence holds no state (a ubatch at position 0 zeroes its row before it reads it)."""
        self.pos[seq], self.prev[seq] = -1, -2

    # -- a ubatch ------------------------------------------------------------------------------------
    def begin(self, ub: Ubatch) -> tuple[np.ndarray, np.ndarray]:
        """The state rows a ubatch's sequences read (s_copy, I32 [n_seqs]) and write (s_dst), once each is
        checked to continue its sequence: it starts at position 0 (the row read is zeroed first) or right
        after the state's last one. The rows read keep the states from before the ubatch (seq_rm can take
        it back). Every check passes before anything changes."""
        seqs = ubatch_seqs(ub)
        n_st = ub.n_seq_tokens
        for k, seq in enumerate(seqs):
            if not 0 <= seq < self.n_seq_max:
                raise ValueError(f"sequence {seq} is outside the recurrent state's {self.n_seq_max} rows")
            pos = ub.pos[k * n_st:(k + 1) * n_st]
            if np.any(np.diff(pos) != 1):
                raise StateTrimError(f"sequence {seq}: a ubatch's positions must follow one another for the "
                                     f"recurrent state (got {pos.tolist()})")
            if pos[0] != 0 and pos[0] != self.pos[seq] + 1:
                raise StateTrimError(f"sequence {seq}: its recurrent state is at position {self.pos[seq]}, and "
                                     f"a ubatch at position {pos[0]} cannot continue it; a recurrent state cannot "
                                     f"be cut back to a prefix (evaluate the sequence again from position 0)")
        read, write = [], []
        for k, seq in enumerate(seqs):
            read.append(self.row(seq))
            if ub.pos[k * n_st] == 0:
                self._rows(("zero", read[-1]))
                self._forget(seq)
            self.prev[seq], self.pos[seq] = self.pos[seq], int(ub.pos[(k + 1) * n_st - 1])
            self.half[seq] ^= 1
            write.append(self.row(seq))
        return np.array(read, np.int32), np.array(write, np.int32)

    # -- sequences (llama_memory_recurrent's seq_* on rows) ---------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> list[int]:
        """Positions [p0, p1) of a sequence (p1 < 0: to the end; seq_id < 0: every sequence). Removing the
        whole state, positions after it, or exactly its last ubatch's (the state from before it comes
        back) is fine; cutting into it further is not (StateTrimError, and nothing changes). Returns the
        sequences whose last ubatch was taken back."""
        seqs = range(self.n_seq_max) if seq_id < 0 else [seq_id]
        end = p1 if p1 >= 0 else np.iinfo(np.int64).max
        hit = [s for s in seqs if self.pos[s] >= 0 and p0 <= self.pos[s] < end]    # its state in the range
        for s in hit:
            if p0 > 0 and not (self.prev[s] >= 0 and p0 == self.prev[s] + 1):
                kept = f" (the state before position {self.prev[s] + 1} is kept)" if self.prev[s] >= 0 else ""
                raise StateTrimError(f"seq_rm({seq_id}, {p0}, {p1}): sequence {s}'s recurrent state covers "
                                     f"positions 0..{self.pos[s]}, and a recurrent state cannot be cut back to "
                                     f"a prefix{kept}; remove the whole sequence and evaluate it again")
        back = []
        for s in hit:
            if p0 == 0:
                self._forget(s)
            else:                               # the last ubatch taken back: the row it read holds the state
                self.half[s] ^= 1
                self.pos[s], self.prev[s] = self.prev[s], -2
                back.append(s)
        return back

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst takes src's whole state; a part of it cannot be copied."""
        last = int(self.pos[src])
        if last >= 0 and (p0 > 0 or 0 <= p1 <= last):
            raise StateTrimError(f"seq_cp({src}, {dst}, {p0}, {p1}): only a whole recurrent state can be "
                                 f"copied (sequence {src}'s covers positions 0..{last})")
        self._rows(("cp", self.row(src), self.row(dst)))
        self.pos[dst], self.prev[dst] = last, -2

    def seq_swap(self, a: int, b: int) -> None:
        n = self.n_seq_max
        self._rows(("swap", a, b))
        self._rows(("swap", a + n, b + n))
        for arr in (self.pos, self.half, self.prev):
            arr[[a, b]] = arr[[b, a]]

    def clear(self) -> None:
        self._rows(("clear",))
        self.pos[:], self.half[:], self.prev[:] = -1, 0, -2

    # -- checkpoints: the only way back to a prefix is a copy taken there -------------------------------
    @property
    def local(self) -> bool:
        """Whether every row is in this process's memory (not on a pipeline's stages)."""
        return all(buf.base is not None for _, buf, _ in self.groups)

    @property
    def row_nbytes(self) -> int:
        """The bytes of one sequence's rows over every layer (a copy's size, all stages together)."""
        return sum(t.nb[1] for t in self.tensors())

    def snapshot(self, seq_id: int) -> StateSnapshot:
        """A copy of the sequence's state row as it is after the ubatches asked so far (positions
        0..pos[seq_id]), kept where the rows are."""
        key = next(self._keys)
        self._rows(("save", self.row(seq_id), key))
        return StateSnapshot(int(self.pos[seq_id]) + 1, key, self.row_nbytes, self.epoch)

    def restore(self, seq_id: int, snap: StateSnapshot) -> None:
        """The sequence's state becomes the snapshot's: after its first snap.n_past tokens (nothing kept from
        before a last ubatch)."""
        if snap.epoch != self.epoch:
            raise StateTrimError(f"the state's copy at position {snap.n_past} was lost with a stage")
        self._rows(("load", snap.key, self.row(seq_id)))
        self.pos[seq_id], self.prev[seq_id] = snap.n_past - 1, -2

    def release(self, snap: StateSnapshot) -> None:
        """The copy is no longer wanted: where the rows are, its memory goes."""
        if snap.epoch == self.epoch:
            self._rows(("drop", snap.key))

    def lost(self) -> None:
        """A stage was lost (and replaced): its copies are gone, so every copy goes and every snapshot
        taken so far is stale."""
        self.epoch += 1
        self._rows(("drop", -1))

    # -- graph pieces (build_rs and the copies back into the cache) -------------------------------------
    def get_r(self, ctx: Context, il: int, s_copy: Tensor) -> Tensor:
        """The ubatch's conv state rows: ne = (n_embd_r, n_seqs)."""
        return ops.get_rows(ctx, self.r_l[il], s_copy)

    def get_s(self, ctx: Context, il: int, s_copy: Tensor) -> Tensor:
        """The ubatch's delta-rule state rows: ne = (n_embd_s, n_seqs)."""
        return ops.get_rows(ctx, self.s_l[il], s_copy)

    def cpy_r(self, ctx: Context, il: int, rows: Tensor, s_dst: Tensor) -> Tensor:
        return ops.set_rows(ctx, self.r_l[il], rows, s_dst)

    def cpy_s(self, ctx: Context, il: int, rows: Tensor, s_dst: Tensor) -> Tensor:
        return ops.set_rows(ctx, self.s_l[il], rows, s_dst)


def ubatch_seqs(ub: Ubatch) -> list[int]:
    """The ubatch's sequences in token order, each with n_seq_tokens consecutive tokens (split_equal or
    split_seq); a token of several sequences is refused (a state row holds one sequence's past)."""
    n_st, n_seqs = ub.n_seq_tokens, max(ub.n_seqs, 1)
    if any(len(s) != 1 for s in ub.seq_ids) or n_st * n_seqs != ub.n_tokens:
        raise ValueError(f"a ubatch of sequence sets {sorted(set(ub.seq_ids), key=min)}: a model with recurrent "
                         f"layers evaluates tokens of one sequence each, in equal groups per sequence")
    seqs = [min(ub.seq_ids[k * n_st]) for k in range(n_seqs)]
    if any(ub.seq_ids[i] != {seqs[i // n_st]} for i in range(ub.n_tokens)) or len(set(seqs)) != len(seqs):
        raise ValueError(f"a ubatch whose sequences are not in equal groups: {[min(s) for s in ub.seq_ids]}")
    return seqs


def apply_row_op(tensors: list[Tensor], op: RowOp, kept: dict[int, tuple[np.ndarray, ...]]) -> None:
    """One row operation on every tensor's rows (in place on host memory, else read and written back), or
    on the copies kept for checkpoints (kept: key -> one row per tensor)."""
    kind = op[0]
    if kind == "drop":
        if op[1] < 0:
            kept.clear()
        else:
            kept.pop(op[1], None)
        return
    if kind == "load" and op[1] not in kept:
        raise StateTrimError(f"no copy of the recurrent state is kept under key {op[1]}")
    saved = []
    for i, t in enumerate(tensors):
        host = t.buffer is not None and t.buffer.base is not None
        a = tensor_array(t) if host else tensor_get(t)
        if kind == "zero":
            a[0, 0, op[1]] = 0
        elif kind == "cp":
            a[0, 0, op[2]] = a[0, 0, op[1]]
        elif kind == "swap":
            a[0, 0, [op[1], op[2]]] = a[0, 0, [op[2], op[1]]]
        elif kind == "clear":
            a[...] = 0
        elif kind == "save":
            saved.append(a[0, 0, op[1]].copy())
            continue
        elif kind == "load":
            a[0, 0, op[2]] = kept[op[1]][i]
        else:
            raise ValueError(f"unknown recurrent state row operation {op!r}")
        if not host:
            tensor_set(t, a)
    if kind == "save":
        kept[op[2]] = tuple(saved)

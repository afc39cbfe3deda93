"""The recurrent state of Qwen3.5's Gated DeltaNet layers, beside the KV cache (llama.cpp's
llama_memory_recurrent, for one process).

Per recurrent layer two F32 tensors with one row per sequence: r_l [n_embd_r, n_seq_max], the last
d_conv - 1 inputs of every conv channel, and s_l [n_embd_s, n_seq_max], each value head's delta-rule
state. Sequence s owns row s (llama.cpp gives each sequence one cell). A ubatch's graph reads its
sequence's rows with GET_ROWS at the row ids s_copy (a graph input) and writes the new state back with
SET_ROWS at the same ids, as llama.cpp's build_rs and its copies into the cache do, so the graph's
topology does not depend on which sequence it runs.

Unlike KV cells, a state holds no positions: it is the sum of everything its sequence saw. So it can be
continued (the next ubatch starts at the position after the last one), restarted (a ubatch at position 0
begins from zeros), copied or removed whole, but never cut back to a prefix: seq_rm of a tail, or a
ubatch that does not continue the sequence, raises StateTrimError instead of running on a wrong state.
A ubatch holds one sequence (the graph's state rows are one row per ubatch).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..backends.base import Buffer, BufferType, tensor_array
from ..core import ops
from ..core.context import Context
from ..core.tensor import Tensor
from ..core.types import GGMLType
from .archs import LlamaHParams
from .ubatch import Ubatch


class StateTrimError(ValueError):
    """An operation would need a recurrent state cut back to a prefix, which no state can give."""


def recurrent_state(hp: LlamaHParams, n_seq_max: int, pipelined: bool,
                    buft: Callable[[], BufferType]) -> RecurrentState | None:
    """The state of a hybrid model's recurrent layers, allocated in buft(); None for other models."""
    if not hp.spec.hybrid:
        return None
    if pipelined:
        refuse_pipeline(hp)
    rs = RecurrentState(hp, n_seq_max)
    rs.allocate(buft())
    return rs


def refuse_pipeline(hp: LlamaHParams) -> None:
    """Raise if hp's model cannot run over pipeline stages yet (a hybrid model: its recurrent state)."""
    if hp.spec.hybrid:
        raise ValueError(f"a {hp.arch} model runs in one process only for now: the recurrent state of its "
                         f"Gated DeltaNet layers is not yet owned by pipeline stages")


class RecurrentState:
    def __init__(self, hp: LlamaHParams, n_seq_max: int) -> None:
        self.layers = [il for il in range(hp.n_layer) if hp.is_recurrent(il)]
        self.n_embd_r, self.n_embd_s, self.n_seq_max = hp.n_embd_r, hp.n_embd_s, n_seq_max
        self.ctx = Context(len(self.layers) * 2 * 400 + 1024, no_alloc=True, name="recurrent_state")
        self.r_l: dict[int, Tensor] = {}
        self.s_l: dict[int, Tensor] = {}
        for il in self.layers:
            self.r_l[il] = self.ctx.new_tensor(GGMLType.F32, (self.n_embd_r, n_seq_max)).set_name(f"cache_r_l{il}")
            self.s_l[il] = self.ctx.new_tensor(GGMLType.F32, (self.n_embd_s, n_seq_max)).set_name(f"cache_s_l{il}")
        self.pos = np.full(n_seq_max, -1, np.int64)      # per row: the last position in its state, -1 empty
        self.buffer: Buffer | None = None

    def tensors(self) -> list[Tensor]:
        return [t for il in self.layers for t in (self.r_l[il], self.s_l[il])]

    def allocate(self, buft: BufferType) -> None:
        """One zeroed buffer of buft for every layer's rows."""
        offs, size = [], 0
        for t in self.tensors():
            offs.append(size)
            size += -(-buft.get_alloc_size(t) // buft.alignment) * buft.alignment
        self.buffer = buft.alloc_buffer(size)
        self.buffer.clear(0)
        for t, o in zip(self.tensors(), offs, strict=True):
            t.buffer, t.data = self.buffer, o

    def _zero(self, row: int) -> None:
        for t in self.tensors():
            tensor_array(t)[0, 0, row] = 0
        self.pos[row] = -1

    # -- a ubatch ------------------------------------------------------------------------------------
    def begin(self, ub: Ubatch) -> np.ndarray:
        """The state rows (s_copy, I32 [1]) a ubatch reads and writes, once it is checked to continue its
        sequence: it starts at position 0 (the row is zeroed first) or right after the state's last one."""
        seqs = frozenset().union(*ub.seq_ids)
        if len(seqs) != 1 or any(len(s) != 1 for s in ub.seq_ids):
            raise ValueError(f"a ubatch of sequences {sorted(seqs)}: a model with recurrent layers evaluates "
                             f"one sequence per ubatch for now")
        (seq,) = seqs
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"sequence {seq} is outside the recurrent state's {self.n_seq_max} rows")
        p0, p1 = int(ub.pos[0]), int(ub.pos[-1])
        if np.any(np.diff(ub.pos) != 1):
            raise StateTrimError(f"sequence {seq}: a ubatch's positions must follow one another for the "
                                 f"recurrent state (got {ub.pos.tolist()})")
        if p0 == 0:
            self._zero(seq)
        elif p0 != self.pos[seq] + 1:
            raise StateTrimError(f"sequence {seq}: its recurrent state is at position {self.pos[seq]}, and a "
                                 f"ubatch at position {p0} cannot continue it; a recurrent state cannot be cut "
                                 f"back to a prefix (evaluate the sequence again from position 0)")
        self.pos[seq] = p1
        return np.array([seq], np.int32)

    # -- sequences (llama_memory_recurrent's seq_* on rows) ---------------------------------------------
    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        """Positions [p0, p1) of a sequence (p1 < 0: to the end; seq_id < 0: every sequence). Removing the
        whole state, or positions after it, is fine; cutting into it is not (StateTrimError)."""
        rows = range(self.n_seq_max) if seq_id < 0 else [seq_id]
        for s in rows:
            last = int(self.pos[s])
            end = p1 if p1 >= 0 else np.iinfo(np.int64).max
            if last < 0 or not p0 <= last < end:
                continue                        # nothing of the state is in the range
            if p0 > 0:
                raise StateTrimError(f"seq_rm({seq_id}, {p0}, {p1}): sequence {s}'s recurrent state covers "
                                     f"positions 0..{last}, and a recurrent state cannot be cut back to a "
                                     f"prefix; remove the whole sequence and evaluate it again")
            self._zero(s)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst takes src's whole state; a part of it cannot be copied."""
        last = int(self.pos[src])
        if last >= 0 and (p0 > 0 or 0 <= p1 <= last):
            raise StateTrimError(f"seq_cp({src}, {dst}, {p0}, {p1}): only a whole recurrent state can be "
                                 f"copied (sequence {src}'s covers positions 0..{last})")
        for t in self.tensors():
            a = tensor_array(t)
            a[0, 0, dst] = a[0, 0, src]
        self.pos[dst] = last

    def seq_swap(self, a: int, b: int) -> None:
        for t in self.tensors():
            arr = tensor_array(t)
            arr[0, 0, [a, b]] = arr[0, 0, [b, a]]
        self.pos[[a, b]] = self.pos[[b, a]]

    def clear(self) -> None:
        for s in range(self.n_seq_max):
            self._zero(s)

    # -- graph pieces (build_rs and the copies back into the cache) -------------------------------------
    def get_r(self, ctx: Context, il: int, s_copy: Tensor) -> Tensor:
        """The ubatch's conv state rows: ne = (n_embd_r, n_seqs)."""
        return ops.get_rows(ctx, self.r_l[il], s_copy)

    def get_s(self, ctx: Context, il: int, s_copy: Tensor) -> Tensor:
        """The ubatch's delta-rule state rows: ne = (n_embd_s, n_seqs)."""
        return ops.get_rows(ctx, self.s_l[il], s_copy)

    def cpy_r(self, ctx: Context, il: int, rows: Tensor, s_copy: Tensor) -> Tensor:
        return ops.set_rows(ctx, self.r_l[il], rows, s_copy)

    def cpy_s(self, ctx: Context, il: int, rows: Tensor, s_copy: Tensor) -> Tensor:
        return ops.set_rows(ctx, self.s_l[il], rows, s_copy)

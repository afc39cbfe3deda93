"""A context's sequence operations (llama_memory_seq_*): on the KV cells, and on the recurrent state of a
hybrid model's recurrent layers (model/recurrent_state.py), which can give only whole sequences and
raises StateTrimError where a caller would cut one back to a prefix. LlamaContext (model/context.py)
takes these methods from here.
"""
from __future__ import annotations

from ..scheduler.sched import Sched
from .kv_cache import KVCache
from .recovery import Recovery
from .recurrent_state import RecurrentState, StateSnapshot, StateTrimError


class SequenceOps:
    """seq_rm / seq_cp / seq_swap / seq_pos_max / clear over a context's KV cache and recurrent state."""
    kv: KVCache
    rs: RecurrentState | None
    recovery: Recovery
    sched: Sched
    pipelined: bool

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        if self.rs is not None:                 # first: a refused trim leaves the KV cells as they were
            for s in self.rs.seq_rm(seq_id, p0, p1):
                self.recovery.step_back(s)
        self.kv.cells.seq_rm(seq_id, p0, p1)
        self.recovery.prune(self.kv.cells)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """dst joins src's cells; between KV streams, src's whole stream is copied into dst's (once
        the work in flight has written its cells)."""
        cells = self.kv.cells
        ss, sd = cells.stream_of(src), cells.stream_of(dst)
        if ss != sd and self.recovery.recoverable:
            raise ValueError(f"seq_cp({src}, {dst}): a copy between KV streams is not replayed after a "
                             f"stage loss; this pipeline needs a unified KV cache for it")
        if self.rs is not None:
            if not self.pipelined:              # a stage applies it before its next call: no wait
                self.sched.synchronize()
            self.rs.seq_cp(src, dst, p0, p1)
            self.recovery.record_copy(src, dst)
        cells.seq_cp(src, dst, p0, p1)
        if ss != sd:
            self.sched.synchronize()
            self.kv.copy_stream(ss, sd, cells.used_max_p1_in(ss))

    def seq_swap(self, a: int, b: int) -> None:
        """Sequences a and b, each in a KV stream of its own, trade streams (cells and K/V), once the
        work in flight has written its cells; see KVCells.seq_swap."""
        if self.recovery.recoverable:
            raise ValueError(f"seq_swap({a}, {b}) is not replayed after a stage loss")
        cells = self.kv.cells
        cells.seq_swap(a, b)
        self.sched.synchronize()
        sa, sb = cells.stream_of(a), cells.stream_of(b)
        self.kv.swap_streams(sa, sb, max(cells.used_max_p1_in(sa), cells.used_max_p1_in(sb)))
        if self.rs is not None:
            self.rs.seq_swap(a, b)

    @property
    def trims_to_prefix(self) -> bool:
        """Whether seq_rm can cut a sequence back to any prefix: not with a recurrent state, which goes
        back only to a snapshot taken there (state_snapshot, seq_restore)."""
        return self.rs is None

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether state_snapshot and seq_restore work here: with a recurrent state (its copies are kept
        where its rows are: in this process, or on each stage for its layers)."""
        return self.rs is not None

    def state_snapshot(self, seq_id: int) -> StateSnapshot:
        """A copy of the sequence's recurrent state after the ubatches asked so far (in one process once
        the work in flight has written it; a stage takes it in its timeline's place)."""
        assert self.rs is not None, "a model without recurrent layers has no state to snapshot"
        if not self.pipelined:
            self.sched.synchronize()
        return self.rs.snapshot(seq_id)

    def state_restorable(self, snap: StateSnapshot) -> bool:
        """Whether seq_restore can go back to snap (its copy was not lost with a stage)."""
        return self.rs is not None and snap.epoch == self.rs.epoch

    def state_release(self, snap: StateSnapshot) -> None:
        """snap's copy is not wanted any more: its memory goes where it is kept."""
        if self.rs is not None:
            self.rs.release(snap)

    def seq_restore(self, seq_id: int, snap: StateSnapshot) -> None:
        """The sequence cut back to the snapshot's prefix: its KV cells from snap.n_past go and its
        recurrent state becomes the snapshot's. The caller vouches that the snapshot was taken on this
        sequence's tokens (the serve's checkpoints key it by the slot's cached tokens)."""
        assert self.rs is not None, "a model without recurrent layers trims with seq_rm"
        if snap.n_past > self.seq_pos_max(seq_id) + 1:
            raise StateTrimError(f"sequence {seq_id} holds {self.seq_pos_max(seq_id) + 1} positions, fewer than "
                                 f"the snapshot's {snap.n_past}")
        if not self.pipelined:
            self.sched.synchronize()
        self.rs.restore(seq_id, snap)            # first: a refused restore leaves the KV cells as they were
        self.kv.cells.seq_rm(seq_id, snap.n_past, -1)
        self.recovery.cut_lineage(seq_id, snap.n_past)
        self.recovery.prune(self.kv.cells)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.kv.cells.seq_pos_max(seq_id)

    def clear(self) -> None:
        self.kv.cells.clear()
        self.recovery.clear()
        if self.rs is not None:
            if not self.pipelined:
                self.sched.synchronize()
            self.rs.clear()

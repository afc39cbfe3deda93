"""A context's recovery from a lost stage: the log of submitted ubatches and its replay.

A recoverable context (a pipeline's: its hooks, workers/driver.py, carry `restore`) logs every ubatch it
submits. When a stage is lost (StageLostError where a result is waited for), `restore` brings the stages back
(a new actor where one died, its weights mapped again), then every logged ubatch whose tokens the KV
cache still holds is run again, in order, on the same cells and with the same graph shape, so the
rebuilt cache holds the same bits and generation goes on with the same tokens. A stage lost during
the replay starts the recovery over, max_recoveries times. Ubatches none of whose tokens the cache
holds any more (their sequence removed) leave the log (prune).

A hybrid model's recurrent state cannot be cut back, so its replay starts every live sequence at position
0: per sequence the log entries its state is the sum of (its lineage: its ubatches since its position 0,
and where it was copied from another sequence, that one's lineage and the copy, StateCopy) are kept, and
nothing else; the replay runs them in their order from zeroed rows, copies included, and the state's
positions are the ones from before the loss once it is done.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from ..backends.base import StageLostError
from .recurrent_state import ubatch_seqs
from .sampling import RowSampling, sample_row
from .ubatch import Ubatch

if TYPE_CHECKING:
    from .kv_cache import KVCells
    from .recurrent_state import RecurrentState

T = TypeVar("T")
__all__ = ["Recovery", "StageLostError", "UbatchRecord"]


@dataclass
class UbatchRecord:
    """One submitted ubatch, kept (on a recoverable context) so the KV cache can be rebuilt exactly:
    the same cells, the same graph shape, so the same numerics."""
    ub: Ubatch
    slot: np.ndarray
    n_kv: int
    fetch: Callable[[], np.ndarray] | None = None
    value: np.ndarray | None = None
    sampling: list[RowSampling] | None = None       # one per output row: choose the tokens
    keep_logits: bool = True                        # with sampling: also return the logits
    fetch_tokens: Callable[[], np.ndarray] | None = None   # tokens chosen where the logits are
    tokens: list[int] | None = None
    done: bool = False                              # its result came back since it was last run
    embd: bool = False                              # outputs are embeddings (the final norm's rows)
    # per token, (record, output row) whose chosen token it is (submit's tokens_from), until known
    token_src: list[tuple[UbatchRecord, int]] | None = None

    def result(self) -> np.ndarray:
        if self.value is None:
            if self.fetch is None:
                raise RuntimeError("the logits of this batch were not kept (submitted with "
                                   "keep_logits=False): only its tokens can be read")
            self.value = self.fetch()
            self.done = True
        return self.value

    def fetched(self) -> bool:
        """Whether this ubatch's result came back (so every stage has finished it)."""
        return self.done

    def chosen(self) -> list[int]:
        """This ubatch's sampled tokens, one per output row: from the stage that sampled them, or
        sampled here from the logits with the same RowSampling."""
        if self.tokens is None:
            assert self.sampling is not None
            if self.fetch_tokens is not None:
                self.tokens = [int(t) for t in np.asarray(self.fetch_tokens()).reshape(-1)]
                self.done = True
                self.fetch_tokens = None       # its result handle is not pinned by the log
            else:
                lg = self.result()
                lg = lg.reshape(-1, lg.shape[-1])
                self.tokens = [sample_row(lg[r], rs) for r, rs in enumerate(self.sampling)]
            self.settle()
        return self.tokens

    def settle(self) -> None:
        """Once the tokens this ubatch was fed are all known, write them in and drop its sources, so
        the log keeps no chain of records back to the first (the driver reads the tokens in order)."""
        src = self.token_src
        if src is not None and all(s.tokens is not None for s, _ in src):
            self.ub.tokens = np.array([s.chosen()[r] for s, r in src], np.int32)
            self.token_src = None


@dataclass(eq=False)
class StateCopy:
    """seq_cp(src, dst) of a hybrid model's recurrent state, logged in its place among the ubatches: a
    replay copies the rows again where the sequences' timeline did."""
    src: int
    dst: int


class Recovery:
    """The log and the figures of a context's recoveries; recoverable once `restore` is set."""

    def __init__(self, rs: RecurrentState | None = None) -> None:
        self.rs = rs                                     # a hybrid model's recurrent state
        self.lineage: dict[int, list[UbatchRecord | StateCopy]] = {}    # with rs: per sequence, its entries
        self.restore: Callable[[], None] | None = None   # a pipeline's hook: restore lost stages
        self.max_recoveries = 3
        self.log: list[UbatchRecord | StateCopy] = []    # to replay after a loss (recoverable only)
        self.n_recoveries = 0
        self.n_replayed_tokens = 0
        self.recovery_s: list[float] = []    # wall time of each recovery (restart + replay)
        self.lost_at: list[float] = []       # perf_counter() when each recovery began (the loss seen)
        self.lost_wall: list[float] = []     # the same moments by the wall clock (time.time())
        self.recovering = False              # True while a lost stage is being brought back

    @property
    def recoverable(self) -> bool:
        return self.restore is not None

    def record(self, rec: UbatchRecord) -> None:
        if self.recoverable:
            self.log.append(rec)
            if self.rs is not None:                      # each of its sequences' lineage
                n_st = rec.ub.n_seq_tokens
                for k, seq in enumerate(ubatch_seqs(rec.ub)):
                    if int(rec.ub.pos[k * n_st]) == 0:
                        self.lineage[seq] = [rec]
                    else:
                        self.lineage.setdefault(seq, []).append(rec)

    def record_copy(self, src: int, dst: int) -> None:
        """dst's recurrent state became a copy of src's (seq_cp)."""
        if self.recoverable and self.rs is not None:
            e = StateCopy(src, dst)
            self.log.append(e)
            self.lineage[dst] = [*self.lineage.get(src, []), e]

    def step_back(self, seq: int) -> None:
        """seq's last ubatch was taken back out of its state (a step queued past a stop)."""
        es = self.lineage.get(seq)
        if es:
            assert isinstance(es[-1], UbatchRecord), "a copy's state has no step to take back"
            es.pop()

    def cut_lineage(self, seq: int, n_past: int) -> None:
        """seq's state went back to a copy after its first n_past positions (a checkpoint): its lineage
        ends with the ubatch that reached them, and a replay makes the state the copy holds."""
        es = self.lineage.get(seq)
        if not es:
            return
        k = next((i for i, e in enumerate(es) if isinstance(e, UbatchRecord) and int(e.ub.pos[0]) >= n_past),
                 len(es))
        last = es[k - 1] if k else None
        assert not isinstance(last, UbatchRecord) or int(last.ub.pos[-1]) == n_past - 1, \
            f"sequence {seq}: a checkpoint at {n_past} inside a ubatch"
        del es[k:]

    def clear(self) -> None:
        self.log.clear()
        self.lineage.clear()

    def retrying(self, fn: Callable[[], T], recover: Callable[[], None]) -> T:
        """fn(), recovering (recover: the context's) and calling it again when a stage was lost."""
        for attempt in range(self.max_recoveries + 1):
            try:
                return fn()
            except StageLostError:
                if attempt == self.max_recoveries or not self.recoverable:
                    raise
                recover()
        raise AssertionError("unreachable")

    def recover(self, reset: Callable[[], None], run: Callable[[UbatchRecord], None], cells: KVCells) -> None:
        """Restore the lost stages, reset the context's view of them (reset: nothing in flight, no
        graph to reuse), and replay the log's live ubatches with run, in order."""
        t0 = time.perf_counter()
        self.lost_at.append(t0)
        self.lost_wall.append(time.time())
        self.recovering = True
        rs = self.rs
        pos = None if rs is None else rs.pos.copy()         # the state's positions before the loss
        try:
            for attempt in range(self.max_recoveries + 1):
                try:
                    assert self.restore is not None, "this context has no recovery hook"
                    self.restore()
                    reset()
                    self.prune(cells)
                    if rs is not None:
                        rs.lost()                            # the checkpoints' copies went with the stage
                        rs.pos[:] = -1                       # every live sequence again from position 0
                    owners = self._owners()
                    for rec in self.log:
                        if isinstance(rec, StateCopy):
                            assert rs is not None
                            rs.seq_cp(rec.src, rec.dst)
                            continue
                        self.n_replayed_tokens += rec.ub.n_tokens
                        self._replay(rec, run, cells, owners)
                    self.n_recoveries += 1
                    self.recovery_s.append(time.perf_counter() - t0)
                    return
                except StageLostError:
                    if attempt == self.max_recoveries:
                        raise
        finally:
            self.recovering = False
            if rs is not None and pos is not None:
                rs.pos[:] = pos

    def _owners(self) -> dict[int, dict[int, set[int]]]:
        """Per logged ubatch (id): for each sequence it ran, the live sequences whose state is made of that
        sequence's part of it (the sequence itself while it lives, the copies made of it since)."""
        owners: dict[int, dict[int, set[int]]] = {}
        for seq, es in self.lineage.items():
            who = seq                                   # backwards: a copy's entries before it are its source's
            for e in reversed(es):
                if isinstance(e, StateCopy):
                    who = e.src
                else:
                    owners.setdefault(id(e), {}).setdefault(who, set()).add(seq)
        return owners

    def _replay(self, rec: UbatchRecord, run: Callable[[UbatchRecord], None], cells: KVCells,
                owners: dict[int, dict[int, set[int]]]) -> None:
        """run(rec); a sequence of it that is gone (removed since, or begun again) but was copied attends
        as one of its copies: the cells its tokens saw then are theirs now (a whole copy of its cells),
        and its own bits are elsewhere or gone, so the mask would hide them all. A sequence of it that no
        live state is made of (removed, or its step taken back, while the ubatch's other sequences live
        on) computes rows nothing reads: its state's position is set for the ubatch and put back after
        (one removed attends as a live one of the ubatch, so its rows stay finite)."""
        rs = self.rs
        if rs is None:
            run(rec)
            return
        heirs = owners.get(id(rec), {})
        moved = {s: min(h) for s, h in heirs.items() if s not in h}
        n_st = rec.ub.n_seq_tokens
        ghosts = {s: int(rec.ub.pos[k * n_st]) for k, s in enumerate(ubatch_seqs(rec.ub)) if s not in heirs}
        live = min(set().union(*heirs.values()))
        moved.update({s: live for s in ghosts if s not in self.lineage})    # removed: no cells of its own to see
        saved, kept = cells.seq.copy(), {s: (rs.pos[s], rs.half[s], rs.prev[s]) for s in ghosts}
        if moved:
            gone = np.uint64(sum(1 << s for s in moved))
            seq = saved & ~gone
            for s, h in moved.items():
                seq |= np.where((saved & np.uint64(1 << h)) != 0, np.uint64(1 << s), np.uint64(0))
            cells.seq[:] = seq
        for s, p0 in ghosts.items():
            rs.pos[s] = p0 - 1                      # the ubatch continues it, whatever it holds now
        try:
            run(rec)                                # its graph inputs are written before it returns
        finally:
            cells.seq[:] = saved
            for s, (pos, half, prev) in kept.items():
                rs.pos[s], rs.half[s], rs.prev[s] = pos, half, prev

    def prune(self, cells: KVCells) -> None:
        """Drop logged ubatches none of whose tokens the cache still holds (nothing to rebuild); with a
        recurrent state, the entries no live sequence's state is the sum of."""
        if not self.log:
            return
        if self.rs is not None:
            for s in [s for s in self.lineage if self.rs.pos[s] < 0]:     # removed whole
                del self.lineage[s]
            held = {id(e) for es in self.lineage.values() for e in es}
            self.log = [e for e in self.log if id(e) in held]
            return

        def live(rec: UbatchRecord | StateCopy) -> bool:
            return isinstance(rec, UbatchRecord) and any(
                cells.pos[c] == p and bool(int(cells.seq[c]) >> min(s) & 1)
                for c, p, s in zip(rec.slot, rec.ub.pos, rec.ub.seq_ids))
        self.log = [rec for rec in self.log if live(rec)]

"""State checkpoints for the prompt cache of a model with recurrent layers (Qwen3.5's Gated DeltaNet).

A slot's KV cells can be cut back to any prefix of its cached tokens (seq_rm); a recurrent state cannot:
it is the sum of everything its sequence saw. So a slot of such a model keeps copies of its state at
agreed points of its tokens, and a new prompt that shares a prefix with the slot's cached tokens restores
the latest copy within that prefix and evaluates only the rest (llama-server's context checkpoints do the
same per slot). The points (due):
    every `every` tokens of a long prompt      a conversation that forks inside it goes back to the last one
    the prompt but its last token              the same prompt again (or with other sampling) keeps all of
                                               it but that token, which is evaluated again for its logits
    the end of each answer (Slots.release)     the next turn of a chat continues from there
A prompt's evaluation stops at each point (Seq.checkpoints_at: a chunk never passes one) so the state
is there to copy. The copies are kept within a byte budget; past it the oldest taken goes first, from
any slot. Without a copy within the shared prefix the slot starts again from position 0.

A checkpoint is only valid with its slot's KV cells for the same tokens (the attention layers' part of
the same prefix): a slot whose cells go (take_blank, a release without keep, forget) drops its copies,
and a slot cut back to n tokens drops those past n. The copies themselves are kept where the state's
rows are (in this process, or on each pipeline stage for its layers: model/recurrent_state.py); here
are their keys, positions and sizes, and every copy dropped here is released there (release).
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from ..model.recurrent_state import StateSnapshot

EVERY = 512                     # tokens of a long prompt between two checkpoints
BUDGET_BYTES = 256 << 20        # all slots' copies together


@dataclass(frozen=True, eq=False)
class Checkpoint:
    snap: StateSnapshot
    tick: int                   # when it was taken: the oldest goes first

    @property
    def n_past(self) -> int:
        return self.snap.n_past


class Checkpoints:
    """Per slot the copies of its state (by_slot[k], in n_past order), their budget and what they did."""

    def __init__(self, n_slots: int, budget_bytes: int = BUDGET_BYTES, every: int = EVERY) -> None:
        self.by_slot: list[list[Checkpoint]] = [[] for _ in range(n_slots)]
        self.budget_bytes, self.every = budget_bytes, every
        self._tick = itertools.count()
        self.taken = self.hits = self.misses = self.evictions = 0
        self.release: Callable[[StateSnapshot], None] = lambda snap: None   # the context's state_release

    def _keep(self, slot: int, keep: Callable[[Checkpoint], bool]) -> None:
        """The slot keeps the copies keep() accepts; the others are released."""
        for c in self.by_slot[slot]:
            if not keep(c):
                self.release(c.snap)
        self.by_slot[slot] = [c for c in self.by_slot[slot] if keep(c)]

    def nbytes(self) -> int:
        return sum(c.snap.nbytes for cs in self.by_slot for c in cs)

    def due(self, n_prompt: int, n_keep: int) -> tuple[int, ...]:
        """Where a prompt of n_prompt tokens, n_keep of them already in the slot, stops to be copied."""
        points = {*range(self.every, n_prompt - 1, self.every), n_prompt - 1}
        return tuple(sorted(p for p in points if p > n_keep))

    def save(self, slot: int, snap: StateSnapshot) -> None:
        """Keep snap as slot's copy at snap.n_past (replacing one there), then keep within the budget."""
        self._keep(slot, lambda c: c.n_past != snap.n_past)
        self.by_slot[slot] = sorted([*self.by_slot[slot], Checkpoint(snap, next(self._tick))], key=lambda c: c.n_past)
        self.taken += 1
        while self.nbytes() > self.budget_bytes:
            oldest = min((c for cs in self.by_slot for c in cs), key=lambda c: c.tick)
            for k in range(len(self.by_slot)):
                self._keep(k, partial(operator.is_not, oldest))
            self.evictions += 1

    def best(self, slot: int, n_keep: int, usable: Callable[[StateSnapshot], bool] = lambda snap: True
             ) -> Checkpoint | None:
        """The slot's latest copy within its first n_keep tokens (a hit), or None (a miss); copies that
        are not usable any more (lost with a stage) go first."""
        self._keep(slot, lambda c: usable(c.snap))
        c = next((c for c in reversed(self.by_slot[slot]) if 0 < c.n_past <= n_keep), None)
        if c is None:
            self.misses += 1
        else:
            self.hits += 1
        return c

    def cut(self, slot: int, n: int) -> None:
        """The slot now holds only its first n tokens: copies past them go."""
        self._keep(slot, lambda c: c.n_past <= n)

    def move(self, src: int, dst: int) -> None:
        """src's sequence moved to dst (Slots.compact): so do its copies; seq_swap swaps them."""
        self.by_slot[src], self.by_slot[dst] = self.by_slot[dst], self.by_slot[src]

    def forget(self) -> None:
        for k in range(len(self.by_slot)):
            self._keep(k, lambda c: False)

    def figures(self) -> dict[str, float]:
        """What /metrics shows of them (engine.status(); HELP gives each its Prometheus help)."""
        return {"state_checkpoints": float(sum(map(len, self.by_slot))),
                "state_checkpoint_bytes": float(self.nbytes()),
                "state_checkpoint_budget_bytes": float(self.budget_bytes),
                "state_checkpoints_taken_total": float(self.taken),
                "state_checkpoint_hits_total": float(self.hits),
                "state_checkpoint_misses_total": float(self.misses),
                "state_checkpoint_evictions_total": float(self.evictions)}


HELP = {
    "state_checkpoints": "recurrent-state checkpoints the slots keep for their cached prompts",
    "state_checkpoint_bytes": "bytes those checkpoints hold",
    "state_checkpoint_budget_bytes": "the checkpoints' byte budget (past it the oldest goes)",
    "state_checkpoints_taken_total": "recurrent-state checkpoints taken",
    "state_checkpoint_hits_total": "prompts cut back into a slot's cache that restored a checkpoint",
    "state_checkpoint_misses_total": "prompts cut back into a slot's cache that found none and started again",
    "state_checkpoint_evictions_total": "checkpoints dropped for the budget",
}

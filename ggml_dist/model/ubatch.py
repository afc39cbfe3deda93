"""Batches and their split into ubatches (llama_batch_allocr; ggml-mechanisms.md §4.5).

A Batch is what a caller submits (tokens with positions, sequence ids and output flags). The splitter
hands out ubatches of at most n_ubatch tokens in one of llama.cpp's three modes: the unified KV cache
takes split_simple, a cache with a stream per sequence split_equal(sequential=True) (one group of equal
length per stream), a hybrid model's recurrent state split_equal, or split_seq where every token outputs
(split_memory chooses).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


class BatchError(ValueError):
    """A batch that cannot be decoded as given."""


@dataclass
class Batch:
    """llama_batch: per token an id, a position, the sequences it belongs to, and an output flag."""
    tokens: np.ndarray                       # int32 [n]
    pos: np.ndarray                          # int32 [n]
    seq_ids: list[frozenset[int]]            # [n]
    output: np.ndarray                       # bool [n]

    @classmethod
    def from_tokens(cls, tokens: list[int] | np.ndarray, pos0: int = 0, seq_id: int = 0,
                    all_outputs: bool = False) -> Batch:
        """One sequence, consecutive positions; only the last token outputs unless all_outputs."""
        tok = np.array(tokens, dtype=np.int32).reshape(-1)
        n = len(tok)
        out = np.array([all_outputs] * (n - 1) + [True], bool) if n else np.zeros(0, bool)
        return cls(tok, np.arange(pos0, pos0 + n, dtype=np.int32), [frozenset({seq_id})] * n, out)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def validate(self, n_vocab: int, n_seq_max: int) -> None:
        n = self.n_tokens
        if n == 0:
            raise BatchError("empty batch: nothing to decode")
        if not (len(self.pos) == len(self.seq_ids) == len(self.output) == n):
            raise BatchError("batch arrays differ in length")
        for i, t in enumerate(self.tokens.tolist()):
            if not 0 <= t < n_vocab:
                raise BatchError(f"token id {t} at batch index {i} is outside the vocabulary (0..{n_vocab - 1})")
        for i, s in enumerate(self.seq_ids):
            if not s or min(s) < 0 or max(s) >= n_seq_max:
                raise BatchError(f"token {i}: sequence ids {sorted(s)} outside 0..{n_seq_max - 1}")

    def check_positions(self, seq_pos_min: Callable[[int], int], seq_pos_max: Callable[[int], int]) -> None:
        """llama_batch_allocr::init's consistency checks against the memory (the KV cache's first and
        last position of each sequence, -1 if it holds none): a sequence continues at its last position
        + 1, its positions in the batch have no gaps and do not decrease, a token shared by sequences
        keeps them in the same sets, and sequences shared this way have not diverged in the cache."""
        pos = self.pos.tolist()
        seq_pos: dict[int, set[int]] = {}
        for p, ss in zip(pos, self.seq_ids):
            for q in ss:
                seq_pos.setdefault(q, set()).add(p)
        for q, ps in seq_pos.items():
            p0, lo, hi = seq_pos_max(q), min(ps), max(ps)
            if p0 >= 0 and lo != p0 + 1:
                raise BatchError(f"the tokens of sequence {q} have inconsistent positions: the KV cache holds "
                                 f"it up to position {p0}, the batch starts it at {lo}; positions must stay "
                                 f"consecutive ({p0 + 1})")
            if hi - lo + 1 > len(ps):
                raise BatchError(f"sequence {q}: positions {lo}..{hi} in the batch are not continuous")
        cur_set: dict[int, frozenset[int]] = {}
        cur_pos: dict[int, int] = {}
        for p, ss in zip(pos, self.seq_ids):
            for q in ss:
                cur_set[q] = cur_set.get(q, ss) & ss
                if not cur_set[q]:
                    raise BatchError(f"sequence {q} belongs to incompatible sequence sets in the batch")
                if p < cur_pos.get(q, -1):
                    raise BatchError(f"sequence {q}: positions decrease within the batch")
                cur_pos[q] = p
        for ss in {ss for ss in self.seq_ids if len(ss) > 1}:
            q0 = min(ss)
            for q in ss:
                if (seq_pos_min(q), seq_pos_max(q)) != (seq_pos_min(q0), seq_pos_max(q0)):
                    raise BatchError(f"sequence {q} shares tokens with sequence {q0} in the batch, but their "
                                     f"cached positions have diverged")


@dataclass
class Ubatch:
    """llama_ubatch: the slice of a batch one graph evaluation processes."""
    tokens: np.ndarray                       # int32 [n_tokens]
    pos: np.ndarray                          # int32 [n_tokens]
    seq_ids: list[frozenset[int]]
    output: np.ndarray                       # bool [n_tokens]
    idx: list[int]                           # batch index of each token
    equal_seqs: bool = False
    n_seqs: int = 0                          # sequence sets (= n_tokens for split_simple)
    seq_id_unq: list[int] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def n_seq_tokens(self) -> int:
        return self.n_tokens // max(self.n_seqs, 1)

    def __post_init__(self) -> None:
        # the batch indices of the output tokens, in ubatch order: a decode step asks for them several
        # times, and each numpy call there costs several us (the step's weights evicted numpy's code)
        self.out_idx: list[int] = [i for i, o in zip(self.idx, self.output.tolist()) if o]

    @property
    def n_outputs(self) -> int:
        return len(self.out_idx)

    @property
    def out_ids(self) -> np.ndarray:
        """Rows of the ubatch whose logits are kept, in ubatch order."""
        return self.output.nonzero()[0].astype(np.int32)


class BatchSplitter:
    """split_reset / split_simple / split_equal / split_seq over one batch."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.used = [False] * batch.n_tokens

    @property
    def n_used(self) -> int:
        return sum(self.used)

    def _free(self) -> list[int]:
        """The batch indices of the tokens not yet in a ubatch."""
        return [i for i, u in enumerate(self.used) if not u]

    def _make(self, idx: list[int], equal_seqs: bool, n_seqs: int | None = None) -> Ubatch:
        b = self.batch
        for i in idx:
            self.used[i] = True
        seqs = [b.seq_ids[i] for i in idx]
        unq = sorted(set().union(*seqs)) if seqs else []
        return Ubatch(b.tokens[idx], b.pos[idx], seqs, b.output[idx], idx, equal_seqs,
                      n_seqs if n_seqs is not None else len(idx), unq)

    def split_memory(self, n_ubatch: int, unified: bool, recurrent: bool) -> Ubatch | None:
        """The next ubatch as the memory needs it (llama.cpp's init_batch of each memory kind): a KV cache
        with a stream per sequence takes equal groups of consecutive sequences (split_equal(sequential));
        the unified cache the tokens in order (split_simple); recurrent layers equal groups too, a state
        row each, or one sequence at a time where every token outputs (llama_memory_hybrid)."""
        if not recurrent and unified:
            return self.split_simple(n_ubatch)
        if recurrent and bool(self.batch.output.all()):
            return self.split_seq(n_ubatch)
        return self.split_equal(n_ubatch, sequential=not unified)

    def split_simple(self, n_ubatch: int) -> Ubatch | None:
        """The next n_ubatch unused tokens in batch order (equal_seqs false, n_seqs = n_tokens)."""
        free = self._free()[:n_ubatch]
        if not free:
            return None
        return self._make(free, equal_seqs=False)

    def split_seq(self, n_ubatch: int) -> Ubatch | None:
        """Tokens whose sequence set is a subset of the current one, narrowing as it goes."""
        free = self._free()
        if not free:
            return None
        cur = self.batch.seq_ids[free[0]]
        idx: list[int] = []
        for i in free:
            s = self.batch.seq_ids[i]
            if s <= cur:
                idx.append(i)
                cur = s
                if len(idx) == n_ubatch:
                    break
        return self._make(idx, equal_seqs=True, n_seqs=1)

    def split_equal(self, n_ubatch: int, sequential: bool = False) -> Ubatch | None:
        """Equal-length slices of non-overlapping sequence sets (llama.cpp's step 2 edge case kept:
        up to n_ubatch + 1 sets can be chosen)."""
        free = self._free()
        if not free:
            return None
        sets: list[frozenset[int]] = []
        for i in free:
            s = self.batch.seq_ids[i]
            if s in sets or any(s & c for c in sets):
                continue
            if sequential and sets and min(s) != min(sets[-1]) + 1:
                continue
            sets.append(s)
            if len(sets) > n_ubatch:
                break
        per_set = {s: [i for i in free if self.batch.seq_ids[i] == s] for s in sets}
        n_take = 1
        while all(len(v) > n_take for v in per_set.values()) and (n_take + 1) * len(sets) <= n_ubatch:
            n_take += 1
        idx = [i for s in sets for i in per_set[s][:n_take]]
        return self._make(idx, equal_seqs=True, n_seqs=len(sets))

"""The server's slots (llama-server's): a slot index is a KV sequence id, and each slot owns
n_ctx / n_parallel cells of the cache. A busy slot holds a Sequence; a free one may keep its last
request's tokens (cache_prompt), which a prompt that starts with them takes and skips (take).

With a KV stream per slot (one process) the busy slots are kept at the bottom (compact): a ubatch spans
consecutive streams, so a gap costs a graph run. Over a pipeline the stages hold the cache and its slots
share one stream by default: sequences are not moved there.

A model with recurrent layers (ctx.trims_to_prefix false) cannot cut a slot's cache back to any prefix:
its slots keep copies of their state at agreed points (serve/checkpoints.py), and a prompt that shares
only part of a slot's cache goes back to the latest copy within that part, or to position 0."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.generate import TextStream
from ..model.recurrent_state import StateTrimError
from ..model.sampling import Sampler
from ..model.steps import Seq
from .checkpoints import BUDGET_BYTES, EVERY, Checkpoints
from .requests import Request, token_logprob
from .stop import StopMatcher

if TYPE_CHECKING:
    from ..model.context import LlamaContext
    from ..model.tokenizer import Tokenizer


@dataclass(eq=False, kw_only=True)
class Sequence(Seq):
    """A request's choice as the decode loop's sequence (model/steps.py): its slot is its KV sequence id."""
    req: Request
    stream: TextStream
    stop: StopMatcher
    t_last: float | None = None             # when the previous token was emitted
    logprobs: list = field(default_factory=list)   # TokenLogprobs not yet sent (with the next event)
    constraint: Any = None                  # serve/grammar.Constraint when the request has a grammar
    index: int = 0                          # the request's choice this sequence makes
    parent: Sequence | None = None          # choice > 0: waits for choice 0's prompt, then copies it
    children: list = field(default_factory=list)   # choice 0: the choices waiting for its prompt
    n_cached: int = 0                       # prompt tokens its slot's cache held at admission

    @classmethod
    def start(cls, req: Request, slot: int, index: int, constraint: Any, n_past: int, tok: Tokenizer) -> Sequence:
        """Choice `index` of a request; a seeded request's choice i draws from seed + i."""
        params = req.sampling
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        return cls(slot=slot, prompt=req.prompt, sampler=Sampler(params), history=list(req.prompt),
                   max_tokens=req.max_tokens, n_past=n_past, req=req, stream=TextStream(tok),
                   stop=StopMatcher(req.stops), constraint=constraint, index=index)

    def steppable(self) -> bool:
        return not self.done and not self.req.cancelled and self.parent is None

    def scoring(self) -> bool:
        return self.req.prompt_logprobs is not None

    def wants_logits(self) -> bool:
        return self.sampler.params.logprobs is not None or bool(self.children)

    def may_feed(self) -> bool:
        return self.constraint is None and self.parent is None and not self.wants_logits()

    def choose(self, tok: int | None, logits: np.ndarray | None) -> tuple[int, tuple]:
        """Its next token and that token's logprob entry (when it asked for logprobs): tok where it was
        chosen with the logits, else sampled here from its row of logits within its grammar."""
        if tok is None:
            assert logits is not None
            allowed = self.constraint.allowed() if self.constraint is not None else None
            tok = self.sampler.sample(logits, self.history, allowed)
        n_lp = self.sampler.params.logprobs
        return tok, () if n_lp is None or logits is None else (token_logprob(logits, tok, n_lp),)


class Slots:
    """seqs[k]: the sequence slot k runs, or None; cached[k]: a free slot's KV tokens (its cells).
    ctx is set once the model has loaded; movable: sequences may move between slots (compact)."""

    def __init__(self, n_parallel: int, cache_prompt: bool, checkpoint_bytes: int = BUDGET_BYTES,
                 checkpoint_every: int = EVERY) -> None:
        self.cache_prompt = cache_prompt
        self.seqs: list[Sequence | None] = [None] * n_parallel
        self.cached: list[list[int]] = [[] for _ in range(n_parallel)]
        self.ctx: LlamaContext | None = None
        self.movable = False
        self.checkpoints = Checkpoints(n_parallel, checkpoint_bytes, checkpoint_every)

    def bind(self, ctx: LlamaContext, movable: bool) -> None:
        """The loaded model's context: its sequences are the slots' (and its state copies the checkpoints')."""
        self.ctx, self.movable = ctx, movable
        self.checkpoints.release = ctx.state_release

    def n_free(self) -> int:
        return sum(s is None for s in self.seqs)

    def n_running(self) -> int:
        return len(self.seqs) - self.n_free()

    def cached_cells(self) -> int:
        """KV cells that free slots keep for a later prompt (cache_prompt)."""
        return sum(len(c) for c in self.cached)

    def take(self, prompt: list[int], reuse: bool = True) -> tuple[int, int]:
        """A free slot for a prompt and how many of its tokens that slot's cache already holds: the slot
        whose cached tokens share the longest prefix with the prompt (llama-server's cache_prompt), else
        the lowest free slot with nothing cached, else the lowest free slot. The prompt's last token is
        always evaluated again: its logits start the generation. The slot keeps only the kept prefix.
        reuse=False (a prompt to score, whose every row is needed): nothing is kept."""
        assert self.ctx is not None
        free = [k for k, s in enumerate(self.seqs) if s is None]
        slot = next((k for k in free if not self.cached[k]), free[0])
        n_keep = 0
        if self.cache_prompt and reuse:
            for k in free:
                n = common_prefix(self.cached[k], prompt)
                if n > n_keep:
                    slot, n_keep = k, n
            n_keep = min(n_keep, len(prompt) - 1)
        if self.cached[slot]:                           # a slot without a cache holds no cells
            n_keep = self._cut(slot, n_keep)
        self.cached[slot] = []
        assert self.ctx.seq_pos_max(slot) == n_keep - 1, f"slot {slot} holds more than its kept prefix"
        return slot, n_keep

    def _cut(self, slot: int, n_keep: int) -> int:
        """The slot's cells cut back to its first n_keep tokens, or, where its recurrent state cannot be
        cut there (more than its last ubatch), to its latest checkpoint within them or to nothing: how
        many it keeps."""
        assert self.ctx is not None
        try:
            self.ctx.seq_rm(slot, n_keep, -1)           # a refused cut changes nothing
        except StateTrimError:
            c = self.checkpoints.best(slot, n_keep, self.ctx.state_restorable) if self.ctx.keeps_checkpoints else None
            if c is None:
                self.ctx.seq_rm(slot)
                n_keep = 0
            else:
                self.ctx.seq_restore(slot, c.snap)
                n_keep = c.n_past
        self.checkpoints.cut(slot, n_keep)
        return n_keep

    def due(self, prompt: list[int], n_keep: int) -> tuple[int, ...]:
        """Where this prompt's evaluation stops for a state checkpoint: nowhere without a recurrent state."""
        assert self.ctx is not None
        return self.checkpoints.due(len(prompt), n_keep) if self.ctx.keeps_checkpoints else ()

    def checkpoint(self, parts: list) -> None:
        """After a step (its parts: (sequence, tokens, output)): a copy of each sequence's state that
        reached one of its checkpoints_at with nothing of it in flight."""
        assert self.ctx is not None
        for s, _, _ in parts:
            if s.n_past in s.checkpoints_at and not s.n_flight and not s.done:
                self.checkpoints.save(s.slot, self.ctx.state_snapshot(s.slot))

    def take_blank(self) -> int:
        """The lowest free slot, its cached tokens dropped: for a choice > 0 (which copies its prompt's
        cells) and for an embedding."""
        assert self.ctx is not None
        slot = self.seqs.index(None)
        if self.cached[slot]:
            self.ctx.seq_rm(slot)
            self.cached[slot] = []
        self.checkpoints.cut(slot, 0)
        return slot

    def release(self, s: Sequence, keep: bool) -> None:
        """s's slot is free again: with keep (cache_prompt) its evaluated tokens stay as the slot's
        cached ones (cells its queued steps took past them are freed), else its cells go. The cells stay
        under the slot's sequence id, in a stream of its own or in the shared one (a pipeline's): a
        slot's cells, cached or in use, never pass ctx/parallel, so the cache always has room for every
        slot. With a stream per slot the cached tokens sit in position order, as a fresh prompt's would;
        in a shared stream a sequence's cells sit wherever they were free, cached or not, so there no run
        is bit for bit another (see docs/api.md)."""
        assert self.ctx is not None
        if keep and self.cache_prompt:
            self.cached[s.slot] = s.history[:s.n_past]
            if s.n_flight:
                self.cached[s.slot] = s.history[:self._cut(s.slot, s.n_past)]
            elif self.ctx.keeps_checkpoints and s.n_past:           # the end of the answer
                self.checkpoints.save(s.slot, self.ctx.state_snapshot(s.slot))
        else:
            self.ctx.seq_rm(s.slot)
            self.checkpoints.cut(s.slot, 0)
        self.seqs[s.slot] = None

    def forget(self) -> None:
        """Every cached prompt goes (the cache itself is cleared by the caller), and every checkpoint."""
        self.cached = [[] for _ in self.seqs]
        self.checkpoints.forget()

    def compact(self) -> None:
        """Keep the busy slots at the bottom: the sequence in the highest busy slot moves into the
        lowest free one, before the step is filled.

        With a KV stream per slot, a ubatch spans consecutive streams (split_equal(sequential)), so
        busy slots 0,1,2 and 4..7 decode as two ubatches, each a graph run with its fixed cost, and
        every such pattern has graph shapes of its own (its stream ranges) to build and plan. Moving a
        sequence copies its stream's K and V (30 layers x 2 x 256 cells x 192 dims f16 for SmolLM2:
        ~6 MB, about a millisecond), once per finished request; where the free slot holds a cached
        prompt, the two streams swap instead (seq_swap, two copies), so the cache moves up and stays."""
        if not self.movable:
            return
        assert self.ctx is not None
        while True:
            busy = [k for k, s in enumerate(self.seqs) if s is not None]
            free = [k for k, s in enumerate(self.seqs) if s is None]
            if not busy or not free or free[0] > busy[-1]:
                return
            src, dst = busy[-1], free[0]
            s = self.seqs[src]
            assert s is not None, f"slot {src} is busy but holds no sequence"
            if s.in_flight:
                return
            if self.cached[dst]:
                self.ctx.seq_swap(src, dst)
            else:
                self.ctx.seq_cp(src, dst)
                self.ctx.seq_rm(src)
            self.checkpoints.move(src, dst)
            self.cached[src], self.cached[dst] = self.cached[dst], []
            s.slot, self.seqs[dst], self.seqs[src] = dst, s, None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""The server's steps: which sequences go into the next micro-batch, submitted to the context, and the
rows that come back (llama.cpp server's update_slots batch building, and vLLM's max_concurrent_batches).

    fill(seqs)  while fewer than `depth` micro-batches are in flight and some sequences are idle, submit
                one: one token per decoding sequence, then prompt chunks (with a KV stream per slot,
                short prompts one token per step beside decodes: _short_chunk); a scoring prompt's
                chunk goes alone (_submit_scored); with lookahead > 1 a group's next step is queued
                before its tokens are back (_follow_up)
    take()      the oldest micro-batch, waited for: its token ids (chosen where the logits are) and/or
                its logits

On a pipeline of K stages the active sequences fall into K groups (depth K x lookahead, at most 4), so
stage k works on one group while stage k+1 works on another. In one process depth is 1 and every idle
sequence shares one batch. A sequence's micro-batches are queued in position order, so its KV writes
happen in order; a micro-batch lists its sequences in slot order, so that consecutive slots form one
ubatch (split_equal(sequential)).
"""
from __future__ import annotations

import collections
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..model.context import MAX_GRAPHS, LlamaContext, PendingLogits
from ..model.ubatch import Batch
from .requests import Event, prompt_logprobs
from .slots import Sequence

TRICKLE = 16        # with a KV stream per slot, prompts with at most this many tokens left trickle in
                    # beside decoding sequences (Steps._short_chunk)


@dataclass(slots=True)
class MicroBatch:
    pending: PendingLogits
    parts: list[tuple[Sequence, int, bool]]     # (sequence, tokens it put in, has an output row)
    sampled: bool = False                       # tokens chosen where the logits are (no penalties)
    keep: bool = False                          # with its logits
    followed: bool = False                      # its group's next step is queued (fed its tokens)
    scored: bool = False                        # one scoring sequence's prompt chunk, every row an output


class Steps:
    """The micro-batches in flight over one context. n_batch: tokens per step; per_slot_streams: a KV
    stream per slot (split_equal, hence _short_chunk); n_ctx_slot: a slot's cells."""

    def __init__(self, ctx: LlamaContext, n_batch: int, per_slot_streams: bool, n_ctx_slot: int,
                 depth: int, n_groups: int, lookahead: int) -> None:
        self.ctx = ctx
        self.n_batch, self.per_slot_streams, self.n_ctx_slot = n_batch, per_slot_streams, n_ctx_slot
        self.depth = depth                      # micro-batches in flight
        self.n_groups = n_groups                # micro-batches the active sequences fall into
        self.lookahead = lookahead              # steps of a group in flight
        self.in_flight: collections.deque[MicroBatch] = collections.deque()
        self.busy_s = 0.0                       # in-process compute time (one stage)
        self.n_fed = 0                          # steps queued before their tokens were back
        self.next_slot = 0                      # round-robin start when filling micro-batches

    def fill(self, seqs: list[Sequence | None]) -> None:
        """Submit micro-batches until `depth` are in flight or no sequence is idle."""
        n = len(seqs)
        per_batch = max(1, math.ceil(sum(s is not None for s in seqs) / self.n_groups))
        while len(self.in_flight) < self.depth:
            idle = [s for k in range(n) if (s := seqs[(self.next_slot + k) % n]) is not None
                    and not s.in_flight and not s.req.cancelled and s.parent is None]
            if not idle:
                if not self._follow_up():
                    return
                continue
            scoring = next((s for s in idle if s.prefilling and s.req.prompt_logprobs is not None), None)
            if scoring is not None:
                self._submit_scored(scoring)
                continue
            # decoding sequences first (one token each), then prompt chunks in what is left of n_batch
            idle.sort(key=lambda s: s.prefilling)
            chosen = self._chunks(idle[:per_batch])
            self.next_slot = (chosen[-1][0].slot + 1) % n
            self._submit(chosen)

    def _chunks(self, idle: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """Each sequence's tokens for the next step, while n_batch lasts: a decoding one its last token, a
        prefilling one its next prompt chunk."""
        short = self._short_chunk(idle)
        chosen: list[tuple[Sequence, list[int]]] = []
        n_tokens = 0
        for s in idle:
            budget = self.n_batch - n_tokens
            if budget <= 0:
                break
            if not s.prefilling:
                chunk = [s.history[-1]]
            else:
                left = len(s.req.prompt) - s.n_past
                chunk = s.req.prompt[s.n_past:s.n_past + min(budget, short if left <= TRICKLE else left)]
            chosen.append((s, chunk))
            n_tokens += len(chunk)
        return chosen

    def _submit(self, chosen: list[tuple[Sequence, list[int]]]) -> None:
        """One micro-batch of the chosen chunks, in slot order."""
        tokens: list[int] = []
        pos: list[int] = []
        seq_ids: list[frozenset[int]] = []
        output: list[bool] = []
        parts: list[tuple[Sequence, int, bool]] = []
        for s, chunk in sorted(chosen, key=lambda sc: sc[0].slot):
            last = s.n_past + len(chunk) == len(s.history)
            tokens += chunk
            pos += range(s.n_past, s.n_past + len(chunk))
            seq_ids += [frozenset({s.slot})] * len(chunk)
            output += [False] * (len(chunk) - 1) + [last]
            parts.append((s, len(chunk), last))
            s.n_flight += 1
        batch = Batch(np.asarray(tokens, np.int32), np.asarray(pos, np.int32), seq_ids, np.asarray(output, bool))
        # without penalties (which need the history) the choice is made where the logits are: a
        # pipeline's last stage returns token ids only
        outs = [s for s, _, has_out in parts if has_out]
        sampled = bool(outs) and not any(s.sampler.penalized for s in outs)
        # logprobs need the logits, and so do the choices that wait to sample from this prompt's
        keep = any(s.sampler.params.logprobs is not None or s.children for s in outs)
        t0 = time.perf_counter()
        if sampled:
            pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in outs], keep_logits=keep)
            for s in outs:
                s.sampler.advance()                  # the choice made there is this sampler's
        else:
            pending = self.ctx.submit(batch)
        self.busy_s += time.perf_counter() - t0
        self.in_flight.append(MicroBatch(pending, parts, sampled, keep))

    def _submit_scored(self, s: Sequence) -> None:
        """A scoring sequence's next prompt chunk (at most n_batch tokens) as a step of its own, every row
        an output: its rows are computed as one process's batch of the same tokens is (`ggml-dist
        logits`), whatever the other slots do; beside one-token decodes a ubatch would take the chunk's
        first token with theirs (split_equal), and with it a different reduction order."""
        chunk = s.req.prompt[s.n_past:s.n_past + self.n_batch]
        batch = Batch.from_tokens(chunk, s.n_past, s.slot, all_outputs=True)
        last = s.n_past + len(chunk) == len(s.history)
        s.n_flight += 1
        t0 = time.perf_counter()
        pending = self.ctx.submit(batch)
        self.busy_s += time.perf_counter() - t0
        self.in_flight.append(MicroBatch(pending, [(s, len(chunk), last)], scored=True))

    def _follow_up(self) -> bool:
        """Queue the next step of a group in flight before its tokens are back: the oldest micro-batch
        not followed yet, where every sequence decodes one token chosen where the logits are, and
        wants at least one more. False if there is none.

        Step-major, as generate_parallel: a stage runs its calls in order and a fed call waits at the
        head of its queue for its token, so a group's step right behind its own previous one idles the
        first stage while the later ones compute that one. Hence oldest first, and not behind the newest
        micro-batch while another group has one in flight (which also undoes a group-major queue)."""
        if self.lookahead < 2:
            return False
        newest = self.in_flight[-1] if self.in_flight else None
        mixed = newest is not None and any(m.parts[0][0] not in {s for s, _, _ in newest.parts}
                                           for m in self.in_flight)
        for mb in self.in_flight:
            if mb.followed or not mb.sampled or mb.keep or (mb is newest and mixed) or not all(
                    n == 1 and has_out and self._may_run_ahead(s) for s, n, has_out in mb.parts):
                continue
            seqs = [s for s, _, _ in mb.parts]
            batch = Batch(np.zeros(len(seqs), np.int32), np.array([s.n_past + s.n_flight for s in seqs], np.int32),
                          [frozenset({s.slot}) for s in seqs], np.ones(len(seqs), bool))
            t0 = time.perf_counter()
            pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in seqs], keep_logits=False,
                                      tokens_from=mb.pending)
            self.busy_s += time.perf_counter() - t0
            for s in seqs:
                s.sampler.advance()
                s.n_flight += 1
            mb.followed = True
            self.n_fed += 1
            self.in_flight.append(MicroBatch(pending, [(s, 1, True) for s in seqs], True))
            return True
        return False

    def _may_run_ahead(self, s: Sequence) -> bool:
        """Whether s may have one more step queued than it has: no grammar, logprobs or choices waiting
        on it, and the token it would choose is still wanted (max_tokens, the slot's context)."""
        return (not s.done and not s.req.cancelled and s.constraint is None and s.parent is None
                and not s.children and s.sampler.params.logprobs is None and s.n_flight < self.lookahead
                and s.n_gen + s.n_flight < s.req.max_tokens and len(s.history) + s.n_flight + 1 < self.n_ctx_slot)

    def _short_chunk(self, batch: list[Sequence]) -> int:
        """Tokens that a short prompt (at most TRICKLE left) puts in this batch.

        With a KV stream per slot, a ubatch takes the same number of tokens from each of a run of
        consecutive sequences (split_equal(sequential)): a prompt chunk beside one-token decodes is
        split off into ubatches of its own, each a graph run with its fixed cost (about a one-token
        step) plus a build and plan when its shape is new (~70 ms). So beside decoding sequences a
        short prompt goes in one token per step, and short prompts starting together take equal
        chunks (the shortest one's length), which keeps each step one ubatch. A prompt longer than
        TRICKLE takes its chunk as before: its own ubatch is cheaper than that many steps."""
        if not self.per_slot_streams:
            return self.n_batch                     # split_simple: any mix of chunks is one ubatch
        if any(not s.prefilling for s in batch):
            return 1
        lefts = [len(s.req.prompt) - s.n_past for s in batch]
        return min([n for n in lefts if n <= TRICKLE], default=1)

    def take(self) -> tuple[MicroBatch, list[int] | None, np.ndarray | None]:
        """The oldest micro-batch, waited for: its token per output row (when chosen where the logits
        are) and its logits [n_outputs, n_vocab] (when sampled here, or kept for logprobs or choices); a
        scored chunk's rows are scored here, and only its last row (if any) is left to sample from."""
        mb = self.in_flight.popleft()
        t0 = time.perf_counter()
        if mb.sampled:
            toks: list[int] | None = mb.pending.tokens()    # one per output row, in batch order
            want = any(s.sampler.params.logprobs is not None or s.children for s, _, has_out in mb.parts
                       if has_out)
            logits = mb.pending.result() if want else None
        else:
            toks, logits = None, mb.pending.result()
        self.busy_s += time.perf_counter() - t0
        if mb.scored:
            assert logits is not None
            logits = _score_chunk(mb, logits)
        return mb, toks, logits


def _score_chunk(mb: MicroBatch, logits: np.ndarray) -> np.ndarray:
    """A scored chunk's rows: row i gives the logprob of the prompt token after it, sent as the chunk's
    prompt_logprobs event; returns the rows left to sample from (the prompt's last row, if the chunk
    ends the prompt, which scores nothing)."""
    s, n_tokens, last = mb.parts[0]
    p0 = s.n_past                                   # the chunk's first position (not advanced yet)
    targets = s.req.prompt[p0 + 1:p0 + n_tokens + 1]
    if not s.done and not s.req.cancelled:
        assert s.req.prompt_logprobs is not None, "only a scoring request's chunks are scored"
        lps = prompt_logprobs(logits, targets, s.req.prompt_logprobs)
        s.req.on_event(Event(prompt_logprobs=tuple(lps), index=s.index))
    return logits[-1:] if last else logits[:0]


def warm_step_shapes(ctx: LlamaContext, tok: int, n_parallel: int) -> None:
    """Decode once with each shape a step of one-token sequences takes (k consecutive streams, j of
    them with an output row: a trickled prompt token has none), so that no request waits while its
    step's graph is built, planned and bound (~45 ms for SmolLM2, each shape once per process: a
    benchmark run of 8 clients built 25 of them in its first 22 s). With a KV stream per slot the
    shapes are fixed by (k, j); over a pipeline or a unified cache n_kv grows with use, so there
    they are not enumerated. Where there would be more than 3/4 of MAX_GRAPHS (past 8 slots), only
    the shapes where every sequence decodes (j = k) are warmed."""
    P = n_parallel
    shapes = [(k, j) for k in range(1, P + 1) for j in range(k + 1)]
    if len(shapes) > MAX_GRAPHS * 3 // 4:
        shapes = [(k, k) for k in range(1, min(P, MAX_GRAPHS // 2) + 1)]
    t0 = time.perf_counter()
    for k, j in shapes:
        ctx.decode(Batch(np.full(k, tok, np.int32), np.zeros(k, np.int32),
                         [frozenset({s}) for s in range(k)], np.arange(k) >= k - j))
        for s in range(k):
            ctx.seq_rm(s)
    dt = time.perf_counter() - t0
    print(f"ggml-dist serve: {len(shapes)} decode step shapes planned in {dt:.1f} s", file=sys.stderr)

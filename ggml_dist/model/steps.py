"""The decode loop every path shares (`run`, `run --parallel`, the server): which sequences go into the
next micro-batch, submitted to the context, and the rows that come back (llama.cpp server's
update_slots batch building; vLLM's max_concurrent_batches).

    fill(seqs)  while fewer than `depth` micro-batches are in flight and some sequences are idle, submit
                one: one token per decoding sequence, then prompt chunks in what is left of n_batch (with
                a KV stream per sequence, short prompts one token per step beside decodes: _short_chunk);
                a scoring prompt's chunk goes alone (_submit_scored); with lookahead > 1 a group's next
                step is queued before its tokens are back, fed them where they are chosen (_follow_up)
    take()      the oldest micro-batch, waited for: its token ids (chosen where the logits are) and/or
                its logits
    rows(...)   each output row's sequence, with its token or its row of logits

On a pipeline of K stages the active sequences fall into K groups, so stage k works on one group while
stage k+1 works on another; in one process depth is 1 and every idle sequence shares one batch. A
sequence's micro-batches are queued in position order, so its KV writes happen in order; a micro-batch
lists its sequences in KV sequence order, so that consecutive ones form one ubatch
(split_equal(sequential)). A sequence that stops while a step of it is in flight is done at once; that
step's row for it is ignored, and the cells it took past the stop are freed by the caller (seq_rm).
"""
from __future__ import annotations

import collections
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from .context import MAX_GRAPHS, LlamaContext, PendingLogits
from .sampling import Sampler
from .ubatch import Batch

TRICKLE = 16        # with a KV stream per sequence, prompts with at most this many tokens left trickle in
                    # beside decoding sequences (Steps._short_chunk)


@dataclass(eq=False)
class Seq:
    """A sequence the loop steps: its KV sequence id, its prompt, the prompt and every token chosen after
    it (history), how much of it the cache holds (n_past) and how many of its steps are in flight. The
    server's sequences (serve/slots.py) add a request and say when they may be stepped."""
    slot: int
    prompt: list[int]
    sampler: Sampler
    history: list[int]
    max_tokens: int
    n_past: int = 0
    n_gen: int = 0
    n_flight: int = 0
    done: bool = False                      # finished: rows of it still in flight are ignored
    checkpoints_at: tuple[int, ...] = ()    # n_past values no prompt chunk passes (a state copy is taken there)
    tokens: list[int] = field(default_factory=list)   # (run) the tokens chosen, an end excluded

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.prompt)

    @property
    def in_flight(self) -> bool:
        return self.n_flight > 0

    def steppable(self) -> bool:
        """May be put in a step when it has none in flight."""
        return not self.done

    def scoring(self) -> bool:
        """Its prompt is scored: each chunk a step of its own, every row an output."""
        return False

    def wants_logits(self) -> bool:
        """Its token's step must bring the logits back (logprobs, or choices that sample from them)."""
        return self.sampler.params.logprobs is not None

    def may_feed(self) -> bool:
        """Its next step may be queued before its token is back (nothing here must see the token first)."""
        return not self.wants_logits()


@dataclass(slots=True)
class MicroBatch:
    pending: PendingLogits
    parts: list[tuple[Seq, int, bool]]          # (sequence, tokens it put in, has an output row)
    sampled: bool = False                       # tokens chosen where the logits are (no penalties)
    keep: bool = False                          # with its logits
    followed: bool = False                      # its group's next step is queued (fed its tokens)
    scored: bool = False                        # one scoring sequence's prompt chunk, every row an output


class Steps:
    """The micro-batches in flight over one context. n_batch: tokens per step; n_ctx_seq: a sequence's
    cells; depth: micro-batches in flight; n_groups: the micro-batches the active sequences fall into;
    lookahead: a group's steps in flight (> 1: token feedback)."""

    def __init__(self, ctx: LlamaContext, n_batch: int, n_ctx_seq: int, depth: int = 1, n_groups: int = 1,
                 lookahead: int = 1) -> None:
        if lookahead > 2 and ctx.rs is not None:
            raise ValueError(f"lookahead {lookahead}: a {ctx.model.hp.arch} model's recurrent state keeps the state "
                             f"from before its last step only, so it can take back one step queued past a stop "
                             f"(token feedback), not {lookahead - 1}; use lookahead 1 or 2")
        self.ctx = ctx
        self.n_batch, self.n_ctx_seq = n_batch, n_ctx_seq
        self.per_seq_streams = not ctx.kv.unified   # split_equal: hence _short_chunk
        self.depth, self.n_groups, self.lookahead = depth, n_groups, lookahead
        self.in_flight: collections.deque[MicroBatch] = collections.deque()
        self.busy_s = 0.0                       # time in submit and in waiting for results
        self.n_fed = 0                          # steps queued before their tokens were back
        self.next_slot = 0                      # round-robin start when filling micro-batches

    def fill(self, seqs: list) -> None:
        """Submit micro-batches until `depth` are in flight or no sequence is idle. seqs: in KV sequence
        order, None where there is none (the server's slots); each fill starts after the sequence the
        previous micro-batch ended with (round robin)."""
        n = len(seqs)
        per_batch = max(1, math.ceil(sum(s is not None and not s.done for s in seqs) / self.n_groups))
        while len(self.in_flight) < self.depth:
            idle = [s for k in range(n) if (s := seqs[(self.next_slot + k) % n]) is not None
                    and not s.in_flight and s.steppable()]
            if not idle:
                if not self._follow_up():
                    return
                continue
            scoring = next((s for s in idle if s.prefilling and s.scoring()), None)
            if scoring is not None:
                self._submit_scored(scoring)
                continue
            idle.sort(key=lambda s: s.prefilling)  # decoding sequences first, then prompt chunks
            chosen = self._chunks(idle[:per_batch])
            self.next_slot = (seqs.index(chosen[-1][0]) + 1) % n
            self._submit(chosen)

    def _chunks(self, idle: list[Seq]) -> list[tuple[Seq, list[int]]]:
        """Each sequence's tokens for the next step, while n_batch lasts: a decoding one its last token, a
        prefilling one its next prompt chunk."""
        short = self._short_chunk(idle)
        chosen: list[tuple[Seq, list[int]]] = []
        n_tokens = 0
        for s in idle:
            budget = self.n_batch - n_tokens
            if budget <= 0:
                break
            if not s.prefilling:
                chunk = [s.history[-1]]
            else:
                left = len(s.prompt) - s.n_past
                end = next((p for p in s.checkpoints_at if p > s.n_past), len(s.prompt))
                chunk = s.prompt[s.n_past:min(end, s.n_past + min(budget, short if left <= TRICKLE else left))]
            chosen.append((s, chunk))
            n_tokens += len(chunk)
        return chosen

    def _submit(self, chosen: list[tuple[Seq, list[int]]]) -> None:
        """One micro-batch of the chosen chunks, in sequence order."""
        tokens: list[int] = []
        pos: list[int] = []
        seq_ids: list[frozenset[int]] = []
        output: list[bool] = []
        parts: list[tuple[Seq, int, bool]] = []
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
        keep = any(s.wants_logits() for s in outs)
        t0 = time.perf_counter()
        if sampled:
            pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in outs], keep_logits=keep)
            for s in outs:
                s.sampler.advance()                  # the choice made there is this sampler's
        else:
            pending = self.ctx.submit(batch)
        self.busy_s += time.perf_counter() - t0
        self.in_flight.append(MicroBatch(pending, parts, sampled, keep))

    def _submit_scored(self, s: Seq) -> None:
        """A scoring sequence's next prompt chunk (at most n_batch tokens) as a step of its own, every row
        an output: its rows are computed as one process's batch of the same tokens is (`ggml-dist
        logits`), whatever the other sequences do; beside one-token decodes a ubatch would take the
        chunk's first token with theirs (split_equal), and with it a different reduction order."""
        chunk = s.prompt[s.n_past:s.n_past + self.n_batch]
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

        Step-major: a stage runs its calls in order and a fed call waits at the head of its queue for
        its token, so a group's step right behind its own previous one idles the first stage while the
        later ones compute that one. Hence oldest first, and not behind the newest micro-batch while
        another group has one in flight (which also undoes a group-major queue)."""
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

    def _may_run_ahead(self, s: Seq) -> bool:
        """Whether s may have one more step queued than it has: the token it would choose is still wanted
        (max_tokens, its cells) and nothing must see the one before it first."""
        return (not s.done and s.steppable() and s.may_feed() and s.n_flight < self.lookahead
                and s.n_gen + s.n_flight < s.max_tokens and len(s.history) + s.n_flight + 1 < self.n_ctx_seq)

    def _short_chunk(self, batch: list[Seq]) -> int:
        """Tokens that a short prompt (at most TRICKLE left) puts in this batch.

        With a KV stream per sequence, a ubatch takes the same number of tokens from each of a run of
        consecutive sequences (split_equal(sequential)): a prompt chunk beside one-token decodes is
        split off into ubatches of its own, each a graph run with its fixed cost (about a one-token
        step) plus a build and plan when its shape is new (~70 ms). So beside decoding sequences a
        short prompt goes in one token per step, and short prompts starting together take equal
        chunks (the shortest one's length), which keeps each step one ubatch. A prompt longer than
        TRICKLE takes its chunk as before: its own ubatch is cheaper than that many steps."""
        if not self.per_seq_streams:
            return self.n_batch                     # split_simple: any mix of chunks is one ubatch
        if any(not s.prefilling for s in batch):
            return 1
        lefts = [len(s.prompt) - s.n_past for s in batch]
        return min([n for n in lefts if n <= TRICKLE], default=1)

    def take(self) -> tuple[MicroBatch, list[int] | None, np.ndarray | None]:
        """The oldest micro-batch, waited for: its token per output row (when chosen where the logits
        are) and its logits [n_outputs, n_vocab] (when sampled here, or kept)."""
        mb = self.in_flight.popleft()
        t0 = time.perf_counter()
        if mb.sampled:
            toks: list[int] | None = mb.pending.tokens()    # one per output row, in batch order
            logits = mb.pending.result() if mb.keep else None
        else:
            toks, logits = None, mb.pending.result()
        self.busy_s += time.perf_counter() - t0
        return mb, toks, logits

    @staticmethod
    def rows(mb: MicroBatch, toks: list[int] | None,
             logits: np.ndarray | None) -> list[tuple[Seq, int | None, np.ndarray | None]]:
        """mb's parts are in the cache now (n_past, n_flight); then per output row of a sequence not done:
        (sequence, the token chosen where the logits are or None, its row of logits or None)."""
        out = []
        row = 0
        for s, n_tokens, has_out in mb.parts:
            s.n_flight -= 1
            s.n_past += n_tokens
            if has_out:
                row += 1
                if not s.done:                  # else it stopped while this step was in flight
                    out.append((s, toks[row - 1] if toks is not None else None,
                                logits[row - 1] if logits is not None else None))
        return out

    def clear(self) -> None:
        self.in_flight.clear()


def warm_step_shapes(ctx: LlamaContext, tok: int, n_seqs: int) -> None:
    """Decode once with each shape a step of one-token sequences takes (k consecutive streams, j of
    them with an output row: a trickled prompt token has none), so that no request waits while its
    step's graph is built, planned and bound (~45 ms for SmolLM2, each shape once per process: a
    benchmark run of 8 clients built 25 of them in its first 22 s). With a KV stream per sequence the
    shapes are fixed by (k, j); over a pipeline or a unified cache n_kv grows with use, so there
    they are not enumerated. Where there would be more than 3/4 of MAX_GRAPHS (past 8 sequences), only
    the shapes where every sequence decodes (j = k) are warmed."""
    shapes = [(k, j) for k in range(1, n_seqs + 1) for j in range(k + 1)]
    if len(shapes) > MAX_GRAPHS * 3 // 4:
        shapes = [(k, k) for k in range(1, min(n_seqs, MAX_GRAPHS // 2) + 1)]
    t0 = time.perf_counter()
    for k, j in shapes:
        ctx.decode(Batch(np.full(k, tok, np.int32), np.zeros(k, np.int32),
                         [frozenset({s}) for s in range(k)], np.arange(k) >= k - j))
        for s in range(k):
            ctx.seq_rm(s)
    dt = time.perf_counter() - t0
    print(f"ggml-dist serve: {len(shapes)} decode step shapes planned in {dt:.1f} s", file=sys.stderr)

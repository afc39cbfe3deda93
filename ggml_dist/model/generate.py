"""Text generation: prompt prefill, then one token per step (gpt-fast's prefill / decode_one_token).

`generate` is written against a small decoder protocol (decode a Batch, return the outputs' logits), so
the same loop drives a single-process LlamaContext and a pipeline of Ray stage actors. A decoder that
can also choose tokens where its logits are (LlamaContext.submit(sampling=)) is asked for the token
alone when no penalty needs the history: a pipeline's last stage then sends back an id, not the logits,
and the next steps are queued before it is read (lookahead: the last stage feeds the first).
`generate_parallel` decodes several continuations of one prompt together (run --parallel).
"""
from __future__ import annotations

import codecs
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer
from .ubatch import Batch


class Decoder(Protocol):
    def decode(self, batch: Batch) -> np.ndarray: ...


@dataclass
class GenerationResult:
    prompt_tokens: list[int]
    tokens: list[int]
    text: str
    prompt_s: float
    decode_s: float
    stop_reason: str
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tok_s(self) -> float:
        return len(self.prompt_tokens) / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes from the prompt's logits; each later one costs a decode step
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 and n else 0.0


class TextStream:
    """Incremental detokenisation: emits only complete UTF-8 characters."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self.dec.decode(self.tok.token_to_piece(token))

    def flush(self) -> str:
        return self.dec.decode(b"", final=True)


def generate(decoder: Decoder, tokenizer: Tokenizer, prompt_tokens: list[int], n_predict: int,
             params: SamplingParams = SamplingParams(), seq_id: int = 0,
             on_text: Callable[[str], None] | None = None, stop_at_eog: bool = True,
             n_batch: int = 512, on_token: Callable[[int, int], None] | None = None,
             lookahead: int | None = None) -> GenerationResult:
    """Greedy or sampled continuation of prompt_tokens; on_token(index, id) runs after each token.

    lookahead: decode steps queued before the oldest one's token is read (default 2 on a pipeline,
    1 elsewhere). Step k+1 takes step k's token where it is sampled (submit(tokens_from=)): a
    pipeline's last stage hands it to the first without the driver in between. Steps queued past a
    stop are taken out of the KV cache again (seq_rm), which leaves it as lookahead 1 would."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if n_predict < 0:
        raise ValueError(f"n_predict must be >= 0, got {n_predict}")
    if lookahead is not None and lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {lookahead}")
    sampler, stream = Sampler(params), TextStream(tokenizer)
    history = list(prompt_tokens)
    steps = _Steps(decoder, sampler, history, seq_id, lookahead)

    t0 = time.perf_counter()
    starts = range(0, len(prompt_tokens), n_batch)          # prefill in n_batch pieces
    for i in starts[:-1]:
        decoder.decode(Batch.from_tokens(prompt_tokens[i:i + n_batch], pos0=i, seq_id=seq_id))
    last = Batch.from_tokens(prompt_tokens[starts[-1]:], pos0=starts[-1], seq_id=seq_id)
    if n_predict:
        steps.request(last)
    else:
        decoder.decode(last)
    out: list[int] = []
    text: list[str] = []
    stop = "length"
    prompt_s = t1 = 0.0
    while len(out) < n_predict:
        while steps.queued < steps.depth and steps.n_requested < n_predict:
            steps.request(None, pos0=len(prompt_tokens) + steps.n_requested - 1)
        tok = steps.next_token()
        if not out:                                         # the prompt's token: its time is the prompt's
            prompt_s = time.perf_counter() - t0
            t1 = time.perf_counter()
        if stop_at_eog and tokenizer.is_eog(tok):
            stop = "eog"
            break
        out.append(tok)
        history.append(tok)
        if on_token is not None:
            on_token(len(out), tok)
        piece = stream.push(tok)
        text.append(piece)
        if on_text and piece:
            on_text(piece)
    if not n_predict:
        prompt_s, t1 = time.perf_counter() - t0, time.perf_counter()
    steps.drop_after(len(prompt_tokens) + len(out))
    tail = stream.flush()
    if tail:
        text.append(tail)
        if on_text:
            on_text(tail)
    return GenerationResult(list(prompt_tokens), out, "".join(text), prompt_s,
                            time.perf_counter() - t1, stop)


class _Steps:
    """One sequence's decode steps in flight, oldest first; each gives the token after its batch.

    With a decoder that chooses tokens where its logits are (submit(sampling=)) and no penalty that
    needs the history, a step is fed the previous step's token without waiting for it (tokens_from),
    up to `depth` steps ahead. Otherwise one step at a time, sampled here from its logits."""

    def __init__(self, decoder: Decoder, sampler: Sampler, history: list[int], seq_id: int,
                 lookahead: int | None) -> None:
        self.decoder, self.sampler, self.history, self.seq_id = decoder, sampler, history, seq_id
        self.submit = None if sampler.penalized else getattr(decoder, "submit", None)
        self.seq_rm = getattr(decoder, "seq_rm", None)
        ahead = self.submit is not None and self.seq_rm is not None
        default = 2 if getattr(decoder, "pipelined", False) else 1
        self.depth = (lookahead or default) if ahead else 1
        self._pending: deque = deque()
        self.n_requested = 0
        self._top = -1                        # the highest position a queued step decodes
        self._last = 0                        # the token read last

    @property
    def queued(self) -> int:
        return len(self._pending)

    def request(self, batch: Batch | None, pos0: int = 0) -> None:
        """Queue the batch, or (None) the step that decodes the newest queued step's token at pos0."""
        if batch is None:
            prev = self._pending[-1] if self._pending else None
            if prev is None or self.depth == 1:           # one at a time: the token is known by now
                batch = Batch.from_tokens([self._last], pos0=pos0, seq_id=self.seq_id)
                prev = None
            else:
                batch = Batch.from_tokens([0], pos0=pos0, seq_id=self.seq_id)
        else:
            prev = None
        self._top = int(batch.pos[-1])
        self.n_requested += 1
        if self.submit is None:
            self._pending.append(self.decoder.decode(batch)[-1])
            return
        fed = {} if prev is None else {"tokens_from": prev}
        self._pending.append(self.submit(batch, sampling=[self.sampler.row()], keep_logits=False, **fed))
        self.sampler.advance()

    def next_token(self) -> int:
        p = self._pending.popleft()
        tok = int(self.sampler.sample(p, self.history)) if self.submit is None else int(p.tokens()[-1])
        self._last = tok
        return tok

    def drop_after(self, pos: int) -> None:
        """Forget the steps still queued, and take what they decoded at pos and on out of the cache."""
        self._pending.clear()
        if self.seq_rm is not None and self._top >= pos:
            self.seq_rm(self.seq_id, pos, -1)


def generate_parallel(ctx, tokenizer: Tokenizer, prompt_tokens: list[int], n_predict: int, n_seq: int,
                      params: SamplingParams = SamplingParams(), groups: int | None = None,
                      lookahead: int | None = None, stop_at_eog: bool = True, n_batch: int = 512,
                      on_token: Callable[[int, int, int], None] | None = None) -> list[GenerationResult]:
    """n_seq continuations of one prompt decoded together (llama.cpp's batched example); sequence i
    samples with seed + i. ctx: a LlamaContext with n_seq_max >= n_seq and a unified KV cache.

    The prompt is evaluated once, as sequence 0, and its cells join the others (seq_cp). The sequences
    then fall into `groups` micro-batches (default: one per stage on a pipeline, so the stages overlap;
    one in one process, which reads the weights once per step for all). With lookahead > 1 a group's
    next steps are queued ahead, their tokens fed from the last stage while the group is unchanged (not
    the default: 4 sequences over 2 stages on 2 cores decoded 95-100 tok/s with 2 against 114-121 with
    1: a fed call waiting for its token holds the calls behind it in its stage's queue). A sequence that
    stops leaves its group, and steps queued past its stop are taken out of the cache again.
    on_token(seq, index, id) runs after each token."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if n_predict < 1 or n_seq < 1 or (lookahead is not None and lookahead < 1):
        raise ValueError(f"n_predict, n_seq and lookahead must be >= 1, got {n_predict}, {n_seq} and {lookahead}")
    if n_seq > ctx.params.n_seq_max or not ctx.kv.unified:
        raise ValueError(f"{n_seq} sequences need a context with n_seq_max >= {n_seq} (it has "
                         f"{ctx.params.n_seq_max}) and a unified KV cache")
    pipelined = ctx.pipelined
    n_groups = min(n_seq, groups or (sum(b.inputs_by_value for b in ctx.backends) if pipelined else 1))
    base = params.seed if params.seed is not None else Sampler(params).seed
    seqs = [_Sequence(i, Sampler(dataclasses.replace(params, seed=base + i)), TextStream(tokenizer),
                      list(prompt_tokens)) for i in range(n_seq)]
    t0 = time.perf_counter()
    starts = range(0, len(prompt_tokens), n_batch)
    for i in starts[:-1]:
        ctx.decode(Batch.from_tokens(prompt_tokens[i:i + n_batch], pos0=i))
    logits = ctx.decode(Batch.from_tokens(prompt_tokens[starts[-1]:], pos0=starts[-1]))[-1]
    for s in seqs[1:]:
        ctx.seq_cp(0, s.id)
    prompt_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    dec = _Decoding(ctx, tokenizer, seqs, n_predict, len(prompt_tokens), stop_at_eog, on_token,
                    lookahead or 1)
    for s in seqs:
        dec.accept(s, s.sampler.sample(logits, s.history))
    groups_of = [seqs[g * n_seq // n_groups:(g + 1) * n_seq // n_groups] for g in range(n_groups)]
    dec.run(groups_of)
    decode_s = time.perf_counter() - t1
    out = []
    for s in seqs:
        tail = s.stream.flush()
        out.append(GenerationResult(list(prompt_tokens), s.tokens, "".join(s.text) + tail, prompt_s, decode_s,
                                    s.stop, {"seq": s.id}))
    return out


@dataclass(eq=False)
class _Sequence:
    id: int
    sampler: Sampler
    stream: TextStream
    history: list[int]
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    stop: str = ""                     # "" while it goes on
    n_queued: int = 0                  # decode steps submitted for it


class _Decoding:
    """generate_parallel's decode loop: per group, steps in flight oldest first; micro-batches are read
    in submission order (they finish in order)."""

    def __init__(self, ctx, tokenizer: Tokenizer, seqs: list[_Sequence], n_predict: int, n_prompt: int,
                 stop_at_eog: bool, on_token: Callable[[int, int, int], None] | None, lookahead: int) -> None:
        self.ctx, self.tok, self.seqs, self.n_predict, self.n_prompt = ctx, tokenizer, seqs, n_predict, n_prompt
        self.stop_at_eog, self.on_token, self.lookahead = stop_at_eog, on_token, lookahead
        self.remote = not any(s.sampler.penalized for s in seqs)   # chosen where the logits are
        self.inflight: deque = deque()                             # (group, pending, members)

    def accept(self, s: _Sequence, tok: int) -> None:
        if self.stop_at_eog and self.tok.is_eog(tok):
            self._finish(s, "eog")
            return
        s.tokens.append(tok)
        s.history.append(tok)
        s.text.append(s.stream.push(tok))
        if self.on_token is not None:
            self.on_token(s.id, len(s.tokens), tok)
        if len(s.tokens) == self.n_predict:
            self._finish(s, "length")

    def _finish(self, s: _Sequence, reason: str) -> None:
        s.stop = reason
        cut = self.n_prompt + len(s.tokens)          # the cache keeps what lookahead 1 would have
        if self.ctx.seq_pos_max(s.id) >= cut:
            self.ctx.seq_rm(s.id, cut, -1)

    def run(self, groups: list[list[_Sequence]]) -> None:
        # step-major: every group's first step, then every group's second. A stage runs its calls in order,
        # and a fed step waits there for its token: group 0's second step queued before group 1's first
        # would hold the first stage idle while the last one computes group 0's first
        for depth in range(1, (self.lookahead if self.remote else 1) + 1):
            for g in range(len(groups)):
                self._top_up(groups, g, depth)
        while self.inflight:
            g, pending, members = self.inflight.popleft()
            if self.remote:
                toks = pending.tokens()
            else:
                lg = pending.result()
                toks = [s.sampler.sample(lg[i], s.history) for i, s in enumerate(members)]
            for s, tok in zip(members, toks):
                if not s.stop:                        # a sequence that stopped ignores what was queued
                    self.accept(s, tok)
            self._top_up(groups, g)

    def _top_up(self, groups: list[list[_Sequence]], g: int, depth: int | None = None) -> None:
        """Queue group g's next steps, up to `depth` (default: lookahead) in flight: fed from the group's
        newest step while the group is unchanged, else (its tokens known) once every step of it was read."""
        limit = depth or (self.lookahead if self.remote else 1)
        while True:
            mine = [(p, m) for gg, p, m in self.inflight if gg == g]
            if len(mine) >= limit:
                return
            members = [s for s in groups[g] if not s.stop and s.n_queued < self.n_predict - 1]
            if not members:
                return
            newest = mine[-1] if mine else None
            if newest is not None and newest[1] != members:
                return                                # the group changed: its tokens come back first
            n = len(members)
            toks = np.zeros(n, np.int32) if newest else np.array([s.tokens[-1] for s in members], np.int32)
            pos = np.array([self.n_prompt + s.n_queued for s in members], np.int32)
            batch = Batch(toks, pos, [frozenset({s.id}) for s in members], np.ones(n, bool))
            if self.remote:
                fed = {} if newest is None else {"tokens_from": newest[0]}
                pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in members], keep_logits=False,
                                          **fed)
                for s in members:
                    s.sampler.advance()
            else:
                pending = self.ctx.submit(batch)
            for s in members:
                s.n_queued += 1
            self.inflight.append((g, pending, members))

"""Text generation: prompt prefill, then one token per step (gpt-fast's prefill / decode_one_token),
through the decode loop every path shares (model/steps.py), on one process's context or a pipeline's.

Where no penalty needs the history the token is chosen where the logits are (LlamaContext.submit(
sampling=)): a pipeline's last stage then sends back an id, not the logits, and with lookahead > 1 the
next steps are queued before it is read (the last stage feeds the first). `generate` continues one
prompt (run); `generate_parallel` several continuations of one prompt together (run --parallel).
"""
from __future__ import annotations

import codecs
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .context import LlamaContext
from .sampling import Sampler, SamplingParams
from .steps import Seq, Steps
from .tokenizer import Tokenizer
from .ubatch import Batch


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


def generate(ctx: LlamaContext, tokenizer: Tokenizer, prompt_tokens: list[int], n_predict: int,
             params: SamplingParams = SamplingParams(), seq_id: int = 0,
             on_text: Callable[[str], None] | None = None, stop_at_eog: bool = True,
             n_batch: int = 512, on_token: Callable[[int, int], None] | None = None,
             lookahead: int | None = None) -> GenerationResult:
    """Greedy or sampled continuation of prompt_tokens; on_token(index, id) runs after each token.

    lookahead: decode steps queued before the oldest one's token is read (default 2 on a pipeline,
    1 elsewhere; a hybrid model's recurrent state takes back one step, so no more than 2). Step k+1
    takes step k's token where it is sampled (submit(tokens_from=)): a pipeline's last stage hands it to
    the first without the driver in between. Steps queued past a stop are taken out of the KV cache (and
    the recurrent state) again (seq_rm), which leaves them as lookahead 1 would."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if n_predict < 0:
        raise ValueError(f"n_predict must be >= 0, got {n_predict}")
    if lookahead is not None and lookahead < 1:
        raise ValueError(f"lookahead must be >= 1, got {lookahead}")
    depth = lookahead or (2 if ctx.pipelined else 1)
    s = Seq(seq_id, list(prompt_tokens), Sampler(params), list(prompt_tokens), n_predict)
    run = _Run(ctx, tokenizer, [s], stop_at_eog, lambda _, i, t: on_token(i, t) if on_token else None, on_text)
    run.loop(Steps(ctx, n_batch, ctx.n_ctx + 1, depth=depth, lookahead=depth))
    return GenerationResult(list(prompt_tokens), s.tokens, run.text(s), run.prompt_s, run.decode_s, run.stops[0])


def generate_parallel(ctx: LlamaContext, tokenizer: Tokenizer, prompt_tokens: list[int], n_predict: int,
                      n_seq: int, params: SamplingParams = SamplingParams(), groups: int | None = None,
                      lookahead: int | None = None, stop_at_eog: bool = True, n_batch: int = 512,
                      on_token: Callable[[int, int, int], None] | None = None) -> list[GenerationResult]:
    """n_seq continuations of one prompt decoded together (llama.cpp's batched example); sequence i
    samples with seed + i. ctx: a LlamaContext with n_seq_max >= n_seq and a unified KV cache.

    The prompt is evaluated once, as sequence 0, and its cells join the others (seq_cp). The sequences
    then fall into `groups` micro-batches (default: one per stage on a pipeline, so the stages overlap;
    one in one process, which reads the weights once per step for all). With lookahead > 1 a group's
    next steps are queued ahead, their tokens fed from the last stage (not the default: 4 sequences
    over 2 stages on 2 cores decoded 95-100 tok/s with 2 against 114-121 with 1: a fed call waiting for
    its token holds the calls behind it in its stage's queue). A sequence that stops leaves the
    groups, and steps queued past its stop are taken out of the cache again.
    on_token(seq, index, id) runs after each token."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if n_predict < 1 or n_seq < 1 or (lookahead is not None and lookahead < 1):
        raise ValueError(f"n_predict, n_seq and lookahead must be >= 1, got {n_predict}, {n_seq} and {lookahead}")
    if n_seq > ctx.params.n_seq_max or not ctx.kv.unified:
        raise ValueError(f"{n_seq} sequences need a context with n_seq_max >= {n_seq} (it has "
                         f"{ctx.params.n_seq_max}) and a unified KV cache")
    n_groups = min(n_seq, groups or (sum(b.inputs_by_value for b in ctx.backends) if ctx.pipelined else 1))
    base = params.seed if params.seed is not None else Sampler(params).seed
    P = len(prompt_tokens)
    seqs = [Seq(i, list(prompt_tokens), Sampler(dataclasses.replace(params, seed=base + i)), list(prompt_tokens),
                n_predict) for i in range(n_seq)]
    run = _Run(ctx, tokenizer, seqs, stop_at_eog, on_token)
    starts = range(0, P, n_batch)
    for i in starts[:-1]:
        ctx.decode(Batch.from_tokens(prompt_tokens[i:i + n_batch], pos0=i))
    logits = ctx.decode(Batch.from_tokens(prompt_tokens[starts[-1]:], pos0=starts[-1]))[-1]
    for s in seqs[1:]:
        ctx.seq_cp(0, s.slot)
    run.prompt_s = time.perf_counter() - run.t0
    for s in seqs:                                  # every first token from the prompt's logits
        s.n_past = P
        run.accept(s, s.sampler.sample(logits, s.history))
    run.loop(Steps(ctx, n_batch, ctx.n_ctx + 1, depth=n_groups * (lookahead or 1), n_groups=n_groups,
                   lookahead=lookahead or 1))
    return [GenerationResult(list(prompt_tokens), s.tokens, run.text(s), run.prompt_s, run.decode_s, run.stops[k],
                             {"seq": s.slot}) for k, s in enumerate(seqs)]


class _Run:
    """The sequences of a generate call through the decode loop: each row's token accepted (an end of
    generation or max_tokens stops a sequence, and the cells its queued steps took past the stop are
    freed), its text streamed, the prompt's time and the decoding's kept."""

    def __init__(self, ctx: LlamaContext, tokenizer: Tokenizer, seqs: list[Seq], stop_at_eog: bool,
                 on_token: Callable[[int, int, int], None] | None, on_text: Callable[[str], None] | None = None):
        self.ctx, self.tok, self.seqs, self.stop_at_eog = ctx, tokenizer, seqs, stop_at_eog
        self.on_token, self.on_text = on_token, on_text
        self.streams = [TextStream(tokenizer) for _ in seqs]
        self.pieces: list[list[str]] = [[] for _ in seqs]
        self.stops = ["length"] * len(seqs)
        self.t0 = time.perf_counter()
        self.prompt_s = -1.0                        # until the prompt's token
        self.t1 = 0.0
        self.decode_s = 0.0

    def loop(self, steps: Steps) -> None:
        """Step every sequence until each has stopped."""
        while not all(s.done for s in self.seqs):
            steps.fill(self.seqs)
            for s, tok, row in steps.rows(*steps.take()):
                if s.n_gen >= s.max_tokens:         # n_predict 0: the prompt only
                    self._tick()
                    self._finish(s, "length")
                elif tok is not None:
                    self.accept(s, tok)
                else:
                    assert row is not None
                    self.accept(s, s.sampler.sample(row, s.history))
        self.decode_s = time.perf_counter() - self.t1

    def _tick(self) -> None:
        """The prompt's time ends with its token (or, sampling nothing, its evaluation)."""
        if self.prompt_s < 0:
            self.prompt_s = time.perf_counter() - self.t0
        if not self.t1:
            self.t1 = time.perf_counter()

    def accept(self, s: Seq, tok: int) -> None:
        self._tick()
        if self.stop_at_eog and self.tok.is_eog(tok):
            self._finish(s, "eog")
            return
        s.tokens.append(tok)
        s.history.append(tok)
        s.n_gen += 1
        if self.on_token is not None:
            self.on_token(s.slot, len(s.tokens), tok)
        self._text(s, self.streams[self.seqs.index(s)].push(tok))
        if s.n_gen >= s.max_tokens:
            self._finish(s, "length")

    def _finish(self, s: Seq, reason: str) -> None:
        s.done = True
        self.stops[self.seqs.index(s)] = reason
        if s.n_flight:                              # the cache keeps what lookahead 1 would have
            self.ctx.seq_rm(s.slot, s.n_past, -1)
        self._text(s, self.streams[self.seqs.index(s)].flush())

    def _text(self, s: Seq, piece: str) -> None:
        if piece:
            self.pieces[self.seqs.index(s)].append(piece)
            if self.on_text is not None:
                self.on_text(piece)

    def text(self, s: Seq) -> str:
        return "".join(self.pieces[self.seqs.index(s)])

"""Text generation: prompt prefill, then one token per step (gpt-fast's prefill / decode_one_token).

`generate` is written against a small decoder protocol (decode a Batch, return the outputs' logits), so
the same loop drives a single-process LlamaContext and a pipeline of Ray stage actors. A decoder that
can also choose tokens where its logits are (LlamaContext.submit(sampling=)) is asked for the token
alone when no penalty needs the history: a pipeline's last stage then sends back an id, not the logits.
"""
from __future__ import annotations

import codecs
import time
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
             n_batch: int = 512, on_token: Callable[[int, int], None] | None = None) -> GenerationResult:
    """Greedy or sampled continuation of prompt_tokens; on_token(index, id) runs after each token."""
    if not prompt_tokens:
        raise ValueError("the prompt is empty: give at least one token")
    if n_predict < 0:
        raise ValueError(f"n_predict must be >= 0, got {n_predict}")
    sampler, stream = Sampler(params), TextStream(tokenizer)
    history = list(prompt_tokens)
    submit = None if sampler.penalized else getattr(decoder, "submit", None)

    def next_token(batch: Batch) -> int:
        """The token after the batch's last output."""
        if submit is not None:
            tok = submit(batch, sampling=[sampler.row()], keep_logits=False).tokens()[-1]
            sampler.advance()
            return int(tok)
        return sampler.sample(decoder.decode(batch)[-1], history)

    t0 = time.perf_counter()
    starts = range(0, len(prompt_tokens), n_batch)          # prefill in n_batch pieces
    for i in starts[:-1]:
        decoder.decode(Batch.from_tokens(prompt_tokens[i:i + n_batch], pos0=i, seq_id=seq_id))
    last = Batch.from_tokens(prompt_tokens[starts[-1]:], pos0=starts[-1], seq_id=seq_id)
    tok = next_token(last) if n_predict else None
    if tok is None:
        decoder.decode(last)
    prompt_s = time.perf_counter() - t0
    out: list[int] = []
    text: list[str] = []
    stop = "length"
    t1 = time.perf_counter()
    pos = len(prompt_tokens)
    while len(out) < n_predict:
        assert tok is not None
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
        if len(out) == n_predict:
            break
        tok = next_token(Batch.from_tokens([tok], pos0=pos, seq_id=seq_id))
        pos += 1
    tail = stream.flush()
    if tail:
        text.append(tail)
        if on_text:
            on_text(tail)
    return GenerationResult(list(prompt_tokens), out, "".join(text), prompt_s,
                            time.perf_counter() - t1, stop)

"""A request to the serving engine and the events it gets back (text pieces, then the last one with its
finish reason), with the logprob numbers the OpenAI and llama-server answers carry."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..model.sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class Event:
    """A piece of text for the client; the last event of a request has finish_reason set
    ("stop", "length", "cancelled" or "error")."""
    text: str = ""
    finish_reason: str | None = None
    n_prompt: int = 0
    n_gen: int = 0
    error: str | None = None
    logprobs: tuple = ()    # per token of this event (sampling.logprobs set): TokenLogprob tuples
    index: int = 0          # which of the request's n choices
    n_cached: int = 0       # the last event: prompt tokens the slot's cache held (not evaluated again)
    prompt_logprobs: tuple = ()   # Request.prompt_logprobs: a chunk's prompt tokens, each a TokenLogprob
                                  # given the tokens before it (the prompt's first token has none)


# (token id, its logprob, ((id, logprob) of the top tokens, most likely first)): log-softmax of the raw
# logits of the step that chose the token (before bias and penalties), in float64
TokenLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


def token_logprob(logits: np.ndarray, tok: int, n_top: int) -> TokenLogprob:
    x = np.asarray(logits, np.float64)
    m = x.max()
    lp = x - (m + np.log(np.exp(x - m).sum()))
    top = np.argsort(-lp, kind="stable")[:n_top] if n_top else np.zeros(0, np.int64)
    return int(tok), float(lp[tok]), tuple((int(i), float(lp[i])) for i in top)


def prompt_logprobs(logits: np.ndarray, targets: list[int], n_top: int) -> list[TokenLogprob]:
    """token_logprob of targets[i] under logits row i, for every row, with the same numbers (float64
    log-softmax) and the same order of the top ones (by logprob, then id). Rows 64 at a time, and the
    top ones from a partition rather than a sort of the vocabulary: 512 rows of 49K take ~0.3 s."""
    out: list[TokenLogprob] = []
    for r0 in range(0, len(targets), 64):
        x = np.asarray(logits[r0:min(r0 + 64, len(targets))], np.float64)
        m = x.max(axis=1, keepdims=True)
        lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
        for i, row in enumerate(lp):
            tok = int(targets[r0 + i])
            top: tuple[tuple[int, float], ...] = ()
            if n_top:
                k = min(n_top, len(row))
                kth = np.partition(row, len(row) - k)[len(row) - k]     # the k-th largest
                ids = np.flatnonzero(row >= kth)                         # ties included, then cut
                ids = ids[np.lexsort((ids, -row[ids]))][:k]
                top = tuple((int(j), float(row[j])) for j in ids)
            out.append((tok, float(row[tok]), top))
    return out


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    on_event: Callable[[Event], None]      # called from the engine thread; must not block
    t_arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    n: int = 1                             # choices: n sequences, the prompt evaluated once (seq_cp)
    prompt_logprobs: int | None = None     # score the prompt: every prompt token's logprob and this many
                                           # top ones (echo + logprobs), from one evaluation of the whole
                                           # prompt (no cache reuse) in chunks of n_batch, each a step of
                                           # its own; max_tokens 0 then ends the request (score only)
    cache_prompt: bool = True              # may start from a slot's cached prefix (llama-server's field)


def score_chunk(s: Any, n_tokens: int, last: bool, logits: np.ndarray) -> np.ndarray:
    """A scored prompt chunk's rows (model/steps.py's scored micro-batch of sequence s, before its n_past
    moves past it): row i gives the logprob of the prompt token after it, sent as the chunk's
    prompt_logprobs event; returns the rows left to sample from (the prompt's last row, if the chunk
    ends the prompt, which scores nothing)."""
    p0 = s.n_past
    targets = s.req.prompt[p0 + 1:p0 + n_tokens + 1]
    if not s.done and not s.req.cancelled:
        assert s.req.prompt_logprobs is not None, "only a scoring request's chunks are scored"
        lps = prompt_logprobs(logits, targets, s.req.prompt_logprobs)
        s.req.on_event(Event(prompt_logprobs=tuple(lps), index=s.index))
    return logits[-1:] if last else logits[:0]

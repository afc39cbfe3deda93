"""Token sampling: llama.cpp's default chain (logit bias -> penalties -> top-k -> top-p -> min-p ->
temperature -> dist; common_sampler_init's order).

temperature <= 0 is greedy (argmax of the raw logits, first index on ties, as ggml_argmax). The n-th
stochastic choice of a sequence draws from a numpy Generator seeded by (seed, n), so a seed reproduces
a run, and the choice does not depend on where it is made: a pipeline's last stage (`sample_row` with
the same RowSampling) picks the ids the driver would. A Sampler without a seed draws one at random.

Degenerate parameters are clamped, never an error (an error in a batched step would cost the other
sequences theirs): llama.cpp reads them as float32, so a temperature that is 0 there (1e-300, 5e-324)
is greedy; a temperature so small that logits / temperature overflows float32 takes the softmax of
the shifted logits in float64 instead, which is the same distribution; a repeat_penalty is held inside
float32's normal range, and logits that penalties push past float32's range stay at its ends.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64             # the penalties' window: the last n tokens (prompt included)
    presence_penalty: float = 0.0       # minus this once for a token in the window (OpenAI's)
    frequency_penalty: float = 0.0      # minus this per occurrence in the window (OpenAI's)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit), applied first
    seed: int | None = None
    logprobs: int | None = None         # report each chosen token's logprob and this many top ones
    grammar: str | None = None          # an llguidance grammar the output must follow (serve/grammar.py)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ValueError(f"repeat_last_n must be >= 0, got {self.repeat_last_n}")


FLT_MIN = float(np.finfo(np.float32).tiny)        # the smallest normal float32
FLT_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, slots=True)
class RowSampling:
    """One output row's choice, self-contained: the chain's parameters (no penalties: they need the
    sequence's history), the sequence's seed and how many choices it made before this one."""
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    n: int

    def to_list(self) -> list:
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.n]

    @classmethod
    def from_list(cls, v: list) -> RowSampling:
        if not (isinstance(v, list) and len(v) == 6 and all(isinstance(x, (int, float)) for x in v)):
            raise ValueError(f"a row's sampling is 6 numbers, not {str(v)[:60]}")
        t, k, p, m, seed, n = v
        return cls(float(t), int(k), float(p), float(m), int(seed), int(n))

    @property
    def greedy(self) -> bool:
        """temperature <= 0, or a temperature that is 0 as float32 (llama.cpp's type for it)."""
        return self.temperature <= 0 or np.float32(self.temperature) == 0


GREEDY = RowSampling(0.0, 0, 1.0, 0.0, 0, 0)


def sample_row(logits: np.ndarray, rs: RowSampling) -> int:
    """top-k -> top-p -> min-p -> temperature -> dist over one row of logits (greedy: argmax)."""
    x = np.asarray(logits, dtype=np.float32)
    if rs.greedy:
        return int(np.argmax(x))
    ids = _top_k(x, rs.top_k)
    probs = _softmax(x[ids])
    if rs.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), rs.top_p) + 1)
        ids, probs = ids[:keep], _softmax(x[ids[:keep]])
    if rs.min_p > 0.0:
        keep_m = probs >= rs.min_p * probs[0]
        ids = ids[keep_m]
    with np.errstate(over="ignore"):
        scaled = x[ids] / rs.temperature
    if np.isfinite(scaled).all():
        probs = _softmax(scaled)
    else:       # differs from llama.cpp (NaNs there): the same distribution, shifted before it is scaled
        z = (x[ids].astype(np.float64) - float(x[ids].max())) / rs.temperature
        e = np.exp(z)
        probs = e / e.sum()
    rng = np.random.default_rng([rs.seed & (2**64 - 1), rs.n])
    return int(ids[rng.choice(len(ids), p=probs)])


def _random_seed() -> int:
    """A seed from the OS's entropy, below 2**63."""
    entropy = np.random.SeedSequence().entropy
    # numpy types entropy as int | Sequence[int] | None: the last two only echo a seed that was given
    assert isinstance(entropy, int), f"SeedSequence() drew {type(entropy).__name__} entropy, not an int"
    return int(entropy % 2**63)


class Sampler:
    """A sequence's sampler: its parameters, seed and count of choices made."""

    def __init__(self, params: SamplingParams = SamplingParams()) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else _random_seed()
        self.n = 0

    @property
    def penalized(self) -> bool:
        """Whether the choice needs more than the logits (the history, or a bias): made on the driver."""
        p = self.params
        return p.repeat_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or \
            bool(p.logit_bias) or p.grammar is not None

    def row(self) -> RowSampling:
        """The next choice, to be made wherever the logits are (then call advance())."""
        p = self.params
        return RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, self.seed, self.n)

    def advance(self) -> None:
        self.n += 1

    def sample(self, logits: np.ndarray, history: list[int] | None = None,
               allowed: np.ndarray | None = None) -> int:
        """allowed: a bool mask over the vocabulary (a grammar's), as llama.cpp's grammar sampler
        setting the others to -inf: the chain runs over the allowed tokens only, which chooses the same
        token (the -inf ones would sort last with probability 0) without partitioning a vector of
        mostly equal values."""
        x = np.asarray(logits, dtype=np.float32)
        if self.penalized:
            x = self.adjust(x, history or [])
        if allowed is not None:
            ids = np.flatnonzero(allowed)
            if not len(ids):
                raise ValueError("the grammar allows no token here")
            tok = int(ids[sample_row(x[ids], self.row())])
            self.advance()
            return tok
        tok = sample_row(x, self.row())
        self.advance()
        return tok

    def adjust(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """llama_sampler_logit_bias, then llama_sampler_penalties over the window's token counts: a
        token seen there has its logit divided (> 0) or multiplied (<= 0) by repeat_penalty, then
        count * frequency_penalty + presence_penalty subtracted (float32 steps). A copy."""
        p = self.params
        x = np.array(logits, dtype=np.float32)
        for tok, bias in p.logit_bias:
            if 0 <= tok < len(x):
                x[tok] += np.float32(bias)
        window = history[-p.repeat_last_n:] if p.repeat_last_n else []
        if window and (p.repeat_penalty != 1.0 or p.presence_penalty or p.frequency_penalty):
            ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
            ok = (ids >= 0) & (ids < len(x))
            ids, counts = ids[ok], counts[ok]
            v = x[ids]
            # differs from llama.cpp (inf, then NaNs): the penalty held inside float32's normal range,
            # and the logits it pushes past float32's range held at its ends
            penalty = np.float32(min(max(p.repeat_penalty, FLT_MIN), FLT_MAX))
            with np.errstate(over="ignore"):
                v = np.where(v <= 0, v * penalty, v / penalty)
                v = v - (counts.astype(np.float32) * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
            x[ids] = np.clip(v, -FLT_MAX, FLT_MAX).astype(np.float32)
        return x


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits, largest first, ties by lower index: the first k of a stable
    descending argsort (all of it for k = 0), found with a partition instead of sorting the vocabulary
    (a 49K-entry sort costs milliseconds, per token and sequence)."""
    if not 0 < k < len(x) or not np.isfinite(x).all():     # NaNs: the sort's own order decides
        return np.argsort(-x, kind="stable")[:k or None]
    kth = np.partition(x, len(x) - k)[len(x) - k]           # the k-th largest value
    above = np.flatnonzero(x > kth)
    cand = np.concatenate([above, np.flatnonzero(x == kth)[:k - len(above)]])
    return cand[np.lexsort((cand, -x[cand]))]


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()

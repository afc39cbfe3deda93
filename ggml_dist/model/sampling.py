"""Token sampling: llama.cpp's default chain (penalties -> top-k -> top-p -> min-p -> temperature -> dist).

temperature <= 0 is greedy (argmax of the raw logits, first index on ties, as ggml_argmax). Every
stochastic choice draws from one seeded numpy Generator, so a seed reproduces a run.
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
    repeat_last_n: int = 64
    seed: int | None = None

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


class Sampler:
    def __init__(self, params: SamplingParams = SamplingParams()) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def sample(self, logits: np.ndarray, history: list[int] | None = None) -> int:
        p = self.params
        x = np.asarray(logits, dtype=np.float32)
        if p.repeat_penalty != 1.0 and history:
            x = x.copy()                            # the caller's logits stay as they were
            recent = np.unique(np.asarray(history[-p.repeat_last_n:], dtype=np.int64))
            vals = x[recent]
            x[recent] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        if p.temperature <= 0:
            return int(np.argmax(x))
        ids = _top_k(x, p.top_k)
        probs = _softmax(x[ids])
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            ids, probs = ids[:keep], _softmax(x[ids[:keep]])
        if p.min_p > 0.0:
            keep_m = probs >= p.min_p * probs[0]
            ids = ids[keep_m]
        probs = _softmax(x[ids] / p.temperature)
        return int(ids[self.rng.choice(len(ids), p=probs)])


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

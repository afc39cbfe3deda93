"""llama-server's embeddings (/v1/embeddings, /embedding): the final norm's rows of every prompt token,
pooled (mean, the last token's, or the first's), then divided by their Euclidean norm (summed in
double); pooling none gives every token's row as it is. Computed by the engine thread in a free slot
between steps, in chunks of n_batch."""
from __future__ import annotations

import numpy as np

from ..model.context import LlamaContext
from ..model.ubatch import Batch


def embed(ctx: LlamaContext, prompt: list[int], slot: int, n_batch: int, pooling: str) -> np.ndarray:
    """float32 [n_embd], or [n_tokens, n_embd] for pooling none; the slot's cells are left empty."""
    ctx.seq_rm(slot)
    rows = []
    try:
        for i in range(0, len(prompt), n_batch):
            chunk = prompt[i:i + n_batch]
            b = Batch(np.asarray(chunk, np.int32), np.arange(i, i + len(chunk), dtype=np.int32),
                      [frozenset({slot})] * len(chunk), np.ones(len(chunk), bool))
            rows.append(ctx.submit(b, embeddings=True).result())
    finally:
        ctx.seq_rm(slot)
    if pooling == "none":
        return np.concatenate(rows).astype(np.float32)
    e = np.concatenate(rows).astype(np.float64)
    v = {"mean": lambda: e.mean(axis=0), "last": lambda: e[-1], "cls": lambda: e[0]}[pooling]()
    norm = float(np.sqrt((v * v).sum()))
    return (v * (1.0 / norm if norm > 0 else 0.0)).astype(np.float32)

"""What the tensor- and expert-parallel tests share: K ranks against one process, bit for bit."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.tp_local import RankContext, TensorParallelContext
from ggml_dist.model.ubatch import Batch


def greedy(decode, prompt: list[int], n_steps: int) -> tuple[list[np.ndarray], list[int]]:
    """The prompt's logits (every row), then n_steps greedy tokens one at a time: (logits, tokens)."""
    logits = [decode(Batch.from_tokens(prompt, all_outputs=True))]
    tokens = []
    for i in range(n_steps):
        tokens.append(int(np.argmax(logits[-1][-1])))
        logits.append(decode(Batch.from_tokens([tokens[-1]], pos0=len(prompt) + i)))
    return logits, tokens


def ranks_equal_one_process(model: LlamaModel, params: ContextParams, prompt: list[int], n_steps: int,
                            check_ranks: Callable[[int, list[RankContext]], None]) -> None:
    """At K = 2 and 4 the group's logits are one process's bit for bit and so its greedy tokens;
    check_ranks(K, every rank's context) then looks at what each rank holds."""
    ref_logits, ref_tokens = greedy(LlamaContext(model, params).decode, prompt, n_steps)
    for size in (2, 4):
        tp = TensorParallelContext(model, size, params)
        try:
            logits, tokens = greedy(tp.decode, prompt, n_steps)
            assert tokens == ref_tokens, f"K={size}"
            for step, (a, b) in enumerate(zip(ref_logits, logits)):
                assert np.array_equal(a, b), f"K={size} step {step}: {np.count_nonzero(a != b)} logits differ"
            check_ranks(size, [tp, *(f.ctx.result() for f in tp.followers)])
        finally:
            tp.close()

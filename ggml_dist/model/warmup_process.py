"""The background compile process of model/warmup.py: `python -m ggml_dist.model.warmup_process PATH MARKER
LOCK_FD` compiles the kernels a run of the model at PATH takes, then writes MARKER. LOCK_FD is MARKER's
lock, taken by the process that started this one: held while this process lives."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from ..backends.cpu import threads as kernel_threads
from .context import ContextParams, LlamaContext
from .model import LlamaModel
from .ubatch import Batch


def compile_kernels(path: str | Path) -> None:
    """Decode a prompt of 32 tokens and then 2 single tokens of the model at 1 thread and at all of them
    with the compiled kernels: every kernel and specialization such a run takes lands in the cache (32
    rows are enough for the row ops' thread split, fkernels._ROW_PARALLEL_WORK, from 512 columns)."""
    model = LlamaModel.load(path)
    prompt = [int(t) % model.hp.n_vocab for t in range(1, 33)]
    for n in sorted({1, kernel_threads.get_threads()}):
        kernel_threads.set_threads(n)
        ctx = LlamaContext(model, ContextParams(n_ctx=64, n_batch=32, n_ubatch=32))
        ctx.decode(Batch.from_tokens(prompt))
        for i in range(2):
            ctx.decode(Batch.from_tokens([prompt[i]], pos0=len(prompt) + i))


def main(argv: list[str]) -> int:
    path, marker = argv[0], Path(argv[1])
    lock = os.fdopen(int(argv[2]), "a")        # held open to the end: that is the lock
    os.nice(10)                                 # the run that started us comes first
    t0 = time.monotonic()
    compile_kernels(path)
    marker.write_text(f"compiled in {time.monotonic() - t0:.1f} s for {path}\n")
    lock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

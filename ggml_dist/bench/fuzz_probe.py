"""Running one GGUF fuzzer case (bench/fuzz_gguf.py) in this process: the file loaded (load_gguf and
LlamaModel.load: metadata, hparams, tensor checks, weights mapping, tokenizer), a short text encoded and a
forward pass run (forward_probe); its outcome classified (ok, clean, unclear, failure) with the CPU time
and the traced memory peak it took.
"""
from __future__ import annotations

import os
import tempfile
import time
import tracemalloc
from typing import Any

from .fuzz_cases import seed_file

# ---------------------------------------------------------------------------------------------------
# running one case (in the worker)

# The project's own error types: GGUFError (and its subclasses), what the loader raises for a file it
# refuses, and the two errors of ggml_dist.model a batch can meet in the forward probe (BatchError: a token
# outside the model's vocabulary; ContextFullError: no free KV cells). Anything else a file provokes -- a
# ValueError from numpy, an IndexError, a KeyError, int() on a bad value, or a core-layer error such as
# ShapeError or AllocError deep inside a graph the loader let through -- is a failure.
def project_errors() -> tuple[type[BaseException], ...]:
    from ggml_dist.model.gguf import GGUFError
    from ggml_dist.model.kv_cache import ContextFullError
    from ggml_dist.model.ubatch import BatchError
    return GGUFError, BatchError, ContextFullError


PROBE_TEXT = "Hello world, 123!"
PROBE_N_CTX = 64            # KV cells of the probe's context: a few tokens, never n_ctx_train
PROBE_N_PROMPT = 8          # prompt tokens decoded as one batch
PROBE_N_DECODE = 2          # then this many single-token steps


def forward_probe(model: Any, tokens: list[int], compiled: bool = True) -> None:
    """A model that loads must also run: decode the probe's prompt (its first PROBE_N_PROMPT tokens, or
    token 0 when the text gave none), then PROBE_N_DECODE greedy steps, each chosen token turned back into
    text, with the compiled (numba) kernels or the numpy reference ones. The logits must have the model's
    shape; their values are the file's business (random bytes in the data section give NaNs, and that is
    no error)."""
    import numpy as np

    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.ubatch import Batch

    n_vocab = model.hp.n_vocab
    prompt = list(tokens[:PROBE_N_PROMPT]) or [0]
    lctx = LlamaContext(model, ContextParams(n_ctx=PROBE_N_CTX, n_batch=PROBE_N_CTX, n_ubatch=PROBE_N_CTX,
                                             numba=compiled))
    logits = lctx.decode(Batch.from_tokens(prompt, all_outputs=True))
    if logits.shape != (len(prompt), n_vocab):
        raise AssertionError(f"logits of shape {logits.shape} for {len(prompt)} tokens, n_vocab {n_vocab}")
    for i in range(PROBE_N_DECODE):
        tok = int(np.argmax(logits[-1]))
        model.tokenizer.token_to_piece(tok)          # what generate() does with each chosen token
        logits = lctx.decode(Batch.from_tokens([tok], pos0=len(prompt) + i))
        if logits.shape != (1, n_vocab):
            raise AssertionError(f"logits of shape {logits.shape} for one token, n_vocab {n_vocab}")


_warmed: set[bool] = set()         # the kernel paths (compiled or not) warm_up has run in this process


def warm_up(compiled: bool = True) -> None:
    """Load and run the seed model once per process and kernel path, outside any case's time and memory:
    the first forward pass loads (or compiles) the numba kernels, which is not the case's cost. The numpy
    path compiles nothing: either path's warm-up (its imports, first allocations) serves it."""
    if compiled in _warmed or (not compiled and _warmed):
        return
    from ggml_dist.model.model import LlamaModel
    with tempfile.TemporaryDirectory(prefix="gguf-fuzz-warm-") as d:
        model = LlamaModel.load(seed_file(os.path.join(d, "seed.gguf")))
        forward_probe(model, model.tokenizer.encode(PROBE_TEXT), compiled=compiled)
        del model
    _warmed.add(compiled)


def run_case(path: str, case_time_limit: float = 2.0, mem_overhead: int = 64 << 20,
             strict_path: bool = False, compiled: bool = True) -> dict[str, Any]:
    """Load one file, encode PROBE_TEXT and run forward_probe (with the compiled kernels or the numpy
    reference ones); classify the outcome (module docstring).

    Traces memory itself when tracemalloc is not already on. With strict_path an unclear error (one of
    project_errors() whose message does not name the file) is a failure. A compiled case can reach a
    kernel (or a specialisation of one) that the warm-up did not, and numba then compiles it inside the
    case (seconds, and the compiler's memory): a case that compiled and was judged slow or too big on
    that account alone is run once more, now compiled, and that run is its result ("jit_rerun": the
    compiles the first run made; its CPU seconds in "jit_first_elapsed").
    """
    warm_up(compiled)
    if not compiled:
        return _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    try:
        from numba.core import event
    except ImportError:                 # no numba: the compiled path is the numpy one (NUMBA_DEFAULT)
        return _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    with event.install_recorder("numba:compile") as rec:
        res = _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
    n_compiles = sum(1 for _, ev in rec.buffer if ev.is_start)
    if n_compiles and res["kind"] in ("slow", "memory"):
        first = res
        res = _run_case_once(path, case_time_limit, mem_overhead, strict_path, compiled)
        res["jit_rerun"], res["jit_first_elapsed"] = n_compiles, first["elapsed"]
    return res


def _run_case_once(path: str, case_time_limit: float, mem_overhead: int, strict_path: bool,
                   compiled: bool) -> dict[str, Any]:
    from ggml_dist.model.gguf import load_gguf
    from ggml_dist.model.model import LlamaModel

    own = project_errors()
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    size = os.path.getsize(path)
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    stage, outcome, kind, msg = "gguf", "ok", "", ""
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        load_gguf(path)
        stage = "model"
        model = LlamaModel.load(path)
        stage = "encode"
        tokens = model.tokenizer.encode(PROBE_TEXT)          # the vocabulary is usable
        stage = "forward"
        forward_probe(model, tokens, compiled=compiled)      # and so are the weights
        del model
    except own as e:
        kind, msg = type(e).__name__, str(e)
        if path in msg:
            outcome = "clean"
        else:
            outcome = "failure" if strict_path else "unclear"
            kind += " (message does not name the file)"
    except BaseException as e:    # every other exception is a finding
        if isinstance(e, KeyboardInterrupt):
            raise
        outcome, kind, msg = "failure", type(e).__name__, str(e)
    # CPU seconds decide "slow": wall time also counts other processes on a busy machine (a case that
    # really hangs is still killed by the parent after hard_timeout of wall time)
    elapsed, wall = time.process_time() - c0, time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    if started:
        tracemalloc.stop()
    over = peak - base - size
    if outcome != "failure" and elapsed > case_time_limit:
        outcome, kind, msg = "failure", "slow", f"took {elapsed:.2f} CPU s (limit {case_time_limit} s); {msg}"
    if outcome != "failure" and over > mem_overhead:
        outcome, kind, msg = "failure", "memory", f"traced peak {peak - base} B for a {size} B file; {msg}"
    return {"outcome": outcome, "kind": kind, "msg": msg[:500], "stage": stage, "elapsed": elapsed, "wall": wall,
            "peak_over_file": over}


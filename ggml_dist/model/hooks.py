"""What a model context asks of the pipeline it runs on: one typed interface (PipelineHooks), which the
runtime hands the context (workers/driver.py's DriverPipeline implements it); in one process there is
none. model/ never imports workers/.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from ..backends.base import Backend, BufferType
from ..core.graph import Graph
from ..core.tensor import Tensor
from ..scheduler.sched import Sched
from .sampling import RowSampling


class PipelineHooks(Protocol):
    """What a context asks of the pipeline it runs on, in one place (workers/driver.py's DriverPipeline).
    The backend protocol knows devices only: where a layer lives, what a stage returns, where a token is
    chosen and how a lost stage comes back are the pipeline's.

    backends                    one per stage, then the host's (the last: the scheduler's fallback)
    n_copies, max_inflight      input copy slots, and micro-batches in flight (more than the slots where
                                the stages take their inputs by value)
    weights                     the model's weights bound to their stage's buffer type (the scheduler's
                                weight rule sends each layer's ops to its stage)
    layer_buft(il)              the buffer type of layer il's KV cache (or its recurrent state's rows)
    state_op(buft, op)          a row operation on the recurrent state rows in buft (model/recurrent_state.py),
                                sent with the next call of the stage that holds them, applied before it computes
    after_alloc(sched, graph)   after each allocation: the stages' exports of that graph
    sample(t, rows, keep)       where the tokens of t's rows (t: the logits; rows: RowSampling) are chosen,
                                the one place that decides it: True, the stage that computes t, at its
                                next compute, which returns t too only if keep; False where t is not a
                                stage's (the context chooses here, from the fetched logits)
    fetch_tokens(t)             after that compute: the fetch of the tokens it chose
    feed(t, fetch) -> bool      the next compute that copies in graph input t takes it from fetch (a token
                                a stage chose) where it runs; False: the context sets t itself.
                                feed(t, None) withdraws an unused feed (True if there was one)
    restore                     brings lost stages back (recovery); None: the context is not recoverable
    """
    backends: list[Backend]
    n_copies: int
    max_inflight: int
    weights: dict[str, Tensor]
    restore: Callable[[], None] | None

    def layer_buft(self, il: int) -> BufferType: ...
    def state_op(self, buft: BufferType, op: tuple) -> None: ...
    def after_alloc(self, sched: Sched, graph: Graph) -> None: ...
    def sample(self, t: Tensor, rows: list[RowSampling], keep_logits: bool) -> bool: ...
    def fetch_tokens(self, t: Tensor) -> Callable[[], np.ndarray]: ...
    def feed(self, t: Tensor, fetch: Callable[[], np.ndarray] | None) -> bool: ...

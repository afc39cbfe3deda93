"""A tensor-parallel group of K ranks as threads of one process (issue 54): each rank a model context of
its own (LlamaContext with its slice of the weights, its heads' KV cache, its CPU backend and graph
allocator) whose ALL_GATHER nodes exchange through an in-process collective (backends/collective.py).

Every rank decodes the same batch, in its own thread, and every rank ends with the whole logits (the
head's last exchange gathers them): the group's result is rank 0's. This is the shape a rank takes
anywhere: in another process its collective is workers/collective.py's socket mesh, and nothing else
changes.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import numpy as np

from ..backends import host
from ..backends.collective import Collective, ThreadGroup
from .context import ContextParams, LlamaContext
from .model import LlamaModel
from .tensor_parallel import TensorParallelBuilder, check_split, rank_hparams, rank_weights
from .ubatch import Batch


@dataclass
class RankParams(ContextParams):
    """A rank's context parameters: the context's, and the collective its backend's ALL_GATHER uses."""
    collective: Collective | None = None

    def compute_options(self) -> host.HostOptions:
        return replace(super().compute_options(), collective=self.collective)


class RankContext(LlamaContext):
    """One rank's model context: the model's file and tokenizer, its own hparams (heads), weights (rows),
    KV cache (its kv heads) and graphs (TensorParallelBuilder)."""

    def __init__(self, model: LlamaModel, params: ContextParams, collective: Collective) -> None:
        size = collective.size
        check_split(model.hp, size)
        self.rank = collective.rank
        self.builder_type = partial(TensorParallelBuilder, size=size)
        rank_model = replace(model, hp=rank_hparams(model.hp, size),
                             weights=rank_weights(model.weights, model.hp, collective.rank, size))
        fields = {f: getattr(params, f) for f in params.__dataclass_fields__}
        super().__init__(rank_model, RankParams(**fields, collective=collective))


class ThreadedTensorParallel:
    """K ranks in K threads of this process; decode(batch) runs the batch on them all and returns the
    logits (rank 0's; every rank has the same). A rank that fails closes the group, so the others fail
    at their next exchange instead of waiting; the group is not usable after."""

    def __init__(self, model: LlamaModel, size: int, params: ContextParams | None = None,
                 timeout: float = 120.0) -> None:
        check_split(model.hp, size)
        self.collectives = ThreadGroup(size, timeout).ranks()
        # one thread per rank, for good: a rank's bound graphs replay fastest on the thread that bound them
        self.threads = [ThreadPoolExecutor(1, thread_name_prefix=f"tp-rank{r}") for r in range(size)]
        params = params or ContextParams()
        self.ranks: list[RankContext] = self._on_all(lambda r: RankContext(model, params, self.collectives[r]))

    @property
    def size(self) -> int:
        return len(self.ranks)

    def decode(self, batch: Batch) -> np.ndarray:
        return self.decode_all(batch)[0]

    def decode_all(self, batch: Batch) -> list[np.ndarray]:
        """Every rank's logits of the batch (equal, bit for bit: a test's view of the exchange)."""
        return self._on_all(lambda r: self.ranks[r].decode(batch))

    def clear(self) -> None:
        self._on_all(lambda r: self.ranks[r].clear())

    def _on_all(self, fn):
        futures: list[Future] = [pool.submit(self._guarded, fn, r) for r, pool in enumerate(self.threads)]
        return [f.result() for f in futures]

    def _guarded(self, fn, r: int):
        try:
            return fn(r)
        except BaseException:
            self.collectives[r].close()
            raise

    def close(self) -> None:
        for c in self.collectives:
            c.close()
        for pool in self.threads:
            pool.shutdown(wait=True)

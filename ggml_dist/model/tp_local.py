"""A tensor-parallel group of K ranks as threads of one process (issue 54): each rank a model context of
its own (RankContext: LlamaContext with its slice of the weights, its heads' KV cache, its CPU backend
and graph allocator) whose ALL_GATHER nodes exchange through an in-process collective
(backends/collective.py).

    TensorParallelContext(model, K, params)     rank 0, the context the caller uses (a LlamaContext:
                                                generate, the decode loop and the server take it as it
                                                is), with ranks 1..K-1 following it on their own threads

Every call that changes the KV cells (submit, seq_rm, seq_cp, seq_swap, clear) runs on every rank, the
same call with the same batch, so their cells stay the same cell for cell; every rank ends a ubatch
with the whole logits (the head's last exchange gathers them) and the caller reads rank 0's. In another
process a rank's collective is workers/collective.py's socket mesh, and nothing else changes.

Recovery (max_recoveries > 0: ranks that are Ray actors): the group keeps a log of the calls that made
its KV cells (each submit's batch as the followers got it, each seq_rm/cp/swap; clear empties it). A
call that fails by the collective (a rank lost: killed, its host gone) makes new followers and a new
collective (rank 0 stays, its backend's collective pointed at the new group: GroupHandle), clears every
rank, replays the log, and runs the call again. The kernels give the same bits for the same ubatches in
the same order, so every rank's KV shard is what it was, and the tokens are the ones without the loss.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import Any, Protocol

import numpy as np

from ..backends import host
from ..backends.collective import Collective, CollectiveError, ThreadGroup
from .context import ContextParams, LlamaContext, PendingLogits
from .hooks import PipelineHooks
from .kv_cache import ContextFullError
from .model import LlamaModel
from .sampling import RowSampling
from .tensor_parallel import TensorParallelBuilder, check_split, rank_model
from .ubatch import Batch, BatchError

# refusals: raised by checks of a call against the KV cells, which are the same on every rank, so every
# rank refuses the same call at the same point and the group stays usable
REFUSALS = (BatchError, ContextFullError)
KEEP_CHOSEN = 64         # a follower that chooses its tokens keeps its last submits' choices for this many steps


@dataclass
class RankParams(ContextParams):
    """A rank's context parameters: the context's, and the collective its backend's ALL_GATHER uses."""
    collective: Collective | None = None

    def compute_options(self) -> host.HostOptions:
        return replace(super().compute_options(), collective=self.collective)


class RankContext(LlamaContext):
    """One rank's model context: the model's file and tokenizer, its own hparams (heads), weights (rows),
    KV cache (its kv heads) and graphs (TensorParallelBuilder)."""

    def __init__(self, model: LlamaModel, params: ContextParams, collective: Collective,
                 pipeline: PipelineHooks | None = None) -> None:
        """pipeline: the hooks of this rank's pipeline of stages (workers/tp_stages.py), whose stage
        actors hold its rows and exchange among a stage's ranks; None: computed here."""
        size = collective.size
        check_split(model.hp, size)
        self.rank = collective.rank
        self.collective = collective
        self.builder_type = partial(TensorParallelBuilder, size=size, rank=collective.rank)
        sliced = rank_model(model, collective.rank, size)
        own = {f.name: getattr(params, f.name) for f in fields(ContextParams)}
        super().__init__(sliced, RankParams(**own, collective=collective), pipeline)
        self.chosen: OrderedDict[int, PendingLogits] = OrderedDict()   # _submit_choosing's steps, by number


class Follower(Protocol):
    """A rank r > 0 that follows rank 0 (a thread here, or a process: workers/tp_ranks.py). One whose
    context runs on a pipeline of stages (workers/tp_stages.py) chooses its own tokens (chooses_tokens):
    its last stage samples the same bits as rank 0's, and feeds them to its first stage as rank 0's does."""
    chooses_tokens: bool

    def call(self, fn: Callable[[RankContext], Any]) -> Future: ...   # fn(its context), in call order
    def ready(self) -> None: ...                                      # its context is built
    def close(self) -> None: ...


# a group's ranks: rank 0's collective (its context is the caller's) and the followers (which build theirs)
RankGroup = Callable[[LlamaModel, ContextParams], "tuple[Collective, list[Follower]]"]


def thread_ranks(size: int, timeout: float = 120.0) -> RankGroup:
    """Ranks 1..size-1 on threads of this process, exchanging through a ThreadGroup."""
    def make(model: LlamaModel, params: ContextParams) -> tuple[Collective, list[Follower]]:
        collectives = ThreadGroup(size, timeout).ranks()
        return collectives[0], [ThreadFollower(model, params, c) for c in collectives[1:]]
    return make


class ThreadFollower:
    """Rank r > 0 and its thread (for good: a rank's bound graphs replay fastest on the thread that
    bound them), its context made there by make (default: computed here, on its rows)."""
    chooses_tokens = False

    def __init__(self, model: LlamaModel, params: ContextParams, collective: Collective,
                 make: Callable[[], RankContext] | None = None) -> None:
        self.thread = ThreadPoolExecutor(1, thread_name_prefix=f"tp-rank{collective.rank}")
        self.collective = collective
        self.ctx: Future[RankContext] = self.thread.submit(make or partial(RankContext, model, params, collective))

    def call(self, fn: Callable[[RankContext], Any]) -> Future:
        return self.thread.submit(self._guarded, fn)

    def ready(self) -> None:
        self.ctx.result()

    def close(self) -> None:
        self.thread.shutdown(wait=True)

    def _guarded(self, fn: Callable[[RankContext], Any]) -> Any:
        try:
            return fn(self.ctx.result())
        except REFUSALS:
            raise
        except BaseException:
            self.collective.close()         # the other ranks fail at their next exchange, not wait on
            raise


def _submit_choosing(batch: Batch, sampling: list[RowSampling] | None, embeddings: bool, step: int,
                     source: int | None, r: RankContext) -> None:
    """A follower's part of submit step `step` where it chooses its own tokens: its submit of step
    `source` gives this batch's tokens, as rank 0's does to rank 0's."""
    tokens_from = None
    if source is not None:
        tokens_from = r.chosen.get(source)
        if tokens_from is None:
            raise BatchError(f"tensor-parallel rank {r.rank}: step {source}'s tokens are no longer kept")
    out = r.submit(batch, sampling, keep_logits=sampling is None, embeddings=embeddings, tokens_from=tokens_from)
    if sampling is not None:
        r.chosen[step] = out
        while len(r.chosen) > KEEP_CHOSEN:
            r.chosen.popitem(last=False)


def _rank_call(name: str, args: tuple, r: RankContext) -> Any:
    """A follower's part of a call: the same LlamaContext method with the same arguments."""
    return getattr(r, name)(*args)


class GroupHandle:
    """The collective rank 0's backend exchanges through: the group's current one (recovery replaces it)."""

    def __init__(self, group: Collective) -> None:
        self.group, self.rank, self.size = group, group.rank, group.size

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        return self.group.all_gather(part)

    def close(self) -> None:
        self.group.close()


class TensorParallelContext(RankContext):
    """Rank 0 of K in this process, the others following it on their threads (module docstring).
    A call every rank refuses (REFUSALS) is refused; a rank that fails otherwise closes the group, so
    the others fail at their next exchange instead of waiting; the group is then made anew where
    max_recoveries allows (module docstring), else it is not usable after."""

    def __init__(self, model: LlamaModel, size: int, params: ContextParams | None = None,
                 timeout: float = 120.0, ranks: RankGroup | None = None, max_recoveries: int = 0,
                 pipeline: PipelineHooks | None = None) -> None:
        """ranks: where ranks 1..size-1 run (default: threads of this process); max_recoveries: how many
        times a group that lost a rank is made anew (module docstring); pipeline: rank 0's pipeline of
        stages (workers/tp_stages.py: every rank's context on its own)."""
        check_split(model.hp, size)
        params = params or ContextParams()
        if params.background_compile:       # every rank would start its own; the compiled kernels serve all
            params = replace(params, background_compile=False)
        self.make_ranks = ranks or thread_ranks(size, timeout)
        own, self.followers = self.make_ranks(model, params)
        if own.size != size:
            raise ValueError(f"a group of {own.size} ranks for --tensor-parallel {size}")
        super().__init__(model, params, GroupHandle(own), pipeline)
        self.group_params, self.max_recoveries, self.n_recoveries = params, max_recoveries, 0
        self.own_tokens = bool(self.followers) and all(f.chooses_tokens for f in self.followers)
        if self.own_tokens and max_recoveries:
            raise ValueError("a group whose ranks choose their own tokens keeps no log to replay")
        self.n_submits = 0
        self.log: list[tuple[str, tuple]] = []      # the calls that made the KV cells, to replay
        for f in self.followers:
            f.ready()

    @property
    def size(self) -> int:
        return self.collective.size

    def _with_followers(self, own: Callable[[], Any], theirs: Callable[[RankContext], Any]) -> Any:
        """_call, made again on a new group where one lost a rank (max_recoveries)."""
        while True:
            try:
                return self._call(own, theirs)
            except CollectiveError:
                if self.n_recoveries >= self.max_recoveries:
                    raise
            self._recover()

    def _recover(self) -> None:
        """New followers and collective, every rank cleared, the log replayed (module docstring)."""
        self.n_recoveries += 1
        for f in self.followers:
            f.close()
        assert isinstance(self.collective, GroupHandle)
        self.collective.close()
        group, self.followers = self.make_ranks(self.model, self.group_params)
        self.collective.group = group
        for f in self.followers:
            f.ready()
        log, self.log = self.log, []
        self._call(lambda: LlamaContext.clear(self), lambda r: r.clear())
        for name, args in log:
            self._call(partial(getattr(LlamaContext, name), self, *args), partial(_rank_call, name, args))

    def _call(self, own: Callable[[], Any], theirs: Callable[[RankContext], Any]) -> Any:
        """own() on this thread while every follower runs theirs(its context); own's result."""
        futures = [f.call(theirs) for f in self.followers]
        try:
            out = own()
        except REFUSALS:
            for fut in futures:
                fut.exception()             # each refused the same call
            raise
        except BaseException:
            self.collective.close()
            raise
        for fut in futures:
            fut.result()
        return out

    def submit(self, batch: Batch, sampling: list[RowSampling] | None = None, keep_logits: bool = True,
               embeddings: bool = False, tokens_from: PendingLogits | None = None) -> PendingLogits:
        """LlamaContext.submit on every rank; rank 0 samples. A follower takes tokens_from's tokens as
        the batch's (they are chosen: a context in this process computes as it submits), or, where the
        followers choose their own (pipelines of stages), samples as rank 0 and takes its own submit's."""
        step, self.n_submits = self.n_submits, self.n_submits + 1
        own = partial(super().submit, batch, sampling, keep_logits, embeddings, tokens_from)
        if self.own_tokens:
            source = None if tokens_from is None else getattr(tokens_from, "tp_step", None)
            if tokens_from is not None and source is None:
                raise BatchError("tokens_from: not a submit of this tensor-parallel group")
            out = self._with_followers(own, partial(_submit_choosing, batch, sampling, embeddings, step, source))
            out.tp_step = step
            return out
        theirs = batch
        if tokens_from is not None:
            theirs = replace(batch, tokens=np.asarray(tokens_from.tokens(), np.int32))
        out = self._with_followers(own, lambda r: r.submit(theirs, embeddings=embeddings))
        self._logged("submit", theirs, None, True, embeddings)
        return out

    def _logged(self, name: str, *args: Any) -> None:
        if self.max_recoveries:
            self.log.append((name, args))

    def _on_all(self, name: str, *args: Any) -> None:
        """LlamaContext.name(*args) on every rank, logged."""
        self._with_followers(partial(getattr(LlamaContext, name), self, *args), partial(_rank_call, name, args))
        self._logged(name, *args)

    def seq_rm(self, seq_id: int, p0: int = 0, p1: int = -1) -> None:
        self._on_all("seq_rm", seq_id, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        self._on_all("seq_cp", src, dst, p0, p1)

    def seq_swap(self, a: int, b: int) -> None:
        self._on_all("seq_swap", a, b)

    def clear(self) -> None:
        self._with_followers(lambda: LlamaContext.clear(self), lambda r: r.clear())
        self.log.clear()

    def close(self) -> None:
        """Leave the group and end the followers' threads."""
        self.collective.close()
        for f in self.followers:
            f.close()

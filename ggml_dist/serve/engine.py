"""Continuous batching over one LlamaContext (llama.cpp server's slots and update_slots).

    submit(request)   -> the admission queue (bounded: QueueFull past max_queue)
    engine thread, each turn:
        1. reap     sequences that are cancelled and not in flight free their slot
        2. admit    queued requests take free slots; the slot index is the KV sequence id. With a KV
                    stream per slot a finished request's tokens stay in its stream, and a prompt that
                    starts with them takes that slot and skips them (cache_prompt: _take_slot); busy
                    slots are then packed at the bottom (_compact)
        3. fill     while fewer than `depth` micro-batches are in flight and some sequences are idle,
                    submit a micro-batch: one token per decoding sequence, then prompt chunks (with a
                    KV stream per slot, short prompts one token per step beside decodes: _short_chunk)
        4. collect  wait for the oldest micro-batch; take each output row's token (chosen where the logits
                    are, the last stage on a pipeline; on the driver when penalties need the history),
                    stream the text

On a pipeline of K stages the active sequences fall into K groups, and a group is sent again as soon
as its logits are back, so stage k works on one group while stage k+1 works on another (vLLM's
max_concurrent_batches). With lookahead > 1 (and plain stage calls, which take result handles) a
group's next step is queued before its tokens are back, `lookahead` steps of a group in flight (`depth`
= K x lookahead, at most 4): its tokens come from the last stage (submit(tokens_from=): _follow_up), so
the engine thread is not between the last stage and the first (step-major: _follow_up). Not the default:
8 clients over 2 testbed hosts gave 27.0 tok/s with it, 31.3 without (docs/api.md).
A sequence that stops while a step of it is still in flight is finished at once; that step's row for it
is ignored. In one process depth is 1 and
every idle sequence shares one batch. A sequence's micro-batches are queued in position order, so its
KV writes happen in order. Every slot owns n_ctx / n_parallel cells of the cache, as in llama-server:
in one process a KV stream of its own (kv_unified=False, llama-server's default with an explicit
--parallel), so a step's attention is one product per sequence over that sequence's cells; a micro-batch
lists its sequences in slot order, so that consecutive slots form one ubatch (split_equal(sequential)).
On a pipeline the slots share one stream by default: its micro-batches hold different slot groups, so
different stream ranges and graph shapes, and a finished slot leaves a gap (the stages hold the cache:
sequences are not moved). 8 clients over 2 stages measured 65-69 tok/s with a stream per slot against
84-105 with one shared stream.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

import numpy as np

from ..model.context import MAX_GRAPHS, ContextParams, LlamaContext, PendingLogits
from ..model.generate import TextStream
from ..model.model import LlamaModel
from ..model.sampling import Sampler, SamplingParams
from ..model.tokenizer import Tokenizer
from ..model.ubatch import Batch
from ..runtime import RunConfig, Runtime, open_runtime, runs_on_ray
from .metrics import Metrics
from .stop import StopMatcher

TRICKLE = 16        # with a KV stream per slot, prompts with at most this many tokens left trickle in
                    # beside decoding sequences (Engine._short_chunk)


class QueueFull(RuntimeError):
    """The admission queue holds max_queue requests already."""


class NotReady(RuntimeError):
    """The model (or a stage actor) is still loading, or failed to load."""


# -- requests and their events -----------------------------------------------------------------------

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


class ServingEngine(Protocol):
    """What the app and the server use of an engine: an Engine in this process, or a ReplicaSet of engine
    processes (serve.replicas). Embeddings are an Engine's only: the app refuses them with replicas."""
    cfg: EngineConfig
    metrics: Metrics
    n_ctx_slot: int
    ready: threading.Event
    load_error: str | None

    def start(self) -> Self: ...
    def wait_ready(self, timeout: float | None = None) -> None: ...
    def abort(self, message: str) -> None: ...
    def shutdown(self) -> None: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def submit(self, req: Request) -> None: ...
    def cancel(self, req: Request) -> None: ...
    def queue_length(self) -> int: ...
    def n_running(self) -> int: ...
    def health(self) -> dict[str, float]: ...
    def status(self) -> dict[str, float]: ...
    def stage_busy(self) -> list[float]: ...


@dataclass(eq=False)
class Sequence:
    req: Request
    slot: int
    sampler: Sampler
    stream: TextStream
    stop: StopMatcher
    history: list[int]                      # prompt, then generated tokens (for repeat penalty)
    n_past: int = 0                         # tokens already in the KV cache
    n_gen: int = 0
    n_flight: int = 0                       # micro-batches in flight that hold it
    done: bool = False                      # finished: rows of it still in flight are ignored
    t_last: float | None = None             # when the previous token was emitted
    logprobs: list = field(default_factory=list)   # TokenLogprobs not yet sent (with the next event)
    constraint: Any = None                  # serve/grammar.Constraint when the request has a grammar
    index: int = 0                          # the request's choice this sequence makes
    parent: Sequence | None = None          # choice > 0: waits for choice 0's prompt, then copies it
    children: list = field(default_factory=list)   # choice 0: the choices waiting for its prompt
    n_cached: int = 0                       # prompt tokens its slot's cache held at admission

    @property
    def prefilling(self) -> bool:
        return self.n_past < len(self.req.prompt)

    @property
    def in_flight(self) -> bool:
        return self.n_flight > 0


@dataclass(slots=True)
class MicroBatch:
    pending: PendingLogits
    parts: list[tuple[Sequence, int, bool]]     # (sequence, tokens it put in, has an output row)
    sampled: bool = False                       # tokens chosen where the logits are (no penalties)
    keep: bool = False                          # with its logits
    followed: bool = False                      # its group's next step is queued (fed its tokens)
    scored: bool = False                        # one scoring sequence's prompt chunk, every row an output


# -- engine ------------------------------------------------------------------------------------------

@dataclass(slots=True)
class EngineConfig:
    model_path: str
    n_stages: int = 1                       # 0: auto, the fewest stages that fit the cluster's nodes
    address: str | None = None
    n_parallel: int = 4
    n_ctx: int = 2048
    n_batch: int = 512
    max_queue: int = 64
    threads_per_stage: int = 1
    n_copies: int | None = None             # micro-batches in flight on a pipeline (default: 2 x stages, <= 4)
    stage_calls: str = "auto"               # Pipeline.launch(calls=...): compiled graph or plain calls
    lookahead: int = 1                      # a group's steps in flight over stages (> 1: token feedback)
    chat_template: str | None = None        # Jinja source overriding the GGUF's tokenizer.chat_template
    kv_unified: bool | None = None          # one KV stream shared by the slots, or one per slot
                                            # (None: per slot in one process, shared on a pipeline)
    cache_prompt: bool = True               # a finished request's tokens stay in its slot's stream, and
                                            # a prompt starting with them reuses them (KV stream per slot)
    n_replicas: int = 1                     # engine processes sharing the slots (serve.replicas)
    pooling: str | None = None              # /v1/embeddings: "mean", "last" or "cls" (llama-server's
                                            # --pooling; the files we load carry pooling type none);
                                            # "none": /embedding's every token's row, not normalized
    request_defaults: tuple[tuple[str, int | float], ...] = ()   # llama-server's --temp, --seed and
                                            # --n-predict: what a request that does not set them takes
                                            # (temperature, seed, n_predict; applied by app.py)
    batch_invariant: bool = False           # --deterministic: a sequence's logits do not depend on the
                                            # steps it shares, the prompt cache or the chunking
                                            # (ContextParams.batch_invariant)

    def __post_init__(self) -> None:
        if self.pooling not in (None, "mean", "last", "cls", "none"):
            raise ValueError(f"--pooling must be mean, last, cls or none, got {self.pooling!r}")
        if not 1 <= self.n_parallel <= 64:
            raise ValueError(f"--parallel must be 1..64 (KV sequence ids), got {self.n_parallel}")
        if self.n_ctx // self.n_parallel < 8:
            raise ValueError(f"--ctx {self.n_ctx} over --parallel {self.n_parallel} leaves "
                             f"{self.n_ctx // self.n_parallel} cells per slot; raise --ctx")
        if self.kv_unified is None:
            self.kv_unified = runs_on_ray(self.n_stages, self.address) and not self.batch_invariant
        if not 1 <= self.n_replicas <= self.n_parallel:
            raise ValueError(f"--replicas must be 1..--parallel ({self.n_parallel}), got {self.n_replicas}")
        if self.n_replicas > 1 and runs_on_ray(self.n_stages, self.address):
            raise ValueError("--replicas runs engines side by side in one machine; it does not combine "
                             "with a pipeline (--stages > 1 or --address)")
        if self.n_stages < 0 or self.max_queue < 0:
            raise ValueError(f"--stages must be >= 1 (or auto) and the queue bound >= 0 "
                             f"({self.n_stages}, {self.max_queue})")
        if self.n_stages == 0 and self.address is None:
            raise ValueError("--stages auto places the model on a cluster's nodes: give --address")
        if self.lookahead < 1:
            raise ValueError(f"--lookahead must be >= 1, got {self.lookahead}")
        # where a sequence's cells sit changes the attention's order (a shared stream interleaves them):
        # the mode needs a stream per slot, also over a pipeline
        if self.batch_invariant and self.kv_unified:
            raise ValueError("--deterministic needs a KV stream per slot: drop --kv-unified on (in a shared "
                             "stream a sequence's cells sit wherever they were free, which changes its bits)")


class Engine:
    def __init__(self, cfg: EngineConfig, metrics: Metrics | None = None,
                 collecting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        # entered on the engine thread around each micro-batch's collection, where sampling posts the
        # step's events: a replica sends them as one message (serve.replicas)
        self.collecting = collecting
        self.n_ctx_slot = cfg.n_ctx // cfg.n_parallel
        self.model: LlamaModel | None = None
        self.ctx: LlamaContext | None = None
        self.runtime: Runtime | None = None     # this process, or a Ray pipeline (runtime.open_runtime)
        self.depth = 1                          # micro-batches in flight
        self.n_groups = 1                       # micro-batches the active sequences fall into
        self.lookahead = 1                      # steps of a group in flight
        self.n_fed = 0                          # steps queued before their tokens were back
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.busy_s = 0.0                       # in-process compute time (one stage)
        self._queue: collections.deque[Request] = collections.deque()
        self._jobs: collections.deque = collections.deque()     # (prompt, Future): embeddings
        self._cv = threading.Condition()
        self._slots: list[Sequence | None] = [None] * cfg.n_parallel
        self._cached: list[list[int]] = [[] for _ in range(cfg.n_parallel)]   # a free slot's KV tokens
        self._in_flight: collections.deque[MicroBatch] = collections.deque()
        self._stopping = False
        self._abort: str | None = None          # abort(): end every request with this error, next turn
        self._next_slot = 0                     # round-robin start when filling micro-batches
        self._thread = threading.Thread(target=self._run, name="ggml-dist-engine", daemon=True)

    # -- life cycle (any thread) ------------------------------------------------------------------------
    def start(self) -> Self:
        self._thread.start()
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout) or self.load_error:
            raise NotReady(self.load_error or f"the model did not load within {timeout} s")

    def abort(self, message: str) -> None:
        """End every queued and running request at the engine's next turn with an error event carrying
        message (a graceful shutdown's end, once its grace is over); the engine keeps running."""
        with self._cv:
            self._abort = message
            self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=30)
        if self.runtime is not None:
            self.runtime.shutdown()

    @property
    def tokenizer(self) -> Tokenizer:
        if self.model is None:
            raise NotReady(self.load_error or "the model is still loading")
        return self.model.tokenizer

    # -- requests (event-loop thread) -------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        if not self.ready.is_set() or self.load_error:
            raise NotReady(self.load_error or "the model is still loading; retry when /health is ok")
        assert 0 < len(req.prompt) < self.n_ctx_slot, "the app checks the prompt against the slot size"
        with self._cv:
            n_idle = sum(s is None for s in self._slots)
            if len(self._queue) >= self.cfg.max_queue + n_idle:
                raise QueueFull(f"{len(self._queue)} requests queued and {self.cfg.n_parallel} "
                                f"running; retry later")
            self._queue.append(req)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    def queue_length(self) -> int:
        return len(self._queue)

    def cached_cells(self) -> int:
        """KV cells that free slots keep for a later prompt (cache_prompt)."""
        return sum(len(c) for c in self._cached)

    def n_running(self) -> int:
        return sum(s is not None for s in self._slots)

    def health(self) -> dict[str, float]:
        """Whether a lost stage is being recovered, and how many were: cheap, for /health."""
        ctx = self.ctx
        return {"recovering": float(bool(ctx and ctx.recovering)),
                "recoveries": ctx.n_recoveries if ctx else 0}

    def status(self) -> dict[str, float]:
        """KV and recovery figures for /metrics (zeros before the model has loaded)."""
        ctx = self.ctx
        return {**self.health(), "kv_cells_used": ctx.kv.cells.used if ctx else 0,
                "kv_cells_cached": self.cached_cells(),
                "kv_cells_total": ctx.kv.kv_size * ctx.kv.n_stream if ctx else 0,
                "replayed_tokens": ctx.n_replayed_tokens if ctx else 0, "fed_steps": self.n_fed}

    def stage_busy(self) -> list[float]:
        """Compute seconds per stage (the engine's own in one process); the last known figures while a
        stage is unreachable."""
        if self.runtime is None or not self.runtime.distributed:
            return [self.busy_s]
        try:
            self._stage_busy = [float(st["compute_s"]) for st in self.runtime.stats()]
        except Exception:  # noqa: BLE001 - a stage is down: metrics must still answer
            pass
        return list(getattr(self, "_stage_busy", []))

    # -- engine thread ----------------------------------------------------------------------------------
    def _load(self) -> None:
        cfg = self.cfg
        assert cfg.kv_unified is not None, "EngineConfig.__post_init__ chooses kv_unified"
        params = ContextParams(n_ctx=cfg.n_ctx, n_batch=cfg.n_batch, n_ubatch=cfg.n_batch,
                               n_seq_max=cfg.n_parallel, kv_unified=cfg.kv_unified, background_compile=True,
                               batch_invariant=cfg.batch_invariant)
        # a pipeline's stage actors have mapped their weights when it returns
        rt = self.runtime = open_runtime(RunConfig(
            cfg.model_path, params, cfg.n_stages or None, cfg.address, threads=cfg.threads_per_stage,
            n_copies=cfg.n_copies or (min(4, cfg.lookahead * cfg.n_stages) or None), stage_calls=cfg.stage_calls,
            label="ggml-dist serve"))
        self.model, self.ctx = rt.model, rt.ctx
        self.depth = rt.depth
        self.n_groups = min(self.depth, rt.n_stages)
        ahead = min(cfg.lookahead, self.depth // self.n_groups)
        self.lookahead = max(1, ahead) if rt.feeds_tokens() else 1
        # one token through every stage: compiles kernels and plans before the first request
        self.ctx.decode(Batch.from_tokens([self.model.tokenizer.bos_id or 0]))
        self.ctx.seq_rm(0)
        if not rt.distributed and not cfg.kv_unified:
            self._warm_step_shapes()

    def _warm_step_shapes(self) -> None:
        """Decode once with each shape a step of one-token sequences takes (k consecutive streams, j of
        them with an output row: a trickled prompt token has none), so that no request waits while its
        step's graph is built, planned and bound (~45 ms for SmolLM2, each shape once per process: a
        benchmark run of 8 clients built 25 of them in its first 22 s). With a KV stream per slot the
        shapes are fixed by (k, j); over a pipeline or a unified cache n_kv grows with use, so there
        they are not enumerated. Where there would be more than 3/4 of MAX_GRAPHS (past 8 slots), only
        the shapes where every sequence decodes (j = k) are warmed."""
        assert self.ctx is not None and self.model is not None
        P = self.cfg.n_parallel
        shapes = [(k, j) for k in range(1, P + 1) for j in range(k + 1)]
        if len(shapes) > MAX_GRAPHS * 3 // 4:
            shapes = [(k, k) for k in range(1, min(P, MAX_GRAPHS // 2) + 1)]
        t0 = time.perf_counter()
        tok = self.model.tokenizer.bos_id or 0
        for k, j in shapes:
            self.ctx.decode(Batch(np.full(k, tok, np.int32), np.zeros(k, np.int32),
                                  [frozenset({s}) for s in range(k)], np.arange(k) >= k - j))
            for s in range(k):
                self.ctx.seq_rm(s)
        dt = time.perf_counter() - t0
        print(f"ggml-dist serve: {len(shapes)} decode step shapes planned in {dt:.1f} s", file=sys.stderr)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported by /health and to every request, not raised
            self.load_error = f"loading {self.cfg.model_path} failed: {type(e).__name__}: {e}"
            print(f"ggml-dist serve: {self.load_error}", file=sys.stderr)
            self.ready.set()
            return
        self.ready.set()
        while True:
            with self._cv:
                while (not self._stopping and not self._queue and not self._in_flight
                       and not any(self._slots) and not self._jobs and self._abort is None):
                    self._cv.wait()
                if self._stopping:
                    break
                if self._abort is not None:
                    self._abort_all(self._abort)
                    self._abort = None
                self._run_jobs()
                self._reap()
                self._admit()
                self._compact()
            try:
                self._fill()
                if self._in_flight:
                    with self.collecting():
                        self._collect(self._in_flight.popleft())
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the server keeps serving
                self._fail_all(_short_error(e), "".join(traceback.format_exception(e))[-4000:])
        for s in self._slots:
            if s is not None:
                s.n_flight = 0
                self._finish(s, "cancelled")
        while self._jobs:
            self._jobs.popleft()[1].set_exception(NotReady("the server is shutting down"))

    # -- embeddings (a job between steps, in a free slot) ---------------------------------------------
    def embed(self, prompt: list[int]) -> concurrent.futures.Future:
        """The pooled, L2-normalized embedding of a prompt (cfg.pooling), computed by the engine thread
        in a free slot between steps; a Future of float32 [n_embd] ([n_tokens, n_embd] for pooling none)."""
        if not self.ready.is_set() or self.load_error:
            raise NotReady(self.load_error or "the model is still loading; retry when /health is ok")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._jobs.append((prompt, fut))
            self._cv.notify()
        return fut

    def _run_jobs(self) -> None:
        while self._jobs and None in self._slots:
            prompt, fut = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self._embed_now(prompt, self._slots.index(None)))
            except Exception as e:  # noqa: BLE001 - this request fails (the future holds it), not the engine
                fut.set_exception(e)

    def _embed_now(self, prompt: list[int], slot: int) -> np.ndarray:
        """llama-server's embedding: the final norm's rows of every prompt token, pooled (mean, the
        last token's, or the first's), then divided by their Euclidean norm (summed in double)."""
        assert self.ctx is not None and self.cfg.pooling is not None
        if self._cached[slot]:
            self._cached[slot] = []
        self.ctx.seq_rm(slot)
        rows = []
        try:
            for i in range(0, len(prompt), self.cfg.n_batch):
                chunk = prompt[i:i + self.cfg.n_batch]
                b = Batch(np.asarray(chunk, np.int32), np.arange(i, i + len(chunk), dtype=np.int32),
                          [frozenset({slot})] * len(chunk), np.ones(len(chunk), bool))
                rows.append(self.ctx.submit(b, embeddings=True).result())
        finally:
            self.ctx.seq_rm(slot)
        if self.cfg.pooling == "none":             # llama-server's pooling none: each token's row as it is
            return np.concatenate(rows).astype(np.float32)
        e = np.concatenate(rows).astype(np.float64)
        v = {"mean": lambda: e.mean(axis=0), "last": lambda: e[-1], "cls": lambda: e[0]}[self.cfg.pooling]()
        norm = float(np.sqrt((v * v).sum()))
        return (v * (1.0 / norm if norm > 0 else 0.0)).astype(np.float32)

    def _reap(self) -> None:
        if any(r.cancelled for r in self._queue):
            for r in [r for r in self._queue if r.cancelled]:
                self._queue.remove(r)
                r.on_event(Event(finish_reason="cancelled", n_prompt=len(r.prompt)))
        for s in self._slots:
            if s is not None and s.req.cancelled and not s.in_flight:
                self._finish(s, "cancelled")

    def _compact(self) -> None:
        """Keep the busy slots at the bottom: the sequence in the highest busy slot moves into the
        lowest free one, before the step is filled.

        With a KV stream per slot, a ubatch spans consecutive streams (split_equal(sequential)), so
        busy slots 0,1,2 and 4..7 decode as two ubatches, each a graph run with its fixed cost, and
        every such pattern has graph shapes of its own (its stream ranges) to build and plan. Moving a
        sequence copies its stream's K and V (30 layers x 2 x 256 cells x 192 dims f16 for SmolLM2:
        ~6 MB, about a millisecond), once per finished request; where the free slot holds a cached
        prompt, the two streams swap instead (seq_swap, two copies), so the cache moves up and stays.
        One process only: a pipeline's stages hold the cache, and its slots share one stream by default."""
        if self.cfg.kv_unified or self.runtime is None or not self.runtime.moves_sequences:
            return
        assert self.ctx is not None
        while True:
            busy = [k for k, s in enumerate(self._slots) if s is not None]
            free = [k for k, s in enumerate(self._slots) if s is None]
            if not busy or not free or free[0] > busy[-1]:
                return
            src, dst = busy[-1], free[0]
            s = self._slots[src]
            assert s is not None, f"slot {src} is busy but holds no sequence"
            if s.in_flight:
                return
            if self._cached[dst]:
                self.ctx.seq_swap(src, dst)
            else:
                self.ctx.seq_cp(src, dst)
                self.ctx.seq_rm(src)
            self._cached[src], self._cached[dst] = self._cached[dst], []
            s.slot, self._slots[dst], self._slots[src] = dst, s, None

    def _admit(self) -> None:
        """Queued requests take free slots in order; a request of n choices waits for n."""
        while self._queue and sum(s is None for s in self._slots) >= self._queue[0].n:
            req = self._queue.popleft()
            if req.cancelled:
                for i in range(req.n):
                    req.on_event(Event(finish_reason="cancelled", n_prompt=len(req.prompt), index=i))
                continue
            assert self.ctx is not None and self.model is not None
            try:
                constraints = [self._constraint(req.sampling.grammar) if req.sampling.grammar is not None
                               else None for _ in range(req.n)]
            except Exception as e:  # noqa: BLE001 - an invalid grammar: this request fails, not the engine
                for i in range(req.n):
                    req.on_event(Event(finish_reason="error", n_prompt=len(req.prompt), error=_short_error(e),
                                       index=i))
                continue
            slot, n_keep = self._take_slot(req.prompt, reuse=req.prompt_logprobs is None and req.cache_prompt)
            first = self._slots[slot] = self._sequence(req, slot, 0, constraints[0], n_keep)
            first.n_cached = n_keep
            self.metrics.add_prompt(len(req.prompt), n_keep)
            for i in range(1, req.n):           # the other choices take the prompt's cells from choice 0
                slot = next(k for k, q in enumerate(self._slots) if q is None)
                if self._cached[slot]:
                    self.ctx.seq_rm(slot)
                    self._cached[slot] = []
                child = self._slots[slot] = self._sequence(req, slot, i, constraints[i], 0)
                child.parent = first
                first.children.append(child)

    def _sequence(self, req: Request, slot: int, index: int, constraint: Any, n_past: int) -> Sequence:
        """Choice `index` of a request; a seeded request's choice i draws from seed + i."""
        assert self.model is not None
        params = req.sampling
        if index and params.seed is not None:
            params = dataclasses.replace(params, seed=params.seed + index)
        return Sequence(req, slot, Sampler(params), TextStream(self.model.tokenizer), StopMatcher(req.stops),
                        list(req.prompt), n_past=n_past, constraint=constraint, index=index)

    def _constraint(self, grammar: str) -> Any:
        from . import grammar as G
        assert self.model is not None
        tok = self.model.tokenizer
        return G.Constraint(G.tokenizer_of(tok), grammar, tok.n_vocab)

    def _take_slot(self, prompt: list[int], reuse: bool = True) -> tuple[int, int]:
        """A free slot for a prompt and how many of its tokens that slot's cache already holds: the slot
        whose cached tokens share the longest prefix with the prompt (llama-server's cache_prompt), else
        the lowest free slot with nothing cached, else the lowest free slot. The prompt's last token is
        always evaluated again: its logits start the generation. The slot keeps only the kept prefix.
        reuse=False (a prompt to score, whose every row is needed): nothing is kept."""
        assert self.ctx is not None
        free = [k for k, s in enumerate(self._slots) if s is None]
        slot = next((k for k in free if not self._cached[k]), free[0])
        n_keep = 0
        if self.cfg.cache_prompt and reuse:
            for k in free:
                n = _common_prefix(self._cached[k], prompt)
                if n > n_keep:
                    slot, n_keep = k, n
            n_keep = min(n_keep, len(prompt) - 1)
        if self._cached[slot]:                          # a slot without a cache holds no cells
            self.ctx.seq_rm(slot, n_keep, -1)
        self._cached[slot] = []
        assert self.ctx.seq_pos_max(slot) == n_keep - 1, f"slot {slot} holds more than its kept prefix"
        return slot, n_keep

    def _fill(self) -> None:
        """Submit micro-batches until `depth` are in flight or no sequence is idle."""
        assert self.ctx is not None
        n_active = sum(s is not None for s in self._slots)
        per_batch = max(1, math.ceil(n_active / self.n_groups))
        while len(self._in_flight) < self.depth:
            n = len(self._slots)
            idle = [s for k in range(n) if (s := self._slots[(self._next_slot + k) % n]) is not None
                    and not s.in_flight and not s.req.cancelled and s.parent is None]
            if not idle:
                if not self._follow_up():
                    return
                continue
            scoring = next((s for s in idle if s.prefilling and s.req.prompt_logprobs is not None), None)
            if scoring is not None:
                self._submit_scored(scoring)
                continue
            # decoding sequences first (one token each), then prompt chunks in what is left of n_batch;
            # the batch lists them in slot order
            idle.sort(key=lambda s: s.prefilling)
            idle = idle[:per_batch]
            short = self._short_chunk(idle)
            chosen: list[tuple[Sequence, list[int]]] = []
            n_tokens = 0
            for s in idle:
                budget = self.cfg.n_batch - n_tokens
                if budget <= 0:
                    break
                if not s.prefilling:
                    chunk = [s.history[-1]]
                else:
                    left = len(s.req.prompt) - s.n_past
                    chunk = s.req.prompt[s.n_past:s.n_past + min(budget, short if left <= TRICKLE else left)]
                chosen.append((s, chunk))
                n_tokens += len(chunk)
            tokens: list[int] = []
            pos: list[int] = []
            seq_ids: list[frozenset[int]] = []
            output: list[bool] = []
            parts: list[tuple[Sequence, int, bool]] = []
            for s, chunk in sorted(chosen, key=lambda sc: sc[0].slot):
                last = s.n_past + len(chunk) == len(s.history)
                tokens += chunk
                pos += range(s.n_past, s.n_past + len(chunk))
                seq_ids += [frozenset({s.slot})] * len(chunk)
                output += [False] * (len(chunk) - 1) + [last]
                parts.append((s, len(chunk), last))
                s.n_flight += 1
            self._next_slot = (chosen[-1][0].slot + 1) % n
            batch = Batch(np.asarray(tokens, np.int32), np.asarray(pos, np.int32), seq_ids,
                          np.asarray(output, bool))
            # without penalties (which need the history) the choice is made where the logits are: a
            # pipeline's last stage returns token ids only
            outs = [s for s, _, has_out in parts if has_out]
            sampled = bool(outs) and not any(s.sampler.penalized for s in outs)
            # logprobs need the logits, and so do the choices that wait to sample from this prompt's
            keep = any(s.sampler.params.logprobs is not None or s.children for s in outs)
            t0 = time.perf_counter()
            if sampled:
                pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in outs], keep_logits=keep)
                for s in outs:
                    s.sampler.advance()                  # the choice made there is this sampler's
            else:
                pending = self.ctx.submit(batch)
            self.busy_s += time.perf_counter() - t0
            self._in_flight.append(MicroBatch(pending, parts, sampled, keep))

    def _submit_scored(self, s: Sequence) -> None:
        """A scoring sequence's next prompt chunk (at most n_batch tokens) as a step of its own, every row
        an output: its rows are computed as one process's batch of the same tokens is (`ggml-dist
        logits`), whatever the other slots do; beside one-token decodes a ubatch would take the chunk's
        first token with theirs (split_equal), and with it a different reduction order."""
        assert self.ctx is not None
        chunk = s.req.prompt[s.n_past:s.n_past + self.cfg.n_batch]
        batch = Batch.from_tokens(chunk, s.n_past, s.slot, all_outputs=True)
        last = s.n_past + len(chunk) == len(s.history)
        s.n_flight += 1
        t0 = time.perf_counter()
        pending = self.ctx.submit(batch)
        self.busy_s += time.perf_counter() - t0
        self._in_flight.append(MicroBatch(pending, [(s, len(chunk), last)], scored=True))

    def _score_chunk(self, mb: MicroBatch, logits: np.ndarray) -> np.ndarray:
        """A scored chunk's rows: row i gives the logprob of the prompt token after it, sent as the
        chunk's prompt_logprobs event; returns the rows left to sample from (the prompt's last row, if
        the chunk ends the prompt, which scores nothing)."""
        s, n_tokens, last = mb.parts[0]
        p0 = s.n_past                                   # the chunk's first position (not advanced yet)
        targets = s.req.prompt[p0 + 1:p0 + n_tokens + 1]
        if not s.done and not s.req.cancelled:
            assert s.req.prompt_logprobs is not None, "only a scoring request's chunks are scored"
            lps = prompt_logprobs(logits, targets, s.req.prompt_logprobs)
            s.req.on_event(Event(prompt_logprobs=tuple(lps), index=s.index))
        return logits[-1:] if last else logits[:0]

    def _follow_up(self) -> bool:
        """Queue the next step of a group in flight before its tokens are back: the oldest micro-batch
        not followed yet, where every sequence decodes one token chosen where the logits are, and
        wants at least one more. False if there is none.

        Step-major, as generate_parallel: a stage runs its calls in order and a fed call waits at the
        head of its queue for its token, so a group's step right behind its own previous one idles the
        first stage while the later ones compute that one. Hence oldest first, and not behind the newest
        micro-batch while another group has one in flight (which also undoes a group-major queue)."""
        if self.lookahead < 2:
            return False
        assert self.ctx is not None
        newest = self._in_flight[-1] if self._in_flight else None
        mixed = newest is not None and any(m.parts[0][0] not in {s for s, _, _ in newest.parts}
                                           for m in self._in_flight)
        for mb in self._in_flight:
            if mb.followed or not mb.sampled or mb.keep or (mb is newest and mixed) or not all(
                    n == 1 and has_out and self._may_run_ahead(s) for s, n, has_out in mb.parts):
                continue
            seqs = [s for s, _, _ in mb.parts]
            batch = Batch(np.zeros(len(seqs), np.int32), np.array([s.n_past + s.n_flight for s in seqs], np.int32),
                          [frozenset({s.slot}) for s in seqs], np.ones(len(seqs), bool))
            t0 = time.perf_counter()
            pending = self.ctx.submit(batch, sampling=[s.sampler.row() for s in seqs], keep_logits=False,
                                      tokens_from=mb.pending)
            self.busy_s += time.perf_counter() - t0
            for s in seqs:
                s.sampler.advance()
                s.n_flight += 1
            mb.followed = True
            self.n_fed += 1
            self._in_flight.append(MicroBatch(pending, [(s, 1, True) for s in seqs], True))
            return True
        return False

    def _may_run_ahead(self, s: Sequence) -> bool:
        """Whether s may have one more step queued than it has: no grammar, logprobs or choices waiting
        on it, and the token it would choose is still wanted (max_tokens, the slot's context)."""
        return (not s.done and not s.req.cancelled and s.constraint is None and s.parent is None
                and not s.children and s.sampler.params.logprobs is None and s.n_flight < self.lookahead
                and s.n_gen + s.n_flight < s.req.max_tokens and len(s.history) + s.n_flight + 1 < self.n_ctx_slot)

    def _short_chunk(self, batch: list[Sequence]) -> int:
        """Tokens that a short prompt (at most TRICKLE left) puts in this batch.

        With a KV stream per slot, a ubatch takes the same number of tokens from each of a run of
        consecutive sequences (split_equal(sequential)): a prompt chunk beside one-token decodes is
        split off into ubatches of its own, each a graph run with its fixed cost (about a one-token
        step) plus a build and plan when its shape is new (~70 ms). So beside decoding sequences a
        short prompt goes in one token per step, and short prompts starting together take equal
        chunks (the shortest one's length), which keeps each step one ubatch. A prompt longer than
        TRICKLE takes its chunk as before: its own ubatch is cheaper than that many steps."""
        if self.cfg.kv_unified:
            return self.cfg.n_batch                 # split_simple: any mix of chunks is one ubatch
        if any(not s.prefilling for s in batch):
            return 1
        lefts = [len(s.req.prompt) - s.n_past for s in batch]
        return min([n for n in lefts if n <= TRICKLE], default=1)

    def _collect(self, mb: MicroBatch) -> None:
        t0 = time.perf_counter()
        if mb.sampled:
            toks: list[int] | None = mb.pending.tokens()   # one per output row, in batch order
            want = any(s.sampler.params.logprobs is not None or s.children for s, _, has_out in mb.parts
                       if has_out)
            logits = mb.pending.result() if want else None
        else:
            toks, logits = None, mb.pending.result()     # [n_outputs, n_vocab] in batch order
        self.busy_s += time.perf_counter() - t0
        if mb.scored:
            assert logits is not None
            logits = self._score_chunk(mb, logits)
        row = 0
        for s, n_tokens, has_out in mb.parts:
            s.n_flight -= 1
            s.n_past += n_tokens
            if has_out:
                row += 1
                if s.done:                               # stopped while this step was in flight
                    continue
                if s.req.cancelled:
                    if not s.in_flight:                  # else once its last step is back (_reap)
                        self._finish(s, "cancelled")
                    continue
                if s.req.max_tokens == 0:                # score only: the prompt is in, nothing is sampled
                    self._finish(s, "length")
                    continue
                # a row's own failure (its grammar, its sampling) fails its sequence only: the step's
                # other rows are fine, and so are the KV cache and the other slots' cached prompts
                try:
                    if toks is not None:
                        tok = toks[row - 1]
                    else:
                        assert logits is not None
                        allowed = s.constraint.allowed() if s.constraint is not None else None
                        tok = s.sampler.sample(logits[row - 1], s.history, allowed)
                    n_lp = s.sampler.params.logprobs
                    lp = () if n_lp is None or logits is None else (token_logprob(logits[row - 1], tok, n_lp),)
                except Exception as e:  # noqa: BLE001 - this request fails, not the step
                    self._fail_one(s, e)
                    continue
                children, s.children = s.children, []
                # the prompt is in: the other choices take its cells and their first tokens first, as
                # choice 0 may end at once (and free its cells)
                starts = []
                for c in children:
                    try:
                        starts.append((c, *self._start_choice(s, c, logits[row - 1] if logits is not None else None)))
                    except Exception as e:  # noqa: BLE001 - that choice fails, not its request's others
                        self._fail_one(c, e)
                self._accept_or_fail(s, tok, lp)
                for c, ctok, clp in starts:
                    if c.req.cancelled:
                        self._finish(c, "cancelled")
                    else:
                        self._accept_or_fail(c, ctok, clp)

    def _start_choice(self, first: Sequence, c: Sequence, logits: np.ndarray | None) -> tuple[int, tuple]:
        """Choice c > 0 of first's request: the prompt's KV cells join c's sequence (seq_cp; between
        KV streams a copy), and c samples its first token from the same logits, with its own sampler."""
        assert self.ctx is not None and logits is not None
        c.parent = None
        self.ctx.seq_cp(first.slot, c.slot)     # all of first's cells: just the prompt so far
        c.n_past = first.n_past
        allowed = c.constraint.allowed() if c.constraint is not None else None
        tok = c.sampler.sample(logits, c.history, allowed)
        n_lp = c.sampler.params.logprobs
        return tok, () if n_lp is None else (token_logprob(logits, tok, n_lp),)

    def _accept(self, s: Sequence, tok: int, lp: tuple = ()) -> None:
        assert self.model is not None
        now = time.perf_counter()
        if s.t_last is None:
            self.metrics.add_token(now - s.req.t_arrival, None)
        else:
            self.metrics.add_token(None, now - s.t_last)
        s.t_last = now
        if self.model.tokenizer.is_eog(tok):
            self._finish(s, "stop")
            return
        s.history.append(tok)
        s.n_gen += 1
        s.logprobs += lp
        if s.constraint is not None:
            s.constraint.accept(tok)
        text, hit = s.stop.push(s.stream.push(tok))
        if s.constraint is not None and s.constraint.done and not hit:
            self._finish(s, "stop", text)       # the grammar is complete: only an end could follow
        elif hit:
            self._finish(s, "stop", text, flush=False)
        elif s.n_gen >= s.req.max_tokens or len(s.history) >= self.n_ctx_slot:
            self._finish(s, "length", text)
        elif text:
            s.req.on_event(Event(text, logprobs=self._take_logprobs(s), index=s.index))

    @staticmethod
    def _take_logprobs(s: Sequence) -> tuple:
        out, s.logprobs = tuple(s.logprobs), []
        return out

    def _finish(self, s: Sequence, reason: str, text: str = "", flush: bool = True,
                error: str | None = None) -> None:
        """Send the last event and free the slot at once: its cells go back to the cache, or with
        cache_prompt (and a KV stream per slot) they stay as the slot's cached tokens."""
        assert self.ctx is not None
        s.done = True                           # a step of it may still be in flight (_follow_up): its
                                                # row is ignored, its cells freed with the others now
        if s.parent is not None:                # a choice that never started: its prompt is not copied
            if s in s.parent.children:
                s.parent.children.remove(s)
            s.parent = None
        if flush and reason in ("stop", "length"):
            tail, hit = s.stop.push(s.stream.flush())
            text += tail if hit else tail + s.stop.flush()
        if self._caches_prompts() and reason != "error":
            self._cached[s.slot] = s.history[:s.n_past]
            if s.n_flight:                      # cells its queued steps took, past what it evaluated
                self.ctx.seq_rm(s.slot, s.n_past, -1)
        else:
            self.ctx.seq_rm(s.slot)
        self._slots[s.slot] = None
        s.req.on_event(Event(text, reason, len(s.req.prompt), s.n_gen, error, self._take_logprobs(s), s.index,
                             n_cached=s.n_cached))
        for c in list(s.children):              # ended before its prompt was in: so do the others
            self._finish(c, reason if reason == "error" else "cancelled", error=error)

    def _caches_prompts(self) -> bool:
        """A finished request's cells stay under its slot's sequence id, in a stream of its own or in the
        shared one (a pipeline's): a slot's cells, cached or in use, never pass ctx/parallel, so the cache
        always has room for every slot. With a stream per slot the cached tokens sit in position order, as
        a fresh prompt's would; in a shared stream a sequence's cells sit wherever they were free, cached
        or not, so there no run is bit for bit another (see docs/api.md)."""
        return self.cfg.cache_prompt

    def _accept_or_fail(self, s: Sequence, tok: int, lp: tuple) -> None:
        try:
            self._accept(s, tok, lp)
        except Exception as e:  # noqa: BLE001 - its grammar refused the token, say: this sequence fails
            self._fail_one(s, e)

    def _fail_one(self, s: Sequence, e: BaseException) -> None:
        """One sequence failed on its own (sampling, its grammar): it ends with an error event, its slot
        is freed (its cells dropped, not cached); the step and every other sequence carry on."""
        msg = _short_error(e)
        print(f"ggml-dist serve: a request failed (the others carry on): {msg}", file=sys.stderr)
        if not s.done:
            self._finish(s, "error", error=msg)

    def _abort_all(self, msg: str) -> None:
        """abort(): every queued request and running sequence ends with an error event now."""
        while self._queue:
            req = self._queue.popleft()
            for i in range(req.n):
                req.on_event(Event(finish_reason="error", n_prompt=len(req.prompt), error=msg, index=i))
        for s in self._slots:
            if s is not None and not s.done:
                self._finish(s, "error", error=msg)

    def _fail_all(self, msg: str, detail: str = "") -> None:
        """A step itself failed (its compute, a stage beyond recovery): the KV cache may hold half its
        writes, so every sequence in it, and every cached prompt, goes. A single row's failure does not
        come here (_fail_one). msg goes to the clients; detail (the traceback's last 4 KB) to the log."""
        print(f"ggml-dist serve: step failed: {msg}\n{detail}", file=sys.stderr)
        self._cached = [[] for _ in self._slots]
        self._in_flight.clear()
        for s in self._slots:
            if s is not None:
                s.n_flight = 0
                self._finish(s, "error", error=msg)
        assert self.ctx is not None
        self.ctx.clear()


def _short_error(e: BaseException, n: int = 300) -> str:
    """An error for a client and a log line: its type and the first line of its message, at most n
    characters (a library's message may carry its whole state: 300 KB for one grammar)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    msg = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return msg if len(msg) <= n else msg[:n] + "..."


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

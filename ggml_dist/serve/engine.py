"""Continuous batching over one LlamaContext (llama.cpp server's slots and update_slots).

    submit(request)   -> the admission queue (bounded: QueueFull past max_queue)
    engine thread, each turn:
        1. reap     sequences that are cancelled and not in flight free their slot
        2. admit    queued requests take free slots (serve/slots.py); the slot index is the KV sequence
                    id, and a prompt that starts with a free slot's cached tokens takes that slot and
                    skips them (cache_prompt); busy slots are then packed at the bottom (Slots.compact)
        3. fill     micro-batches are submitted while fewer than `depth` are in flight (model/steps.py)
        4. collect  wait for the oldest micro-batch; take each output row's token (chosen where the logits
                    are, the last stage on a pipeline; on the driver when penalties need the history),
                    stream the text, finish what stopped

On a pipeline of K stages the active sequences fall into K groups, so stage k works on one group while
stage k+1 works on another (vLLM's max_concurrent_batches). With lookahead > 1 (and plain stage calls,
which take result handles) a group's next step is queued before its tokens are back (Steps._follow_up).
Not the default: 8 clients over 2 testbed hosts gave 27.0 tok/s with it, 31.3 without (docs/api.md).
A sequence that stops while a step of it is still in flight is finished at once; that step's row for it
is ignored. Every slot owns n_ctx / n_parallel cells of the cache, as in llama-server: in one process a
KV stream of its own (kv_unified=False, llama-server's default with an explicit --parallel), so a step's
attention is one product per sequence over that sequence's cells. On a pipeline the slots share one
stream by default: its micro-batches hold different slot groups, so different stream ranges and graph
shapes, and a finished slot leaves a gap (the stages hold the cache: sequences are not moved). 8 clients
over 2 stages measured 65-69 tok/s with a stream per slot against 84-105 with one shared stream.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol, Self

import numpy as np

from ..model.context import LlamaContext
from ..model.model import LlamaModel
from ..model.steps import MicroBatch, Steps, warm_step_shapes
from ..model.tokenizer import Tokenizer
from ..model.ubatch import Batch
from ..runtime import Runtime, open_runtime
from .embeddings import embed
from .engine_config import EngineConfig
from .metrics import Metrics
from .requests import Event, Request, score_chunk
from .slots import Sequence, Slots


class QueueFull(RuntimeError):
    """The admission queue holds max_queue requests already."""


class NotReady(RuntimeError):
    """The model (or a stage actor) is still loading, or failed to load."""


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


# -- engine ------------------------------------------------------------------------------------------

class Engine:
    """The admission queue, the engine thread's turn (the module's docstring) and each request's life:
    admission with its n choices and grammar, every row's token, stop and cancel, and failure, one
    request or all. Its slots and prompt cache are serve/slots.py's, its micro-batches model/steps.py's,
    embeddings serve/embeddings.py's. ~350 lines: a request's life is one state machine over the same
    lock, slots and events, read most easily in one place."""

    def __init__(self, cfg: EngineConfig, metrics: Metrics | None = None,
                 collecting: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        # entered on the engine thread around each micro-batch's collection, where sampling posts the
        # step's events: a replica sends them as one message (serve.replicas)
        self.collecting = collecting
        self.n_ctx_slot = cfg.params.n_ctx // cfg.n_parallel
        self.model: LlamaModel | None = None
        self.ctx: LlamaContext | None = None
        self.runtime: Runtime | None = None     # this process, or a Ray pipeline (runtime.open_runtime)
        self.steps: Steps | None = None         # the micro-batches in flight, once loaded
        self.slots = Slots(cfg.n_parallel, cfg.cache_prompt, cfg.checkpoint_mib << 20, cfg.checkpoint_every)
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._jobs: collections.deque = collections.deque()     # (prompt, Future): embeddings
        self._cv = threading.Condition()
        self._stopping = False
        self._abort: str | None = None          # abort(): end every request with this error, next turn
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
        """Stop the engine thread, then the runtime (a pipeline's stage actors). A load still running
        30 s later ends the runtime itself once it is open (_run)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.ident is not None:          # started (a stop can come before start())
            self._thread.join(timeout=30)
        with self._cv:
            rt, self.runtime = self.runtime, None
        if rt is not None:
            rt.shutdown()

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
            n_idle = self.slots.n_free()
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

    def n_running(self) -> int:
        return self.slots.n_running()

    def health(self) -> dict[str, float]:
        """Whether a lost stage is being recovered, and how many were: cheap, for /health."""
        ctx = self.ctx
        return {"recovering": float(bool(ctx and ctx.recovery.recovering)),
                "recoveries": ctx.recovery.n_recoveries if ctx else 0}

    def status(self) -> dict[str, float]:
        """KV and recovery figures for /metrics (zeros before the model has loaded)."""
        ctx = self.ctx
        return {**self.health(), "kv_cells_used": ctx.kv.cells.used if ctx else 0,
                "kv_cells_cached": self.slots.cached_cells(),
                "kv_cells_total": ctx.kv.kv_size * ctx.kv.n_stream if ctx else 0,
                "replayed_tokens": ctx.recovery.n_replayed_tokens if ctx else 0,
                "fed_steps": self.steps.n_fed if self.steps else 0, **self.slots.checkpoints.figures()}

    def stage_busy(self) -> list[float]:
        """Compute seconds per stage (the engine's own in one process); the last known figures while a
        stage is unreachable."""
        if self.runtime is None or not self.runtime.distributed:
            return [self.steps.busy_s if self.steps else 0.0]
        with contextlib.suppress(Exception):   # a stage is down: metrics must still answer
            self._stage_busy = [st.compute_s for st in self.runtime.stats(since=float("inf"))]   # no timeline
        return list(getattr(self, "_stage_busy", []))

    # -- engine thread ----------------------------------------------------------------------------------
    def _load(self) -> None:
        cfg = self.cfg
        rt = self.runtime = open_runtime(cfg.run)  # a pipeline's stages have mapped their weights
        self.model, self.ctx = rt.model, rt.ctx
        n_groups = min(rt.depth, rt.n_stages)
        lookahead = max(1, min(cfg.lookahead, rt.depth // n_groups)) if rt.feeds_tokens() else 1
        self.steps = Steps(rt.ctx, cfg.params.n_batch, self.n_ctx_slot, rt.depth, n_groups, lookahead)
        self.slots.bind(rt.ctx, movable=not cfg.kv_unified and rt.moves_sequences)
        # one token through every stage: compiles kernels and plans before the first request
        self.ctx.decode(Batch.from_tokens([self.model.tokenizer.bos_id or 0]))
        self.ctx.seq_rm(0)
        if not rt.distributed and not cfg.kv_unified:
            warm_step_shapes(self.ctx, self.model.tokenizer.bos_id or 0, cfg.n_parallel)

    def _run(self) -> None:
        try:
            self._load()
        except Exception as e:  # noqa: BLE001 - reported by /health and to every request, not raised
            self.load_error = f"loading {self.cfg.model_path} failed: {type(e).__name__}: {e}"
            print(f"ggml-dist serve: {self.load_error}", file=sys.stderr)
            self.ready.set()
            return
        with self._cv:
            if self._stopping and self.runtime is not None:     # shut down while it loaded: its runtime
                rt, self.runtime = self.runtime, None            # is ours to end
                rt.shutdown()
        self.ready.set()
        steps, slots = self.steps, self.slots
        assert steps is not None
        while True:
            with self._cv:
                while (not self._stopping and not self._queue and not steps.in_flight
                       and not any(slots.seqs) and not self._jobs and self._abort is None):
                    self._cv.wait()
                if self._stopping:
                    break
                if self._abort is not None:
                    self._abort_all(self._abort)
                    self._abort = None
                self._run_jobs()
                self._reap()
                self._admit()
                slots.compact()
            try:
                steps.fill(slots.seqs)
                if steps.in_flight:
                    with self.collecting():
                        self._collect(*steps.take())
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests; the server keeps serving
                self._fail_all(_short_error(e), "".join(traceback.format_exception(e))[-4000:])
        for s in slots.seqs:
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
        while self._jobs and self.slots.n_free():
            prompt, fut = self._jobs.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                assert self.ctx is not None and self.cfg.pooling is not None
                fut.set_result(embed(self.ctx, prompt, self.slots.take_blank(), self.cfg.params.n_batch,
                                     self.cfg.pooling))
            except Exception as e:  # noqa: BLE001 - this request fails (the future holds it), not the engine
                fut.set_exception(e)

    def _reap(self) -> None:
        if any(r.cancelled for r in self._queue):
            for r in [r for r in self._queue if r.cancelled]:
                self._queue.remove(r)
                r.on_event(Event(finish_reason="cancelled", n_prompt=len(r.prompt)))
        for s in self.slots.seqs:
            if s is not None and s.req.cancelled and not s.in_flight:
                self._finish(s, "cancelled")

    def _admit(self) -> None:
        """Queued requests take free slots in order; a request of n choices waits for n."""
        while self._queue and self.slots.n_free() >= self._queue[0].n:
            req = self._queue.popleft()
            if req.cancelled:
                for i in range(req.n):
                    req.on_event(Event(finish_reason="cancelled", n_prompt=len(req.prompt), index=i))
                continue
            assert self.ctx is not None and self.model is not None
            try:
                constraints = [_constraint(self.model.tokenizer, req.sampling.grammar) for _ in range(req.n)]
            except Exception as e:  # noqa: BLE001 - an invalid grammar: this request fails, not the engine
                for i in range(req.n):
                    req.on_event(Event(finish_reason="error", n_prompt=len(req.prompt), error=_short_error(e),
                                       index=i))
                continue
            slot, n_keep = self.slots.take(req.prompt, reuse=req.prompt_logprobs is None and req.cache_prompt)
            first = self.slots.seqs[slot] = Sequence.start(req, slot, 0, constraints[0], n_keep, self.model.tokenizer)
            first.checkpoints_at = self.slots.due(req.prompt, n_keep)
            first.n_cached = n_keep
            self.metrics.add_prompt(len(req.prompt), n_keep)
            for i in range(1, req.n):           # the other choices take the prompt's cells from choice 0
                slot = self.slots.take_blank()
                child = self.slots.seqs[slot] = Sequence.start(req, slot, i, constraints[i], 0, self.model.tokenizer)
                child.parent = first
                first.children.append(child)

    def _collect(self, mb: MicroBatch, toks: list[int] | None, logits: np.ndarray | None) -> None:
        """A micro-batch's rows back (Steps.take): each output row's token, chosen there (toks) or here
        from its logits, goes to its sequence."""
        if mb.scored:
            assert logits is not None
            logits = score_chunk(*mb.parts[0], logits)
        rows = Steps.rows(mb, toks, logits)
        self.slots.checkpoint(mb.parts)
        for s, chosen, row in rows:
            assert isinstance(s, Sequence)
            if s.req.cancelled:
                if not s.in_flight:                      # else once its last step is back (_reap)
                    self._finish(s, "cancelled")
                continue
            if s.req.max_tokens == 0:                    # score only: the prompt is in, nothing is sampled
                self._finish(s, "length")
                continue
            # a row's own failure (its grammar, its sampling) fails its sequence only: the step's other
            # rows are fine, and so are the KV cache and the other slots' cached prompts
            try:
                tok, lp = s.choose(chosen, row)
            except Exception as e:  # noqa: BLE001 - this request fails, not the step
                self._fail_one(s, e)
                continue
            children, s.children = s.children, []
            # the prompt is in: the other choices take its cells and their first tokens first, as
            # choice 0 may end at once (and free its cells)
            starts = []
            for c in children:
                try:
                    starts.append((c, *self._start_choice(s, c, row)))
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
        return c.choose(None, logits)

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
        cache_prompt they stay as the slot's cached tokens (Slots.release)."""
        s.done = True                           # a step of it may still be in flight (_follow_up): its
                                                # row is ignored, its cells freed with the others now
        if s.parent is not None:                # a choice that never started: its prompt is not copied
            if s in s.parent.children:
                s.parent.children.remove(s)
            s.parent = None
        if flush and reason in ("stop", "length"):
            tail, hit = s.stop.push(s.stream.flush())
            text += tail if hit else tail + s.stop.flush()
        self.slots.release(s, keep=reason != "error")
        s.req.on_event(Event(text, reason, len(s.req.prompt), s.n_gen, error, self._take_logprobs(s), s.index,
                             n_cached=s.n_cached))
        for c in list(s.children):              # ended before its prompt was in: so do the others
            self._finish(c, reason if reason == "error" else "cancelled", error=error)

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
        for s in self.slots.seqs:
            if s is not None and not s.done:
                self._finish(s, "error", error=msg)

    def _fail_all(self, msg: str, detail: str = "") -> None:
        """A step itself failed (its compute, a stage beyond recovery): the KV cache may hold half its
        writes, so every sequence in it, and every cached prompt, goes. A single row's failure does not
        come here (_fail_one). msg goes to the clients; detail (the traceback's last 4 KB) to the log."""
        print(f"ggml-dist serve: step failed: {msg}\n{detail}", file=sys.stderr)
        self.slots.forget()
        if self.steps is not None:
            self.steps.in_flight.clear()
        for s in self.slots.seqs:
            if s is not None:
                s.n_flight = 0
                self._finish(s, "error", error=msg)
        assert self.ctx is not None
        self.ctx.clear()


def _constraint(tok: Tokenizer, grammar: str | None) -> Any:
    """A sequence's grammar state (serve/grammar, imported only when a request has a grammar)."""
    if grammar is None:
        return None
    from . import grammar as G
    return G.Constraint(G.tokenizer_of(tok), grammar, tok.n_vocab)


def _short_error(e: BaseException, n: int = 300) -> str:
    """An error for a client and a log line: its type and the first line of its message, at most n
    characters (a library's message may carry its whole state: 300 KB for one grammar)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else ""
    msg = f"{type(e).__name__}: {line}" if line else type(e).__name__
    return msg if len(msg) <= n else msg[:n] + "..."

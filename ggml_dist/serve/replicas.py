"""Data-parallel engine replicas on one machine: R processes, each an Engine over its share of the slots,
behind one HTTP front (vLLM's data parallelism over a CPU's cores).

    front (the HTTP process)                      replica k (a spawned process)
      submit  -> route: a free slot, least load,    Engine over n_parallel/R slots, n_ctx/R cells,
                 the longest cached prompt prefix   cores/(busy replicas) threads: all of them while
      cancel  -> Cancel(rid)                        it is the only one with requests
      sender thread per replica -> Submit, Cancel, SetThreads, ... (the event loop only queues them)
      reader thread per replica <- EventBatch([(rid, event), ...], metric updates), one per step

Why: one process decoding 8 sequences on 2 cores runs each op's kernel split in two, and between the
kernels its Python holds the GIL while the other core waits at the next launch; every op is a barrier,
and any thread the OS runs in between (the HTTP loop, clients) stalls both cores. Two single-threaded
replicas of 4 sequences each keep a core busy with a step of their own: on this 2-vCPU VM their decode
steps gave 307-410 tok/s where one process gave 211-357, interleaved (scratch proc.py). Threads in one
process would not do: the GIL is held ~65% of a step's time, so two engine threads serialize.

Each replica loads the model itself (the GGUF is mapped, shared by the page cache; packed weights are
per process). Sequences never move between replicas: a request runs where it was routed. A replica whose
process dies fails its requests and is started again; the others keep serving.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from typing import Any, Self, assert_never

from ..backends.cpu import threads as kernel_threads
from ..model.sampling import SamplingParams
from ..model.tokenizer import Tokenizer
from .engine import Engine, EngineConfig, Event, NotReady, QueueFull, Request
from .metrics import Metrics
from .slots import common_prefix

_STATUS_TIMEOUT_S = 10.0


# -- messages (pickled over a replica's socket) -------------------------------------------------------
# One frozen record per kind, so that each side dispatches on the type (match) and mypy checks the
# fields at both ends. They pickle by this module's name: a replica runs its loop from the module
# imported as ggml_dist.serve.replicas, not from __main__.

@dataclass(frozen=True, slots=True)
class Configure:
    """The front's first message: the replica's engine and its compute threads."""
    cfg: EngineConfig
    threads: int


@dataclass(frozen=True, slots=True)
class Submit:
    rid: int                                # the front's id of the request (the Request stays there)
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams
    stops: tuple[str, ...]
    t_arrival: float
    prompt_logprobs: int | None = None      # Request.prompt_logprobs (echo + logprobs: scoring)
    cache_prompt: bool = True               # Request.cache_prompt

    def request(self, on_event: Callable[[Event], None]) -> Request:
        return Request(self.prompt, self.max_tokens, self.sampling, self.stops, on_event, self.t_arrival,
                       prompt_logprobs=self.prompt_logprobs, cache_prompt=self.cache_prompt)


@dataclass(frozen=True, slots=True)
class Cancel:
    rid: int


@dataclass(frozen=True, slots=True)
class SetThreads:
    """The front's share of the cores for this replica."""
    n: int


@dataclass(frozen=True, slots=True)
class StatusQuery:
    """Asks for a StatusReply."""


@dataclass(frozen=True, slots=True)
class Stop:
    """Ends the replica; its running requests end "cancelled", and those events are sent first."""


ToReplica = Submit | Cancel | SetThreads | StatusQuery | Stop      # after the Configure


@dataclass(frozen=True, slots=True)
class PromptAdded:
    n: int
    cached: int

    def apply(self, m: Metrics) -> None:
        m.add_prompt(self.n, self.cached)


@dataclass(frozen=True, slots=True)
class TokenAdded:
    ttft: float | None
    itl: float | None

    def apply(self, m: Metrics) -> None:
        m.add_token(self.ttft, self.itl)


MetricUpdate = PromptAdded | TokenAdded


@dataclass(frozen=True, slots=True)
class Ready:
    """The replica's first message: its engine has loaded (error None), or why it did not."""
    error: str | None


@dataclass(frozen=True, slots=True)
class EventBatch:
    events: tuple[tuple[int, Event], ...]       # (rid, event), in the order the engine posted them
    updates: tuple[MetricUpdate, ...]           # the metrics since the last message, applied first


@dataclass(frozen=True, slots=True)
class StatusReply:
    figures: dict[str, float]                   # Engine.status() and busy_s
    updates: tuple[MetricUpdate, ...]


ToFront = EventBatch | StatusReply            # after the Ready


# -- replica process ---------------------------------------------------------------------------------

class _ForwardMetrics(Metrics):
    """The replica's metric updates, queued for the front (which owns the /metrics counters)."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[MetricUpdate] = []

    def add_prompt(self, n: int, cached: int = 0) -> None:
        with self.lock:
            self.updates.append(PromptAdded(n, cached))

    def add_token(self, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            self.updates.append(TokenAdded(ttft, itl))

    def drain(self) -> tuple[MetricUpdate, ...]:
        with self.lock:
            out, self.updates = tuple(self.updates), []
        return out


class _Outbox:
    """A replica's events on their way to the front. Those that sampling posts while the engine thread
    collects a micro-batch (Engine's `collecting` hook) leave together at its end: one write and one
    wake-up of the front per step. Any other event (a cancelled request's end, an error from the main
    thread) goes at once."""

    def __init__(self, send: Callable[[Ready | ToFront], None], metrics: _ForwardMetrics) -> None:
        self.send, self.metrics = send, metrics
        self._events: list[tuple[int, Event]] = []
        self._lock = threading.Lock()
        self._collector: threading.Thread | None = None     # the engine thread, while it collects

    @contextlib.contextmanager
    def collecting(self) -> Iterator[None]:
        self._collector = threading.current_thread()
        try:
            yield
        finally:
            self._collector = None
            self.flush()

    def post(self, rid: int, ev: Event) -> None:
        with self._lock:
            self._events.append((rid, ev))
        if threading.current_thread() is not self._collector:
            self.flush()

    def flush(self) -> None:
        with self._lock:                # held while sending: two flushes keep their order
            if self._events:
                self.send(EventBatch(tuple(self._events), self.metrics.drain()))
                self._events = []


def _replica_main(conn: Connection) -> None:
    """A replica process: an engine, driven by the front's messages; its events go back on `conn`.
    The first message is a Configure."""
    first: Configure = conn.recv()
    cfg, threads = first.cfg, first.threads
    kernel_threads.set_threads(threads)
    lock = threading.Lock()             # the engine thread and this one both send

    def send(msg: Ready | ToFront) -> None:
        with lock:
            try:
                conn.send(msg)
            except OSError:             # the front is gone: the main loop sees EOF and shuts down
                pass
    metrics = _ForwardMetrics()
    outbox = _Outbox(send, metrics)
    engine = Engine(cfg, metrics, collecting=outbox.collecting).start()
    try:
        engine.wait_ready(None)
    except NotReady as e:
        send(Ready(str(e)))
        return
    send(Ready(None))
    reqs: dict[int, Request] = {}

    def on_event(rid: int, ev: Event) -> None:
        if ev.finish_reason is not None:
            reqs.pop(rid, None)
        outbox.post(rid, ev)
    try:
        while True:
            msg: ToReplica = conn.recv()
            match msg:
                case Submit(rid=rid):
                    req = msg.request(functools.partial(on_event, rid))
                    reqs[rid] = req
                    try:
                        engine.submit(req)
                    except (QueueFull, NotReady) as e:     # the front bounds the queue: not expected
                        on_event(rid, Event(finish_reason="error", n_prompt=len(msg.prompt), error=str(e)))
                case Cancel(rid=rid):
                    if (target := reqs.get(rid)) is not None:
                        engine.cancel(target)
                case SetThreads():                          # the front's share of the cores for this one
                    kernel_threads.set_threads(msg.n)
                case StatusQuery():
                    send(StatusReply({**engine.status(), "busy_s": engine.stage_busy()[0]}, metrics.drain()))
                case Stop():
                    break
                case _:
                    assert_never(msg)
    except (EOFError, OSError):                         # the front is gone
        pass
    finally:
        engine.shutdown()                               # running requests end "cancelled", sent back


# -- front ---------------------------------------------------------------------------------------------

class _Sender:
    """Writes one replica's messages from a thread of its own, in the order they were queued: the event
    loop (submit, cancel, and the threads' split under ReplicaSet._lock) never blocks on a socket whose
    buffer a busy replica has not drained. The sender closes the connection once told to (the reader
    has seen it end), after what it holds, so no write races the close."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self._q: queue.SimpleQueue[Configure | ToReplica | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def send(self, msg: Configure | ToReplica) -> None:
        """Queue msg; OSError once the connection has ended, as the socket's own send would raise."""
        if self._closed:
            raise OSError("the replica's connection is closed")
        self._q.put(msg)

    def close(self) -> None:
        self._closed = True
        self._q.put(None)

    def _run(self) -> None:
        while (msg := self._q.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError:             # the replica is gone: its reader sees EOF and fails its requests
                pass
        self.conn.close()


@dataclass(eq=False)
class _Replica:
    index: int
    cfg: EngineConfig
    proc: Any = None
    sender: _Sender | None = None
    ready: bool = False
    load: int = 0                                       # requests routed here and not finished
    threads: int = 0                                    # compute threads it was told to use
    reqs: dict[int, Request] = field(default_factory=dict)
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=16))
    status: dict | None = None
    status_ev: threading.Event = field(default_factory=threading.Event)
    status_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def slots(self) -> int:
        return self.cfg.n_parallel

    def send(self, msg: Configure | ToReplica) -> None:
        assert self.sender is not None
        self.sender.send(msg)

    def affinity(self, prompt: list[int]) -> int:
        """The longest prefix of `prompt` among those recently routed here (a free slot's cache)."""
        return max((common_prefix(p, prompt) for p in self.recent), default=0)


class ReplicaSet:
    """Engine's interface (what the app uses) over `cfg.n_replicas` replica processes."""

    def __init__(self, cfg: EngineConfig, metrics: Metrics | None = None) -> None:
        if cfg.n_replicas < 2:
            raise ValueError("ReplicaSet needs n_replicas >= 2 (one replica is a plain Engine)")
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.n_ctx_slot = cfg.params.n_ctx // cfg.n_parallel
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._tokenizer: Tokenizer | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._next_rid = 0
        self._where: dict[Request, tuple[_Replica, int]] = {}
        self._threads = kernel_threads.get_threads()
        R, P = cfg.n_replicas, cfg.n_parallel
        shares = [P // R + (k < P % R) for k in range(R)]
        sized = [replace(cfg.run, params=replace(cfg.params, n_ctx=n * self.n_ctx_slot)) for n in shares]
        self.replicas = [_Replica(k, replace(cfg, run=run, n_replicas=1, n_parallel=n, max_queue=cfg.max_queue + P))
                         for k, (n, run) in enumerate(zip(shares, sized))]

    # -- life cycle -----------------------------------------------------------------------------------
    def start(self) -> Self:
        threading.Thread(target=self._start, name="ggml-dist-replicas", daemon=True).start()
        return self

    def _start(self) -> None:
        try:
            from ..model.gguf import load_gguf
            self._tokenizer = Tokenizer.from_gguf(load_gguf(self.cfg.model_path))
        except Exception as e:  # noqa: BLE001 - reported by /health and to every request, as Engine._run
            self._fail_load(f"loading {self.cfg.model_path} failed: {type(e).__name__}: {e}")
            return
        for r in self.replicas:
            self._spawn(r)

    def _spawn(self, r: _Replica) -> None:
        """Start replica r: `python -m ggml_dist.serve.replicas FD` over a socket pair (a fresh
        interpreter: no fork of this threaded process, no re-import of the user's main module)."""
        front, child = socket.socketpair()
        r.proc = subprocess.Popen([sys.executable, "-m", __name__, str(child.fileno())],
                                  pass_fds=(child.fileno(),))
        child.close()
        conn = Connection(front.detach())
        r.sender = _Sender(conn, name=f"ggml-dist-replica-{r.index}-sender")
        r.ready, r.threads = False, self._threads
        r.send(Configure(r.cfg, r.threads))
        threading.Thread(target=self._read, args=(r, conn, r.sender), name=f"ggml-dist-replica-{r.index}-reader",
                         daemon=True).start()

    def _fail_load(self, msg: str) -> None:
        self.load_error = msg
        print(f"ggml-dist serve: {msg}", file=sys.stderr)
        self.ready.set()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout) or self.load_error:
            raise NotReady(self.load_error or f"the model did not load within {timeout} s")

    def shutdown(self) -> None:
        self._stopping = True
        for r in self.replicas:
            if r.proc is not None and r.proc.poll() is None:
                try:
                    r.send(Stop())
                except OSError:
                    pass
        for r in self.replicas:
            if r.proc is not None:
                try:
                    r.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()

    def abort(self, message: str) -> None:
        """Every request routed to a replica ends now with an error event carrying message (a graceful
        shutdown's end): the front answers for the replicas, tells each to cancel, and drops what they
        send for those requests afterwards."""
        with self._lock:
            ended = [(r, rid, req) for r in self.replicas for rid, req in r.reqs.items()]
            for r, rid, req in ended:
                del r.reqs[rid]
                self._where.pop(req, None)
            for r in self.replicas:
                self._set_load(r, len(r.reqs))
        for r, rid, req in ended:
            try:
                r.send(Cancel(rid))
            except OSError:
                pass
            for i in range(req.n):
                req.on_event(Event(finish_reason="error", n_prompt=len(req.prompt), error=message, index=i))

    # -- messages from a replica (its reader thread) --------------------------------------------------
    def _read(self, r: _Replica, conn: Connection, sender: _Sender) -> None:
        try:
            ready: Ready = conn.recv()
            self._on_ready(r, ready.error)
            if ready.error is not None:
                return
            while True:
                msg: ToFront = conn.recv()
                match msg:
                    case EventBatch(events, updates):
                        self._apply(updates)
                        for rid, ev in events:
                            self._deliver(r, rid, ev)
                    case StatusReply(figures, updates):
                        self._apply(updates)
                        r.status = figures
                        r.status_ev.set()
                    case _:
                        assert_never(msg)
        except (EOFError, OSError):
            pass
        finally:
            sender.close()                                  # and with it the connection
        self._lost(r)

    def _apply(self, updates: tuple[MetricUpdate, ...]) -> None:
        for u in updates:
            u.apply(self.metrics)

    def _deliver(self, r: _Replica, rid: int, ev: Event) -> None:
        with self._lock:
            req = r.reqs.get(rid)
            if req is not None and ev.finish_reason is not None:
                del r.reqs[rid]
                self._where.pop(req, None)
                self._set_load(r, r.load - 1)
        if req is not None:
            req.on_event(ev)

    def _on_ready(self, r: _Replica, error: str | None) -> None:
        if error is not None:
            if not self.ready.is_set():
                self._fail_load(f"replica {r.index}: {error}")
            else:
                print(f"ggml-dist serve: replica {r.index} did not restart: {error}", file=sys.stderr)
            return
        with self._lock:
            r.ready = True
            self._set_load(r, r.load)           # its threads, as the others' loads have them
            all_up = all(x.ready for x in self.replicas)
        if all_up and not self.ready.is_set():
            self.ready.set()

    def _lost(self, r: _Replica) -> None:
        """The replica's process ended: its requests fail, and it starts again unless we are stopping."""
        try:
            code = r.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        with self._lock:
            r.ready = False
            lost = list(r.reqs.values())
            for req in lost:
                self._where.pop(req, None)
            r.reqs.clear()
            self._set_load(r, 0)
        for req in lost:
            req.on_event(Event(finish_reason="error", n_prompt=len(req.prompt),
                               error=f"replica {r.index} exited (code {code}); retry the request"))
        if not self._stopping and not self.load_error:
            print(f"ggml-dist serve: replica {r.index} exited (code {code}); starting it again",
                  file=sys.stderr)
            self._spawn(r)

    # -- requests (event-loop thread) -----------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None or not self.ready.is_set() or self.load_error:
            raise NotReady(self.load_error or "the model is still loading")
        return self._tokenizer

    def submit(self, req: Request) -> None:
        if not self.ready.is_set() or self.load_error:
            raise NotReady(self.load_error or "the model is still loading; retry when /health is ok")
        with self._lock:
            r = self._route(req.prompt)
            rid, self._next_rid = self._next_rid, self._next_rid + 1
            r.reqs[rid] = req
            self._set_load(r, r.load + 1)
            r.recent.append(req.prompt)
            self._where[req] = (r, rid)
        try:
            r.send(Submit(rid, req.prompt, req.max_tokens, req.sampling, req.stops, req.t_arrival,
                          req.prompt_logprobs, req.cache_prompt))
        except OSError:                 # the replica just died: its reader fails the request
            pass

    def _set_load(self, r: _Replica, load: int) -> None:
        """(under _lock) r's load, and each replica's threads: the cores split evenly among the replicas
        that have requests (all of them for one alone)."""
        r.load = load
        want = max(1, self._threads // max(1, sum(x.load > 0 for x in self.replicas)))
        for x in self.replicas:
            if x.ready and x.threads != want:
                try:
                    x.send(SetThreads(want))
                    x.threads = want
                except OSError:
                    pass

    def _route(self, prompt: list[int]) -> _Replica:
        """A replica with a free slot: the least loaded (a replica's step slows with its sequences while
        the other's core may idle), and of those the one whose recent prompts share the longest prefix
        with this one (its prompt cache may skip them: a closed-loop client's next request finds its
        previous one's replica with the free slot); with none free, the shortest queue, within
        max_queue queued in all."""
        live = [r for r in self.replicas if r.ready]
        if not live:
            raise NotReady("every replica is restarting; retry when /health is ok")
        free = [r for r in live if r.load < r.slots]
        if free:
            return max(free, key=lambda r: (-r.load, r.affinity(prompt)))
        queued = sum(r.load - r.slots for r in live)
        if queued >= self.cfg.max_queue:
            raise QueueFull(f"{queued} requests queued and {self.cfg.n_parallel} running; retry later")
        return min(live, key=lambda r: r.load - r.slots)

    def cancel(self, req: Request) -> None:
        req.cancelled = True
        with self._lock:
            where = self._where.get(req)
        if where is not None:
            try:
                where[0].send(Cancel(where[1]))
            except OSError:
                pass

    def queue_length(self) -> int:
        return sum(max(0, r.load - r.slots) for r in self.replicas)

    def n_running(self) -> int:
        return sum(min(r.load, r.slots) for r in self.replicas)

    # -- figures (a replica answers a status message) -------------------------------------------------
    def _statuses(self) -> list[dict]:
        out = []
        for r in self.replicas:
            if not r.ready:
                continue
            with r.status_lock:
                r.status_ev.clear()
                try:
                    r.send(StatusQuery())
                except OSError:
                    continue
                if r.status_ev.wait(_STATUS_TIMEOUT_S) and r.status is not None:
                    out.append(r.status)
        return out

    def health(self) -> dict[str, float]:
        """From the front's own state (no message): a replica is being started again. Replicas are
        one-stage engines, which recover no pipeline stage."""
        return {"recovering": float(self.ready.is_set() and not all(r.ready for r in self.replicas)),
                "recoveries": 0}

    def status(self) -> dict[str, float]:
        sts = self._statuses()
        return {**self.health(), **{k: float(sum(s[k] for s in sts)) for k in
                                    ("kv_cells_used", "kv_cells_cached", "kv_cells_total", "replayed_tokens",
                                     "fed_steps")}}

    def cached_cells(self) -> int:
        return int(self.status()["kv_cells_cached"])

    def stage_busy(self) -> list[float]:
        """Compute seconds per replica (each replica is a one-stage engine)."""
        return [float(s["busy_s"]) for s in self._statuses()]


if __name__ == "__main__":          # a replica process, started by ReplicaSet._spawn
    # the loop of the module by its name, whose message classes are the ones the front pickles (this
    # file's own run, as __main__, would pickle its replies as __main__'s classes)
    from ggml_dist.serve.replicas import _replica_main as main
    main(Connection(int(sys.argv[1])))

"""Running the app: `serve` (the CLI's blocking call) and `ServerThread` (uvicorn in a background thread,
for tests and benchmarks). Both start uvicorn before the model has loaded, so /health answers
"loading" (503) until every stage is up.

`serve` stops on SIGTERM or SIGINT, gracefully: new requests get 503 at once, the running ones have
`shutdown_grace` seconds to finish, then the engine ends what is left with an error event (a stream's
`data: {"error": ...}` then `data: [DONE]`, a plain request's 503); then uvicorn finishes, then the
engine, then the local Ray it started, every process of it. A second signal ends the serving at once.
The signals are the server's from its first line to its last (_StopSignals): one during the start-up
unwinds it, one during the clean-up is noted and does not cut it short, and the process exits
128 + the first signal's number whatever the disposition it inherited.

uvicorn has no deadline for a request's headers, and keeps every connection it accepts: a client that
opens connections and sends nothing (or a header a byte a minute) holds a descriptor each for ever.
_guarded_protocol closes a connection whose next request's headers have not arrived header_timeout_s
after it opened (or after its previous response), and one opened past max_connections at once;
uvicorn's own limit_concurrency answers 503 past max_connections in flight.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, cast

import uvicorn

from .app import create_app
from .engine import Engine, ServingEngine
from .engine_config import EngineConfig
from .guard import MAX_BODY_BYTES, Admission, HTTPPolicy, is_loopback
from .metrics import Metrics

HEADER_TIMEOUT_S = 10.0           # a request's headers, from its connection's start or last response
MAX_CONNECTIONS = 1000            # open at once; past it a new connection is closed, requests get 503
SHUTDOWN_GRACE_S = 10.0           # after SIGTERM, for the running requests to finish
_FLUSH_S = 5.0                    # after the grace: for the ended requests' handlers to write their end


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServeOptions:
    """How `serve` meets the network: who may call (policy: key, Host names, body limits), the
    connection limits, and the shutdown's grace."""
    policy: HTTPPolicy = field(default_factory=HTTPPolicy)
    header_timeout_s: float = HEADER_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    shutdown_grace_s: float = SHUTDOWN_GRACE_S


def check_bind(host: str, api_key: str | None, insecure_no_api_key: bool = False,
               say: Callable[[str], None] | None = None) -> None:
    """A non-loopback bind needs an API key (or the explicit insecure flag): anyone who reaches the
    port could otherwise generate on this machine. ValueError if neither; a warning line either way."""
    if is_loopback(host):
        return
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if api_key is None and not insecure_no_api_key:
        raise ValueError(f"--host {host} listens beyond this machine: give --api-key (or GGML_DIST_API_KEY), "
                         f"or --insecure-no-api-key to serve anyone who can reach the port")
    say(f"ggml-dist serve: warning: listening on {host}, beyond this machine; "
        + ("requests need the API key" if api_key is not None else "WITHOUT an API key (--insecure-no-api-key)"))


def _guarded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools or h11, as http="auto" picks) with the module docstring's header
    deadline and connection cap. Both implementations set `cycle` when a request's headers are in, and
    call on_response_complete when its response is out."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    base = cast(Any, AutoHTTPProtocol)

    class GuardedHTTP(base):  # type: ignore[misc, valid-type]
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                return
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _arm(self) -> None:
            self.loop.call_later(header_timeout_s, self._expire, self.cycle)

        def _expire(self, cycle: object) -> None:
            # no request's headers since the timer was set: the same cycle as then
            if self.cycle is cycle and not self.transport.is_closing():
                self.transport.close()
    return GuardedHTTP


def _uvicorn_config(engine: ServingEngine, model_name: str, host: str, port: int, max_body_bytes: int,
                    opts: ServeOptions | None = None,
                    admission: Admission | None = None) -> uvicorn.Config:
    opts = opts or ServeOptions(policy=HTTPPolicy.for_bind(host, max_body_bytes=max_body_bytes))
    app = create_app(engine, model_name, max_body_bytes, policy=opts.policy, admission=admission)
    # one event loop thread; the engine thread does the compute. uvloop and httptools (C) where installed:
    # the loop thread's Python per streamed token holds the GIL the engine thread needs between kernels
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=5, loop="auto", lifespan="off",
                          http=_guarded_protocol(opts.header_timeout_s, opts.max_connections),
                          limit_concurrency=opts.max_connections)


def make_engine(cfg: EngineConfig, metrics: Metrics) -> ServingEngine:
    """The engine behind the app: one in this process, or a set of replica processes (--replicas)."""
    if cfg.n_replicas > 1:
        from .replicas import ReplicaSet
        return ReplicaSet(cfg, metrics)
    return Engine(cfg, metrics)


def drain(engine: ServingEngine, admission: Admission, grace_s: float,
          say: Callable[[str], None] | None = None) -> None:
    """A graceful shutdown's first part (blocking): admit nothing more (503), give the running requests
    grace_s to finish, then end the rest with an error event and wait a little for their handlers to
    write it. The caller then stops uvicorn."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    admission.closed = True
    t0 = time.monotonic()
    if admission.active:
        say(f"ggml-dist serve: shutting down: new requests get 503; {admission.active} running may take "
            f"{grace_s:g} s to finish (--shutdown-grace)")
    while admission.active and time.monotonic() - t0 < grace_s:
        time.sleep(0.05)
    if admission.active:
        say(f"ggml-dist serve: {admission.active} requests still running after {grace_s:g} s: ending them "
            f"with an error")
        engine.abort(f"the server is shutting down (its {grace_s:g} s grace is over)")
        t1 = time.monotonic()
        while admission.active and time.monotonic() - t1 < _FLUSH_S:
            time.sleep(0.05)


class ServerStopped(BaseException):
    """A stop signal during the server's start-up: unwinds the start-up to serve()'s clean-up. A
    BaseException, as KeyboardInterrupt, so that no `except Exception` on the way keeps it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """SIGINT and SIGTERM for the whole of a server's life, one handler for both, installed before
    anything starts:
      start-up   the first signal raises ServerStopped where the main thread is, and serve() cleans up
      serving    the server's handle_exit: drain, then stop (a second signal: at once)
      clean-up   noted only: the engine, its stages and the local Ray are ended in full
    `signum` is the first signal; serve() returns it, and the command exits 128 + it. Nothing is left to
    the signal's inherited disposition: a process started as a shell's background job inherits SIGINT
    ignored, and uvicorn, which catches it while it serves and raises it again once stopped, used to
    raise it into that SIG_IGN and exit 0."""
    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.server: _SignalledServer | None = None
        self.cleaning = False
        self._previous = {s: signal.signal(s, self.handle) for s in self.SIGNALS}

    def handle(self, sig: int, frame: FrameType | None) -> None:
        signal.alarm(0)        # absl's abort timer (a Ray core worker's failure handler); nothing here sets one
        first = self.signum is None
        if first:
            self.signum = sig
        if self.cleaning:
            return
        if self.server is not None:
            self.server.handle_exit(sig, frame)
        elif first:
            raise ServerStopped(sig)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


class _SignalledServer(uvicorn.Server):
    """uvicorn's server, whose handle_exit (uvicorn installs it for SIGTERM and SIGINT while it runs)
    notes the signal in the server's _StopSignals rather than uvicorn's list, which uvicorn would raise
    again once stopped. The first signal drains (drain(), in a thread) before uvicorn is told to exit; a
    second one exits at once."""

    def __init__(self, config: uvicorn.Config, engine: ServingEngine, admission: Admission,
                 grace_s: float, stop: _StopSignals) -> None:
        super().__init__(config)
        self.engine, self.admission, self.grace_s, self.stop = engine, admission, grace_s, stop
        self._draining: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        signal.alarm(0)
        if self.stop.signum is None:
            self.stop.signum = sig
        if self._draining is None and self.grace_s > 0:
            self._draining = threading.Thread(target=self._drain, name="ggml-dist-drain", daemon=True)
            self._draining.start()
            return
        self.should_exit = self.force_exit = True

    def _drain(self) -> None:
        try:
            drain(self.engine, self.admission, self.grace_s)
        finally:
            self.should_exit = True


def protect_ray_token(joining: bool, say: Callable[[str], None] | None = None) -> Path | None:
    """Ray's token file (~/.ray/auth_token) mode 0600. Ray 2.60 turns token auth on for a local cluster it
    starts and writes a new token there with the process's umask (0644: anyone on the machine could read
    it and run code on the cluster): so before a local start we write it ourselves, as Ray would (32
    random bytes, hex), with 0600; a token file found readable by others is made 0600, with a line
    saying so. Nothing when RAY_AUTH_MODE=disabled. Returns the file when it exists."""
    say = say or (lambda m: print(m, file=sys.stderr, flush=True))
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None
    path = Path.home() / ".ray" / "auth_token"
    if not path.exists():
        if joining:
            return None                         # a cluster's token is its operator's to give
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass                                # written meanwhile: checked below
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        os.chmod(path, 0o600)
        say(f"ggml-dist serve: {path} was mode {mode:o} (readable by others); made it 600")
    return path


def serve(cfg: EngineConfig, model_name: str, host: str = "127.0.0.1", port: int = 8080,
          max_body_bytes: int = MAX_BODY_BYTES, opts: ServeOptions | None = None) -> int | None:
    """Serve until SIGTERM or SIGINT (then drain: the module docstring); the engine loads in the
    background meanwhile. Returns the signal that stopped it, once the engine, its stages and the local
    Ray it started have ended (the caller exits 128 + it)."""
    from ..runtime import shutdown_local
    stop = _StopSignals()
    engine: ServingEngine | None = None
    config: uvicorn.Config | None = None
    try:
        opts = opts or ServeOptions(policy=HTTPPolicy.for_bind(host, max_body_bytes=max_body_bytes))
        if cfg.run.distributed:
            protect_ray_token(joining=bool(cfg.run.address or os.environ.get("RAY_ADDRESS")))
        engine = make_engine(cfg, Metrics())
        engine.start()
        admission = Admission()
        config = _uvicorn_config(engine, model_name, host, port, max_body_bytes, opts, admission)
        stop.server = _SignalledServer(config, engine, admission, opts.shutdown_grace_s, stop)
        stop.server.run()
    except ServerStopped:
        pass
    finally:
        stop.cleaning = True
        try:
            if config is not None:
                cast(Any, config.app).state.checker.close()
            if engine is not None:
                engine.shutdown()
        finally:
            shutdown_local()
            stop.restore()
    return stop.signum


class ServerThread:
    """uvicorn on a free loopback port in a daemon thread: `with ServerThread(cfg) as srv: srv.url`."""

    def __init__(self, cfg: EngineConfig, model_name: str = "model", host: str = "127.0.0.1",
                 port: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
                 opts: ServeOptions | None = None) -> None:
        self.engine = make_engine(cfg, Metrics())
        self.host = host
        self.port = port or free_port(host)
        self.admission = Admission()
        config = _uvicorn_config(self.engine, model_name, host, self.port, max_body_bytes, opts, self.admission)
        self.app = cast(Any, config.app)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="ggml-dist-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait_ready_s: float = 300.0) -> ServerThread:
        self.engine.start()
        self.thread.start()
        t0 = time.monotonic()
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() - t0 > 30:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        self.engine.wait_ready(wait_ready_s)
        return self

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop; with grace_s > 0 drain first, as serve does on SIGTERM."""
        if grace_s > 0:
            drain(self.engine, self.admission, grace_s)
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.app.state.checker.close()
        self.engine.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

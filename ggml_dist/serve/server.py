"""Running the app: `serve` (the CLI's blocking call) and `ServerThread` (uvicorn in a background thread,
for tests and benchmarks). Both start uvicorn before the model has loaded, so /health answers
"loading" (503) until every stage is up. `serve` stops on SIGTERM or SIGINT: uvicorn finishes, then
the engine, then the local Ray it started, every process of it.
"""
from __future__ import annotations

import signal
import socket
import threading
import time
from types import FrameType

import uvicorn

from .app import MAX_BODY_BYTES, create_app
from .engine import Engine, EngineConfig, ServingEngine
from .metrics import Metrics


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _uvicorn_config(engine: ServingEngine, model_name: str, host: str, port: int,
                    max_body_bytes: int) -> uvicorn.Config:
    app = create_app(engine, model_name, max_body_bytes)
    # one event loop thread; the engine thread does the compute. uvloop and httptools (C) where installed:
    # the loop thread's Python per streamed token holds the GIL the engine thread needs between kernels
    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=5, http="auto", loop="auto", lifespan="off")


def make_engine(cfg: EngineConfig, metrics: Metrics) -> ServingEngine:
    """The engine behind the app: one in this process, or a set of replica processes (--replicas)."""
    if cfg.n_replicas > 1:
        from .replicas import ReplicaSet
        return ReplicaSet(cfg, metrics)
    return Engine(cfg, metrics)


class _SignalledServer(uvicorn.Server):
    """uvicorn's server, which takes SIGTERM and SIGINT while it runs and raises them again once it has
    stopped. A local Ray started meanwhile (by the engine's thread) put absl's failure handler in
    front of SIGTERM, and that handler aborts the process 3 s after the signal unless disarmed."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        signal.alarm(0)                       # absl's abort timer; nothing else here sets an alarm
        super().handle_exit(sig, frame)


def serve(cfg: EngineConfig, model_name: str, host: str = "127.0.0.1", port: int = 8080,
          max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Serve until SIGTERM or SIGINT; the engine loads in the background meanwhile. uvicorn raises the
    signal again when it has stopped: SIGTERM then unwinds as SystemExit(143), SIGINT as
    KeyboardInterrupt, through the engine's shutdown and the local Ray's."""
    from ..workers.cluster import exit_on_signal, shutdown_local
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    engine = make_engine(cfg, Metrics()).start()
    try:
        _SignalledServer(_uvicorn_config(engine, model_name, host, port, max_body_bytes)).run()
    finally:
        try:
            engine.shutdown()
        finally:
            shutdown_local()
            signal.signal(signal.SIGTERM, previous)


class ServerThread:
    """uvicorn on a free loopback port in a daemon thread: `with ServerThread(cfg) as srv: srv.url`."""

    def __init__(self, cfg: EngineConfig, model_name: str = "model", host: str = "127.0.0.1",
                 port: int | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.engine = make_engine(cfg, Metrics())
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(_uvicorn_config(self.engine, model_name, host, self.port,
                                                     max_body_bytes))
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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.engine.shutdown()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

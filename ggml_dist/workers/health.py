"""Liveness of a stage actor that does not queue behind its compute calls.

A stage runs its calls one at a time, in order; a ping sent as an actor call waits behind every call
before it, including one whose upstream input never comes (the stage before it was cut off). So each
stage also answers on a TCP port of its own node's IP, from a daemon thread:

    HealthServer(host)    accept, write one line {"pid", "calls"}, close
    probe(addr, timeout)  the line, or None if the stage's node or process does not answer in time

The driver probes only when a result is late (past a deadline derived from the measured step time), so
a healthy pipeline pays nothing for it. The line carries no secrets and the server takes no input.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class HealthServer:
    def __init__(self, host: str, calls: Callable[[], int]) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._calls = calls
        threading.Thread(target=self._serve, name="stage-health", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                                  # closed
            with conn:
                try:
                    conn.sendall(json.dumps({"pid": os.getpid(), "calls": self._calls()}).encode() + b"\n")
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()


def probe(address: str, timeout: float = 2.0) -> dict | None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(256)
                if not chunk:
                    break
                data += chunk
        return json.loads(data)
    except (OSError, ValueError):
        return None


class StageWatch:
    """The driver's wait for stage results, with a deadline from the measured step time.

    Past the deadline (DEADLINE_FACTOR x the median of the recent waits, at least DEADLINE_MIN_S) it
    probes every stage's health port once a second; a stage that misses MISSES probes in a row (each
    PROBE_TIMEOUT_S) is declared lost, and the wait raises StageLostError for it. A stage that answers
    is only slow (compiling, a long prompt): the wait goes on."""
    DEADLINE_MIN_S = 3.0
    DEADLINE_FACTOR = 4.0
    PROBE_TIMEOUT_S = 2.0
    MISSES = 2

    def __init__(self, describe: Callable[[int], str]) -> None:
        self.addresses: list[str] = []           # health address per stage ("" = not known)
        self.recent: list[float] = []            # the last waits' durations, seconds
        self.lost: set[int] = set()              # stages declared unreachable, for the recovery
        self._describe = describe

    def deadline(self) -> float:
        med = sorted(self.recent)[len(self.recent) // 2] if self.recent else 0.0
        return max(self.DEADLINE_MIN_S, self.DEADLINE_FACTOR * med)

    def wait(self, handles: list) -> list:
        """ray.get(handles), or StageLostError for a stage that stopped answering. A result in time
        costs one ray.get; the probes start only past the deadline."""
        import time

        import ray
        import ray.exceptions as rex

        def ready(timeout: float) -> bool:
            return not ray.wait(handles, num_returns=len(handles), timeout=timeout)[1]
        t0 = time.perf_counter()
        try:
            out = ray.get(handles, timeout=self.deadline())
        except rex.GetTimeoutError:
            return self.await_result(ready, lambda: ray.get(handles))
        self.recent = [*self.recent, time.perf_counter() - t0][-16:]
        return out

    def await_result(self, ready: Callable[[float], bool], get: Callable[[], T]) -> T:
        """get() once ready(timeout) says the result is there (it waits up to timeout seconds for it,
        False if it is not there yet); past the deadline, the stages are probed between waits."""
        import time
        t0 = time.perf_counter()
        if not ready(self.deadline()):
            self._probe_until(ready)
        out = get()
        self.recent = [*self.recent, time.perf_counter() - t0][-16:]
        return out

    def _probe_until(self, ready: Callable[[float], bool]) -> None:
        from ..model.context import StageLostError
        misses = [0] * len(self.addresses)
        while not ready(0.0):
            for k, addr in enumerate(self.addresses):
                if addr and probe(addr, self.PROBE_TIMEOUT_S) is None:
                    misses[k] += 1
                    if misses[k] >= self.MISSES:
                        self.lost.add(k)
                        msg = (f"{self._describe(k)} stopped answering: no reply on its health port {addr} "
                               f"for {self.MISSES} probes after a {self.deadline():.1f} s deadline")
                        print(f"ggml-dist: {msg}", file=sys.stderr, flush=True)
                        raise StageLostError(msg, k)
                else:
                    misses[k] = 0
            if ready(1.0):
                return

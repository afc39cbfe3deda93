"""Liveness of a stage actor that does not queue behind its compute calls.

A stage runs its calls one at a time, in order; a ping sent as an actor call waits behind every call
before it, including one whose upstream input never comes (the stage before it was cut off). So each
stage also answers on a TCP port of its own node's IP, from a daemon thread:

    HealthServer(host, status)  accept, write one line {"pid", "calls", "busy_s", "cpu_s"}, close
    probe(addr, timeout)        the line, or None if the stage's node or process does not answer in time

The driver probes only when a result is late (past a deadline derived from the measured step time), so
a healthy pipeline pays nothing for it. The line carries no secrets and the server takes no input.

Answering is not progress: a stage whose compute is wedged (blocked on a lock, a read that never
returns) still answers. So the line also says how long the stage has been in its current call (busy_s,
None when idle) and how much CPU the thread running it has used (cpu_s): a stage busy in one call
whose thread's CPU time does not move for STALL_S is declared lost too, however long its calls take
(a long prompt on a slow host keeps its thread's CPU time moving).
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
    def __init__(self, host: str, status: Callable[[], dict]) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._status = status
        threading.Thread(target=self._serve, name="stage-health", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return                                  # closed
            with conn:
                try:
                    conn.sendall(json.dumps({"pid": os.getpid(), **self._status()}).encode() + b"\n")
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
    PROBE_TIMEOUT_S) is declared lost, and so is one that stays in one call without its thread using
    any CPU for STALL_S (wedged), and the wait raises StageLostError for it. A stage that answers and
    computes is only slow (compiling, a long prompt): the wait goes on."""
    DEADLINE_MIN_S = 3.0
    DEADLINE_FACTOR = 4.0
    PROBE_TIMEOUT_S = 2.0
    MISSES = 2
    STALL_S = 20.0
    STALL_CPU_S = 0.005              # CPU a computing thread uses in STALL_S, at the very least

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
        import time
        misses = [0] * len(self.addresses)
        still: dict[int, tuple[float, float, float]] = {}     # stage -> (call start, cpu_s, when first seen)
        while not ready(0.0):
            for k, addr in enumerate(self.addresses):
                line = probe(addr, self.PROBE_TIMEOUT_S) if addr else {}
                if line is None:
                    misses[k] += 1
                    if misses[k] >= self.MISSES:
                        self._lose(k, f"stopped answering: no reply on its health port {addr} for {self.MISSES} "
                                      f"probes after a {self.deadline():.1f} s deadline")
                    continue
                misses[k] = 0
                busy, cpu = line.get("busy_since"), line.get("cpu_s")
                if busy is None or cpu is None:
                    still.pop(k, None)
                    continue
                now = time.monotonic()
                seen = still.get(k)
                if seen is None or seen[0] != busy or cpu - seen[1] > self.STALL_CPU_S:
                    still[k] = (busy, cpu, now)
                elif now - seen[2] >= self.STALL_S:
                    self._lose(k, f"is wedged: in one call for {line.get('busy_s', 0):.0f} s, its thread used "
                                  f"{cpu - seen[1]:.3f} s of CPU in the last {now - seen[2]:.0f} s")
            if ready(1.0):
                return

    def _lose(self, k: int, why: str) -> None:
        from ..backends.base import StageLostError
        self.lost.add(k)
        msg = f"{self._describe(k)} {why}"
        print(f"ggml-dist: {msg}", file=sys.stderr, flush=True)
        raise StageLostError(msg, k)

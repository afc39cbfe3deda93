"""`ggml-dist serve` in a process of its own, for the tests that must see the process survive (or exit):
a crash of the server there is a dead process the test can tell, not a dead test run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CLIServer:
    """`python -m ggml_dist.cli serve --model M --port P *args`, its stderr in log_path; start() waits
    for /health ok (or the process to exit)."""

    def __init__(self, model: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "ggml_dist.cli", "serve", "--model", model, "--port", str(self.port), *args]
        self.log_path = log_path
        self.env = {**os.environ, "GGML_DIST_API_KEY": "", **(env or {})}
        self.headers = headers or {}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> CLIServer:
        self._log = open(self.log_path, "wb")      # noqa: SIM115 - open as long as the server runs
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                return self
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert time.monotonic() - t0 < timeout, f"the server did not start: {self.log()[-2000:]}"
            time.sleep(0.1)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def post(self, path: str, body: object = None, content: bytes | None = None, **kw: object) -> httpx.Response:
        headers = {"Content-Type": "application/json", **self.headers, **kw.pop("headers", {})}  # type: ignore[dict-item]
        if content is None:
            import json
            content = json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers=headers, timeout=kw.pop("timeout", 60))  # type: ignore[arg-type]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def __enter__(self) -> CLIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

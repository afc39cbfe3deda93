"""What an open page costs a serving server: 8 streaming clients against `ggml-dist serve --stages 2` with
the page closed, with its data stream open (what the server pays: the live thread's readings and one
server-sent-events stream), and with the page open in a headless chromium on the same machine (the
browser's own CPU besides), interleaved; with --baseline DIR, the same clients against the server of the
code in DIR (a checkout without the page: today's) first.

    python benchmarks/page_cost.py [--model smollm2-135m] [--duration 20] [--repeat 2] [--baseline /work/main]

Prints one JSON object: each condition's aggregate tok/s per run (benchmarks/serve.py's clients).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import ServerProcess

from ggml_dist.bench.clients import run_clients


@contextlib.contextmanager
def stream_open(url: str) -> Iterator[None]:
    """The page's data stream read as the page reads it, in a thread, for the block's length."""
    stop = threading.Event()

    def read() -> None:
        with httpx.stream("GET", url + "/live/events", timeout=None) as r:
            for _ in r.iter_raw():
                if stop.is_set():
                    return
    t = threading.Thread(target=read, daemon=True)
    t.start()
    _wait_watching(url, 1)
    try:
        yield
    finally:
        stop.set()
        t.join(timeout=10)


@contextlib.contextmanager
def browser_open(url: str) -> Iterator[None]:
    """The page in a headless chromium (kept alive by its DevTools port) for the block's length."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("no chromium: `apt-get install chromium`, or leave out the browser condition")
    profile = tempfile.mkdtemp(prefix="ggml-dist-page-")
    proc = subprocess.Popen([exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", url + "/"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_watching(url, 1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


def _wait_watching(url: str, n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/live", timeout=30).json()["watching"] < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the page's stream did not open within {timeout_s:.0f} s")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--baseline", default=None, help="a checkout whose server is today's (no page)")
    ap.add_argument("--conditions", default="closed,stream,browser")
    args = ap.parse_args()
    from ggml_dist.model.pull import resolve_model
    path = str(resolve_model(args.model))
    out: dict = {"model": args.model, "clients": args.clients, "stages": 2, "duration_s": args.duration,
                 "max_tokens": args.max_tokens, "runs": {}}

    def point(srv: ServerProcess) -> float:
        r = run_clients(srv.url, args.clients, args.duration, args.max_tokens)
        assert not r["errors"], r["errors"][:3]
        return float(r["aggregate_tok_s"])

    here = os.getcwd()
    if args.baseline:
        os.chdir(args.baseline)                  # `python -c` puts the working directory first on sys.path
        try:
            with ServerProcess(path, 2, args.clients, 256 * args.clients) as srv:
                point(srv)                       # warm-up: kernels, plans, prompt cache
                out["runs"]["today"] = [point(srv) for _ in range(args.repeat)]
        finally:
            os.chdir(here)
    opening = {"closed": contextlib.nullcontext, "stream": stream_open, "browser": browser_open}
    conditions = args.conditions.split(",")
    with ServerProcess(path, 2, args.clients, 256 * args.clients) as srv:
        point(srv)
        for _ in range(args.repeat):
            for c in conditions:
                with opening[c](srv.url) if c != "closed" else contextlib.nullcontext():
                    out["runs"].setdefault(c, []).append(point(srv))
    out["median_tok_s"] = {k: sorted(v)[len(v) // 2] for k, v in out["runs"].items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Serving benchmark: N concurrent streaming clients against `ggml-dist serve` for a fixed time.

    python benchmarks/serve.py [--model smollm2-135m] [--duration 30] [--clients 1,4,8] [--stages 1,2]
                               [--repeat 1] [--replicas 1,2]
    python benchmarks/serve.py --soak 16 --duration 20      # concurrency soak on a synthetic model

Each (stages, clients) point starts `ggml-dist serve` as its own process on a free loopback port
(--parallel = the largest client count; as users run it, so the clients' threads here do not share the
server's GIL; with --replicas R the one-stage server runs R engine processes, and a list of R values
runs a server each, their points interleaved), runs the clients (the standard library's HTTP client,
light on the cores they share with the server) for --duration seconds, and reports requests completed,
errors, aggregate generated tok/s over those seconds (requests in flight at the deadline finish and
count as requests; aggregate_tok_s_with_drain also counts their tokens past it, over the whole wall
time), p50/p99 time to first token and inter-token latency, and the prompt tokens admitted and found in
the server's prompt cache
(each client repeats its prompt: all but its last token are cached after its first request; with
--no-cache-prompt every prompt is evaluated whole). `single_stream_decode_tok_s` is generate()'s
decode rate in this process, without the server, for comparison: each sample is the median of three
runs of --max-tokens tokens, taken before the first point and after each one, while that point's
server sits idle (`single_stream_decode_samples`); a point's `x_single_stream` divides its rate by the
mean of the two samples that bracket it in time (this machine's speed drifts within minutes). With
--repeat R each server runs its client counts R times, interleaved, and `summary` gives each point's
median, min and max over the R runs.
`batched_decode` gives the decode rate of steps taking one token from each of 1 and N sequences,
without a server, here and (with llama-cpp-python installed) in llama.cpp on the same file, with a KV
stream per sequence (the server's default) and with one unified cache: what batching itself can give on
this machine. The soak mode mixes streaming, non-streaming, chat, early disconnects and bad requests
from N clients and counts every unexpected answer as an error. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from ggml_dist.bench.clients import PROMPTS, run_clients


def single_stream_decode(path: str, n: int) -> float:
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.generate import generate
    from ggml_dist.model.model import LlamaModel
    m = LlamaModel.load(path)
    ctx = LlamaContext(m, ContextParams(n_ctx=512))
    ids = m.tokenizer.encode(PROMPTS[0])
    generate(ctx, m.tokenizer, ids, 2)                 # warm-up (kernel compile, plans)
    rates = []
    for _ in range(3):                                 # the median of three: this machine is noisy
        ctx.clear()
        rates.append(generate(ctx, m.tokenizer, ids, n, stop_at_eog=False).decode_tok_s)
    return round(float(np.median(rates)), 3)


# -- batched decode without a server: what one step of N sequences gives, here and in llama.cpp ------

_PREFIX = 40                                    # tokens each sequence holds before the timed steps
_STEPS = 20


def batched_decode(path: str, n_seqs: int, unified: bool = False) -> float:
    """tok/s of decode steps taking one token from each of n_seqs sequences (ctx.decode, no server),
    with a KV stream per sequence (the server's default) or one unified cache."""
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.ubatch import Batch
    m = LlamaModel.load(path)
    ctx = LlamaContext(m, ContextParams(n_ctx=n_seqs * 256, n_seq_max=n_seqs, kv_unified=unified))
    P = _PREFIX
    for s in range(n_seqs):
        ctx.decode(Batch(np.arange(100, 100 + P, dtype=np.int32), np.arange(P, dtype=np.int32),
                         [frozenset({s})] * P, np.arange(P) == P - 1))
    times = []
    for step in range(_STEPS):
        b = Batch(np.full(n_seqs, 7, np.int32), np.full(n_seqs, P + step, np.int32),
                  [frozenset({s}) for s in range(n_seqs)], np.ones(n_seqs, bool))
        t0 = time.perf_counter()
        ctx.decode(b)
        times.append(time.perf_counter() - t0)
    return round(n_seqs / float(np.median(times[2:])), 2)


def llamacpp_batched_decode(path: str, n_seqs: int, threads: int, unified: bool = False) -> float | None:
    """The same steps through llama.cpp (llama-cpp-python's C API, the same KV layout; flash attention
    left to llama.cpp's default); None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(path, n_ctx=256, n_threads=threads, verbose=False)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_seqs * 256, 512, 512, n_seqs
    cp.n_threads = cp.n_threads_batch = threads
    cp.kv_unified = unified
    ctx = llama_cpp.llama_init_from_model(llm.model, cp)
    batch = llama_cpp.llama_batch_init(512, 0, n_seqs)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, out) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, out
            batch.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
    try:
        P = _PREFIX
        for s in range(n_seqs):
            decode([(100 + j, j, s, j == P - 1) for j in range(P)])
        times = []
        for step in range(_STEPS):
            t0 = time.perf_counter()
            decode([(7, P + step, s, True) for s in range(n_seqs)])
            times.append(time.perf_counter() - t0)
        return round(n_seqs / float(np.median(times[2:])), 2)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)


def batched_decode_table(path: str, n_max: int) -> dict:
    from ggml_dist.backends.cpu import threads as kernel_threads
    threads = kernel_threads.get_threads()
    table: dict = {"threads": threads}
    for n in sorted({1, n_max}):
        for unified in ((False,) if n == 1 else (False, True)):
            key = str(n) if n == 1 else f"{n}_{'unified' if unified else 'streams'}"
            table[key] = {"ggml_dist_tok_s": batched_decode(path, n, unified),
                          "llamacpp_tok_s": llamacpp_batched_decode(path, n, threads, unified)}
    return table


class ServerProcess:
    """`ggml-dist serve` in a child process on a free loopback port, ready (GET /health) on entry,
    stopped with SIGINT (uvicorn's graceful shutdown; a Ray cluster it started goes with it) on exit."""

    def __init__(self, path: str, stages: int, parallel: int, ctx: int, timeout_s: float = 600.0,
                 kv_unified: str = "auto", cache_prompt: bool = True, replicas: int = 1,
                 stage_calls: str = "auto", lookahead: int | None = None) -> None:
        from ggml_dist.serve.server import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ggml-dist-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-c", "import sys; from ggml_dist.cli import main; sys.exit(main())", "serve",
               "--model", path, "--port", str(self.port), "--stages", str(stages), "--parallel", str(parallel),
               "--ctx", str(ctx), "--kv-unified", kv_unified, "--replicas", str(replicas)]
        cmd += ["--stage-calls", stage_calls] if stages > 1 else []
        cmd += ["--lookahead", str(lookahead)] if stages > 1 and lookahead else []
        cmd += [] if cache_prompt else ["--no-cache-prompt"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self._tail()}")
            if time.monotonic() - t0 > timeout_s:
                self.stop()
                raise RuntimeError(f"server not ready after {timeout_s:.0f} s: {self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def _tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-2000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bench(args: argparse.Namespace) -> dict:
    from ggml_dist.model.pull import resolve_model
    path = str(resolve_model(args.model))
    clients = [int(x) for x in args.clients.split(",")]
    stages = [int(x) for x in args.stages.split(",")]
    replicas = [int(x) for x in args.replicas.split(",")]
    out: dict = {"model": Path(path).name, "duration_s": args.duration, "max_tokens": args.max_tokens,
                 "kv_unified": args.kv_unified, "replicas": replicas,
                 "batched_decode": batched_decode_table(path, max(clients)),
                 "runs": []}
    # the single-stream rate is sampled right before and right after each point: this machine's speed
    # drifts by tens of percent within minutes, so each point's ratio uses the mean of the two samples
    # that bracket it in time (x_single_stream), and the overall median of all samples is reported too
    singles = [single_stream_decode(path, args.max_tokens)]

    def measure(servers: list[tuple[int, int, ServerProcess]]) -> None:
        for rep, (k, R, srv), n in ((rep, s, n) for rep in range(args.repeat) for s in servers for n in clients):
            before = _prompt_counters(srv.url)
            r = run_clients(srv.url, n, args.duration, args.max_tokens)
            after = _prompt_counters(srv.url)
            r["prompt_tokens"], r["prompt_tokens_cached"] = (b - a for a, b in zip(before, after))
            r["stages"], r["replicas"], r["repeat"] = k, R, rep
            singles.append(single_stream_decode(path, args.max_tokens))
            r["single_stream_decode_tok_s"] = round((singles[-2] + singles[-1]) / 2, 3)
            r["x_single_stream"] = round(r["aggregate_tok_s"] / r["single_stream_decode_tok_s"], 2)
            print(json.dumps(r), file=sys.stderr)
            out["runs"].append(r)

    def server(k: int, R: int) -> ServerProcess:
        return ServerProcess(path, k, max(clients), max(clients) * 256, kv_unified=args.kv_unified,
                             cache_prompt=not args.no_cache_prompt, replicas=R, stage_calls=args.stage_calls,
                             lookahead=args.lookahead)
    # the one-stage servers (one per --replicas value) are all up at once, idle but for the one measured,
    # so that their points interleave in time; a pipeline's Ray processes are never idle, so each
    # pipeline runs alone, afterwards
    if 1 in stages:
        with contextlib.ExitStack() as stack:
            measure([(1, R, stack.enter_context(server(1, R))) for R in replicas])
    for k in (k for k in stages if k != 1):
        with server(k, 1) as srv:
            measure([(k, 1, srv)])
    out["single_stream_decode_samples"] = singles
    out["single_stream_decode_tok_s"] = round(float(np.median(singles)), 3)
    out["summary"] = _summary(out["runs"])
    return out


def _summary(runs: list[dict]) -> list[dict]:
    """Per (stages, replicas, clients): the median, min and max over --repeat runs of the aggregate rate
    and of x_single_stream, and the errors in all of them."""
    points: dict[tuple[int, int, int], list[dict]] = {}
    for r in runs:
        points.setdefault((r["stages"], r["replicas"], r["clients"]), []).append(r)
    return [{"stages": k, "replicas": R, "clients": n, "runs": len(rs), "errors": sum(r["errors"] for r in rs),
             **{f"{key}_{f.__name__}": round(float(f([r[key] for r in rs])), 3)
                for key in ("aggregate_tok_s", "x_single_stream") for f in (np.median, min, max)}}
            for (k, R, n), rs in points.items()]


def _metric(text: str, name: str) -> float:
    """One unlabelled sample of /metrics text (Prometheus format)."""
    return float(re.search(rf"^ggml_dist_{name} (\S+)$", text, re.M).group(1))


def _prompt_counters(url: str) -> tuple[int, int]:
    """The server's prompt tokens admitted, and those found in a slot's cache (so not evaluated)."""
    text = httpx.get(url + "/metrics").text
    return int(_metric(text, "prompt_tokens_total")), int(_metric(text, "prompt_tokens_cached_total"))


# -- soak ----------------------------------------------------------------------------------------------

def soak(args: argparse.Namespace) -> dict:
    """N clients for --duration s: random request kinds; any unexpected answer counts as an error."""
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    from ggml_dist.model.context import ContextParams
    from ggml_dist.runtime import RunConfig
    from ggml_dist.serve import EngineConfig, ServerThread
    chatml = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
              "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    path = args.soak_model or str(write_synthetic(Path(tempfile.mkdtemp()) / "soak.gguf",
                                                  SyntheticSpec(n_layer=2, tied=False, seed=3)))
    counts: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + args.duration

    def note(kind: str, ok: bool, detail: str = "") -> None:
        with lock:
            counts[kind] = counts.get(kind, 0) + 1
            if not ok:
                errors.append(f"{kind}: {detail[:200]}")

    def client(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(timeout=120) as c:
            while time.perf_counter() < deadline:
                kind = rng.choice(["stream", "plain", "chat", "disconnect", "bad", "stop"])
                body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 40),
                        "temperature": rng.choice([0, 0.8])}
                try:
                    if kind == "stream" or kind == "disconnect":
                        with c.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
                            ok = r.status_code in (200, 429)
                            n = 0
                            for line in r.iter_lines():
                                n += 1
                                if kind == "disconnect" and n >= 3:
                                    break
                            note(kind, ok, str(r.status_code))
                    elif kind == "chat":
                        r = c.post(url + "/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": body["prompt"]}],
                                         "max_tokens": body["max_tokens"]})
                        note(kind, r.status_code in (200, 429) and
                             (r.status_code == 429 or r.json()["choices"][0]["message"]["role"] == "assistant"),
                             r.text)
                    elif kind == "bad":
                        r = c.post(url + "/v1/completions", content=b'{"prompt": "x", "max_tokens": "many"}')
                        note(kind, r.status_code == 400 and "error" in r.json(), r.text)
                    else:
                        r = c.post(url + "/v1/completions", json={**body, "stop": [" ", "e"]})
                        note(kind, r.status_code in (200, 429), r.text)
                except Exception as e:
                    note(kind, False, f"{type(e).__name__}: {e}")

    cfg = EngineConfig(RunConfig(path, ContextParams(n_ctx=args.parallel * 256)), n_parallel=args.parallel,
                       max_queue=args.soak, chat_template=chatml)
    with ServerThread(cfg) as srv:
        url = srv.url
        threads = [threading.Thread(target=client, args=(k,)) for k in range(args.soak)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
    leaked = (health["slots_processing"] != 0
              or _metric(metrics, "kv_cells_used") != _metric(metrics, "kv_cells_cached"))
    return {"mode": "soak", "clients": args.soak, "parallel": args.parallel, "wall_s": round(wall, 2),
            "requests": counts, "errors": len(errors) + int(leaked), "error_samples": errors[:5],
            "slots_leaked": leaked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds per point (soak: in all)")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each server's client counts this many times, interleaved (medians in summary)")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="tokens per request (with few, each request's prefill dominates the steps)")
    ap.add_argument("--kv-unified", choices=["auto", "on", "off"], default="auto",
                    help="the server's --kv-unified (auto: a stream per slot in one process)")
    ap.add_argument("--no-cache-prompt", action="store_true",
                    help="the server's --no-cache-prompt: every prompt is evaluated whole (each client here "
                    "repeats its prompt, which the prompt cache otherwise serves but for its last token)")
    ap.add_argument("--replicas", default="1",
                    help="the one-stage server's --replicas (engine processes sharing the slots and cores); "
                    "several values: one server each, all up at once, their points interleaved")
    ap.add_argument("--stage-calls", choices=["auto", "compiled", "plain"], default="auto",
                    help="a pipeline server's --stage-calls (compiled graph or plain actor calls)")
    ap.add_argument("--lookahead", type=int, default=None,
                    help="a pipeline server's --lookahead (steps of a group in flight; 1: no token feedback)")
    ap.add_argument("--soak", type=int, default=0, help="run the soak with this many clients instead")
    ap.add_argument("--soak-model", default=None, help="GGUF for the soak (default: a synthetic one)")
    ap.add_argument("--parallel", type=int, default=4, help="server slots in the soak")
    args = ap.parse_args(argv)
    print(json.dumps(soak(args) if args.soak else bench(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`ggml-dist serve`'s own options (beside a run's: config.add_run_args) and the command: the engine's
configuration (serve.EngineConfig) and the HTTP server's (serve.server.ServeOptions) from them.
"""
from __future__ import annotations

import argparse
import sys

from .config import run_config


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", type=int, default=4, help="sequences decoded together (KV slots)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before "
                   "new ones get 429")
    p.add_argument("--lookahead", type=int, default=1, metavar="N",
                   help="over stages: steps of a group of sequences in flight, the later ones fed their tokens "
                        "by the last stage (default 1: off; 2 was slower with 8 clients: docs/api.md)")
    p.add_argument("--replicas", type=int, default=1, help="engine processes in this machine, each with "
                   "parallel/replicas of the slots, the cores split among those with requests: more "
                   "throughput with many clients on a multi-core CPU; each process loads the model")
    p.add_argument("--pooling", choices=["mean", "last", "cls", "none"], default=None,
                   help="/v1/embeddings: how a prompt's final-norm rows are pooled (llama-server's "
                   "--pooling; without it the endpoint answers 400); none: /embedding gives every "
                   "token's row")
    p.add_argument("--kv-unified", choices=["auto", "on", "off"], default="auto",
                   help="one KV cache stream shared by the slots (on), or a stream per slot whose attention "
                   "spans only its own cells (off); auto: off in one process, on over a pipeline")
    p.add_argument("--no-cache-prompt", action="store_true", help="do not keep a finished request's "
                   "tokens in its slot for a later prompt that starts with them (kept by default, with a "
                   "KV stream per slot, as llama-server's cache_prompt)")
    p.add_argument("--checkpoint-every", type=int, default=512, metavar="N", help="a model with recurrent "
                   "layers (Qwen3.5): its slots copy their state every N tokens of a long prompt, besides at "
                   "the prompt's last token but one and the end of each answer, so a prompt that shares a "
                   "prefix with a slot's cache goes back to a copy instead of position 0")
    p.add_argument("--checkpoint-mib", type=int, default=256, metavar="MIB", help="the state copies' "
                   "budget, all slots and stages together (past it the oldest goes; 0: none kept)")
    p.add_argument("--temp", type=float, default=None, help="the temperature of requests that set none "
                   "(llama-server's flag; default: each API's own, OpenAI's 1.0, /completion's 0.8)")
    p.add_argument("--seed", type=int, default=None, help="the seed of requests that set none (llama-server's "
                   "flag; default: a random one per request)")
    p.add_argument("--n-predict", type=int, default=None, help="the max_tokens/n_predict of requests that set "
                   "none (llama-server's flag; -1: until the context per request is full)")
    p.add_argument("--alias", default=None, help="model id reported by /v1/models")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file, for models "
                   "whose GGUF has none")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but "
                   "/health (default: $GGML_DIST_API_KEY; none: open)")
    p.add_argument("--insecure-no-api-key", action="store_true", help="allow a non-loopback --host without "
                   "an API key (anyone who reaches the port may generate)")
    p.add_argument("--allowed-hosts", default="", metavar="NAMES", help="comma-separated Host header names "
                   "answered besides the bound address and localhost (IP literals always are; * for any): "
                   "other names get 403, against DNS rebinding")
    p.add_argument("--shutdown-grace", type=float, default=10.0, metavar="S", help="on SIGTERM, seconds the "
                   "running requests get to finish (new ones get 503) before they end with an error (default 10)")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S", help="seconds a connection may "
                   "take to send a request's headers (default 10)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S", help="seconds a request may take "
                   "to send its body (default 30; then 408)")
    p.add_argument("--max-connections", type=int, default=1000, metavar="N", help="connections open at once "
                   "(default 1000; past it new ones are closed, and requests get 503)")


def cmd_serve(args: argparse.Namespace) -> int:
    """`ggml-dist serve`: the engine and its HTTP server, until a stop signal."""
    import os
    from pathlib import Path

    from .serve import EngineConfig, serve
    from .serve.guard import HTTPPolicy
    from .serve.server import ServeOptions, check_bind
    api_key = args.api_key or os.environ.get("GGML_DIST_API_KEY") or None
    check_bind(args.host, api_key, args.insecure_no_api_key)
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    opts = ServeOptions(policy=HTTPPolicy.for_bind(args.host, api_key, hosts, body_timeout_s=args.body_timeout),
                        header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                        shutdown_grace_s=args.shutdown_grace)
    cfg = EngineConfig(run_config(args, serving=True), n_parallel=args.parallel, max_queue=args.max_queue,
                       lookahead=args.lookahead, kv_unified={"auto": None, "on": True, "off": False}[args.kv_unified],
                       cache_prompt=not args.no_cache_prompt, n_replicas=args.replicas, pooling=args.pooling,
                       checkpoint_every=args.checkpoint_every, checkpoint_mib=args.checkpoint_mib,
                       request_defaults=tuple((k, v) for k, v in (("temperature", args.temp), ("seed", args.seed),
                                                                  ("n_predict", args.n_predict)) if v is not None),
                       chat_template=Path(args.chat_template).read_text() if args.chat_template else None)
    name = args.alias or Path(args.model).stem
    print(f"ggml-dist serve: {name} on http://{args.host}:{args.port}/v1 ({args.parallel} slots of "
          f"{args.ctx // args.parallel} tokens{f' over {args.replicas} replicas' if args.replicas > 1 else ''}); "
          f"loading, see /health", file=sys.stderr)
    stopped_by = serve(cfg, name, args.host, args.port, opts=opts)
    return 128 + stopped_by if stopped_by else 0

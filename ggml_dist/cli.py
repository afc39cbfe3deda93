"""The `ggml-dist` command: pull, run, logits, plan, tokenize, serve, bench, warmup."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="a run config (JSON or YAML, see configs/); "
                   "command-line options override it")
    p.add_argument("--model", default=None, help="a GGUF path or a known name (smollm2-135m)")
    p.add_argument("--ctx", type=int, default=2048, help="context size in tokens (default 2048)")
    p.add_argument("--batch", type=int, default=512, help="n_batch (default 512)")
    p.add_argument("--ubatch", type=int, default=512, help="n_ubatch (default 512)")
    p.add_argument("--cache-type", choices=["f16", "f32"], default="f16", help="KV cache type")
    p.add_argument("--exact", action="store_true",
                   help="keep f32 activations in matmuls instead of ggml's quantized vec_dot numerics")
    p.add_argument("--stages", type=_stages_arg, default=None,
                   help="pipeline stages (Ray actors), or auto: the fewest that fit the cluster's nodes, "
                   "one per node; 1 without --address runs in this process")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: start a "
                   "local Ray, or join the cluster of a `ray job submit` job)")
    p.add_argument("--layers", default=None, help="explicit layer ranges per stage, first:end with the end "
                   "exclusive, e.g. 0:15,15:30 (the older inclusive 0-14,15-29 is accepted too)")
    p.add_argument("--n-copies", type=int, default=None, help="micro-batches in flight (default: 4, as "
                   "llama.cpp's pipeline parallelism)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (per stage with --stages; default: the cores available, 1 per stage)")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the stages here")
    _add_stage_calls(p)


def _add_stage_calls(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage-calls", choices=["auto", "direct", "compiled", "plain"], default="auto",
                   help="how a step reaches the stages: frames on sockets between the driver and the stages, "
                   "stage to stage (direct), one Ray Compiled Graph execution, or a Ray actor call per stage; "
                   "auto: direct, plain where the links cannot be opened")


def _stages_arg(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stages takes a number or auto, got '{v}'") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"--stages must be at least 1, got {k}")
    return k


def _on_cluster(args: argparse.Namespace) -> bool:
    """Joining a cluster: --address, or inside a `ray job submit` job (RAY_ADDRESS)."""
    import os
    return bool(args.address or os.environ.get("RAY_ADDRESS"))


class _DefaultsFormatter(argparse.HelpFormatter):
    """--help with each option's default, where its help does not state it already (a flag's False and
    an unset None are not defaults worth a word)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        h = action.help or ""
        if (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                and "default" not in h):
            h += " (default: %(default)s)"
        return h.strip()


def _version() -> str:
    """ggml-dist's version and those of what it runs on (package metadata: nothing is imported)."""
    from importlib import metadata
    from platform import python_version

    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"
    return f"ggml-dist {v('ggml-dist')} (Python {python_version()}, numba {v('numba')}, ray {v('ray')})"


def _known_models_text() -> str:
    from .model.pull import KNOWN_MODELS, cache_dir
    return (f"a known model: {', '.join(f'{k} ({m.member})' for k, m in sorted(KNOWN_MODELS.items()))}; "
            f"cached in {cache_dir()}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggml-dist", description=__doc__)
    ap.add_argument("--version", action="version", version=_version())
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="fetch a known model into the cache and print its path")
    p.add_argument("name", help=_known_models_text())
    p.add_argument("--verify", action="store_true", help="hash the cached file in full (a file that does "
                   "not match is deleted and fetched again)")

    p = sub.add_parser("run", help="generate text")
    _add_model_args(p)
    p.add_argument("--prompt", default=None)
    p.add_argument("-n", "--n-predict", type=int, default=None, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=None, help="temperature (default 0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--inject-fault", default=None, metavar="kill-stage:K:after-token:N",
                   help="kill stage K's actor (kill-stage) or make its next call block (wedge-stage) after N "
                   "generated tokens; the run recovers")
    p.add_argument("--parallel", type=int, default=1, metavar="N",
                   help="N continuations of the prompt decoded together (sequence i samples with seed + i); "
                        "over stages they form one micro-batch per stage, which overlap")
    p.add_argument("--lookahead", type=int, default=None, metavar="N",
                   help="decode steps queued before a token is read, the later ones fed their token by the "
                        "last stage (default: 2 over stages, for --parallel over direct stage calls; else 1)")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics: every token's "
                   "logits as if it were evaluated alone (llama.cpp's with --ubatch 1), whatever the batch, "
                   "ubatch size or prompt cache (prompts on K-quant or F16 weights run a few percent slower)")

    p = sub.add_parser("logits", help="write the logits of every position of a token list")
    _add_model_args(p)
    p.add_argument("--tokens", required=True, help="comma-separated token ids (no BOS is added)")
    p.add_argument("--out", required=True, help="output .npz (array 'logits' [n_tokens, n_vocab])")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics: every token's "
                   "logits as if it were evaluated alone (llama.cpp's with --ubatch 1), whatever the batch, "
                   "ubatch size or prompt cache (prompts on K-quant or F16 weights run a few percent slower)")

    p = sub.add_parser("plan", help="print the placement of a model's layers over pipeline stages")
    _add_model_args(p)
    p.add_argument("--budget-gib", default=None,
                   help="memory budget per stage in GiB: one value, or one per stage (comma-separated)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    p.add_argument("--model", required=True, help="a GGUF path or a known name (smollm2-135m)")
    p.add_argument("--stages", type=_stages_arg, default=1, help="pipeline stages (Ray actors), or auto: "
                   "the fewest that fit the cluster's nodes; 1 without --address serves from this process")
    p.add_argument("--address", default=None, help="Ray cluster address to join")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", type=int, default=4, help="sequences decoded together (KV slots)")
    p.add_argument("--ctx", type=int, default=2048, help="KV cache cells, shared by the slots "
                   "(each request gets ctx/parallel)")
    p.add_argument("--batch", type=int, default=512, help="tokens per micro-batch at most")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before "
                   "new ones get 429")
    p.add_argument("--threads", type=int, default=1, help="threads per stage actor")
    _add_stage_calls(p)
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
    p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics: a request's "
                   "tokens and logprobs to the bit whatever else is served, with or without a prompt cache hit "
                   "(every token's logits as if evaluated alone); one process only")
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

    p = sub.add_parser("bench", help="benchmarks (each prints one JSON object)")
    p.add_argument("what", choices=["alloc", "pipeline", "decode", "faults", "fuzz-gguf", "cluster"])
    p.add_argument("rest", nargs=argparse.REMAINDER)

    p = sub.add_parser("warmup", help="compile the model's kernels into the kernel cache now (for images and "
                       "cluster nodes: the first run then starts with the compiled kernels)")
    p.add_argument("--model", required=True, help="a GGUF path or a known name (smollm2-135m)")
    p.add_argument("--threads", default=None, metavar="N[,N...]", help="the thread counts to compile for "
                   "(default: 1, as a stage actor runs, and the cores available, as one process runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object: seconds in all and per kernel")

    for name, sp in sub.choices.items():     # every subcommand: its defaults in --help, and --verbose
        sp.formatter_class = _DefaultsFormatter
        for a in sp._actions:                # an option without help gets a line for its default
            if a.help is None and a.option_strings and a.default not in (None, False, argparse.SUPPRESS):
                a.help = "(default: %(default)s)"
        if name != "bench":                  # (bench hands its arguments on as they are)
            sp.add_argument("--verbose", action="store_true", help="also show Ray's own notices (token auth, "
                            "connecting to a cluster, packaging the code for the job) and its info lines")
    return ap


def _exit_on_stop_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "serve":
        # a server's signals are its own from here (serve/server.py takes them over once its modules
        # are in), whatever the disposition it inherited
        import signal
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _exit_on_stop_signal)
    if getattr(args, "verbose", False):           # read by workers/cluster.connect (and serve's replicas)
        import os
        os.environ["GGML_DIST_VERBOSE"] = "1"
    if args.cmd in ("run", "serve", "bench", "warmup"):     # a first run's kernel compiles announce themselves
        from .backends.cpu.compile_progress import install
        install(f"ggml-dist {args.cmd}")
    try:
        return _COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"ggml-dist {args.cmd}: error: {e}", file=sys.stderr)
        return 1


def _cmd_pull(args: argparse.Namespace) -> int:
    from .model.pull import pull
    print(pull(args.name, verify=args.verify))
    return 0


_CONFIG_KEYS = {"model", "ctx", "batch", "ubatch", "cache_type", "exact", "stages", "address", "layers",
                "n_copies", "threads", "trace", "prompt", "n_predict", "temp", "seed", "chat", "budget_gib"}
_DEFAULTS = {"stages": 1, "threads": 1, "n_predict": 64, "temp": 0.0}


def _apply_config(args: argparse.Namespace) -> None:
    """Fill options not given on the command line from --config, then the defaults."""
    if getattr(args, "config", None):
        from .config import load_run_config
        for k, v in load_run_config(args.config, _CONFIG_KEYS).items():
            if getattr(args, k, None) in (None, False):
                setattr(args, k, v)
    args.threads_given = getattr(args, "threads", None) is not None
    for k, v in _DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if not getattr(args, "model", None):
        raise ValueError("no model: give --model NAME_OR_PATH (or a --config that names one)")


def _parse_layers(spec: str | None) -> list[tuple[int, int]] | None:
    """--layers: `first:end` ranges (end exclusive; the older inclusive `first-last` too)."""
    if not spec:
        return None
    from .workers.placement import parse_layers
    return parse_layers(spec)


def _params(args: argparse.Namespace):
    from .core.types import GGMLType
    from .model.context import ContextParams
    kv_type = GGMLType.F16 if args.cache_type == "f16" else GGMLType.F32
    return ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.ubatch, type_k=kv_type,
                         type_v=kv_type, exact=args.exact, background_compile=True,
                         n_seq_max=max(1, getattr(args, "parallel", 1)),
                         batch_invariant=getattr(args, "deterministic", False))


def _load(args: argparse.Namespace):
    """(model, context, pipeline or None): runtime.open_runtime decides where, from the flags."""
    from .model.pull import resolve_model
    from .runtime import RunConfig, open_runtime
    _apply_config(args)
    path = resolve_model(args.model)
    if args.stages == "auto" and not _on_cluster(args):
        print("ggml-dist: --stages auto without a cluster (--address, or a ray job): one stage, in this "
              "process", file=sys.stderr)
        args.stages = 1
    rt = open_runtime(RunConfig(path, _params(args), None if args.stages == "auto" else args.stages, args.address,
                                _parse_layers(args.layers), args.threads, getattr(args, "threads_given", False),
                                args.n_copies, args.stage_calls))
    return rt.model, rt.ctx, rt.pipeline


def _write_flush(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _cmd_run(args: argparse.Namespace) -> int:
    from .model.generate import generate
    from .model.sampling import SamplingParams
    model, lctx, pl = _load(args)
    if args.prompt is None:
        raise ValueError("no prompt: give --prompt TEXT (or a --config with one)")
    tok = model.tokenizer
    prompt = args.prompt
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}])
    ids = tok.encode(prompt, add_special=True, parse_special=True)
    sp = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, seed=args.seed)
    on_text = None if args.json else _write_flush
    if args.parallel != 1:
        return _run_parallel(args, lctx, pl, ids, sp)
    injector = _fault_injector(args.inject_fault, pl)
    clock = _RecoveryClock(lctx, injector)
    res = generate(lctx, tok, ids, args.n_predict, sp, on_text=on_text, n_batch=args.batch, on_token=clock,
                   lookahead=args.lookahead)
    timings = {"prompt_tok_s": round(res.prompt_tok_s, 3), "decode_tok_s": round(res.decode_tok_s, 3)}
    if pl is not None and args.trace:
        pl.write_trace(args.trace)
    rec = lctx.recovery
    if args.json:
        out = {"prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": res.text,
               "timings": timings, "stop_reason": res.stop_reason,
               "graphs": {"reused": lctx.n_reused, "rebuilt": lctx.n_rebuilt},
               "recoveries": rec.n_recoveries, "replayed_tokens": rec.n_replayed_tokens,
               "recovery": clock.report()}
        if pl is not None:
            out["stages"] = _stage_summary(pl)
            out["stage_calls"] = pl.calls_used()
            out["plan"] = pl.placement.to_json()
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        print(f"prompt: {len(res.prompt_tokens)} tokens, {timings['prompt_tok_s']} tok/s | "
              f"decode: {len(res.tokens)} tokens, {timings['decode_tok_s']} tok/s | "
              f"graphs reused {lctx.n_reused}, rebuilt {lctx.n_rebuilt}"
              + (f" | recoveries {rec.n_recoveries}: {clock.line()}" if rec.n_recoveries else ""), file=sys.stderr)
    return 0


def _run_parallel(args: argparse.Namespace, lctx, pl, ids: list[int], sp) -> int:
    """run --parallel N: N continuations, printed one after the other once all are done."""
    from .model.generate import generate_parallel
    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if args.inject_fault:
        raise ValueError("--inject-fault takes a single sequence (no --parallel)")
    tok = lctx.model.tokenizer
    done = [0]

    def progress(seq: int, i: int, t: int) -> None:
        done[0] += 1
        if not args.json and done[0] % 32 == 0:
            print(f"ggml-dist: {done[0]} tokens over {args.parallel} sequences", file=sys.stderr, flush=True)
    # over direct links a group's next step fed its tokens by the last stage pays (2 hosts, 4 sequences:
    # 30.5 against 28.5 tok/s); through Ray calls it did not
    lookahead = args.lookahead or (2 if pl is not None and pl.calls_used() == "direct" else None)
    res = generate_parallel(lctx, tok, ids, args.n_predict, args.parallel, sp, lookahead=lookahead,
                            n_batch=args.batch, on_token=progress)
    n_gen = sum(max(len(r.tokens) - 1, 0) for r in res)
    decode_s = res[0].decode_s
    timings = {"prompt_tok_s": round(res[0].prompt_tok_s, 3),
               "decode_tok_s": round(n_gen / decode_s, 3) if decode_s > 0 else 0.0}
    if args.json:
        out = {"prompt_tokens": ids, "sequences": [{"tokens": r.tokens, "text": r.text, "stop_reason": r.stop_reason}
                                                   for r in res], "timings": timings}
        if pl is not None:
            out["stages"] = _stage_summary(pl)
            out["stage_calls"] = pl.calls_used()
        print(json.dumps(out))
        return 0
    for i, r in enumerate(res):
        sys.stdout.write(f"--- sequence {i} ({r.stop_reason}, {len(r.tokens)} tokens)\n{r.text}\n")
    print(f"prompt: {len(ids)} tokens, {timings['prompt_tok_s']} tok/s | decode: {n_gen} tokens over "
          f"{args.parallel} sequences, {timings['decode_tok_s']} tok/s", file=sys.stderr)
    return 0


class _RecoveryClock:
    """run's on_token callback (after the fault injector's), timing each recovery three ways: detect_s,
    from the injected fault to the moment the loss was detected (only for --inject-fault: a real fault's
    moment is not known); restore_s, the restart and the replay of the KV log (Recovery.recovery_s);
    first_token_s, from detection to the first token generated after it. detected_at is the wall clock
    (time.time()) of each detection, so an outside fault (a cut link) can be timed against it."""

    def __init__(self, lctx, injector) -> None:
        self.lctx, self.injector = lctx, injector
        self.first_token_s: list[float] = []

    def __call__(self, i: int, tok: int) -> None:
        import time
        lost = self.lctx.recovery.lost_at
        while len(lost) > len(self.first_token_s):
            self.first_token_s.append(time.perf_counter() - lost[len(self.first_token_s)])
        if self.injector is not None:
            self.injector(i, tok)

    def report(self) -> list[dict]:
        rec, out = self.lctx.recovery, []
        fault = getattr(self.injector, "fault_at", None)
        for k, lost in enumerate(rec.lost_at):
            out.append({"detect_s": round(lost - fault, 3) if fault is not None and k == 0 else None,
                        "restore_s": round(rec.recovery_s[k], 3) if k < len(rec.recovery_s) else None,
                        "first_token_s": round(self.first_token_s[k], 3) if k < len(self.first_token_s) else None,
                        "detected_at": round(rec.lost_wall[k], 3)})
        return out

    def line(self) -> str:
        return "; ".join(f"detected after {r['detect_s'] if r['detect_s'] is not None else '?'} s (at "
                         f"{r['detected_at']}), restored in {r['restore_s']} s, first token {r['first_token_s']} s "
                         f"after detection" for r in self.report())


class _FaultInjector:
    """--inject-fault kill-stage:K:after-token:N (the stage's process killed) or wedge-stage:K:after-token:N
    (its next call blocks, the process alive): an on_token callback that makes the fault once, after token
    N; fault_at is when (perf_counter)."""
    KINDS = ("kill-stage", "wedge-stage")

    def __init__(self, spec: str, pl) -> None:
        parts = spec.split(":")
        try:
            if len(parts) != 4 or parts[0] not in self.KINDS or parts[2] != "after-token":
                raise ValueError
            self.kind, self.stage, self.after = parts[0], int(parts[1]), int(parts[3])
        except ValueError:
            raise ValueError(f"--inject-fault takes kill-stage:K:after-token:N or wedge-stage:K:after-token:N, "
                             f"got '{spec}'") from None
        if pl is None:
            raise ValueError("--inject-fault needs a pipeline: add --stages 2 (or more)")
        if not 0 <= self.stage < len(pl.actors):
            raise ValueError(f"--inject-fault: stage {self.stage} does not exist (stages 0..{len(pl.actors) - 1})")
        self.pl = pl
        self.fault_at: float | None = None

    def __call__(self, i: int, tok: int) -> None:
        import time
        if i == self.after and self.fault_at is None:
            verb = "killing" if self.kind == "kill-stage" else "wedging"
            print(f"ggml-dist: injecting fault: {verb} stage {self.stage} after token {self.after}", file=sys.stderr)
            self.fault_at = time.perf_counter()
            if self.kind == "kill-stage":
                self.pl.kill_stage(self.stage)
            else:
                self.pl.wedge_stage(self.stage)


def _fault_injector(spec: str | None, pl) -> _FaultInjector | None:
    return None if not spec else _FaultInjector(spec, pl)


def _stage_summary(pl) -> list[dict]:
    """Per stage over the run: compute time; prepare time, each call's part before its compute (finding
    or building the plan, decoding the received messages, writing the inputs: the stage's `decode_s`);
    the rest of the stage's span as idle (which includes encoding the outputs); bytes moved."""
    out = []
    for k, st in enumerate(pl.stats()):
        tl = st["timeline"]
        span = (tl[-1][3] - tl[0][0]) if tl else 0.0
        node = pl.infos[k].get("node_id", "") if k < len(pl.infos) else ""   # where the actor runs
        out.append({"stage": k, "node_id": node, "layers": list(pl.placement.stages[k].layers),
                    "calls": st["n_calls"],
                    "plans": st["n_plans"], "compute_s": round(st["compute_s"], 4),
                    "prepare_s": round(st["decode_s"], 4),
                    "idle_s": round(max(0.0, span - st["compute_s"] - st["decode_s"]), 4),
                    "bytes_in": st["bytes_in"], "bytes_out": st["bytes_out"]})
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from .model.model import LlamaModel
    from .model.pull import resolve_model
    from .workers.driver import plan_stages
    from .workers.placement import NodeInfo
    _apply_config(args)
    model = LlamaModel.load(resolve_model(args.model))
    params = _params(args)
    budgets = None
    if args.budget_gib:
        try:
            budgets = [int(float(x) * 2**30) for x in str(args.budget_gib).split(",")]
        except ValueError:
            raise ValueError(f"--budget-gib takes numbers, got '{args.budget_gib}'") from None
    n_stages = None if args.stages == "auto" else args.stages
    layers = _parse_layers(args.layers)
    if _on_cluster(args):
        from .workers.cluster import connect
        from .workers.resources import cluster_nodes
        print(f"ggml-dist: {connect(args.address)}", file=sys.stderr)
        pl = plan_stages(model, params, n_stages, nodes=cluster_nodes(), layers=layers, threads=args.threads)
    elif n_stages is None:
        if not budgets or len(budgets) != 1:
            raise ValueError("--stages auto needs a cluster (--address, or a ray job) or one --budget-gib "
                             "per stage")
        nodes = [NodeInfo(f"budget-{i}", "", budgets[0], 1.0) for i in range(model.hp.n_layer)]
        pl = plan_stages(model, params, None, nodes=nodes, layers=layers)
    else:       # the same account as run's table and run --json's plan (driver.plan_stages)
        pl = plan_stages(model, params, n_stages, budgets=budgets, layers=layers)
    print(json.dumps({"stages": pl.to_json()}) if args.json else pl.table())
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    from .model.ubatch import Batch
    try:
        ids = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got '{args.tokens}'") from None
    _, lctx, _ = _load(args)
    logits = lctx.decode(Batch.from_tokens(ids, all_outputs=True))
    np.savez(args.out, logits=logits.astype(np.float32))
    print(f"wrote {args.out}: logits {list(logits.shape)}", file=sys.stderr)
    return 0


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from .model.gguf import load_gguf
    from .model.pull import resolve_model
    from .model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(load_gguf(resolve_model(args.model)))
    ids = tok.encode(args.text, add_special=not args.no_special, parse_special=True)
    if args.json:
        print(json.dumps({"tokens": ids, "pieces": [tok.token_to_piece(i).decode("utf-8", "replace")
                                                   for i in ids]}))
    else:
        print(" ".join(str(i) for i in ids))
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from .model.pull import resolve_model
    from .serve import EngineConfig, serve
    from .serve.app import HTTPPolicy
    from .serve.server import ServeOptions, check_bind
    api_key = args.api_key or os.environ.get("GGML_DIST_API_KEY") or None
    check_bind(args.host, api_key, args.insecure_no_api_key)
    hosts = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    opts = ServeOptions(policy=HTTPPolicy.for_bind(args.host, api_key, hosts, body_timeout_s=args.body_timeout),
                        header_timeout_s=args.header_timeout, max_connections=args.max_connections,
                        shutdown_grace_s=args.shutdown_grace)
    cfg = EngineConfig(str(resolve_model(args.model)), n_stages=0 if args.stages == "auto" else args.stages,
                       address=args.address,
                       n_parallel=args.parallel, n_ctx=args.ctx, n_batch=args.batch,
                       max_queue=args.max_queue, threads_per_stage=args.threads,
                       stage_calls=args.stage_calls, lookahead=args.lookahead,
                       kv_unified={"auto": None, "on": True, "off": False}[args.kv_unified],
                       cache_prompt=not args.no_cache_prompt, n_replicas=args.replicas, pooling=args.pooling,
                       batch_invariant=args.deterministic,
                       request_defaults=tuple((k, v) for k, v in (("temperature", args.temp), ("seed", args.seed),
                                                                  ("n_predict", args.n_predict)) if v is not None),
                       chat_template=Path(args.chat_template).read_text() if args.chat_template else None)
    name = args.alias or Path(args.model).stem
    print(f"ggml-dist serve: {name} on http://{args.host}:{args.port}/v1 ({args.parallel} slots of "
          f"{args.ctx // args.parallel} tokens{f' over {args.replicas} replicas' if args.replicas > 1 else ''}); "
          f"loading, see /health", file=sys.stderr)
    stopped_by = serve(cfg, name, args.host, args.port, opts=opts)
    return 128 + stopped_by if stopped_by else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import alloc, cluster, decode, faults, fuzz_gguf, pipeline
    mains = {"alloc": alloc.main, "pipeline": pipeline.main, "decode": decode.main, "faults": faults.main,
             "fuzz-gguf": fuzz_gguf.main, "cluster": cluster.main}
    return mains[args.what](args.rest)


def _cmd_warmup(args: argparse.Namespace) -> int:
    from .model.pull import resolve_model
    from .model.warmup_process import warm
    try:
        threads = [int(x) for x in args.threads.split(",")] if args.threads else None
    except ValueError:
        raise ValueError(f"--threads takes comma-separated numbers, got '{args.threads}'") from None
    res = warm(resolve_model(args.model), threads)
    print(json.dumps(res.to_json()) if args.json else res.summary())
    return 0


_COMMANDS = {"pull": _cmd_pull, "run": _cmd_run, "logits": _cmd_logits, "tokenize": _cmd_tokenize,
             "plan": _cmd_plan, "bench": _cmd_bench, "serve": _cmd_serve, "warmup": _cmd_warmup}

if __name__ == "__main__":
    sys.exit(main())

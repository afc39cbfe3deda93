"""The `ggml-dist` command: pull, run, logits, plan, tokenize, serve, bench, warmup."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from .config import add_run_args, apply_config, context_params, devices_of, on_cluster, parse_layers, run_config
from .serve_args import add_serve_args, cmd_serve

if TYPE_CHECKING:
    from .runtime import Runtime


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
    add_run_args(p)
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

    p = sub.add_parser("logits", help="write the logits of every position of a token list")
    add_run_args(p)
    p.add_argument("--tokens", required=True, help="comma-separated token ids (no BOS is added)")
    p.add_argument("--out", required=True, help="output .npz (array 'logits' [n_tokens, n_vocab])")

    p = sub.add_parser("plan", help="print the placement of a model's layers over pipeline stages")
    add_run_args(p)
    p.add_argument("--budget-gib", default=None,
                   help="memory budget per stage in GiB: one value, or one per stage (comma-separated)")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("tokenize", help="print the token ids of a text")
    p.add_argument("--model", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--no-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching)")
    add_run_args(p, serving=True)
    add_serve_args(p)

    p = sub.add_parser("bench", help="benchmarks (each prints one JSON object)")
    p.add_argument("what", choices=["alloc", "pipeline", "decode", "batched", "faults", "fuzz-gguf", "cluster"])
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
    import signal
    args = _parser().parse_args(argv)
    previous = {}
    if args.cmd == "serve":
        # a server's signals are its own from here (serve/server.py takes them over once its modules
        # are in), whatever the disposition it inherited
        previous = {sig: signal.signal(sig, _exit_on_stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
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
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _cmd_pull(args: argparse.Namespace) -> int:
    from .model.pull import pull
    print(pull(args.name, verify=args.verify))
    return 0


def _load(args: argparse.Namespace) -> Runtime:
    """The model and its context where the flags say (runtime.open_runtime decides)."""
    from .runtime import open_runtime
    return open_runtime(run_config(args))


def _write_flush(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _cmd_run(args: argparse.Namespace) -> int:
    from .model.generate import generate
    from .model.sampling import SamplingParams
    rt = _load(args)
    model, lctx = rt.model, rt.ctx
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
        return _run_parallel(args, rt, ids, sp)
    injector = _fault_injector(args.inject_fault, rt)
    clock = _RecoveryClock(lctx, injector)
    res = generate(lctx, tok, ids, args.n_predict, sp, on_text=on_text, n_batch=args.batch, on_token=clock,
                   lookahead=args.lookahead)
    timings = {"prompt_tok_s": round(res.prompt_tok_s, 3), "decode_tok_s": round(res.decode_tok_s, 3)}
    if rt.distributed and args.trace:
        rt.write_trace(args.trace)
    rec = lctx.recovery
    if args.json:
        out = {"prompt_tokens": res.prompt_tokens, "tokens": res.tokens, "text": res.text,
               "timings": timings, "stop_reason": res.stop_reason,
               "graphs": {"reused": lctx.n_reused, "rebuilt": lctx.n_rebuilt},
               "recoveries": rec.n_recoveries, "replayed_tokens": rec.n_replayed_tokens,
               "recovery": clock.report()}
        if rt.placement is not None:
            out["stages"] = _stage_summary(rt)
            out["stage_calls"] = rt.calls_used()
            out["plan"] = rt.placement.to_json()
        print(json.dumps(out))
    else:
        sys.stdout.write("\n")
        print(f"prompt: {len(res.prompt_tokens)} tokens, {timings['prompt_tok_s']} tok/s | "
              f"decode: {len(res.tokens)} tokens, {timings['decode_tok_s']} tok/s | "
              f"graphs reused {lctx.n_reused}, rebuilt {lctx.n_rebuilt}"
              + (f" | recoveries {rec.n_recoveries}: {clock.line()}" if rec.n_recoveries else ""), file=sys.stderr)
    return 0


def _run_parallel(args: argparse.Namespace, rt: Runtime, ids: list[int], sp) -> int:
    """run --parallel N: N continuations, printed one after the other once all are done."""
    from .model.generate import generate_parallel
    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}")
    if args.inject_fault:
        raise ValueError("--inject-fault takes a single sequence (no --parallel)")
    lctx, tok = rt.ctx, rt.model.tokenizer
    done = [0]

    def progress(seq: int, i: int, t: int) -> None:
        done[0] += 1
        if not args.json and done[0] % 32 == 0:
            print(f"ggml-dist: {done[0]} tokens over {args.parallel} sequences", file=sys.stderr, flush=True)
    # over direct links a group's next step fed its tokens by the last stage pays (2 hosts, 4 sequences:
    # 30.5 against 28.5 tok/s); through Ray calls it did not
    lookahead = args.lookahead or (2 if rt.calls_used() == "direct" else None)
    res = generate_parallel(lctx, tok, ids, args.n_predict, args.parallel, sp, lookahead=lookahead,
                            n_batch=args.batch, on_token=progress)
    n_gen = sum(max(len(r.tokens) - 1, 0) for r in res)
    decode_s = res[0].decode_s
    timings = {"prompt_tok_s": round(res[0].prompt_tok_s, 3),
               "decode_tok_s": round(n_gen / decode_s, 3) if decode_s > 0 else 0.0}
    if args.json:
        out = {"prompt_tokens": ids, "sequences": [{"tokens": r.tokens, "text": r.text, "stop_reason": r.stop_reason}
                                                   for r in res], "timings": timings}
        if rt.distributed:
            out["stages"] = _stage_summary(rt)
            out["stage_calls"] = rt.calls_used()
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

    def __init__(self, spec: str, rt: Runtime) -> None:
        parts = spec.split(":")
        try:
            if len(parts) != 4 or parts[0] not in self.KINDS or parts[2] != "after-token":
                raise ValueError
            self.kind, self.stage, self.after = parts[0], int(parts[1]), int(parts[3])
        except ValueError:
            raise ValueError(f"--inject-fault takes kill-stage:K:after-token:N or wedge-stage:K:after-token:N, "
                             f"got '{spec}'") from None
        if not rt.distributed:
            raise ValueError("--inject-fault needs a pipeline: add --stages 2 (or more)")
        if not 0 <= self.stage < rt.n_stages:
            raise ValueError(f"--inject-fault: stage {self.stage} does not exist (stages 0..{rt.n_stages - 1})")
        self.rt = rt
        self.fault_at: float | None = None

    def __call__(self, i: int, tok: int) -> None:
        import time
        if i == self.after and self.fault_at is None:
            verb = "killing" if self.kind == "kill-stage" else "wedging"
            print(f"ggml-dist: injecting fault: {verb} stage {self.stage} after token {self.after}", file=sys.stderr)
            self.fault_at = time.perf_counter()
            if self.kind == "kill-stage":
                self.rt.kill_stage(self.stage)
            else:
                self.rt.wedge_stage(self.stage)


def _fault_injector(spec: str | None, rt: Runtime) -> _FaultInjector | None:
    return None if not spec else _FaultInjector(spec, rt)


def _stage_summary(rt: Runtime) -> list[dict]:
    """Per stage over the run: compute time; prepare time, each call's part before its compute (finding
    or building the plan, decoding the received messages, writing the inputs: the stage's `decode_s`);
    the rest of the stage's span as idle (which includes encoding the outputs); bytes moved."""
    out = []
    infos = {i.stage: i for i in rt.stage_infos()}
    assert rt.placement is not None
    for k, st in enumerate(rt.stats()):
        tl = st.timeline
        span = (tl[-1][3] - tl[0][0]) if tl else 0.0
        node = infos[k].node_id if k in infos else ""          # where the actor runs
        out.append({"stage": k, "node_id": node, "layers": list(rt.placement.stages[k].layers),
                    "calls": st.n_calls, "plans": st.n_plans, "compute_s": round(st.compute_s, 4),
                    "prepare_s": round(st.decode_s, 4),
                    "idle_s": round(max(0.0, span - st.compute_s - st.decode_s), 4),
                    "bytes_in": st.bytes_in, "bytes_out": st.bytes_out})
    return out


def _cmd_plan(args: argparse.Namespace) -> int:
    from .config import parse_budgets
    from .model.model import LlamaModel
    from .model.pull import resolve_model
    from .workers.driver import plan_stages
    from .workers.placement import NodeInfo
    apply_config(args)
    model = LlamaModel.load(resolve_model(args.model))
    params = context_params(args)
    if (args.tensor_parallel or 1) > 1:                 # a group's ranks, or each rank's pipeline (--stages S)
        from .workers.tp_plan import report
        print(report(model, args.tensor_parallel, params, args.json, args.stages, parse_layers(args.layers)))
        return 0
    budgets = parse_budgets(args.budget_gib)
    n_stages = None if args.stages == "auto" else args.stages
    layers = parse_layers(args.layers)
    kinds = list(devices_of(args)) or None
    if on_cluster(args):
        from .workers.local_ray import connect
        from .workers.resources import cluster_nodes
        print(f"ggml-dist: {connect(args.address, verbose=args.verbose or None)}", file=sys.stderr)
        pl = plan_stages(model, params, n_stages, nodes=cluster_nodes(), layers=layers, threads=args.threads,
                         kinds=kinds)
    elif n_stages is None:
        if not budgets or len(budgets) != 1:
            raise ValueError("--stages auto needs a cluster (--address, or a ray job) or one --budget-gib "
                             "per stage")
        nodes = [NodeInfo(f"budget-{i}", "", budgets[0], 1.0) for i in range(model.hp.n_layer)]
        pl = plan_stages(model, params, None, nodes=nodes, layers=layers, kinds=kinds)
    else:       # the same account as run's table and run --json's plan (driver.plan_stages)
        pl = plan_stages(model, params, n_stages, budgets=budgets, layers=layers, kinds=kinds)
    print(json.dumps({"stages": pl.to_json()}) if args.json else pl.table())
    return 0


def _cmd_logits(args: argparse.Namespace) -> int:
    from .model.ubatch import Batch
    try:
        ids = [int(x) for x in args.tokens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--tokens must be comma-separated integers, got '{args.tokens}'") from None
    lctx = _load(args).ctx
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import alloc, batched, cluster, decode, faults, fuzz_gguf, pipeline
    mains = {"alloc": alloc.main, "pipeline": pipeline.main, "decode": decode.main, "batched": batched.main,
             "faults": faults.main, "fuzz-gguf": fuzz_gguf.main, "cluster": cluster.main}
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
             "plan": _cmd_plan, "bench": _cmd_bench, "serve": cmd_serve, "warmup": _cmd_warmup}

if __name__ == "__main__":
    sys.exit(main())

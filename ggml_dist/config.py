"""A run's options, defined once for `run`, `logits`, `plan` and `serve`, and the run configuration they
make (runtime.RunConfig); run configs, a JSON or YAML mapping of the same options (see configs/).

    add_run_args(parser)    the options of a run: model, context size and numerics, where it runs
    run_config(args)        the RunConfig they describe, built in this one place
    load_run_config(path)   a run config file's options (command-line options override them)

A new run option is an argument here, a field of RunConfig (or of ContextParams, for the context's
numerics) and its use: nothing between.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backends.devices import DeviceKind
    from .model.context import ContextParams
    from .runtime import RunConfig


class ConfigError(ValueError):
    """A run config that cannot be read or names unknown options."""


def load_run_config(path: str, known: set[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml/json raise several unrelated types; re-raised as ConfigError
        raise ConfigError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run config is a mapping of option names to values")
    norm = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(norm) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown options {unknown}; known: {sorted(known)}")
    if isinstance(norm.get("layers"), list):
        norm["layers"] = ",".join(f"{a}-{b}" for a, b in norm["layers"])
    return norm


# -- the run options: one list, for run, logits, plan and serve (run_config builds the RunConfig) ---------
def add_run_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """What a run is (its model, its context's size and numerics, and where it runs), defined once.
    serving: the server's micro-batch is one ubatch of at most --batch tokens (no --ubatch), and it
    writes no trace."""
    p.add_argument("--config", default=None, help="a run config (JSON or YAML, see configs/); "
                   "command-line options override it")
    p.add_argument("--model", default=None, help="a GGUF path or a known name (smollm2-135m)")
    p.add_argument("--ctx", type=int, default=2048, help="context size in tokens (default 2048)"
                   + ("; the KV cache's cells, shared by the slots (each request gets ctx/parallel)"
                      if serving else ""))
    p.add_argument("--batch", type=int, default=512, help="n_batch (default 512)"
                   + ("; the tokens of a micro-batch at most" if serving else ""))
    if not serving:
        p.add_argument("--ubatch", type=int, default=512, help="n_ubatch (default 512)")
    p.add_argument("--cache-type", choices=["f16", "f32"], default="f16", help="KV cache type")
    p.add_argument("--exact", action="store_true",
                   help="keep f32 activations in matmuls instead of ggml's quantized vec_dot numerics")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant numerics: every token's "
                   "logits as if it were evaluated alone (llama.cpp's with --ubatch 1), whatever the batch, "
                   "ubatch size, prompt cache or what else is served (prompts on K-quant or F16 weights run a "
                   "few percent slower)")
    p.add_argument("--stages", type=stages_arg, default=None,
                   help="pipeline stages (Ray actors), or auto: the fewest that fit the cluster's nodes, "
                   "one per node; 1 without --address runs in this process")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="K",
                   help="split every matrix (a mixture's experts: whole) over K ranks (threads of this process; "
                   "with --address, rank 0 here and the others Ray actors exchanging over direct links; with "
                   "--stages S, S x K stage actors): each output row computed whole on one rank, so the tokens "
                   "are one process's")
    p.add_argument("--address", default=None, help="Ray cluster address to join (default: start a "
                   "local Ray, or join the cluster of a `ray job submit` job)")
    p.add_argument("--layers", default=None, help="explicit layer ranges per stage, first:end with the end "
                   "exclusive, e.g. 0:15,15:30 (the older inclusive 0-14,15-29 is accepted too)")
    p.add_argument("--n-copies", type=int, default=None, help="micro-batches in flight (default: 4, as "
                   "llama.cpp's pipeline parallelism)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads (per stage with --stages; default: the cores available, 1 per stage)")
    p.add_argument("--stage-calls", choices=["auto", "direct", "compiled", "plain"], default="auto",
                   help="how a step reaches the stages: frames on sockets between the driver and the stages, "
                   "stage to stage (direct), one Ray Compiled Graph execution, or a Ray actor call per stage; "
                   "auto: direct, plain where the links cannot be opened")
    p.add_argument("--device", default=None, metavar="KIND[,KIND...]",
                   help="each stage's device kind, one for all or one per stage (backends/devices.py: cpu, or "
                   "accel, the tests' fake accelerator; default cpu)")
    if not serving:
        p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace of the stages here")


def stages_arg(v: str) -> int | str:
    if v == "auto":
        return v
    try:
        k = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stages takes a number or auto, got '{v}'") from None
    if k < 1:
        raise argparse.ArgumentTypeError(f"--stages must be at least 1, got {k}")
    return k


def on_cluster(args: argparse.Namespace) -> bool:
    """Joining a cluster: --address, or inside a `ray job submit` job (RAY_ADDRESS)."""
    import os
    return bool(args.address or os.environ.get("RAY_ADDRESS"))


CONFIG_KEYS = {"model", "ctx", "batch", "ubatch", "cache_type", "exact", "stages", "address", "layers",
                "n_copies", "threads", "trace", "prompt", "n_predict", "temp", "seed", "chat", "budget_gib",
                "device", "tensor_parallel"}
DEFAULTS = {"stages": 1, "threads": 1, "n_predict": 64, "temp": 0.0, "tensor_parallel": 1}


def apply_config(args: argparse.Namespace) -> None:
    """Fill options not given on the command line from --config, then the defaults."""
    if getattr(args, "config", None):
        for k, v in load_run_config(args.config, CONFIG_KEYS).items():
            if getattr(args, k, None) in (None, False):
                setattr(args, k, v)
    args.threads_given = getattr(args, "threads", None) is not None
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if not getattr(args, "model", None):
        raise ValueError("no model: give --model NAME_OR_PATH (or a --config that names one)")


def parse_layers(spec: str | None) -> list[tuple[int, int]] | None:
    """--layers: `first:end` ranges (end exclusive; the older inclusive `first-last` too)."""
    if not spec:
        return None
    from .workers.placement import parse_layers as parse
    return parse(spec)


def parse_budgets(spec: str | None) -> list[int] | None:
    """--budget-gib: a comma list of GiB, one per stage (or one for every stage), in bytes."""
    if not spec:
        return None
    try:
        return [int(float(x) * 2**30) for x in str(spec).split(",")]
    except ValueError:
        raise ValueError(f"--budget-gib takes numbers, got '{spec}'") from None


def context_params(args: argparse.Namespace) -> ContextParams:
    from .core.types import GGMLType
    from .model.context import ContextParams
    kv_type = GGMLType.F16 if args.cache_type == "f16" else GGMLType.F32
    return ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_ubatch=getattr(args, "ubatch", args.batch),
                         type_k=kv_type, type_v=kv_type, exact=args.exact, background_compile=True,
                         n_seq_max=max(1, getattr(args, "parallel", 1)), batch_invariant=args.deterministic)


def devices_of(args: argparse.Namespace) -> tuple[DeviceKind, ...]:
    from .backends.devices import DeviceKind
    if not args.device:
        return ()
    try:
        return tuple(DeviceKind(k.strip()) for k in str(args.device).split(","))
    except ValueError:
        raise ValueError(f"--device takes {' or '.join(k.value for k in DeviceKind)} (one, or one per stage, "
                         f"comma-separated), got '{args.device}'") from None


def run_config(args: argparse.Namespace, serving: bool = False) -> RunConfig:
    """The run the run options describe (add_run_args), built in this one place: `run`, `logits` and
    `serve` open it, `plan` places it. --stages auto without a cluster is one stage for a run; a server
    says that it needs a cluster (EngineConfig)."""
    from .model.pull import resolve_model
    from .runtime import RunConfig
    apply_config(args)
    path = resolve_model(args.model)
    if args.stages == "auto" and not on_cluster(args) and not serving:
        print("ggml-dist: --stages auto without a cluster (--address, or a ray job): one stage, in this "
              "process", file=sys.stderr)
        args.stages = 1
    return RunConfig(path, context_params(args), None if args.stages == "auto" else args.stages, args.address,
                     parse_layers(args.layers), args.threads, args.threads_given and not serving, args.n_copies,
                     args.stage_calls, devices=devices_of(args), verbose=args.verbose or None,
                     label="ggml-dist serve" if serving else "ggml-dist", tensor_parallel=args.tensor_parallel)

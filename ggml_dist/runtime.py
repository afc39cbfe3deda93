"""Where a model runs, decided once: this process, or a pipeline of stage actors on Ray.

    RunConfig       what a run is: the model, its context's numerics, and where (stages, a cluster's
                    address, layer ranges, threads per stage, micro-batches in flight, stage calls)
    runs_on_ray     the one place that chooses: in this process for one stage without a cluster (also
                    inside `ray job submit`, where it is one stage), else a Pipeline on Ray (joining the
                    cluster at the address, or RAY_ADDRESS, or a local Ray it starts)
    open_runtime    acts on it: the model mapped here, or the stage actors started and holding weights
    Runtime         what the callers (cli, serve, bench) ask of either: the model and its context, how
                    many micro-batches it takes in flight (depth), how many stages, whether the last
                    stage's tokens feed the first's next step (feeds_tokens), whether a sequence's cells
                    can be moved between streams here (moves_sequences: the KV lives in this process),
                    the stages' figures, the plan, shutdown. `pipeline` is the Ray pipeline itself, for
                    what only a pipeline has (fault injection, traces, stage calls); None in one process

serve/ and bench/ reach workers/ only through this module (tests/test_layers.py).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .model.context import ContextParams, LlamaContext
from .model.model import LlamaModel
from .workers.cluster import connect, exit_on_signal, local_ray_cpu_s, shutdown_local  # noqa: F401 - the face
from .workers.driver import default_copies  # noqa: F401 - the face
from .workers.placement import Placement


def runs_on_ray(n_stages: int | None, address: str | None) -> bool:
    """The one decision: one stage without a cluster's address runs in this process (also inside a
    `ray job submit`, where RAY_ADDRESS is set but one stage needs no actor); anything else on Ray."""
    return n_stages != 1 or bool(address)


@dataclass(frozen=True)
class RunConfig:
    model_path: str | Path
    params: ContextParams
    n_stages: int | None = 1                     # None: the fewest stages that fit the cluster's nodes
    address: str | None = None                   # a cluster to join ("auto", host:port); None: RAY_ADDRESS
    layers: list[tuple[int, int]] | None = None  # first:end per stage (placement's split otherwise)
    threads: int = 1                             # kernel threads per stage
    set_threads: bool = False                    # one process: set this process's kernel threads to it
    n_copies: int | None = None                  # micro-batches in flight on a pipeline (its default)
    stage_calls: str = "auto"                    # direct | compiled | plain | auto
    on_ray: bool | None = None                   # None: as the stages and address say; True: always
    node_ids: list[str] | None = None            # stage k on node_ids[k] (a testbed's pinned hosts)
    label: str = "ggml-dist"                     # the prefix of the lines it prints
    show_plan: bool = True                       # print the placement's table before the stages start

    @property
    def distributed(self) -> bool:
        return self.on_ray if self.on_ray is not None else runs_on_ray(self.n_stages, self.address)


class Runtime:
    """A model's context in this process (pipeline None) or over a Ray pipeline's stages."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, pipeline: Any = None) -> None:
        self.model, self.ctx, self.pipeline = model, ctx, pipeline

    @property
    def distributed(self) -> bool:
        return self.pipeline is not None

    @property
    def depth(self) -> int:
        """Micro-batches the context takes in flight before it needs one back."""
        return self.ctx.n_copies if self.pipeline is not None else 1

    @property
    def n_stages(self) -> int:
        return len(self.pipeline.proxies) if self.pipeline is not None else 1

    @property
    def moves_sequences(self) -> bool:
        """A sequence's cells can be moved or swapped between KV streams here (the cache is this
        process's); a pipeline's stages hold theirs."""
        return self.pipeline is None

    def feeds_tokens(self) -> bool:
        """The last stage's sampled token goes straight to the first stage's next step."""
        return self.pipeline is not None and self.pipeline.feeds_tokens()

    @property
    def placement(self) -> Placement | None:
        return self.pipeline.placement if self.pipeline is not None else None

    def stats(self) -> list[dict]:
        """Each stage's figures (compute_s, calls, ...); none in one process (the caller times it)."""
        return self.pipeline.stats() if self.pipeline is not None else []

    def calls_used(self) -> str | None:
        return self.pipeline.calls_used() if self.pipeline is not None else None

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.shutdown()


def open_runtime(cfg: RunConfig, on_plan: Callable[[Placement], None] | None = None) -> Runtime:
    """The model and its context where cfg says: the weights mapped here, or every stage actor holding
    its weights (Pipeline.launch returns once they do). on_plan sees a pipeline's placement before any
    actor starts (default: its table on stderr, unless cfg.show_plan is off)."""
    if not cfg.distributed:
        if cfg.set_threads:
            from .backends.host import kernel_threads
            kernel_threads.set_threads(cfg.threads)
        model = LlamaModel.load(cfg.model_path)
        return Runtime(model, LlamaContext(model, cfg.params))
    from .workers.cluster import Pipeline
    n = cfg.n_stages or 1
    joined = connect(cfg.address, num_cpus=max(2, n * cfg.threads))
    if joined != "already connected":
        print(f"{cfg.label}: {joined}", file=sys.stderr)
    if on_plan is None and cfg.show_plan:
        def on_plan(p: Placement) -> None:
            print(p.table(), file=sys.stderr, flush=True)
    pl = Pipeline.launch(str(cfg.model_path), cfg.n_stages, cfg.params, n_copies=cfg.n_copies, layers=cfg.layers,
                         threads_per_stage=cfg.threads, node_ids=cfg.node_ids, on_plan=on_plan,
                         calls=cfg.stage_calls)
    return Runtime(pl.model, pl.ctx, pl)

"""Where a model runs, decided once: this process, or a pipeline of stage actors on Ray.

    RunConfig       what a run is: the model, its context's numerics, and where (stages, a cluster's
                    address, layer ranges, threads per stage, micro-batches in flight, stage calls)
    runs_on_ray     the one place that chooses: in this process for one stage without a cluster (also
                    inside `ray job submit`, where it is one stage), else a Pipeline on Ray (joining the
                    cluster at the address, or RAY_ADDRESS, or a local Ray it starts)
    open_runtime    acts on it: the model mapped here, or the stage actors started and holding weights
    Runtime         what the callers (cli, serve, bench) ask of either, typed: the model and its context,
                    how many micro-batches it takes in flight (depth), how many stages, whether the last
                    stage's tokens feed the first's next step (feeds_tokens), whether a sequence's cells
                    can be moved between streams here (moves_sequences: the KV lives in this process),
                    the plan, the stages' figures and descriptions (StageStats, StageInfo), how the steps
                    reached them, a trace, fault injection (kill_stage, wedge_stage), shutdown. Asked of
                    one process, what only a pipeline has is empty (stats, infos) or refused (faults)

serve/ and bench/ reach workers/ only through this module (tests/test_layers.py).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .backends.devices import DeviceKind
from .model.context import ContextParams, LlamaContext
from .model.model import LlamaModel
from .model.tp_local import TensorParallelContext
from .workers.cluster import Pipeline
from .workers.driver import default_copies  # noqa: F401 - the face
from .workers.local_ray import connect, exit_on_signal, local_ray_cpu_s, shutdown_local  # noqa: F401 - the face
from .workers.placement import Placement
from .workers.stage_data import StageInfo, StageStats
from .workers.tp_ranks import ray_ranks


def runs_on_ray(n_stages: int | None, address: str | None) -> bool:
    """The one decision: one stage without a cluster's address runs in this process (also inside a
    `ray job submit`, where RAY_ADDRESS is set but one stage needs no actor); anything else on Ray."""
    return n_stages != 1 or bool(address)


TP_RECOVERIES = 3        # times a tensor-parallel group on Ray is made anew after losing a rank (model/tp_local.py)

@dataclass(frozen=True)
class RunConfig:
    """One run's configuration, built once (config.run_config, from the options `run`, `logits`, `plan` and
    `serve` share) and passed down whole: the server's configuration holds it, and a stage's spec carries
    its context (params) and backend options by value. A new option is a field here (or of ContextParams,
    for the context's numerics) and its use."""
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
    node_ids: list[str] | None = None            # stage k (or tensor-parallel rank k + 1) on node_ids[k];
                                                 # with both, stage s of rank r on node_ids[s * K + r] (K
                                                 # nodes for K ranks: one stage of K rank actors)
    label: str = "ggml-dist"                     # the prefix of the lines it prints
    show_plan: bool = True                       # print the placement's table before the stages start
    devices: tuple[DeviceKind, ...] = ()         # each stage's device kind (one for all, or one per stage)
    verbose: bool | None = None                  # Ray's own notices (None: $GGML_DIST_VERBOSE)
    tensor_parallel: int = 1                     # ranks splitting every matrix (model/tp_local.py: threads here)

    @property
    def distributed(self) -> bool:
        return self.on_ray if self.on_ray is not None else runs_on_ray(self.n_stages, self.address)


class Runtime:
    """A model's context in this process, or over a Ray pipeline's stages (`_pipeline`)."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, pipeline: Pipeline | None = None) -> None:
        self.model, self.ctx, self._pipeline = model, ctx, pipeline

    @property
    def distributed(self) -> bool:
        return self._pipeline is not None

    @property
    def depth(self) -> int:
        """Micro-batches the context takes in flight before it needs one back."""
        return self.ctx.n_copies if self._pipeline is not None else 1

    @property
    def n_stages(self) -> int:
        return len(self._pipeline.proxies) if self._pipeline is not None else 1

    @property
    def moves_sequences(self) -> bool:
        """A sequence's cells can be moved or swapped between KV streams here (the cache is this
        process's); a pipeline's stages hold theirs."""
        return self._pipeline is None

    def feeds_tokens(self) -> bool:
        """The last stage's sampled token goes straight to the first stage's next step."""
        return self._pipeline is not None and self._pipeline.feeds_tokens()

    @property
    def placement(self) -> Placement | None:
        return self._pipeline.placement if self._pipeline is not None else None

    def stats(self, since: float = 0.0) -> list[StageStats]:
        """Each stage's figures (compute_s, calls, ...) with its timeline's calls ended since `since` (wall
        clock; inf: none); none in one process (the caller times it)."""
        return self._pipeline.stats(since) if self._pipeline is not None else []

    def poll_stats(self, since: float = 0.0, timeout_s: float = 1.0) -> list[StageStats | None]:
        """Each stage's figures with its timeline since `since`, None where a stage did not answer within
        timeout_s (Pipeline.poll_stats); none in one process."""
        return self._pipeline.poll_stats(since, timeout_s) if self._pipeline is not None else []

    def stage_infos(self) -> list[StageInfo]:
        """What each stage last said of itself (its process, node, device, memory); none in one process."""
        if self._pipeline is None:
            return []
        return [i for i in self._pipeline.infos if i is not None]

    def calls_used(self) -> str | None:
        return self._pipeline.calls_used() if self._pipeline is not None else None

    def write_trace(self, path: str) -> None:
        """A Chrome/Perfetto trace of the stages' calls so far (workers/timeline.py)."""
        self._stages("a trace").write_trace(path)

    def kill_stage(self, k: int) -> None:
        """Fault injection: kill stage k's process (Ray restarts it; the context recovers)."""
        self._stages("kill-stage").kill_stage(k)

    def wedge_stage(self, k: int) -> None:
        """Fault injection: stage k's next call blocks, its process alive (its watch declares it lost)."""
        self._stages("wedge-stage").wedge_stage(k)

    def set_recover_timeout(self, seconds: float) -> None:
        """How long a recovery may wait for a lost stage to come back before it gives up."""
        self._stages("a recovery timeout").recover_timeout_s = seconds

    def _stages(self, what: str) -> Pipeline:
        if self._pipeline is None:
            raise ValueError(f"{what} needs a pipeline: add --stages 2 (or more)")
        return self._pipeline

    def shutdown(self) -> None:
        if self._pipeline is not None:
            self._pipeline.shutdown()
        if isinstance(self.ctx, TensorParallelContext):
            self.ctx.close()


def open_runtime(cfg: RunConfig, on_plan: Callable[[Placement], None] | None = None) -> Runtime:
    """The model and its context where cfg says: the weights mapped here, or every stage actor holding
    its weights (Pipeline.launch returns once they do). on_plan sees a pipeline's placement before any
    actor starts (default: its table on stderr, unless cfg.show_plan is off)."""
    if not cfg.distributed:
        if cfg.set_threads:
            from .backends.host import kernel_threads
            kernel_threads.set_threads(cfg.threads)
        model = LlamaModel.load(cfg.model_path)
        if cfg.tensor_parallel != 1:
            return Runtime(model, TensorParallelContext(model, cfg.tensor_parallel, cfg.params))
        return Runtime(model, LlamaContext(model, cfg.params))
    if cfg.tensor_parallel > 1 and cfg.n_stages is None:
        raise ValueError(f"--tensor-parallel {cfg.tensor_parallel} with --stages auto: give the number of stages")
    n = cfg.n_stages or 1
    joined = connect(cfg.address, num_cpus=max(2, n * cfg.threads * cfg.tensor_parallel), verbose=cfg.verbose)
    if joined != "already connected":
        print(f"{cfg.label}: {joined}", file=sys.stderr)
    if on_plan is None and cfg.show_plan:
        def on_plan(p: Placement) -> None:
            print(p.table(), file=sys.stderr, flush=True)
    # K pipelines of S stages (workers/tp_stages.py): with stages, or with a node for every rank (one stage:
    # every rank a stage actor, the driver apart); else rank 0 is this process (workers/tp_ranks.py)
    if cfg.tensor_parallel > 1 and (n > 1 or len(cfg.node_ids or ()) == cfg.tensor_parallel):
        from .workers.tp_stages import launch_stage_group
        model, group, pipelines = launch_stage_group(
            str(cfg.model_path), n, cfg.tensor_parallel, cfg.params, node_ids=cfg.node_ids,
            threads_per_stage=cfg.threads, n_copies=cfg.n_copies, layers=cfg.layers, calls=cfg.stage_calls,
            on_plan=on_plan)
        return Runtime(model, group, pipelines[0])
    if cfg.tensor_parallel > 1:                  # rank 0 here, the others Ray actors (workers/tp_ranks.py)
        from .backends.host import kernel_threads
        kernel_threads.set_threads(cfg.threads)
        model = LlamaModel.load(cfg.model_path)
        from .workers.placement import STAGE_OVERHEAD_BYTES
        from .workers.tp_plan import rank_plan
        need = [a.weights + a.kv + STAGE_OVERHEAD_BYTES for a in rank_plan(model, cfg.tensor_parallel, cfg.params)]
        ranks = ray_ranks(str(cfg.model_path), cfg.tensor_parallel, threads=cfg.threads, node_ids=cfg.node_ids,
                          memory=need[1:])
        return Runtime(model, TensorParallelContext(model, cfg.tensor_parallel, cfg.params, ranks=ranks,
                                                    max_recoveries=TP_RECOVERIES))
    pl = Pipeline.launch(str(cfg.model_path), cfg.n_stages, cfg.params, n_copies=cfg.n_copies, layers=cfg.layers,
                         threads_per_stage=cfg.threads, node_ids=cfg.node_ids, on_plan=on_plan,
                         calls=cfg.stage_calls, devices=list(cfg.devices) or None)
    return Runtime(pl.model, pl.ctx, pl)

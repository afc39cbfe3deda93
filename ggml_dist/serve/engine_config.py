"""The server's configuration (EngineConfig): the run's, whole (runtime.RunConfig: what `run` takes), and
what only a server has: slots, queue, lookahead, templates, replicas, pooling, request defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..model.context import ContextParams
from ..runtime import RunConfig


@dataclass(slots=True)
class EngineConfig:
    """The server's configuration: the run's (RunConfig, the same options as `run`'s: the model, its
    context and where it runs), and what only a server has. The server owns three of the run's fields,
    set here from its own: the context's sequences (one per slot), its KV streams (kv_unified) and the
    micro-batches in flight over stages (n_copies, from lookahead), and a micro-batch is one ubatch."""
    run: RunConfig
    n_parallel: int = 4
    max_queue: int = 64
    lookahead: int = 1                      # a group's steps in flight over stages (> 1: token feedback)
    chat_template: str | None = None        # Jinja source overriding the GGUF's tokenizer.chat_template
    kv_unified: bool | None = None          # one KV stream shared by the slots, or one per slot
                                            # (None: per slot in one process, shared on a pipeline)
    cache_prompt: bool = True               # a finished request's tokens stay in its slot's stream, and
                                            # a prompt starting with them reuses them (KV stream per slot)
    checkpoint_every: int = 512             # a recurrent model's slots copy their state every this many
    checkpoint_mib: int = 256               # prompt tokens, within this budget (serve/checkpoints.py)
    n_replicas: int = 1                     # engine processes sharing the slots (serve.replicas)
    pooling: str | None = None              # /v1/embeddings: "mean", "last" or "cls" (llama-server's
                                            # --pooling; the files we load carry pooling type none);
                                            # "none": /embedding's every token's row, not normalized
    request_defaults: tuple[tuple[str, int | float], ...] = ()   # llama-server's --temp, --seed and
                                            # --n-predict: what a request that does not set them takes
                                            # (temperature, seed, n_predict; applied by app.py)

    def __post_init__(self) -> None:
        run, params = self.run, self.run.params
        if self.pooling not in (None, "mean", "last", "cls", "none"):
            raise ValueError(f"--pooling must be mean, last, cls or none, got {self.pooling!r}")
        if not 1 <= self.n_parallel <= 64:
            raise ValueError(f"--parallel must be 1..64 (KV sequence ids), got {self.n_parallel}")
        if params.n_ctx // self.n_parallel < 8:
            raise ValueError(f"--ctx {params.n_ctx} over --parallel {self.n_parallel} leaves "
                             f"{params.n_ctx // self.n_parallel} cells per slot; raise --ctx")
        if self.kv_unified is None:
            self.kv_unified = run.distributed and not params.batch_invariant
        if not 1 <= self.n_replicas <= self.n_parallel:
            raise ValueError(f"--replicas must be 1..--parallel ({self.n_parallel}), got {self.n_replicas}")
        if self.n_replicas > 1 and run.distributed:
            raise ValueError("--replicas runs engines side by side in one machine; it does not combine "
                             "with a pipeline (--stages > 1 or --address)")
        if self.checkpoint_every < 1 or self.checkpoint_mib < 0:
            raise ValueError(f"state checkpoints every {self.checkpoint_every} tokens within "
                             f"{self.checkpoint_mib} MiB: the interval must be >= 1 and the budget >= 0")
        if self.max_queue < 0:
            raise ValueError(f"the queue bound must be >= 0, got {self.max_queue}")
        if run.n_stages is None and run.address is None:
            raise ValueError("--stages auto places the model on a cluster's nodes: give --address")
        if self.lookahead < 1:
            raise ValueError(f"--lookahead must be >= 1, got {self.lookahead}")
        # where a sequence's cells sit changes the attention's order (a shared stream interleaves them):
        # the mode needs a stream per slot, also over a pipeline
        if params.batch_invariant and self.kv_unified:
            raise ValueError("--deterministic needs a KV stream per slot: drop --kv-unified on (in a shared "
                             "stream a sequence's cells sit wherever they were free, which changes its bits)")
        # a micro-batch of the server is at most n_batch tokens, computed as one ubatch
        n_copies = run.n_copies or (min(4, self.lookahead * (run.n_stages or 0)) or None)
        self.run = replace(run, n_copies=n_copies, params=replace(
            params, n_ubatch=params.n_batch, n_seq_max=self.n_parallel, kv_unified=self.kv_unified,
            background_compile=True))

    @property
    def params(self) -> ContextParams:
        return self.run.params

    @property
    def model_path(self) -> str:
        return str(self.run.model_path)

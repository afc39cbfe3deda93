"""The server's configuration as `serve` builds it from its options (config.run_config, then EngineConfig): the
run's (RunConfig: the model, its context, where it runs) and the server's own fields."""
from __future__ import annotations

from typing import Any

from ggml_dist.model.context import ContextParams
from ggml_dist.runtime import RunConfig
from ggml_dist.serve import EngineConfig


def engine_config(model_path: str, *, n_ctx: int = 2048, n_batch: int = 512, n_stages: int | None = 1,
                  batch_invariant: bool = False, **server: Any) -> EngineConfig:
    params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, batch_invariant=batch_invariant)
    return EngineConfig(RunConfig(str(model_path), params, n_stages, label="ggml-dist serve"), **server)

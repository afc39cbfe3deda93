"""A stage as data, by value: what it is (StageSpec, sent to its process), what it says of itself
(StageInfo) and what it measured (StageStats, its calls' CallSpans). workers/stage.py's worker keeps
and sends them; the driver, the runtime face and the server's live view read them."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..backends.base import DeviceInfo
from ..backends.devices import DeviceSpec
from ..model import layout
from ..model.archs import LlamaHParams
from ..model.context import ContextParams
from ..model.recurrent_state import recurrent_layers


@dataclass(frozen=True)
class StageSpec:
    """What one stage is, by value (it travels to the stage's process): a layer range of a model (plus
    embeddings / head when first / last), the run's context (KV size and types, sequences, numerics),
    the model's KV row widths, and the device it computes on."""
    stage_id: int
    model_path: str
    layers: tuple[int, int]            # [first, last) layer indices
    first: bool
    last: bool
    params: ContextParams
    n_embd_k_gqa: int
    n_embd_v_gqa: int
    device: DeviceSpec = field(default_factory=DeviceSpec)
    # a hybrid model's recurrent layers in this stage's range: a state of n_embd_r + n_embd_s values per
    # sequence each (model/recurrent_state.py) instead of KV cells
    recurrent: tuple[int, ...] = ()
    n_embd_r: int = 0
    n_embd_s: int = 0
    # one rank of a tensor-parallel group per stage (workers/tp_stages.py): its rows of each matrix
    # (model/tensor_parallel.py's rank_weights of the model's hparams), exchanging with the stage's other ranks
    tp_rank: int = 0
    tp_size: int = 1
    tp_hp: LlamaHParams | None = None

    def weight_names(self, all_names: list[str], tied: bool) -> list[str]:
        return layout.stage_tensors(all_names, self.layers, self.first, self.last, tied)

    @property
    def kv_layers(self) -> list[int]:
        return [il for il in range(*self.layers) if il not in self.recurrent]


def recurrent_fields(hp: LlamaHParams, layers: tuple[int, int]) -> dict[str, Any]:
    """StageSpec's recurrent-state fields for a stage of `layers` of a model of hp (none but a hybrid's)."""
    rec = recurrent_layers(hp, range(*layers))
    return {"recurrent": rec, "n_embd_r": hp.n_embd_r, "n_embd_s": hp.n_embd_s} if rec else {}


# one call's wall times: (start, compute start, compute end, end, plan label)
CallSpan = tuple[float, float, float, float, str]


@dataclass
class StageStats:
    """A stage's figures since it started: kept by the stage, and sent as a snapshot (StageWorker.get_stats)."""
    n_calls: int = 0
    n_plans: int = 0
    compute_s: float = 0.0
    decode_s: float = 0.0        # each call's part before its compute: finding the plan, decoding, inputs
    bytes_in: int = 0            # every message received: the driver's inputs and upstream results
    bytes_in_host: int = 0       # of which from the driver (tokens, positions, masks, KV slots)
    bytes_out: int = 0
    cpu_s: float = 0.0           # the process's CPU seconds, every thread (in a snapshot)
    rss_bytes: int = 0           # the process's resident memory (in a snapshot; 0 where /proc has none)
    incarnation: str = ""        # the process's life (in a snapshot): a restarted stage's stats have another
    state_copy_bytes: int = 0    # the recurrent state's copies kept for checkpoints (in a snapshot)
    timeline: list[CallSpan] = field(default_factory=list)


@dataclass(frozen=True)
class StageInfo:
    """What a stage says of itself (StageWorker.info; its Ray actor adds where it listens)."""
    stage: int
    pid: int
    incarnation: str             # this process's life: a restarted stage has another
    node: str                    # the host's name
    node_id: str                 # Ray's node id ("" outside Ray)
    needs_weights: bool          # cannot read the model file and was sent none yet
    layers: tuple[int, int]
    weight_bytes: int
    kv_bytes: int
    compute_bytes: int
    device: DeviceInfo
    health: str = ""             # the health port's address (workers/health.py)
    node_ip: str = ""


def rss_bytes() -> int:
    """This process's resident memory now (Linux's /proc; 0 elsewhere): what a stage uses, beside what
    placement planned for it."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

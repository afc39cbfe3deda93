"""The driver's side of a pipeline: a LlamaContext whose scheduler sees one proxy per stage.

    DriverPipeline
        the context's pipeline hooks (model/context.py's PipelineHooks), in one object: the proxies and
        the driver's CPU, the weights bound to their stage's remote buffer type (so the scheduler's
        weight rule sends each layer's ops to its stage), the KV layers on their stage, exports bound
        after each allocation, the last stage choosing the tokens from its logits, a chosen token fed to
        a later call as a handle (token feedback), and the restore of lost stages
    driver_context(model, params, placement, proxies, n_copies, restore)
        a LlamaContext on a DriverPipeline
    planned_compute(model, params, n_stages, layers=None)
        the compute buffer the scheduler plans for each stage of a k-stage split (balanced, or the
        given layer ranges), on proxies that are never called: what placement counts before any
        actor exists, and what the stage allocates (its largest split's plan: a stage's plans share
        one buffer)
    plan_on_nodes(model, params, nodes, n_stages, ...)
        placement.place_on_nodes with those compute figures and the model's sizes at params' context
    plan_stages(model, params, n_stages, nodes=None, ...)
        the one memory account: what `ggml-dist plan` prints, what `run` prints on stderr and reports
        in `run --json`'s plan, and what Pipeline.launch places and reserves (plan_on_nodes on a
        cluster's nodes, else place() with the same compute and stage-process figures)

The stage's own allocator replans each split it receives; its buffer is what the driver plans for it
with one copy (planned_compute): the n_copies input copies live in the driver's plan only. That figure
is the account's compute_bytes, before launch as after it (Pipeline.launch used to put the driver's
figure with its n_copies copies in its place on a local Ray: 58.4 MiB where plan said 44.1).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..backends.base import Backend, BufferType, BufferUsage
from ..backends.devices import DeviceKind, DeviceSpec, kind_info, open_backend
from ..core.context import Context
from ..core.graph import Graph
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model import layout
from ..model.context import ContextParams, LlamaContext
from ..model.kv_cache import kv_cells
from ..model.model import LlamaModel
from ..model.sampling import RowSampling
from ..scheduler.sched import Sched
from .model_sizes import ModelSizes
from .placement import STAGE_OVERHEAD_BYTES, NodeInfo, Placement, PlacementError, place, place_on_nodes
from .proxy import Call, Exports, Fetch, RemoteBuffer, RemoteBufferType, StageDevice, StageProxy


class DriverPipeline:
    """A LlamaContext's pipeline hooks (model/context.py's PipelineHooks) over the proxies of one
    pipeline, which share the current graph's Exports (bind_exports, after each allocation)."""

    def __init__(self, model: LlamaModel, params: ContextParams, placement: Placement, proxies: list[StageProxy],
                 n_copies: int, restore: Callable[[], None] | None = None) -> None:
        cpu = open_backend(DeviceSpec(DeviceKind.CPU, params.backend_options()), "driver")  # last: the fallback
        self.proxies = proxies
        self.backends: list[Backend] = [*proxies, cpu]
        self.n_copies = n_copies
        # a stage takes its inputs by value (snapshotted when sent), so no copy slot is reused while in
        # use: up to two micro-batches per stage in flight (every group of a --parallel run, a step queued ahead)
        self.max_inflight = max(n_copies, 2 * len(proxies))
        self.weights = driver_weights(model, placement, proxies)
        self.restore = restore
        self._stage_of = {il: p for p in proxies for il in range(*p.layers)}

    def layer_buft(self, il: int) -> RemoteBufferType:
        return self._stage_of[il].device.buft

    def state_op(self, buft: BufferType, op: tuple) -> None:
        """A row operation on the recurrent state rows of buft's stage: sent with its next call."""
        assert isinstance(buft, RemoteBufferType) and buft.proxy is not None, f"{buft.name} is no stage's"
        buft.proxy.pending_state.append([op[0], *map(int, op[1:])])

    def after_alloc(self, sched: Sched, graph: Graph) -> None:
        bind_exports(sched, graph, self.proxies)

    def _exports(self) -> Exports:
        ex = self.proxies[0].exports
        assert ex is not None, "Exports.of(sched, graph) must be bound before compute"
        return ex

    def sample(self, t: Tensor, rows: list[RowSampling], keep_logits: bool) -> bool:
        """Where t's rows are sampled: by the stage that computes t (the logits), at its next call, which
        returns the tokens, and t's value only if keep_logits; False where no stage computes t."""
        buft = getattr(t.buffer, "buft", None)
        proxy = buft.proxy if isinstance(buft, RemoteBufferType) else None
        if proxy is None:
            return False
        proxy.pending_sample = {"export": self._exports().keys[t], "rows": [r.to_list() for r in rows],
                                "keep": keep_logits}
        return True

    def fetch_tokens(self, t: Tensor) -> Fetch:
        assert isinstance(t.buffer, RemoteBuffer)
        return t.buffer.get_tensor_async(t, ":tok")

    def feed(self, t: Tensor, fetch: Callable[[], np.ndarray] | None) -> bool:
        """The next compute takes graph input t from `fetch` (a Fetch of this pipeline's): the stage
        that reads t gets the producing call's handle, and the transport hands it the result from stage to
        stage. Not while the calls run as a compiled graph (its executions take their inputs from the
        driver). fetch None: withdraw t's feed if the compute did not take it."""
        feeds = self._exports().feeds
        if fetch is None:
            return feeds.pop(t, None) is not None
        if not isinstance(fetch, Fetch) or not fetch.proxy.call.takes_refs():
            return False
        feeds[t] = (fetch.handle, fetch.key)
        return True


def driver_context(model: LlamaModel, params: ContextParams, placement: Placement, proxies: list[StageProxy],
                   n_copies: int, restore: Callable[[], None] | None = None) -> LlamaContext:
    """The driver's context over the stages' proxies; restore: how lost stages come back (None: the
    context is not recoverable)."""
    return LlamaContext(model, params, DriverPipeline(model, params, placement, proxies, n_copies, restore))


def stage_kinds(kinds: list[DeviceKind] | None, n_stages: int) -> list[DeviceKind]:
    """Each stage's device kind: as given (one for all, or one per stage), else the CPU."""
    if not kinds:
        return [DeviceKind.CPU] * n_stages
    if len(kinds) not in (1, n_stages):
        raise PlacementError(f"{len(kinds)} device kinds for {n_stages} stages; give one for all, or one per stage")
    return list(kinds) * n_stages if len(kinds) == 1 else list(kinds)


def planned_compute(model: LlamaModel, params: ContextParams, n_stages: int, n_copies: int = 1,
                    layers: list[tuple[int, int]] | None = None, kinds: list[DeviceKind] | None = None) -> list[int]:
    """Per stage of an n_stages split (balanced, or `layers`): the compute buffer the driver plans for
    it. The figure hardly depends on where the split falls (a layer's activations; the head's logits
    on the last). With one copy it is what the stage itself allocates
    (tests/workers/test_stage_local.py): the driver's n_copies input copies live in the driver's plan
    only, since a stage receives each micro-batch's inputs in its call. Before any stage exists, its
    device is its kind's description (devices.kind_info)."""
    pl = place(model.file, model.hp, n_stages, params.n_ctx, layers=layers)

    def never(*_: Any) -> Any:
        raise RuntimeError("a sizing proxy is never called")
    proxies = [StageProxy(s.stage, s.layers, Call(never, never, never),
                          StageDevice(f"stage{s.stage}", kind_info(DeviceSpec(kind), f"stage{s.stage}")))
               for s, kind in zip(pl.stages, stage_kinds(kinds, n_stages))]
    ctx = driver_context(model, params, pl, proxies, n_copies)
    return [ctx.sched.get_buffer_size(p) for p in proxies]


MAX_COPIES = 4      # GGML_SCHED_MAX_COPIES: llama.cpp's n_copies whenever it pipelines


def default_copies(n_stages: int) -> int:
    """Micro-batches in flight by default: 4, as llama.cpp. Not one per stage: the driver is a stage
    too (it samples a step's token and builds the next step's inputs while the actors compute), and
    continuous decode of several sequences keeps every copy busy (bench pipeline --mode decode, 4
    sequences, SmolLM2 on 2 cores: 2 stages 67 -> 103 tok/s, 1 stage 48 -> 88 tok/s with 4 copies
    instead of 2 and 1). Only the driver's plan holds the copies; a stage's memory does not grow."""
    return MAX_COPIES


def kv_plan(params: ContextParams) -> tuple[int, int]:
    """(cells over every stream, bytes per element) of the KV cache params ask for."""
    cells, n_stream = kv_cells(params.n_ctx, params.n_seq_max, params.kv_unified)
    return cells * n_stream, 2 if params.type_k == GGMLType.F16 else 4


def plan_on_nodes(model: LlamaModel, params: ContextParams, nodes: list[NodeInfo], n_stages: int | None,
                  threads: int = 1, layers: list[tuple[int, int]] | None = None,
                  kinds: list[DeviceKind] | None = None) -> Placement:
    memo: dict[int, list[int]] = {}

    def compute_of(k: int) -> list[int]:
        if k not in memo:
            memo[k] = planned_compute(model, params, k, kinds=kinds if kinds and len(kinds) == 1 else None)
        return memo[k]
    n_kv, kv_size = kv_plan(params)
    sizes = ModelSizes.of(model.file, model.hp, n_kv, kv_size, params.n_seq_max)
    return place_on_nodes(sizes, nodes, n_stages, compute_of, STAGE_OVERHEAD_BYTES, threads, layers)


def plan_stages(model: LlamaModel, params: ContextParams, n_stages: int | None, *,
                nodes: list[NodeInfo] | None = None, budgets: list[int] | None = None,
                layers: list[tuple[int, int]] | None = None, threads: int = 1,
                kinds: list[DeviceKind] | None = None) -> Placement:
    """The placement and memory account of a pipeline, the one function behind `plan`, `run`'s table,
    `run --json`'s plan and Pipeline.launch: per stage its weights, KV cache, the compute buffer it
    allocates (planned_compute, one copy) and the stage process (STAGE_OVERHEAD_BYTES). nodes: one
    stage per node (n_stages None: the fewest that fit); else n_stages stages against the optional
    budgets (one machine, or stages pinned by the caller)."""
    if nodes is not None:
        return plan_on_nodes(model, params, nodes, n_stages, threads, layers, kinds)
    if n_stages is None:
        raise PlacementError("--stages auto needs a cluster's nodes (--address, or a ray job) or one budget")
    n_kv, kv_size = kv_plan(params)
    ranges = [s.layers for s in place(model.file, model.hp, n_stages, n_kv, kv_size, layers=layers,
                                      n_seq=params.n_seq_max).stages]
    return place(model.file, model.hp, n_stages, n_kv, kv_size, planned_compute(model, params, n_stages,
                 layers=ranges, kinds=kinds), 1, budgets, ranges, STAGE_OVERHEAD_BYTES, params.n_seq_max)


def bind_exports(sched: Any, graph: Graph, proxies: list[StageProxy]) -> None:
    ex = Exports.of(sched, graph)
    for p in proxies:
        p.exports = ex


def driver_weights(model: LlamaModel, placement: Placement, proxies: list[StageProxy]) -> dict[str, Tensor]:
    """The weights as the driver's graph sees them: metadata bound to the owning stage's buffer type
    (usage WEIGHTS), so the scheduler's weight rule sends each layer's ops to its stage."""
    n = len(proxies)
    ctx = Context((len(model.weights) + model.hp.n_layer) * 400 + 4096, no_alloc=True, name="driver-weights")
    bufs = [RemoteBuffer(p.device.buft, 0, BufferUsage.WEIGHTS) for p in proxies]
    owner = {il: k for k, s in enumerate(placement.stages) for il in range(*s.layers)}
    out: dict[str, Tensor] = {}
    for name, w in model.weights.items():
        role, il = layout.tensor_role(name)         # a tensor every stage maps: the last's, for the graph
        k = owner[il] if role == "layer" else 0 if role == "embd" else n - 1
        t = ctx.new_tensor(w.type, w.ne).set_name(name)
        t.buffer, t.data = bufs[k], w.data
        out[name] = t
    for name in layout.EVERY_STAGE & set(model.weights):  # each layer's own copy, on its stage (llama.cpp's)
        w = model.weights[name]
        for il, k in owner.items():
            t = ctx.new_tensor(w.type, w.ne).set_name(f"blk.{il}.{name}")
            t.buffer, t.data = bufs[k], w.data
            out[t.name] = t
    if layout.HEAD not in out:                    # tied head: the last stage's own mapping of it
        w = model.weights[layout.EMBD]
        t = ctx.new_tensor(w.type, w.ne).set_name(layout.HEAD)
        t.buffer, t.data = bufs[n - 1], w.data
        out[layout.HEAD] = t
    return out

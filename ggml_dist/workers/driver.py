"""The driver's side of a pipeline: a LlamaContext whose scheduler sees one proxy per stage.

    driver_context(model, params, placement, proxies, n_copies)
        weights bound to their stage's remote buffer type (so the scheduler's weight rule sends each
        layer's ops to its stage), the KV layers on their stage, exports bound after each allocation
    planned_compute(model, params, n_stages)
        the compute buffer the scheduler plans for each stage of a balanced k-stage split, on proxies
        that are never called: what placement counts before any actor exists, and what the stage
        allocates (its largest split's plan: a stage's plans share one buffer)
    plan_on_nodes(model, params, nodes, n_stages, ...)
        placement.place_on_nodes with those compute figures and the model's sizes at params' context

The stage's own allocator replans each split it receives; its buffer is what the driver planned for it
(the driver's plan of that stage's splits, with their n_copies input copies).
"""
from __future__ import annotations

from typing import Any

from ..backends.base import BufferUsage
from ..backends.cpu.backend import CPUDevice
from ..core.context import Context
from ..core.graph import Graph
from ..core.tensor import Tensor
from ..core.types import GGMLType
from ..model.context import ContextParams, LlamaContext
from ..model.kv_cache import kv_cells
from ..model.model import LlamaModel
from .placement import STAGE_OVERHEAD_BYTES, ModelSizes, NodeInfo, Placement, place, place_on_nodes
from .proxy import Call, Exports, RemoteBuffer, StageDevice, StageProxy
from .stage import EVERY_STAGE


def driver_context(model: LlamaModel, params: ContextParams, placement: Placement,
                   proxies: list[StageProxy], n_copies: int) -> LlamaContext:
    cpu = CPUDevice("driver").init_backend(opts=params.compute_options())
    stage_of = {il: p for p in proxies for il in range(*p.layers)}
    return LlamaContext(model, params, backends=[*proxies, cpu], n_copies=n_copies,
                        weights=driver_weights(model, placement, proxies),
                        layer_buft=lambda il: stage_of[il].device.buft,
                        after_alloc=lambda sched, g: bind_exports(sched, g, proxies))


def planned_compute(model: LlamaModel, params: ContextParams, n_stages: int, n_copies: int = 1) -> list[int]:
    """Per stage of a balanced n_stages split: the compute buffer the driver plans for it. The figure
    hardly depends on where the split falls (a layer's activations; the head's logits on the last).
    With one copy it is what the stage itself allocates (tests/workers/test_stage_local.py): the
    driver's n_copies input copies live in the driver's plan only, since a stage receives each
    micro-batch's inputs in its call."""
    pl = place(model.file, model.hp, n_stages, params.n_ctx)

    def never(*_: Any) -> Any:
        raise RuntimeError("a sizing proxy is never called")
    proxies = [StageProxy(s.stage, s.layers, Call(never, never, never), StageDevice(f"stage{s.stage}"))
               for s in pl.stages]
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
                  threads: int = 1, layers: list[tuple[int, int]] | None = None) -> Placement:
    memo: dict[int, list[int]] = {}

    def compute_of(k: int) -> list[int]:
        if k not in memo:
            memo[k] = planned_compute(model, params, k)
        return memo[k]
    n_kv, kv_size = kv_plan(params)
    return place_on_nodes(ModelSizes.of(model.file, model.hp, n_kv, kv_size), nodes, n_stages, compute_of,
                          STAGE_OVERHEAD_BYTES, threads, layers)


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
        if name.startswith("blk."):
            k = owner[int(name.split(".")[1])]
        elif name == "token_embd.weight":
            k = 0
        else:
            k = n - 1
        t = ctx.new_tensor(w.type, w.ne).set_name(name)
        t.buffer, t.data = bufs[k], w.data
        out[name] = t
    for name in EVERY_STAGE & set(model.weights):  # each layer's own copy, on its stage (llama.cpp's)
        w = model.weights[name]
        for il, k in owner.items():
            t = ctx.new_tensor(w.type, w.ne).set_name(f"blk.{il}.{name}")
            t.buffer, t.data = bufs[k], w.data
            out[t.name] = t
    if "output.weight" not in out:                # tied head: the last stage's own mapping of it
        w = model.weights["token_embd.weight"]
        t = ctx.new_tensor(w.type, w.ne).set_name("output.weight")
        t.buffer, t.data = bufs[n - 1], w.data
        out["output.weight"] = t
    return out

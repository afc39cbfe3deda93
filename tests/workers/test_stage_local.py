"""Stage workers and proxies without Ray: a driver context over in-process stages, plan LRU mirroring."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.devices import DeviceKind, DeviceSpec
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch
from ggml_dist.workers import stage as stage_mod
from ggml_dist.workers.driver import driver_context
from ggml_dist.workers.placement import place
from ggml_dist.workers.proxy import Call, StageDevice, StageProxy
from ggml_dist.workers.stage import StageWorker
from ggml_dist.workers.stage_data import StageSpec, recurrent_fields
from tests.model.refs import LONG_SPECS, LONG_TOKENS


def local_pipeline(path, n_stages: int, params: ContextParams, n_copies: int = 1, kinds=None):
    """The Ray pipeline's driver side, with each actor replaced by a StageWorker called directly; kinds:
    each stage's device kind (default the CPU)."""
    model = LlamaModel.load(path)
    hp = model.hp
    pl = place(model.file, hp, n_stages, params.n_ctx)
    workers, proxies = [], []
    for sp, kind in zip(pl.stages, kinds or [DeviceKind.CPU] * n_stages):
        w = StageWorker(StageSpec(sp.stage, str(path), sp.layers, sp.stage == 0, sp.stage == n_stages - 1,
                                  params, hp.n_embd_k_gqa, hp.n_embd_v_gqa, DeviceSpec(kind),
                                  **recurrent_fields(hp, sp.layers)))
        workers.append(w)
        call = Call(submit=lambda pid, desc, inp, *ups, w=w: w.compute(pid, desc, inp, *ups),
                    get=lambda hs: hs, wait=lambda hs: None)
        proxies.append(StageProxy(sp.stage, sp.layers, call, StageDevice(f"stage{sp.stage}", w.info().device)))
    ctx = driver_context(model, params, pl, proxies, n_copies=n_copies)
    return model, ctx, workers


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("stl") / "m.gguf", SyntheticSpec(n_layer=3, seed=4))


# in-process stages give bitwise the single-process logits
def test_local_stages_bitwise(path):
    toks = [1, 30, 40, 50, 60]
    model, ctx, _ = local_pipeline(path, 3, ContextParams(n_ctx=256))
    ref = LlamaContext(model, ContextParams(n_ctx=256))
    assert np.array_equal(ctx.decode(Batch.from_tokens(toks, all_outputs=True)),
                          ref.decode(Batch.from_tokens(toks, all_outputs=True)))


# in-process stages on the fake accelerator (weights uploaded into its non-host buffer type, the KV cache
# and the compute arena in it) give bitwise the single-process logits
def test_local_stages_on_the_fake_accelerator_bitwise(path):
    from ggml_dist.backends.base import BufferUsage
    toks = [1, 30, 40, 50, 60]
    kinds = [DeviceKind.ACCEL, DeviceKind.CPU, DeviceKind.ACCEL]
    model, ctx, workers = local_pipeline(path, 3, ContextParams(n_ctx=256), kinds=kinds)
    ref = LlamaContext(model, ContextParams(n_ctx=256))
    assert np.array_equal(ctx.decode(Batch.from_tokens(toks, all_outputs=True)),
                          ref.decode(Batch.from_tokens(toks, all_outputs=True)))
    for w, kind in zip(workers, kinds):
        on_device = all(t.buffer.buft is w.buft and t.buffer.usage == BufferUsage.WEIGHTS for t in w.weights.values())
        assert on_device == (kind == DeviceKind.ACCEL)
        assert all(t.buffer.buft is w.buft for t in w.kv.tensors())


# more graph shapes than a stage keeps plans: the proxy's mirror of the LRU resends descriptions in time
def test_plan_lru_mirrored(path, monkeypatch):
    monkeypatch.setattr(stage_mod, "MAX_PLANS", 2)
    model, ctx, workers = local_pipeline(path, 2, ContextParams(n_ctx=256, n_batch=64))
    ref = LlamaContext(model, ContextParams(n_ctx=256, n_batch=64))
    pos = 0
    for n in [3, 5, 1, 7, 3, 1, 5, 2, 7]:          # 5 shapes, revisited in an order that evicts
        toks = list(range(10, 10 + n))
        a = ctx.decode(Batch.from_tokens(toks, pos0=pos, all_outputs=True))
        b = ref.decode(Batch.from_tokens(toks, pos0=pos, all_outputs=True))
        assert np.array_equal(a, b)
        pos += n
    assert all(len(w.plans) <= 2 for w in workers)
    assert all(w.stats.n_plans > 2 for w in workers)   # evicted plans were described again


# a stage's plans share one compute buffer, the size of its largest plan's: shapes that grow it move
# the earlier plans into the new buffer, and every shape still gives the single-process logits
def test_plans_share_one_compute_buffer(path):
    model, ctx, workers = local_pipeline(path, 2, ContextParams(n_ctx=256, n_batch=64))
    ref = LlamaContext(model, ContextParams(n_ctx=256, n_batch=64))
    pos = 0
    for n in [1, 4, 2, 9, 1, 4, 2, 9]:             # grows twice, then revisits the earlier shapes
        toks = list(range(20, 20 + n))
        assert np.array_equal(ctx.decode(Batch.from_tokens(toks, pos0=pos, all_outputs=True)),
                              ref.decode(Batch.from_tokens(toks, pos0=pos, all_outputs=True)))
        pos += n
    for w in workers:
        sizes = [p.galloc.get_buffer_size(0) for p in w.plans.values()]
        assert len(sizes) == 4 and w.compute_bytes() == max(sizes) < sum(sizes)
        assert all(p.galloc.buffers[0].chunks[0] is w.arena.buffer for p in w.plans.values())


# what placement counts for a stage's compute buffer (the driver's plan of its splits, one copy) is
# what the stage allocates for the worst-case ubatch (every token an output, over the whole cache)
def test_planned_compute_is_what_the_stage_allocates(path):
    from ggml_dist.workers.driver import planned_compute
    params = ContextParams(n_ctx=256, n_batch=64, n_ubatch=64)
    model, ctx, workers = local_pipeline(path, 3, params)
    ctx.decode(Batch.from_tokens(list(range(30, 94)), pos0=0, all_outputs=True))       # 64 tokens
    planned = planned_compute(model, params, 3, 1)
    got = [w.compute_bytes() for w in workers]
    assert got == planned


# llama3 rope scaling (rope_freqs.weight, read by every layer) and qwen3 (QK-norm, heads of 24) over 2 and
# 3 in-process stages: each stage holds the factors under its layers' names; same logits as one process
@pytest.mark.parametrize("spec", LONG_SPECS, ids=lambda s: s.arch + ("-llama3" if s.rope_scaling else ""))
@pytest.mark.parametrize("n_stages", [2, 3])
def test_llama3_and_qwen3_stages_bitwise(tmp_path, spec, n_stages):
    from dataclasses import replace
    p = write_synthetic(tmp_path / "m.gguf", replace(spec, n_layer=3))
    toks = LONG_TOKENS[:40]
    model, ctx, _ = local_pipeline(p, n_stages, ContextParams(n_ctx=256))
    ref = LlamaContext(model, ContextParams(n_ctx=256))
    assert np.array_equal(ctx.decode(Batch.from_tokens(toks, all_outputs=True)),
                          ref.decode(Batch.from_tokens(toks, all_outputs=True)))


# a call meant for an earlier incarnation of a stage (it was restarted: its KV cache is empty) is refused
def test_call_for_another_incarnation_refused(path):
    from ggml_dist.workers.stage import StateLostError
    _, ctx, workers = local_pipeline(path, 2, ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens([1, 2, 3]))
    w = workers[0]
    pid = next(iter(w.plans))
    with pytest.raises(StateLostError, match="restarted"):
        w.compute(pid, None, b"", incarnation="0" * 16)


# the driver's scheduler keeps n_copies slots of each input ("stage0#inp_pos#2") and a graph per (shape,
# slot); the stages take inputs by value, so one graph shape is one plan on a stage whichever slot the
# driver used, not one per slot (each a rebuild and a bind on the stage); the logits are one process's
@pytest.mark.parametrize("n_copies", [1, 4])
def test_one_plan_per_shape_whatever_the_copy(path, n_copies):
    model, ctx, workers = local_pipeline(path, 2, ContextParams(n_ctx=256), n_copies=n_copies)
    ref = LlamaContext(model, ContextParams(n_ctx=256))
    toks = [1, 30, 40, 50]
    assert np.array_equal(ctx.decode(Batch.from_tokens(toks)), ref.decode(Batch.from_tokens(toks)))
    pos = len(toks)
    for step in range(12):                      # two shapes taking turns: the slot moves on each change
        chunk = [7 + pos + i for i in range(1 + step % 2)]
        assert np.array_equal(ctx.decode(Batch.from_tokens(chunk, pos0=pos)),
                              ref.decode(Batch.from_tokens(chunk, pos0=pos)))
        pos += len(chunk)
    assert [w.stats.n_plans for w in workers] == [3, 3]          # the prompt's and the two steps'


# a stage's stats since a moment: the timeline's calls ended since then only (the live view asks for its
# last second, /metrics for none), its totals whatever the moment
def test_stats_since(path):
    _, ctx, workers = local_pipeline(path, 2, ContextParams(n_ctx=256))
    ctx.decode(Batch.from_tokens([1, 30, 40, 50]))
    ctx.decode(Batch.from_tokens([60], pos0=4))
    w = workers[0]
    whole, none = w.get_stats(), w.get_stats(float("inf"))
    assert len(whole.timeline) == 2 and none.timeline == []
    assert none.n_calls == whole.n_calls == 2 and none.compute_s == whole.compute_s > 0
    assert len(w.get_stats(whole.timeline[1][3]).timeline) == 1

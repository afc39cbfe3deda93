"""A lost stage of a Qwen3.5 hybrid pipeline comes back with the same tokens: its recurrent state cannot
be cut back, so the replay runs every live sequence from position 0 (model/recovery.py: each sequence's
lineage, the copies between sequences in their place), from zeroed rows on the new stage.

In-process stages (a restore that starts a fresh StageWorker, whose rows and KV cells are zero) test the
replay cheaply; the Ray tests kill a real actor as tests/workers/test_moe_pipeline.py does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggml_dist.backends.base import StageLostError
from ggml_dist.backends.devices import DeviceSpec
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate, generate_parallel
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.recovery import StateCopy
from ggml_dist.model.sampling import SamplingParams
from ggml_dist.model.synthetic import write_synthetic
from ggml_dist.model.synthetic_hybrid import QWEN35_SPECS
from ggml_dist.workers.driver import driver_context
from ggml_dist.workers.placement import place
from ggml_dist.workers.proxy import Call, StageDevice, StageProxy
from ggml_dist.workers.stage import StageWorker
from ggml_dist.workers.stage_data import StageSpec, recurrent_fields

REFS = np.load(Path(__file__).resolve().parents[1] / "data" / "qwen35_refs.npz")
PROMPT = REFS["meta/tokens"].tolist()[:7]
N = 12
ARCHS = {s.arch: s for s in QWEN35_SPECS}
SAMPLED = SamplingParams(temperature=0.9, seed=11)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35-rec")
    return {a: str(write_synthetic(d / f"{s.name}.gguf", s)) for a, s in ARCHS.items()}


class LocalStages:
    """tests/workers/test_stage_local.py's in-process pipeline, recoverable: lose(k) makes stage k's next
    call fail as a lost actor's does (StageLostError); the restore starts a fresh worker in its place."""

    def __init__(self, path: str, n_stages: int, params: ContextParams) -> None:
        self.model = m = LlamaModel.load(path)
        pl = place(m.file, m.hp, n_stages, params.n_ctx)
        self.specs = [StageSpec(sp.stage, path, sp.layers, sp.stage == 0, sp.stage == n_stages - 1, params,
                                m.hp.n_embd_k_gqa, m.hp.n_embd_v_gqa, DeviceSpec(), **recurrent_fields(m.hp, sp.layers))
                      for sp in pl.stages]
        self.workers = [StageWorker(s) for s in self.specs]
        self.lost: set[int] = set()
        self.proxies = [StageProxy(sp.stage, sp.layers, self._call(sp.stage),
                                   StageDevice(f"stage{sp.stage}", self.workers[sp.stage].info().device))
                        for sp in pl.stages]
        self.ctx = driver_context(m, params, pl, self.proxies, 1, self.restore)

    def _call(self, k: int) -> Call:
        def submit(pid, desc, inp, *ups):
            if k in self.lost:
                raise StageLostError(f"stage {k} lost (test)")
            return self.workers[k].compute(pid, desc, inp, *ups)
        return Call(submit=submit, get=lambda hs: hs, wait=lambda hs: None)

    def lose(self, k: int) -> None:
        self.lost.add(k)

    def restore(self) -> None:
        for k in sorted(self.lost):
            self.workers[k] = StageWorker(self.specs[k])        # zero rows, empty KV, no plans
        self.lost.clear()
        for p in self.proxies:
            p.reset()


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_local_stage_lost_replays_from_position_0(paths, arch, stage):
    m = LlamaModel.load(paths[arch])
    want = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, PROMPT, N, stop_at_eog=False).tokens
    st = LocalStages(paths[arch], 2, ContextParams(n_ctx=256))

    def on_token(i: int, tok: int) -> None:
        if i == 5:
            st.lose(stage)
    got = generate(st.ctx, m.tokenizer, PROMPT, N, on_token=on_token, stop_at_eog=False)
    assert got.tokens == want
    rec = st.ctx.recovery
    assert rec.n_recoveries == 1 and rec.n_replayed_tokens >= len(PROMPT) + 5   # from position 0


# --parallel's branches (one prompt evaluation, its state copied whole) over 2 stages, a stage lost after
# the copies: the replay copies the rows again in their place, and every branch keeps its tokens
def test_local_stage_lost_after_the_branches(paths):
    m = LlamaModel.load(paths["qwen35moe"])
    params = ContextParams(n_ctx=256, n_seq_max=4)
    want = generate_parallel(LlamaContext(m, params), m.tokenizer, PROMPT, N, 4, SAMPLED, stop_at_eog=False)
    st = LocalStages(paths["qwen35moe"], 2, params)

    def on_token(seq: int, i: int, tok: int) -> None:
        if seq == 2 and i == 4:
            st.lose(1)
    got = generate_parallel(st.ctx, m.tokenizer, PROMPT, N, 4, SAMPLED, stop_at_eog=False, on_token=on_token)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    rec = st.ctx.recovery
    assert rec.n_recoveries == 1
    assert sorted((e.src, e.dst) for e in rec.log if isinstance(e, StateCopy)) == [(0, 1), (0, 2), (0, 3)]


# a sequence removed whole leaves the replay; the copies its branches were made from stay, and replay as
# the branch that holds their cells now (an attention layer before a recurrent one: a mask that hid every
# cell would give NaN, copied into the branch's state). Layers: R A R A.
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_lineage_keeps_what_live_sequences_are_made_of(tmp_path):
    from ggml_dist.model.synthetic_hybrid import SyntheticHybridSpec
    path = str(write_synthetic(tmp_path / "i2.gguf", SyntheticHybridSpec(full_attention_interval=2, seed=3)))
    m = LlamaModel.load(path)
    assert [m.hp.is_recurrent(il) for il in range(4)] == [True, False, True, False]
    st = LocalStages(path, 2, ContextParams(n_ctx=256, n_seq_max=2))
    ctx = st.ctx
    from ggml_dist.model.ubatch import Batch
    ctx.decode(Batch.from_tokens(PROMPT))
    ctx.seq_cp(0, 1)
    ctx.seq_rm(0)                                           # the source goes; its prompt stays in 1's lineage
    nxt = Batch(np.array([PROMPT[0]], np.int32), np.array([len(PROMPT)], np.int32), [frozenset({1})],
                np.array([True]))
    ref = LlamaContext(m, ContextParams(n_ctx=256))
    ref.decode(Batch.from_tokens(PROMPT))
    want = ref.decode(Batch.from_tokens([PROMPT[0]], pos0=len(PROMPT)))
    st.lose(0)
    assert np.array_equal(ctx.decode(nxt), want)
    assert ctx.recovery.n_recoveries == 1 and ctx.rs is not None
    assert ctx.rs.pos.tolist() == [-1, len(PROMPT)]        # positions as before the loss, then the step
    assert [type(e).__name__ for e in ctx.recovery.log] == ["UbatchRecord", "StateCopy", "UbatchRecord"]


@pytest.fixture
def ray_up():
    """A local Ray per test (test_recovery.py's way: its tests kill and restart stages)."""
    ray = pytest.importorskip("ray")
    from ggml_dist.workers.local_ray import connect
    connect(num_cpus=4)
    yield
    ray.shutdown()


# a stage actor killed mid-generation is restarted and the sequence replayed from position 0
@pytest.mark.parametrize("arch", list(ARCHS))
def test_hybrid_pipeline_recovers(ray_up, paths, arch):
    from ggml_dist.workers.cluster import Pipeline
    m = LlamaModel.load(paths[arch])
    want = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, PROMPT, N, stop_at_eog=False).tokens
    pl = Pipeline.launch(paths[arch], 2, ContextParams(n_ctx=256))
    try:
        def on_token(i: int, tok: int) -> None:
            if i == 5:
                pl.kill_stage(1)
        assert generate(pl.ctx, pl.model.tokenizer, PROMPT, N, on_token=on_token, stop_at_eog=False).tokens == want
        assert pl.ctx.recovery.n_recoveries == 1
    finally:
        pl.shutdown()


# a step queued past a stop and taken back leaves the lineage too: a loss after it replays without it
def test_local_stage_lost_after_a_step_was_taken_back(paths, monkeypatch):
    from ggml_dist.model.ubatch import Batch
    m = LlamaModel.load(paths["qwen35moe"])
    free = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, PROMPT, N, stop_at_eog=False).tokens
    monkeypatch.setattr(m.tokenizer, "is_eog", lambda t: t == free[5])
    ref = LlamaContext(m, ContextParams(n_ctx=256))
    want = generate(ref, m.tokenizer, PROMPT, N, lookahead=1)
    st = LocalStages(paths["qwen35moe"], 2, ContextParams(n_ctx=256))
    got = generate(st.ctx, m.tokenizer, PROMPT, N, lookahead=2)
    assert got.tokens == want.tokens and got.stop_reason == "eog"
    st.lose(1)
    nxt = Batch.from_tokens([7], pos0=ref.seq_pos_max(0) + 1)
    assert np.array_equal(st.ctx.decode(nxt), ref.decode(nxt))
    assert st.ctx.recovery.n_recoveries == 1
    # the prompt, a step per token (the last chose the stop), and nxt: not the step taken back
    assert st.ctx.recovery.n_replayed_tokens == len(PROMPT) + len(want.tokens) + 1

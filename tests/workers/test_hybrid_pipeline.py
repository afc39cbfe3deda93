"""Qwen3.5 hybrid files (qwen35 and qwen35moe) over pipeline stages: each stage owns the recurrent state of
its Gated DeltaNet layers (model/recurrent_state.py, allocated by workers/stage.py in its buffer type), the
graph's split reads and writes its rows there, and the driver's sequence operations reach them as row
operations sent with the stage's next call. Logits and tokens are one process's (and llama.cpp's) bit for bit.

The synthetic files are tests/model/test_qwen35_refs.py's (4 layers: 3 recurrent, then one attention
layer): over 2 stages both hold recurrent layers, over 3 the last holds only the attention layer.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggml_dist.backends.base import tensor_get
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.generate import generate
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.recurrent_state import StateTrimError
from ggml_dist.model.synthetic import write_synthetic
from ggml_dist.model.synthetic_hybrid import QWEN35_SPECS
from ggml_dist.model.ubatch import Batch
from tests.workers.test_stage_local import local_pipeline

REFS = np.load(Path(__file__).resolve().parents[1] / "data" / "qwen35_refs.npz")
TOKENS = REFS["meta/tokens"].tolist()
SPLIT = int(REFS["meta/split"])
N = 12
ARCHS = {s.arch: s for s in QWEN35_SPECS}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35-pipe")
    return {a: str(write_synthetic(d / f"{s.name}.gguf", s)) for a, s in ARCHS.items()}


@pytest.fixture(scope="module")
def want(paths):
    """One process's greedy continuation of the first SPLIT tokens."""
    out = {}
    for a, p in paths.items():
        m = LlamaModel.load(p)
        out[a] = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, TOKENS[:SPLIT], N,
                          stop_at_eog=False).tokens
    return out


def _mixed(ctx: LlamaContext) -> np.ndarray:
    """A prompt, then one token at a time: the state carried from call to call on its stages."""
    out = [ctx.decode(Batch.from_tokens(TOKENS[:SPLIT], all_outputs=True))]
    out += [ctx.decode(Batch.from_tokens([t], pos0=SPLIT + i)) for i, t in enumerate(TOKENS[SPLIT:])]
    return np.concatenate(out)


# in-process stages (no Ray): llama.cpp's logits, one process's tokens; the state rows where they belong
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_local_stages_own_the_state(paths, want, arch, stages):
    model, ctx, workers = local_pipeline(paths[arch], stages, ContextParams(n_ctx=256))
    hp = model.hp
    for w in workers:                             # each stage: its recurrent layers' rows, KV for the others
        rec = [il for il in range(*w.spec.layers) if hp.is_recurrent(il)]
        assert (w.rs.layers if w.rs else []) == rec
        assert w.kv.layers == [il for il in range(*w.spec.layers) if il not in rec]
    assert ctx.rs is not None and all(buf.base is None for _, buf, _ in ctx.rs.groups)   # none on the driver
    assert np.array_equal(_mixed(ctx), REFS[f"{ARCHS[arch].name}/mixed"])
    ctx.clear()
    assert generate(ctx, model.tokenizer, TOKENS[:SPLIT], N, stop_at_eog=False).tokens == want[arch]
    ctx.clear()                                   # cleared on the stages too: a new run, the same logits
    assert np.array_equal(_mixed(ctx), REFS[f"{ARCHS[arch].name}/mixed"])


# what the plan counts for a stage's cache (KV for its attention layers, two state rows per sequence for its
# recurrent ones: not a KV cache at the whole context) is what the stage allocates
@pytest.mark.parametrize("n_seq", [1, 3])
def test_planned_cache_is_what_the_stage_allocates(paths, n_seq):
    from ggml_dist.workers.driver import plan_stages
    params = ContextParams(n_ctx=256, n_seq_max=n_seq)
    model, _, workers = local_pipeline(paths["qwen35"], 2, params)
    planned = [s.kv_bytes for s in plan_stages(model, params, 2).stages]
    assert planned == [w.info().kv_bytes for w in workers]
    hp = model.hp
    assert any(hp.is_recurrent(il) for il in range(*workers[0].spec.layers))


# the driver's sequence operations reach the stages' rows: a whole copy continues as the original, a
# trim into the state is refused by name and changes nothing
def test_sequence_operations_on_the_stages_rows(paths):
    name = ARCHS["qwen35"].name
    _, ctx, workers = local_pipeline(paths["qwen35"], 2, ContextParams(n_ctx=256, n_seq_max=3))
    ctx.decode(Batch.from_tokens(TOKENS[:SPLIT]))
    ctx.seq_cp(0, 2)
    with pytest.raises(StateTrimError, match="cannot be cut back to a prefix"):
        ctx.seq_rm(0, 3)
    assert ctx.seq_pos_max(0) == SPLIT - 1
    for s in (2, 0):
        one = Batch(np.array([TOKENS[SPLIT]], np.int32), np.array([SPLIT], np.int32), [frozenset({s})],
                    np.array([True]))
        assert np.array_equal(ctx.decode(one)[0], REFS[f"{name}/mixed"][SPLIT])
    r0, r2, n = ctx.rs.row(0), ctx.rs.row(2), 3
    assert (r0, r2) == (0, 2 + n)                   # each ubatch wrote its sequence's other row: 0 two
    for w in workers:                               # 0 and 2 hold the same state on every stage, 1 none
        for t in w.rs.tensors():
            a = tensor_get(t)
            assert np.array_equal(a[0, 0, r0], a[0, 0, r2]) and a[0, 0, r0].any()
            assert not a[0, 0, 1].any() and not a[0, 0, 1 + n].any()
    ctx.seq_rm(2)                                # whole: fine
    assert ctx.rs.pos.tolist() == [SPLIT, -1, -1]


@pytest.fixture
def ray_up(request):
    """conftest's module-wide local Ray, where Ray is installed."""
    pytest.importorskip("ray")
    request.getfixturevalue("local_ray")


# Ray actors: greedy tokens over 2 and 3 stages equal one process's
@pytest.mark.parametrize("arch,stages", [("qwen35", 2), ("qwen35", 3), ("qwen35moe", 2), ("qwen35moe", 3)])
def test_hybrid_pipeline_tokens(ray_up, paths, want, arch, stages):
    from ggml_dist.workers.cluster import Pipeline
    pl = Pipeline.launch(paths[arch], stages, ContextParams(n_ctx=256))
    try:
        assert np.array_equal(_mixed(pl.ctx), REFS[f"{ARCHS[arch].name}/mixed"])
        pl.ctx.clear()
        assert generate(pl.ctx, pl.model.tokenizer, TOKENS[:SPLIT], N, stop_at_eog=False).tokens == want[arch]
    finally:
        pl.shutdown()


# -- --parallel: the prompt evaluated once, then its state copied whole to the other sequences ----------
SAMPLED = ["--temp", "1.5", "--seed", "11"]


def _run_json(capsys, path: str, *args: str) -> dict:
    import json

    from ggml_dist.cli import main
    assert main(["run", "--model", path, "--prompt", "a b c d e", "-n", str(N), "--json", "--ctx", "256", *args]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def fresh(paths):
    """Per file, a fresh single-sequence run of `run` with seed 11 + i, i < 4 (the seed --parallel's
    sequence i samples with), as a function of the capsys of the test that asks."""
    memo: dict[str, list[list[int]]] = {}

    def get(capsys, arch: str) -> list[list[int]]:
        if arch not in memo:
            memo[arch] = [_run_json(capsys, paths[arch], "--temp", "1.5", "--seed", str(11 + i))["tokens"]
                          for i in range(4)]
            # the seeds give different tokens (the dense file's greedy choice is one token, repeated)
            assert len({tuple(t) for t in memo[arch]}) >= (4 if arch == "qwen35moe" else 3)
        return memo[arch]
    return get


@pytest.mark.parametrize("arch", list(ARCHS))
def test_run_parallel_branches_in_one_process(capsys, paths, fresh, arch, monkeypatch):
    evaluated = []
    submit = LlamaContext.submit

    def counting(self, batch, *a, **k):
        evaluated.append(batch.n_tokens)
        return submit(self, batch, *a, **k)
    monkeypatch.setattr(LlamaContext, "submit", counting)
    out = _run_json(capsys, paths[arch], "--parallel", "4", *SAMPLED)
    n_prompt = len(out["prompt_tokens"])
    assert evaluated[0] == n_prompt and n_prompt not in evaluated[1:]            # the prompt once
    monkeypatch.setattr(LlamaContext, "submit", submit)
    assert [s["tokens"] for s in out["sequences"]] == fresh(capsys, arch)


# the same over 2 in-process stages: the copies are row operations sent to the stages
def test_parallel_branches_over_local_stages(capsys, paths, fresh):
    from ggml_dist.model.generate import generate_parallel
    from ggml_dist.model.sampling import SamplingParams
    want = fresh(capsys, "qwen35moe")
    m, ctx, _ = local_pipeline(paths["qwen35moe"], 2, ContextParams(n_ctx=256, n_seq_max=4))
    ids = m.tokenizer.encode("a b c d e", add_special=True, parse_special=True)
    sp = SamplingParams(temperature=1.5, seed=11)
    assert [r.tokens for r in generate_parallel(ctx, m.tokenizer, ids, N, 4, sp)] == want


# `run --parallel 4 --stages 2` (Ray actors, direct calls): each branch's tokens are a fresh run's
@pytest.mark.parametrize("arch", list(ARCHS))
def test_run_parallel_over_two_stages(ray_up, capsys, paths, fresh, arch):
    want = fresh(capsys, arch)
    out = _run_json(capsys, paths[arch], "--parallel", "4", "--stages", "2", *SAMPLED)
    assert [s["tokens"] for s in out["sequences"]] == want


# token feedback: a step queued before the previous token is read, past a stop, is taken back out of the
# state (the row it read kept the state from before it): the tokens and the cache lookahead 1 leaves
@pytest.mark.parametrize("where", ["one process", "2 stages"])
def test_a_step_queued_past_a_stop_is_taken_back(paths, where, monkeypatch):
    from ggml_dist.model.recurrent_state import RecurrentState
    m = LlamaModel.load(paths["qwen35moe"])
    free = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, TOKENS[:SPLIT], N, stop_at_eog=False)
    stop = free.tokens[5]
    monkeypatch.setattr(m.tokenizer, "is_eog", lambda t: t == stop)
    ref = LlamaContext(m, ContextParams(n_ctx=256))
    want = generate(ref, m.tokenizer, TOKENS[:SPLIT], N, lookahead=1)
    assert want.stop_reason == "eog" and len(want.tokens) == free.tokens.index(stop)
    ctx = LlamaContext(m, ContextParams(n_ctx=256)) if where == "one process" else \
        local_pipeline(paths["qwen35moe"], 2, ContextParams(n_ctx=256))[1]
    back = []
    seq_rm = RecurrentState.seq_rm

    def counting(self, *a):
        back.extend(out := seq_rm(self, *a))
        return out
    monkeypatch.setattr(RecurrentState, "seq_rm", counting)
    got = generate(ctx, m.tokenizer, TOKENS[:SPLIT], N, lookahead=2)
    assert (got.tokens, got.stop_reason) == (want.tokens, "eog") and back == [0]
    assert ctx.seq_pos_max(0) == ref.seq_pos_max(0) and ctx.rs is not None and ref.rs is not None
    assert ctx.rs.pos[0] == ref.rs.pos[0] == SPLIT + len(want.tokens) - 1
    nxt = Batch.from_tokens([7], pos0=ref.seq_pos_max(0) + 1)      # the state goes on from the right place
    assert np.array_equal(ctx.decode(nxt), ref.decode(nxt))


def test_two_steps_back_are_refused_by_name(paths):
    from ggml_dist.model.generate import generate_parallel
    m = LlamaModel.load(paths["qwen35"])
    ctx = LlamaContext(m, ContextParams(n_ctx=256, n_seq_max=2))
    with pytest.raises(ValueError, match="can take back one step queued past a stop"):
        generate(ctx, m.tokenizer, TOKENS[:SPLIT], 4, lookahead=3)
    with pytest.raises(ValueError, match="use lookahead 1 or 2"):
        generate_parallel(ctx, m.tokenizer, TOKENS[:SPLIT], 4, 2, lookahead=3)
    ctx.clear()                                                # (their prompts ran before the refusal)
    ctx.decode(Batch.from_tokens(TOKENS[:SPLIT]))
    for i, t in enumerate(TOKENS[SPLIT:SPLIT + 2]):
        ctx.decode(Batch.from_tokens([t], pos0=SPLIT + i))
    with pytest.raises(StateTrimError, match="the state before position 8 is kept"):
        ctx.seq_rm(0, SPLIT)                                   # two ubatches back
    ctx.seq_rm(0, SPLIT + 1)                                   # one: fine
    assert ctx.rs is not None and ctx.rs.pos[0] == SPLIT and ctx.seq_pos_max(0) == SPLIT

"""A lost stage actor is recovered: same tokens as an uninterrupted run, nothing lost, or a clear error."""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager

import pytest

ray = pytest.importorskip("ray")

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic  # noqa: E402
from ggml_dist.workers.cluster import Pipeline, RecoveryError  # noqa: E402
from ggml_dist.workers.local_ray import connect  # noqa: E402

PROMPT = [1, 300, 17, 402]
N = 16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_synthetic(tmp_path_factory.mktemp("rec") / "m.gguf",
                               SyntheticSpec(wtype="Q4_1", n_layer=4, tied=False, seed=21)))


@pytest.fixture(scope="module")
def want(model_path):
    m = LlamaModel.load(model_path)
    toks = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, PROMPT, N).tokens
    assert len(set(toks)) > 4                     # a varied continuation, so a wrong replay shows
    return toks


def _run_with_fault(pl: Pipeline, after: int, fault) -> list[int]:
    def on_token(i: int, tok: int) -> None:
        if i == after:
            fault(pl)
    return generate(pl.ctx, pl.model.tokenizer, PROMPT, N, on_token=on_token).tokens


@pytest.fixture
def local_ray():
    connect(num_cpus=4)
    yield
    ray.shutdown()


# a stage whose compute blocks without using CPU (a lock, a read that never returns) still answers its
# health port: the watch sees its call's thread make no progress, declares it lost, and the run recovers
@pytest.mark.parametrize("calls", ["direct", "plain"])
def test_wedged_stage_is_replaced(local_ray, model_path, want, calls, monkeypatch):
    from ggml_dist.workers.health import StageWatch
    monkeypatch.setattr(StageWatch, "STALL_S", 3.0)
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), calls=calls)
    try:
        got = _run_with_fault(pl, 5, lambda p: p.wedge_stage(1))
        assert got == want
        assert pl.ctx.recovery.n_recoveries == 1
    finally:
        pl.shutdown()


# ray.kill of a stage mid-generation: Ray restarts it, the KV cache is replayed, same tokens; with the
# compiled graph's steps too (the recovered pipeline goes on with plain calls)
@pytest.mark.parametrize("stage,calls", [(0, "plain"), (1, "plain"), (0, "compiled"), (0, "direct"),
                                         (1, "direct")])
def test_kill_stage_actor(local_ray, model_path, want, stage, calls):
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), calls=calls)
    try:
        got = _run_with_fault(pl, 6, lambda p: p.kill_stage(stage))
        assert got == want
        assert pl.ctx.recovery.n_recoveries == 1 and pl.ctx.recovery.n_replayed_tokens >= len(PROMPT) + 5
        assert calls != "compiled" or (pl.chain is not None and pl.chain.n_executions >= 6 and not pl.chain.enabled)
        assert calls != "direct" or pl.calls_used() == "direct"     # the links were opened again
    finally:
        pl.shutdown()


# a kill right after the first token, with 4 copies: the next steps use copy slots whose plans the
# restarted stage is sent for the first time; it must refuse them (another incarnation), not compute
# them over its empty KV cache (which gave wrong tokens in bench faults)
@pytest.mark.parametrize("stage", [0, 1])
def test_kill_before_every_copy_slot_was_used(local_ray, model_path, want, stage):
    pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), n_copies=4)
    try:
        assert _run_with_fault(pl, 1, lambda p: p.kill_stage(stage)) == want
        assert pl.ctx.recovery.n_recoveries == 1
    finally:
        pl.shutdown()


# SIGKILL of the actor's process (found by its pid), twice in one run
def test_kill_stage_process_by_pid(local_ray, model_path, want):
    pl = Pipeline.launch(model_path, 3, ContextParams(n_ctx=256))
    try:
        def kill(p: Pipeline) -> None:
            pid = ray.get(p.actors[1].ping.remote())
            os.kill(pid, signal.SIGKILL)
        toks = []

        def on_token(i: int, tok: int) -> None:
            if i in (4, 11):
                kill(pl)
        toks = generate(pl.ctx, pl.model.tokenizer, PROMPT, N, on_token=on_token).tokens
        assert toks == want and pl.ctx.recovery.n_recoveries == 2
    finally:
        pl.shutdown()


@contextmanager
def two_node_pipeline(model_path, recover_timeout_s: float, spare: bool):
    """Stage 0 on the head, stage 1 on a second node (the victim); optionally a spare third node."""
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        victim = cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        head_id = ray.get_runtime_context().get_node_id()
        victim_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head_id)
        pl = Pipeline.launch(model_path, 2, ContextParams(n_ctx=256), node_ids=[head_id, victim_id])
        pl.recover_timeout_s = recover_timeout_s
        if spare:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
        try:
            yield pl, lambda p: cluster.remove_node(victim)
        finally:
            pl.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


# a node removed from a multi-node cluster: its stage restarts on the spare node, same tokens
def test_node_removed(model_path, want):
    with two_node_pipeline(model_path, 60, spare=True) as (pl, remove_victim):
        got = _run_with_fault(pl, 6, remove_victim)
        assert got == want and pl.ctx.recovery.n_recoveries >= 1


# no node can take the lost stage: a clear error naming the stage and its memory, not a hang
def test_unrecoverable_is_clear(model_path):
    with two_node_pipeline(model_path, 8, spare=False) as (pl, remove_victim):
        with pytest.raises(RecoveryError, match=r"stage 1 \(layers 2..3\).*MiB"):
            _run_with_fault(pl, 3, remove_victim)


# `run --inject-fault`: the JSON names the three recovery figures apart (from the fault to its detection,
# the restart and replay, detection to the next token) and the tokens are one process's; a wedged stage
# is detected only after the watch's stall time, a killed one at the next call
@pytest.mark.parametrize("fault", ["kill-stage:1:after-token:4", "wedge-stage:0:after-token:4"])
def test_run_reports_recovery_figures(local_ray, model_path, fault, capsys, monkeypatch):
    import json

    from ggml_dist.cli import main
    from ggml_dist.workers.health import StageWatch
    monkeypatch.setattr(StageWatch, "STALL_S", 3.0)
    base = ["run", "--model", model_path, "--prompt", "ab cd", "-n", "12", "--temp", "0", "--json", "--ctx", "256"]
    assert main(base) == 0
    want = json.loads(capsys.readouterr().out)["tokens"]
    assert main([*base, "--stages", "2", "--inject-fault", fault]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == want and out["recoveries"] == 1
    (r,) = out["recovery"]
    assert r["detect_s"] is not None and r["restore_s"] > 0 and r["first_token_s"] >= r["restore_s"]
    if fault.startswith("wedge"):
        assert r["detect_s"] >= StageWatch.STALL_S

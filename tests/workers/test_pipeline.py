"""A pipeline of Ray stage actors gives bitwise the single-process logits and tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest

ray = pytest.importorskip("ray")

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic  # noqa: E402
from ggml_dist.model.ubatch import Batch  # noqa: E402
from ggml_dist.workers.cluster import Pipeline  # noqa: E402
from ggml_dist.workers.local_ray import connect  # noqa: E402

SPEC = SyntheticSpec(wtype="Q4_1", embd_type="Q8_0", n_layer=4, tied=True, seed=21)
TOKENS = [1, 300, 17, 402, 259, 260, 511, 299, 333, 42]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("pipe") / "m.gguf", SPEC)


def _reference(path, tokens):
    ctx = LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=256))
    batch = ctx.decode(Batch.from_tokens(tokens, all_outputs=True))
    steps = [ctx.decode(Batch.from_tokens([t], pos0=len(tokens) + i)) for i, t in enumerate([5, 6, 7])]
    return batch, steps


# 2, 3 and 4 stages (one layer each), 1 to 4 copies, plain actor calls, a compiled graph or direct links:
# bitwise the single-process logits, prompt and one-token steps
@pytest.mark.parametrize("stages,n_copies,calls", [(2, 1, "plain"), (2, 2, "plain"), (3, 3, "plain"),
                                                   (2, 2, "compiled"), (3, 3, "compiled"),
                                                   (2, 1, "direct"), (3, 3, "direct"), (4, 4, "direct")])
def test_pipeline_bitwise(local_ray, model_path, stages, n_copies, calls):
    ref_batch, ref_steps = _reference(model_path, TOKENS)
    pl = Pipeline.launch(str(model_path), stages, ContextParams(n_ctx=256), n_copies=n_copies, calls=calls)
    try:
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), ref_batch)
        for i, t in enumerate([5, 6, 7]):
            assert np.array_equal(pl.ctx.decode(Batch.from_tokens([t], pos0=len(TOKENS) + i)), ref_steps[i])
        assert pl.ctx.sched.get_n_splits() == stages
        stats = pl.stats()
        assert all(s.n_calls == 4 for s in stats)              # one call per stage per ubatch
        assert all(s.n_plans <= 2 for s in stats)              # prompt shape + one-token shape
        if calls == "compiled":                                   # every step one execution, none plain
            assert pl.chain is not None and pl.chain.enabled and pl.chain.n_executions == 4
        else:
            assert pl.chain is None
        assert pl.calls_used() == calls
        if calls == "direct":                                     # every call over the links
            assert pl.direct is not None and pl.direct.n_calls == 4 * stages
    finally:
        pl.shutdown()


# the stages take batch-invariant numerics (--deterministic): a prompt a token at a time over 2 stages gives
# the logits of one process that takes it whole, bit for bit (F16 weights: without the mode the two differ)
def test_pipeline_batch_invariant(local_ray, tmp_path):
    path = write_synthetic(tmp_path / "f16.gguf", SyntheticSpec(wtype="F16", embd_type="Q8_0", n_layer=4, seed=21))
    tokens = (TOKENS * 2)[:17]
    m = LlamaModel.load(path)
    whole = LlamaContext(m, ContextParams(n_ctx=256)).decode(Batch.from_tokens(tokens, all_outputs=True))
    single = LlamaContext(m, ContextParams(n_ctx=256, n_ubatch=1)).decode(Batch.from_tokens(tokens, all_outputs=True))
    assert not np.array_equal(whole, single)                     # the default numerics depend on the ubatch
    one = LlamaContext(m, ContextParams(n_ctx=256, batch_invariant=True))
    want = one.decode(Batch.from_tokens(tokens, all_outputs=True))
    pl = Pipeline.launch(str(path), 2, ContextParams(n_ctx=256, n_ubatch=1, batch_invariant=True))
    try:
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(tokens, all_outputs=True)), want)
    finally:
        pl.shutdown()


# a prompt split into ubatches runs with several micro-batches in flight, same logits
@pytest.mark.parametrize("calls", ["plain", "compiled", "direct"])
def test_pipeline_microbatches_in_flight(local_ray, model_path, calls):
    tokens = (TOKENS * 5)[:48]
    ref = LlamaContext(LlamaModel.load(model_path), ContextParams(n_ctx=256, n_ubatch=8))
    want = ref.decode(Batch.from_tokens(tokens, all_outputs=True))
    pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256, n_ubatch=8), n_copies=2, calls=calls)
    try:
        got = pl.ctx.decode(Batch.from_tokens(tokens, all_outputs=True))
        assert np.array_equal(got, want)
        assert pl.ctx.n_reused >= 4
        assert calls != "compiled" or (pl.chain is not None and pl.chain.enabled and pl.chain.n_executions == 6)
        assert pl.calls_used() == calls
    finally:
        pl.shutdown()


# a KV stream per sequence: the stage actors hold the streams, the driver's views pick them; several
# sequences per step (and a step that skips one) give the single-process logits
def _decode_steps(model_path, params: ContextParams, n_seqs: int, schedule: list[tuple[int, ...]]):
    """A 2-stage pipeline decoding n_seqs 3-token prompts in one batch, then one token for each sequence
    of each schedule entry, checked against one process's logits step by step; returns the pipeline's
    context (the pipeline is shut down)."""
    steps = [Batch(np.array(TOKENS[:3 * n_seqs], np.int32), np.array([0, 1, 2] * n_seqs, np.int32),
                   [frozenset({s}) for s in range(n_seqs) for _ in range(3)], np.ones(3 * n_seqs, bool))]
    n_past = [3] * n_seqs
    for k, seqs in enumerate(schedule):
        steps.append(Batch(np.array([5 + k] * len(seqs), np.int32),
                           np.array([n_past[s] for s in seqs], np.int32),
                           [frozenset({s}) for s in seqs], np.ones(len(seqs), bool)))
        for s in seqs:
            n_past[s] += 1
    ref = LlamaContext(LlamaModel.load(model_path), params)
    want = [ref.decode(b) for b in steps]
    pl = Pipeline.launch(str(model_path), 2, params, n_copies=2)
    try:
        for b, w in zip(steps, want):
            assert np.array_equal(pl.ctx.decode(b), w)
    finally:
        pl.shutdown()
    return pl.ctx


def test_pipeline_streams(local_ray, model_path):
    ctx = _decode_steps(model_path, ContextParams(n_ctx=3 * 256, n_seq_max=3, kv_unified=False), 3,
                        [(0, 1, 2), (0, 2), (0, 1, 2)])
    assert ctx.kv.n_stream == 3


# batch shapes that come back (a server's: all its sequences, then one finished) recall their graph and
# plan, one per input copy slot, instead of splitting and planning again; same logits as one process
def test_pipeline_recalls_graphs(local_ray, model_path):
    ctx = _decode_steps(model_path, ContextParams(n_ctx=512, n_seq_max=2), 2,
                        [(0, 1) if k % 3 else (0,) for k in range(8)])
    # 3 shapes, each built once (here each keeps to one copy slot); a shape change recalls
    assert (ctx.n_rebuilt, ctx.n_recalled, ctx.n_reused) == (3, 4, 2)


# greedy generation through the pipeline gives the single-process tokens
def test_pipeline_generate(local_ray, model_path, tmp_path):
    m = LlamaModel.load(model_path)
    want = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, TOKENS, 12)
    pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256))
    try:
        got = generate(pl.ctx, m.tokenizer, TOKENS, 12)
        assert got.tokens == want.tokens
        trace = tmp_path / "trace.json"                # a track per stage: inputs, compute, outputs slices
        pl.write_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
        for k in range(2):
            cats = [e["cat"] for e in events if e["tid"] == k]
            assert cats.count("inputs") == cats.count("compute") == cats.count("outputs") >= 12
            assert all(e["dur"] >= 0 for e in events)
    finally:
        pl.shutdown()


# a stage built from a device: the last stage on the fake accelerator (backends/accel.py: the CPU's
# kernels behind a non-host buffer type, so its weights are uploaded into its own buffers) in a Ray actor,
# beside a CPU stage; the driver's proxies describe each stage's device as it answered, and the logits
# and greedy tokens are one process's
def test_pipeline_stage_on_the_fake_accelerator(local_ray, model_path):
    from ggml_dist.backends.base import DeviceType
    from ggml_dist.backends.devices import DeviceKind
    ref_batch, ref_steps = _reference(model_path, TOKENS)
    m = LlamaModel.load(model_path)
    want = generate(LlamaContext(m, ContextParams(n_ctx=256)), m.tokenizer, TOKENS, 12)
    pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256), devices=[DeviceKind.CPU, DeviceKind.ACCEL])
    try:
        assert [p.device.type for p in pl.proxies] == [DeviceType.CPU, DeviceType.GPU]
        assert pl.infos[1].device.type == DeviceType.GPU
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), ref_batch)
        for i, t in enumerate([5, 6, 7]):
            assert np.array_equal(pl.ctx.decode(Batch.from_tokens([t], pos0=len(TOKENS) + i)), ref_steps[i])
        pl.ctx.clear()
        assert generate(pl.ctx, m.tokenizer, TOKENS, 12).tokens == want.tokens
    finally:
        pl.shutdown()


# stages pinned to different nodes of a simulated multi-node cluster
def test_pipeline_multinode_cluster(model_path):
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2
        ref_batch, _ = _reference(model_path, TOKENS)
        pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256), node_ids=nodes)
        try:
            assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), ref_batch)
            assert {i.node_id for i in pl.infos} == set(nodes)
        finally:
            pl.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
        connect(num_cpus=4)     # the module's local Ray back (local_ray's), for the tests after this one


# a stage whose node cannot read the GGUF path gets its layers' weights from the driver, once
def test_weights_sent_when_path_unreadable(local_ray, model_path):
    ref_batch, ref_steps = _reference(model_path, TOKENS)
    pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256), stage_model_path="/nonexistent/m.gguf")
    try:
        assert not any(i.needs_weights for i in pl.infos)
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), ref_batch)
        pl.kill_stage(1)                       # a restarted stage is sent its weights again
        assert np.array_equal(pl.ctx.decode(Batch.from_tokens([5], pos0=len(TOKENS))), ref_steps[0])
        assert pl.ctx.recovery.n_recoveries == 1
    finally:
        pl.shutdown()


# Gemma 3 over 2 stages: its per-layer norms travel with their layers and the sliding-window layers get
# their mask; the last position of each 512 + 280 ubatch equals llama.cpp's (tests/data/gemma3_tf.npz)
def test_pipeline_gemma3_sliding_window(local_ray):
    from pathlib import Path

    from ggml_dist.model.pull import ModelNotFoundError, pull
    try:
        path = pull("gemma3-270m", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"gemma3-270m is not in the cache and cannot be pulled: {e}")
    tf = np.load(Path(__file__).resolve().parents[1] / "data" / "gemma3_tf.npz")
    toks = tf["tokens"].tolist()
    pl = Pipeline.launch(str(path), 2, ContextParams(n_ctx=1024))
    try:
        rows = [pl.ctx.decode(Batch.from_tokens(toks[:512]))[-1],
                pl.ctx.decode(Batch.from_tokens(toks[512:], pos0=512))[-1]]
    finally:
        pl.shutdown()
    for row, p in zip(rows, (511, len(toks) - 1)):
        assert np.array_equal(row[tf["ids"][p].astype(np.int64)], tf["vals"][p])


# the last stage chooses the tokens (greedy and seeded temperature sampling): the ids one process
# chooses from its logits, and with keep_logits=False no logits cross the wire
@pytest.mark.parametrize("calls", ["plain", "compiled", "direct"])
def test_pipeline_samples_on_the_last_stage(local_ray, model_path, calls):
    from ggml_dist.model.sampling import GREEDY, RowSampling, sample_row
    rows = [RowSampling(0.9, 40, 0.95, 0.05, 1234, i) for i in range(2)] + [GREEDY]
    batch = Batch(np.array(TOKENS[:6], np.int32), np.arange(6, dtype=np.int32), [frozenset({0})] * 6,
                  np.array([0, 1, 0, 1, 0, 1], bool))
    one = LlamaContext(LlamaModel.load(model_path), ContextParams(n_ctx=256))
    logits = one.decode(batch)
    want = [sample_row(logits[i], rs) for i, rs in enumerate(rows)]
    local = one.submit(Batch.from_tokens([5], pos0=6), sampling=[rows[0]])
    assert local.tokens() == [sample_row(local.result()[0], rows[0])]
    pl = Pipeline.launch(str(model_path), 2, ContextParams(n_ctx=256), calls=calls)
    try:
        before = pl.stats()[-1].bytes_out
        got = pl.ctx.submit(batch, sampling=rows, keep_logits=False)
        assert got.tokens() == want
        assert pl.stats()[-1].bytes_out - before < 1024          # 3 token ids, not 3 x 512 logits
        with pytest.raises(RuntimeError, match="not kept"):
            got.result()
        kept = pl.ctx.submit(Batch.from_tokens([5], pos0=6), sampling=[GREEDY])
        assert kept.tokens() == [int(np.argmax(kept.result()[0]))]
    finally:
        pl.shutdown()


def test_bench_pipeline_reports_the_study(local_ray, model_path, tmp_path):
    """One decode point of `bench pipeline`: per-stage utilization, TPOT next to the ITL percentiles, and
    a Perfetto trace with a compute slice per micro-batch on each stage's track."""
    import json

    from ggml_dist.bench.pipeline import run_one
    trace = tmp_path / "t.json"
    r = run_one(str(model_path), 2, 2, 2, 8, "decode", 3, 1, str(trace))
    assert len(r["utilization"]) == 2 and all(0 < u <= 1 for u in r["utilization"])
    assert r["tpot_ms"] > 0 and r["itl_ms"]["p50"] > 0 and r["ttft_ms"]["p50"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    compute = [e for e in events if e.get("cat") == "compute"]
    assert {e["tid"] for e in compute} == {0, 1} and all(e["dur"] > 0 for e in compute)
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"inputs", "compute", "outputs", "transfer"}
    hops = [e for e in events if e.get("cat") in ("transfer", "queue")]
    assert hops and {e["tid"] for e in hops} == {2} and all(e["dur"] >= 0 for e in hops)   # stage0 -> stage1


# bench pipeline's CPU account: every process of the run, Ray's daemons included, and no bound where a
# waiter may spin (a compiled graph's channel readers count their waiting as CPU)
def test_bench_pipeline_cpu_account(local_ray, model_path):
    from ggml_dist.bench.pipeline import run_one
    from ggml_dist.workers.local_ray import local_ray_cpu_s
    r = run_one(str(model_path), 2, 2, 2, 8, "decode", 4, 1, calls="direct")
    cpu = r["cpu_ms_per_token"]
    assert cpu["driver"] > 0 and all(c > 0 for c in cpu["stages"]) and cpu["ray_other"] >= 0
    names = set()
    for pid in local_ray_cpu_s():                              # what ray_other sums: the daemons too
        with open(f"/proc/{pid}/comm") as f:
            names.add(f.read().strip())
    assert {"raylet", "gcs_server"} <= names, names
    share = r["machine_cpu_share"]
    assert 0 < share <= 1.1                                    # of this machine's cores, over the run
    assert r["cpu_bound_tok_s"] == pytest.approx(r["tok_s"] / share, rel=0.02)
    assert r["efficiency"] == pytest.approx(r["tok_s"] / r["ideal_tok_s"], abs=0.002)
    spun = run_one(str(model_path), 2, 2, 2, 8, "decode", 4, 1, calls="compiled")
    assert spun["calls"] == "compiled" and spun["cpu_bound_tok_s"] is None and "spinning" in spun["cpu_bound_note"]

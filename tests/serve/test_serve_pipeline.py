"""The server over a 2-stage Ray pipeline: concurrent greedy requests give the single-process tokens."""
from __future__ import annotations

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import itertools  # noqa: E402
import re  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import httpx  # noqa: E402
import openai  # noqa: E402

ray = pytest.importorskip("ray")


from .test_app import PROMPTS, reference  # noqa: E402


# --stages 2: micro-batches of the active sequences overlap on the stages; tokens match single runs
def test_pipeline_server(local_ray, serve_model):
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    model = LlamaModel.load(serve_model)
    lengths = [12, 20, 8, 16, 10]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=1024, lookahead=2)) as srv:
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(i: int) -> str:
            stream = c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0,
                                          stream=i % 2 == 0)
            if i % 2 == 0:
                return "".join(ch.choices[0].text for ch in stream)
            return stream.choices[0].text

        with ThreadPoolExecutor(len(lengths)) as ex:
            assert list(ex.map(one, range(len(lengths)))) == want
        text = httpx.get(srv.url + "/metrics").text
        busy = [float(v) for v in re.findall(r'^ggml_dist_stage_busy_seconds_total\{stage="\d"\} (\S+)$', text, re.M)]
        assert len(busy) == 2 and all(b > 0 for b in busy)
        # groups' next steps were queued before their tokens came back (token feedback), same tokens
        assert srv.engine.steps.lookahead == 2 and float(re.search(r"^ggml_dist_steps_fed_total (\S+)$", text, re.M)[1]) > 0


# with token feedback the stages' queues stay step-major: a group's fed step never goes right behind its
# own previous one while another group has a micro-batch in flight (the first stage would wait there for
# the last one), and the tokens are still the separate runs'
def test_pipeline_server_queues_step_major(local_ray, serve_model):
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    model = LlamaModel.load(serve_model)
    want = [reference(model, p, 24) for p in PROMPTS[:4]]
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=1024, lookahead=2)) as srv:
        eng = srv.engine
        submit, log = eng.ctx.submit, []

        def recorded(batch, *args, **kw):
            others = any(m.parts[0][0].slot not in set(batch.seq_ids[0]) for m in eng.steps.in_flight)
            pending = submit(batch, *args, **kw)
            log.append((pending, kw.get("tokens_from"), others))
            return pending
        eng.ctx.submit = recorded
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(lambda i: c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=24,
                                                             temperature=0).choices[0].text, range(4)))
    assert got == want
    fed = [(prev[0], cur) for prev, cur in itertools.pairwise(log) if cur[1] is not None]
    assert len(fed) > 10
    assert not [cur for prev, cur in fed if cur[1] is prev and cur[2]], "a fed step queued behind its own"


# 8 greedy requests at once over 2 stages with --deterministic (a KV stream per slot, batch-invariant
# numerics on the stages): each gets the tokens it gets alone; without it a row's bits may depend on the
# rows beside it (docs/numerics.md), which test_pipeline_server's references do not meet
def test_concurrent_greedy_over_stages_deterministic(local_ray, smollm2_path):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    prompts = [*PROMPTS, "seven eight nine", "the end of the story"]
    with ServerThread(engine_config(smollm2_path, n_stages=2, n_parallel=8, n_ctx=8 * 256,
                                   batch_invariant=True)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def one(p: str) -> str:
            return c.completions.create(model="m", prompt=p, max_tokens=16, temperature=0).choices[0].text
        alone = [one(p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as ex:
            together = list(ex.map(one, prompts))
    assert together == alone and len(set(alone)) > 1


# stop strings and max_tokens end sequences whose next steps are already queued (token feedback): the
# text ends where the separate runs' does, and the queued steps' tokens never reach a client
def test_pipeline_server_stops_with_steps_queued(local_ray, serve_model):
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    model = LlamaModel.load(serve_model)
    full = [reference(model, p, 24) for p in PROMPTS[:4]]
    stops = [t[len(t) // 2:len(t) // 2 + 2] for t in full]          # from the middle of each text
    want = [t[:t.index(st)] for t, st in zip(full, stops)]
    assert all(w and len(w) < len(t) for w, t in zip(want, full))
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=1024, lookahead=2)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(i: int) -> str:
            return c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                        stop=[stops[i]]).choices[0].text

        with ThreadPoolExecutor(4) as ex:
            assert list(ex.map(one, range(4))) == want
        assert srv.engine.steps.n_fed > 0
        # every cell a queued step took past a stop is freed: a slot holds only its cached tokens
        assert srv.engine.ctx.kv.cells.used == srv.engine.slots.cached_cells() > 0


# a slot's finished request stays in the shared cache of the stages: the same prompt again evaluates only
# its last token (/metrics counts the rest as cached), with the tokens of a fresh run
def test_pipeline_server_caches_prompts(local_ray, serve_model):
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    model = LlamaModel.load(serve_model)
    want = reference(model, PROMPTS[1], 12)
    n_prompt = len(model.tokenizer.encode(PROMPTS[1], add_special=True))
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=2, n_ctx=512)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = [c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
               for _ in range(2)]
        text = httpx.get(srv.url + "/metrics").text
        cached = float(re.search(r"^ggml_dist_prompt_tokens_cached_total (\S+)$", text, re.M)[1])
    assert got[0] == want and got[1] == want
    assert cached == n_prompt - 1


# a stage killed while concurrent requests run: all complete, with the tokens of separate runs;
# /metrics counts the recovery
def test_pipeline_server_survives_stage_loss(local_ray, serve_model):
    import threading
    import time
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    model = LlamaModel.load(serve_model)
    lengths = [24, 20, 28, 16]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=1024)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        engine = srv.engine

        def killer() -> None:                 # once generation is under way, kill stage 1
            t0 = time.time()
            while engine.metrics.generated_tokens < 10 and time.time() - t0 < 60:
                time.sleep(0.02)
            engine.runtime.kill_stage(1)

        th = threading.Thread(target=killer)
        th.start()

        def one(i: int) -> str:
            return c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=lengths[i],
                                        temperature=0).choices[0].text

        with ThreadPoolExecutor(len(lengths)) as ex:
            got = list(ex.map(one, range(len(lengths))))
        th.join()
        assert got == want
        text = httpx.get(srv.url + "/metrics").text
        rec = float(re.search(r"^ggml_dist_recoveries_total (\S+)$", text, re.M).group(1))
        assert rec >= 1
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"


# a node removed under concurrent server requests: its stage moves to the spare node, nothing lost
def test_pipeline_server_survives_node_removal(serve_model):
    import threading
    import time
    from ray.cluster_utils import Cluster
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    if ray.is_initialized():
        ray.shutdown()
    model = LlamaModel.load(serve_model)
    lengths = [20, 16, 24]
    want = [reference(model, p, n) for p, n in zip(PROMPTS, lengths)]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        nodes = [cluster.add_node(num_cpus=1)]
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        with ServerThread(engine_config(serve_model, n_stages=2, n_parallel=4, n_ctx=1024)) as srv:
            engine = srv.engine
            engine.runtime.set_recover_timeout(60)
            cluster.add_node(num_cpus=1)                  # the spare
            cluster.wait_for_nodes()
            c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
            stage_nodes = {i.node_id for i in engine.runtime.stage_infos()}
            victim = next(n for n in nodes if n.node_id in stage_nodes)

            def remover() -> None:
                t0 = time.time()
                while engine.metrics.generated_tokens < 8 and time.time() - t0 < 60:
                    time.sleep(0.02)
                cluster.remove_node(victim)

            th = threading.Thread(target=remover)
            th.start()
            with ThreadPoolExecutor(len(lengths)) as ex:
                got = list(ex.map(lambda i: c.completions.create(
                    model="m", prompt=PROMPTS[i], max_tokens=lengths[i], temperature=0).choices[0].text,
                    range(len(lengths))))
            th.join()
            assert got == want
            assert engine.ctx.recovery.n_recoveries >= 1
    finally:
        ray.shutdown()
        cluster.shutdown()

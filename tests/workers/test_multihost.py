"""The pipeline on real hosts: a Ray head and three worker nodes, each in its own network namespace
with its own IP on a bridge (ggml_dist/testbed), started with `ray start --block`.

    host 0  head: no CPUs, the dashboard (Jobs API); drivers run here, as `ray job submit` runs them
    host 1  1 CPU, a little less memory than 2 and 3: the spare that takes a lost stage
    host 2  1 CPU, a Python environment without ggml-dist: its stage runs the code the job ships
    host 3  1 CPU, the model's directory hidden (a tmpfs over it): its stage is sent its weights

Their Ray `memory` lies between what a 2-stage split's largest stage and a single stage need, so
`--stages auto` must choose 2 stages on hosts 2 and 3. The link cut runs last: it loses a host.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ray")

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.generate import generate  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic  # noqa: E402
from ggml_dist.model.ubatch import Batch  # noqa: E402
from ggml_dist.workers.driver import plan_on_nodes  # noqa: E402
from ggml_dist.workers.placement import NodeInfo  # noqa: E402

from ggml_dist.testbed.cluster import HostSpec, NamespaceCluster, run_with_link_cut  # noqa: E402
from ggml_dist.testbed.envs import VenvError, venv_without_ggml_dist  # noqa: E402
from ggml_dist.testbed.netns import netns_available  # noqa: E402

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")

CTX = 256
PROMPT = "The capital of"
N_PREDICT = 24
TOKENS = [1, 300, 17, 402, 88, 1000, 5, 77]
SPEC = SyntheticSpec(n_vocab=2048, n_embd=512, n_layer=4, n_head=8, n_head_kv=4, n_ff=1536, wtype="Q4_0",
                     embd_type="Q8_0", tied=False, seed=31)
CLI = shutil.which("ggml-dist") or str(Path(sys.executable).parent / "ggml-dist")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("mh_model") / "m.gguf", SPEC)


def _node_memory(path: Path) -> int:
    """Between the largest stage of the best 2-stage split and the whole model in one stage."""
    m = LlamaModel.load(path)
    big = [NodeInfo(f"n{i}", f"10.0.0.{i}", 2**40, 1.0) for i in range(2)]
    params = ContextParams(n_ctx=CTX)
    one = plan_on_nodes(m, params, big, 1).stages[0].total_bytes
    two = max(s.total_bytes for s in plan_on_nodes(m, params, big, 2).stages)
    assert two + 2 * 2**20 < one
    return (one + two) // 2


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    try:
        venv = venv_without_ggml_dist(tmp_path_factory.mktemp("venv_no_ggml_dist"))
    except VenvError as e:
        pytest.skip(f"no venv without ggml_dist: {e}")
    mem = _node_memory(model)
    env = {"GGML_DIST_CACHE": str(tmp_path_factory.mktemp("node_cache"))}
    hosts = [HostSpec(num_cpus=0, dashboard=True, env=env),
             HostSpec(num_cpus=1, memory_bytes=mem - 2**20, env=env),
             HostSpec(num_cpus=1, memory_bytes=mem, python=venv, env=env),
             HostSpec(num_cpus=1, memory_bytes=mem, hide_dirs=[str(model.parent)], env=env)]
    with NamespaceCluster(hosts, log_dir=tmp_path_factory.mktemp("mh_logs")) as c:
        c.memory = mem
        yield c


@pytest.fixture(scope="module")
def reference(model):
    m = LlamaModel.load(model)
    logits = LlamaContext(m, ContextParams(n_ctx=CTX)).decode(Batch.from_tokens(TOKENS, all_outputs=True))
    ids = m.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
    res = generate(LlamaContext(m, ContextParams(n_ctx=CTX)), m.tokenizer, ids, N_PREDICT)
    return logits, res.tokens, res.text


def _cli(cluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    r = cluster.run_in(0, [CLI, *args, "--address", cluster.gcs_address], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{args}: {r.stdout[-2000:]}\n{r.stderr[-4000:]}\n{cluster.diagnostics()}"
    return r


# plan --stages auto reads the nodes: 2 stages, on hosts 2 and 3, each within its node's memory
def test_plan_auto_reads_the_cluster(cluster, model):
    r = _cli(cluster, "plan", "--model", str(model), "--stages", "auto", "--ctx", str(CTX), "--json")
    stages = json.loads(r.stdout)["stages"]
    assert [s["node_ip"] for s in stages] and {s["node_ip"] for s in stages} == {cluster.ips[2], cluster.ips[3]}
    assert len({s["node_id"] for s in stages}) == 2
    for s in stages:
        assert s["total_bytes"] <= s["node_memory_bytes"] == cluster.memory
        assert s["total_bytes"] == s["weight_bytes"] + s["kv_bytes"] + s["compute_bytes"] + s["overhead_bytes"]


# --stages auto over the hosts (one without the file, one without ggml-dist) gives the one-process
# logits bit for bit; the weights sent to host 3 are cached there, and a second run sends nothing
def test_auto_logits_bitwise_and_weight_cache(cluster, model, reference, tmp_path):
    out = tmp_path / "logits.npz"
    tokens = ",".join(map(str, TOKENS))
    r = _cli(cluster, "logits", "--model", str(model), "--stages", "auto", "--ctx", str(CTX), "--tokens", tokens,
             "--out", str(out))
    assert np.array_equal(np.load(out)["logits"], reference[0])
    assert "sending weights" in r.stderr and "from the node's cache" not in r.stderr
    assert cluster.ips[2] in r.stderr and cluster.ips[3] in r.stderr          # the plan table, by node IP
    r = _cli(cluster, "logits", "--model", str(model), "--stages", "auto", "--ctx", str(CTX), "--tokens", tokens,
             "--out", str(out))
    assert "from the node's cache" in r.stderr and "sending weights" not in r.stderr
    assert np.array_equal(np.load(out)["logits"], reference[0])


# the steps as one compiled-graph execution each, its channels between hosts over the bridge: the
# same greedy tokens, and no fall-back to plain calls
def test_compiled_graph_across_hosts(cluster, model, reference):
    r = _cli(cluster, "run", "--model", str(model), "--stages", "auto", "--ctx", str(CTX), "--prompt", PROMPT,
             "-n", str(N_PREDICT), "--temp", "0", "--stage-calls", "compiled", "--json")
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"prompt_tokens"')))
    assert out["tokens"] == reference[1] and out["stage_calls"] == "compiled", r.stderr[-3000:]


# `ray job submit` to the head's dashboard: the job joins the cluster, places 2 stages, same tokens
def test_ray_job_submit_auto(cluster, model, reference):
    ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    r = subprocess.run([ray_cli, "job", "submit", "--address", cluster.dashboard_url, "--", "ggml-dist", "run",
                        "--model", str(model), "--stages", "auto", "--ctx", str(CTX), "--prompt", PROMPT,
                        "-n", str(N_PREDICT), "--temp", "0", "--json"],
                       capture_output=True, text=True, timeout=600, env=cluster.env_for(0, driver=False),
                       cwd=str(cluster.workdir))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"prompt_tokens"')))
    assert out["tokens"] == reference[1]
    assert {s["node_ip"] for s in out["plan"]} == {cluster.ips[2], cluster.ips[3]}


# the README's command for a job that brings its own code (`--runtime-env-json` py_modules from the
# repository's root): the driver leaves the job's runtime env alone, and host 2 runs that copy
def test_ray_job_submit_with_job_py_modules(cluster, model, reference):
    ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    repo = Path(__file__).resolve().parents[2]
    r = subprocess.run([ray_cli, "job", "submit", "--address", cluster.dashboard_url, "--runtime-env-json",
                        json.dumps({"py_modules": ["ggml_dist"], "excludes": ["__pycache__"]}), "--",
                        "python", "-m", "ggml_dist.cli", "run", "--model", str(model), "--stages", "auto", "--ctx",
                        str(CTX), "--prompt", PROMPT, "-n", "4", "--temp", "0", "--json"],
                       capture_output=True, text=True, timeout=600, env=cluster.env_for(0, driver=False),
                       cwd=str(repo))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"prompt_tokens"')))
    assert out["tokens"] == reference[1][:4]


# `ggml-dist serve --stages auto` on the head, reached over the bridge by the official client
def test_serve_auto_over_hosts(cluster, model, reference):
    import openai
    port = 18080
    p = cluster.popen_in(0, [CLI, "serve", "--address", cluster.gcs_address, "--model", str(model), "--stages",
                             "auto", "--ctx", str(CTX), "--parallel", "2", "--host", cluster.head_ip, "--port",
                             str(port), "--api-key", "multihost-key"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://{cluster.head_ip}:{port}"
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            assert p.poll() is None, p.stderr.read().decode()[-3000:]
            try:
                import httpx
                if httpx.get(url + "/health", timeout=2).json().get("status") == "ok":
                    break
            except Exception:
                pass
            time.sleep(1)
        c = openai.OpenAI(base_url=url + "/v1", api_key="multihost-key", max_retries=0, timeout=120)
        got = c.completions.create(model="m", prompt=PROMPT, max_tokens=N_PREDICT, temperature=0)
        assert got.choices[0].text == reference[2]
    finally:
        p.terminate()
        p.wait(timeout=60)


# the link of the host holding stage 1 cut mid-generation: found within seconds (not Ray's node-death
# timeout), the stage placed again on the spare host, the same text
def test_link_cut_mid_generation(cluster, model, reference):
    r = run_with_link_cut(cluster, [CLI, "run", "--address", cluster.gcs_address, "--model", str(model), "--stages",
                                    "auto", "--ctx", str(CTX), "--prompt", PROMPT, "-n", str(N_PREDICT), "--temp",
                                    "0"], after_chars=8)                     # a few tokens in
    assert r.returncode == 0 and r.victim is not None, r.log[-4000:]
    assert r.text.rstrip("\n") == reference[2], r.log[-3000:]
    assert r.recoveries >= 1 and r.restore_s is not None and r.detect_s is not None, r.log[-3000:]
    assert 0 < r.detect_s <= 30 and r.restore_s <= 30 and r.cut_to_end_s < 60, r.log[-3000:]
    assert "stopped answering" in r.log and f"on {cluster.ips[1]}" in r.log   # replaced on the spare

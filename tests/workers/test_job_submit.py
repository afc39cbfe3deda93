"""`ray job submit` of a 2-stage run onto a two-node cluster, end to end (the README's commands)."""
from __future__ import annotations

import json
import socket
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# a job submitted to the cluster joins it (RAY_ADDRESS) and runs its stages on both nodes, one each
def test_ray_job_submit_two_nodes(tmp_path):
    from ray.cluster_utils import Cluster
    if ray.is_initialized():
        ray.shutdown()
    model = write_synthetic(tmp_path / "m.gguf", SyntheticSpec(n_layer=2, seed=5))
    port = _free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": port})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        cmd = [ray_cli, "job", "submit",
               "--address", f"http://127.0.0.1:{port}", "--",
               "ggml-dist", "run", "--model", str(model), "--stages", "2", "--prompt", "abc", "-n", "4",
               "--ctx", "256", "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith('{"prompt_tokens"'))
        out = json.loads(line)
        assert len(out["tokens"]) == 4 and len(out["stages"]) == 2
        assert len({s["node_id"] for s in out["plan"]}) == 2             # planned on both nodes
        ran = [s["node_id"] for s in out["stages"]]                        # and the actors ran there
        assert len(set(ran)) == 2 and ran == [s["node_id"] for s in out["plan"]]
    finally:
        cluster.shutdown()

"""ggml_dist/testbed/cluster.py itself: a 3-host Ray cluster in network namespaces (head + 2 workers,
one worker on a venv without ggml_dist and with a hidden dir), links cut and restored, and a
teardown that leaves no process, namespace or bridge behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")

from ggml_dist.testbed.cluster import ClusterStartError, HostSpec, NamespaceCluster  # noqa: E402
from ggml_dist.testbed.envs import VenvError, venv_without_ggml_dist  # noqa: E402
from ggml_dist.testbed.netns import link_exists, namespace_exists, netns_available  # noqa: E402
from ggml_dist.testbed.procs import http_get, pid_alive  # noqa: E402

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")

MIB = 2**20
MARKER = "marker.txt"

# Run in the head's namespace: one task pinned to each worker node reports what that node sees.
DRIVER = textwrap.dedent('''
    import json, os, sys
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    args = json.loads(sys.argv[1])
    ray.init(address=args["address"], log_to_driver=False)

    @ray.remote(num_cpus=1)
    def probe(marker):
        import os, sys
        import ray
        try:
            import ggml_dist
            ggml = ggml_dist.__file__
        except ImportError as e:
            ggml = "ImportError: " + str(e)
        return {"ip": ray.util.get_node_ip_address(), "python": sys.executable,
                "marker": os.path.exists(marker), "ggml_dist": ggml}

    out = {"driver_ip": ray.util.get_node_ip_address(), "tasks": {}}
    for ip, node_id in args["workers"].items():
        s = NodeAffinitySchedulingStrategy(node_id, soft=False)
        out["tasks"][ip] = ray.get(probe.options(scheduling_strategy=s).remote(args["marker"]),
                                   timeout=120)
    print("RESULT " + json.dumps(out))
''')


@pytest.fixture(scope="session")
def venv_python(tmp_path_factory):
    try:
        return venv_without_ggml_dist(tmp_path_factory.mktemp("venv_no_ggml_dist"))
    except VenvError as e:
        pytest.skip(f"no venv without ggml_dist: {e}")


@pytest.fixture(scope="module")
def hidden_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hidden")
    (d / MARKER).write_text("only some hosts see this\n")
    return d


@pytest.fixture(scope="module")
def cluster(venv_python, hidden_dir, tmp_path_factory):
    hosts = [HostSpec(num_cpus=0, dashboard=True),
             HostSpec(num_cpus=1, memory_bytes=200 * MIB),
             HostSpec(num_cpus=1, memory_bytes=200 * MIB, python=venv_python,
                      hide_dirs=[str(hidden_dir)])]
    with NamespaceCluster(hosts, log_dir=tmp_path_factory.mktemp("cluster_logs")) as c:
        yield c


def test_nodes_alive_on_distinct_ips(cluster):
    nodes = cluster.nodes()
    alive = {n["NodeManagerAddress"]: n for n in nodes if n["Alive"]}
    assert set(alive) == set(cluster.ips) and len(cluster.ips) == 3
    assert all(not ip.startswith("127.") for ip in cluster.ips)
    assert cluster.gcs_address == f"{cluster.head_ip}:6379"
    for ip in cluster.ips[1:]:
        assert alive[ip]["Resources"]["memory"] == 200 * MIB
        assert alive[ip]["Resources"]["CPU"] == 1
    assert "CPU" not in alive[cluster.head_ip]["Resources"]
    assert cluster.node_id_of(cluster.ips[2], nodes) == alive[cluster.ips[2]]["NodeID"]
    status, body = http_get(cluster.dashboard_url + "/api/version", timeout=10)
    assert status == 200 and "ray_version" in json.loads(body)


def test_tasks_see_their_host(cluster, venv_python, hidden_dir, tmp_path):
    marker = str(hidden_dir / MARKER)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    ids = cluster.node_ids()
    args = {"address": cluster.gcs_address, "marker": marker,
            "workers": {ip: ids[ip] for ip in cluster.ips[1:]}}
    p = cluster.run_in(0, [sys.executable, str(script), json.dumps(args)],
                       capture_output=True, text=True, timeout=180)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"driver failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    plain, venv_host = out["tasks"][cluster.ips[1]], out["tasks"][cluster.ips[2]]
    assert out["driver_ip"] == cluster.head_ip
    assert plain["ip"] == cluster.ips[1] and venv_host["ip"] == cluster.ips[2]
    # the hidden dir is empty only for host 2's processes
    assert plain["marker"] is True and venv_host["marker"] is False
    assert os.path.exists(marker)
    # host 2 runs its workers on the venv's python, where ggml_dist is missing
    assert venv_host["python"] == venv_python
    assert venv_host["ggml_dist"].startswith("ImportError"), venv_host
    assert plain["python"] == sys.executable and plain["ggml_dist"].endswith("__init__.py")


def test_link_down_partitions_a_host(cluster):
    ports = {n["NodeManagerAddress"]: n["NodeManagerPort"] for n in cluster.nodes() if n["Alive"]}
    cut, other = cluster.ips[1], cluster.ips[2]
    assert cluster.try_connect(0, cut, ports[cut]) == "ok"
    cluster.link_down(1)
    try:
        assert "timed out" in cluster.try_connect(0, cut, ports[cut], timeout=1.0)
        assert cluster.can_connect(0, other, ports[other])            # only host 1 is cut off
    finally:
        cluster.link_up(1)
    assert cluster.can_connect(0, cut, ports[cut])
    cluster.wait_for_nodes(alive=cluster.ips, timeout=30)        # a short cut loses no node


def test_failed_start_cleans_up():
    c = NamespaceCluster([HostSpec(num_cpus=0, extra_args=["--no-such-flag"])])
    try:
        with pytest.raises(ClusterStartError, match="no-such-flag"):
            c.start()
        assert c.started_pids and not any(pid_alive(p) for p in c.started_pids)
        assert not any(namespace_exists(ns) for ns in c.namespaces)
        assert not link_exists(c.bridge) and not any(link_exists(v) for v in c.veths)
        assert c.log_path(0).exists()                             # kept for diagnosis
    finally:
        if c.workdir is not None:
            shutil.rmtree(c.workdir, ignore_errors=True)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


# keep last: it ends the module's cluster
def test_stop_leaves_nothing(cluster):
    pids = cluster.pids()
    ray_procs = {int(p) for p in os.listdir("/proc") if p.isdigit()
                 and str(cluster.workdir).encode() in _cmdline(int(p))}
    assert len(ray_procs) >= 6 and ray_procs <= pids         # every raylet, gcs, agent is ours
    cluster.stop()
    assert not [p for p in pids | cluster.started_pids if pid_alive(p)]
    assert not any(namespace_exists(ns) for ns in cluster.namespaces)
    assert not link_exists(cluster.bridge) and not any(link_exists(v) for v in cluster.veths)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert cluster.tag not in listed
    assert not cluster.workdir.exists()
    assert cluster.log_path(2).exists() and list(cluster.log_dir.glob("host2-session_*/raylet.out"))

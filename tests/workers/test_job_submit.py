"""`ray job submit` as the README prints it, with Ray 2.60's token auth on (issue 43).

    one machine   the README's `runnable: cluster` block: its exports, `ray get-auth-token`, a real
                  `ray start --head ... --block` (the flags as printed, `--block` and a `--temp-dir` of its
                  own added; the ports it names swapped for free ones), then `ray job submit` exactly as
                  printed. Checked: a submit without RAY_AUTH_MODE=token is refused (token auth is on),
                  every port of that Ray listens on loopback only, and the job's tokens are one process's.
    multi-host    the README's `runnable: namespaces` block on namespace hosts (ggml_dist/testbed): a head
                  and two workers started with the block's `ray start` flags, token auth on, then its
                  `ray job submit` run on the head as printed (the model path swapped for SmolLM2's); the
                  tokens are one process's. Slow path: GGML_DIST_SLOW_TESTS=1, and root for namespaces.

The token is a file of the test's own (RAY_AUTH_TOKEN_PATH, which Ray's CLI reads as it does
~/.ray/auth_token), so the user's ~/.ray is not touched. Every Ray process started here is ended by pid.
"""
from __future__ import annotations

import functools
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from tests.test_readme import SLOW, blocks_of  # noqa: E402
from tests.workers.test_local_ray import LOOPBACK, _kill, _listeners, _tree, _wait_gone  # noqa: E402

BIN = str(Path(sys.executable).parent)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _token_file(tmp: Path) -> Path:
    from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
    p = tmp / "auth_token"
    p.write_text(generate_new_authentication_token())
    p.chmod(0o600)
    return p


def _env(exports: dict[str, str], token: Path) -> dict[str, str]:
    """The test session's environment with the block's exports, the token file, this Python's scripts
    first on PATH, and no RAY_ADDRESS or RAY_AUTH_MODE of the caller's."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env.update(exports)
    env["RAY_AUTH_TOKEN_PATH"] = str(token)
    env["PATH"] = os.pathsep.join((BIN, env.get("PATH", "")))
    return env


def _split(commands: list[str]) -> tuple[dict[str, str], list[str]]:
    """A block's `export NAME=VALUE` lines as a dict, and its other commands."""
    exports, rest = {}, []
    for c in commands:
        words = shlex.split(c, comments=True)
        if words and words[0] == "export":
            for w in words[1:]:
                k, v = w.split("=", 1)
                exports[k] = v
        else:
            rest.append(c)
    return exports, rest


def _one_of(cmds: list[str], start: str) -> str:
    got = [c for c in cmds if c.startswith(start)]
    assert len(got) == 1, f"the README block should have one `{start} ...` line: {cmds}"
    return got[0]


def _job_json(out: str) -> dict:
    """The `run --json` object in a job's log (ray job submit tails it)."""
    line = next((ln for ln in out.splitlines() if ln.startswith('{"prompt_tokens"')), None)
    assert line is not None, out[-4000:]
    return json.loads(line)


def _one_process(job_cmd: str, model: str, env: dict[str, str]) -> list[int]:
    """The job's `ggml-dist run` in one process here (no --stages, no cluster): its tokens."""
    words = shlex.split(job_cmd.split(" -- ", 1)[1])
    i = words.index("--stages")
    del words[i:i + 2]
    words[words.index("--model") + 1] = model
    r = subprocess.run(words, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)["tokens"]


def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`ray start` exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the dashboard port {port} did not open within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


NO_AGENT = "No available agent to submit job"       # the head's job agent is not up yet: nothing was started


def _submit(job_cmd: str, env: dict, run=subprocess.run, patience: float = 120) -> subprocess.CompletedProcess:
    """`ray job submit` as printed (by run: here, or in a testbed host); on a loaded machine the dashboard's
    port opens before the head's job agent registers, and Ray then refuses the job and says to try again
    later: so does this, as a user would."""
    deadline = time.monotonic() + patience
    while True:
        r = run(["bash", "-e", "-c", job_cmd], env=env, capture_output=True, text=True, timeout=900, check=False)
        if r.returncode == 0 or NO_AGENT not in r.stdout + r.stderr or time.monotonic() > deadline:
            return r
        time.sleep(2)


# the one-machine recipe: a real `ray start --head --block` as printed, then `ray job submit` as printed
def test_one_machine_recipe(tmp_path, smollm2_path):
    (block,) = blocks_of("cluster")
    port, dash = _free_port(), _free_port()
    swap = {"6379": str(port), "8265": str(dash)}
    cmds = [re.sub(r"\b(6379|8265)\b", lambda m: swap[m.group(1)], c) for c in block.commands()]
    exports, cmds = _split(cmds)
    env = _env(exports, _token_file(tmp_path))
    assert env.get("RAY_AUTH_MODE") == "token" and env.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0"
    head_cmd, job_cmd = _one_of(cmds, "ray start --head"), _one_of(cmds, "ray job submit")
    for c in cmds:
        if c not in (head_cmd, job_cmd):                        # ray get-auth-token: the token is there
            r = subprocess.run(["bash", "-e", "-c", c], env=env, capture_output=True, text=True, timeout=120,
                               check=False)
            assert r.returncode == 0, f"{c}: {r.stderr[-2000:]}"
    log = tmp_path / "head.log"
    temp = Path(os.path.realpath("/tmp")) / f"gdjs{os.getpid()}"         # Ray's sockets want a short path
    with open(log, "w") as f:
        head = subprocess.Popen(["bash", "-c", f"exec {head_cmd} --block --temp-dir={temp}"], env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    procs: dict[int, int] = {}
    try:
        _wait_port(dash, head, log)
        procs = _tree(head.pid)
        # without RAY_AUTH_MODE=token Ray's client sends no token: refused, so token auth is on
        noauth = {k: v for k, v in env.items() if k != "RAY_AUTH_MODE"}
        r = subprocess.run(["bash", "-c", job_cmd.replace(" -- ", " --no-wait -- ", 1)], env=noauth,
                           capture_output=True, text=True, timeout=120, check=False)
        assert r.returncode != 0 and "uthentica" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]

        r = _submit(job_cmd, env)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
        out = _job_json(r.stdout)
        assert "(token auth)" in r.stdout or "(token auth)" in r.stderr          # ggml-dist joined with it
        assert len(out["plan"]) == 1 and out["plan"][0]["node_ip"] == "127.0.0.1"   # the head holds the stage
        assert out["tokens"] == _one_process(job_cmd, smollm2_path, env)

        procs.update(_tree(head.pid))
        wide = [s for s in _listeners(procs, head.pid) if s.ip not in LOOPBACK]
        assert not wide, f"the head listens beyond loopback: {wide}"
    finally:
        procs.update(_tree(head.pid))
        head.terminate()                                      # `ray start --block` stops what it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        _kill(_wait_gone(procs, 15))


def _flags(cmd: str) -> dict[str, str]:
    """`ray start`'s --name=value flags (values through the shell: `$((4 * 2**30))`)."""
    words = shlex.split(subprocess.run(["bash", "-c", f"printf '%s\\n' {cmd}"], capture_output=True, text=True,
                                       check=True).stdout.replace("\n", " "))
    return dict(w[2:].split("=", 1) for w in words if w.startswith("--") and "=" in w)


# the multi-host recipe on namespace hosts, with the block's `ray start` flags and its `ray job submit`
@pytest.mark.skipif(not SLOW, reason="a cluster of namespace hosts, a minute or more: set GGML_DIST_SLOW_TESTS=1")
def test_multi_host_recipe(tmp_path, smollm2_path):
    from ggml_dist.testbed.cluster import HostSpec, NamespaceCluster
    from ggml_dist.testbed.netns import netns_available
    reason = netns_available()
    if reason:
        pytest.skip(f"no network namespaces: {reason}")
    (block,) = blocks_of("namespaces")
    exports, cmds = _split(block.commands())
    token = _token_file(tmp_path)
    env = _env(exports, token)
    for c in cmds:
        if c.startswith("ray get-auth-token"):
            subprocess.run(["bash", "-e", "-c", c], env=env, check=True, capture_output=True, timeout=120)
    head, worker = _flags(_one_of(cmds, "ray start --head")), _flags(_one_of(cmds, "ray start --address"))
    job_cmd = _one_of(cmds, "ray job submit").replace("/models/model.gguf", smollm2_path)
    dash = ["--include-dashboard=true", f"--dashboard-host={head['dashboard-host']}",
            f"--dashboard-port={head['dashboard-port']}"]             # the last --include-dashboard wins
    hosts = [HostSpec(num_cpus=int(head["num-cpus"]), extra_args=dash),
             *[HostSpec(num_cpus=int(worker["num-cpus"]), memory_bytes=int(worker["memory"])) for _ in range(2)]]
    cenv: dict[str, str | None] = {**exports, "RAY_AUTH_TOKEN_PATH": str(token)}
    with NamespaceCluster(hosts, port=int(head["port"]), env=cenv, log_dir=tmp_path / "logs") as c:
        deadline = time.monotonic() + 120
        probe = (f"import socket; socket.create_connection(('{head['dashboard-host']}', "
                 f"{head['dashboard-port']}), 1)")
        while c.run_in(0, [sys.executable, "-c", probe], capture_output=True).returncode != 0:
            assert time.monotonic() < deadline, c.diagnostics()
            time.sleep(1)
        r = _submit(job_cmd, cenv, functools.partial(c.run_in, 0))
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:] + c.diagnostics()
        out = _job_json(r.stdout)
        assert {s["node_ip"] for s in out["plan"]} <= set(c.ips[1:])         # the head holds no stage
    assert out["tokens"] == _one_process(job_cmd, smollm2_path, env)

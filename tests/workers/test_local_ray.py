"""The local Ray that ggml-dist starts for itself: every process of it listens on loopback only, and
every process of it ends when the server is stopped by SIGTERM or SIGINT, at any moment of its life.

The processes of an instance are the server's descendants, found in /proc/<pid>/stat while it runs
(the raylet's agents are reparented once their raylet is gone, so the tree is read before the signal);
their listening sockets are the socket inodes of /proc/<pid>/fd looked up in the server's
/proc/<pid>/net/tcp and tcp6.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest

pytest.importorskip("ray")

from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.serve.server import free_port

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
TCP_LISTEN = "0A"                     # st column of /proc/net/tcp (include/net/tcp_states.h)


@dataclass(frozen=True, slots=True)
class Listener:
    pid: int
    comm: str
    ip: str
    port: int


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(write_synthetic(tmp_path_factory.mktemp("local_ray") / "m.gguf",
                               SyntheticSpec(n_layer=2, seed=9)))


# -- processes and sockets, from /proc ---------------------------------------------------------------
def _stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time, state) of pid, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _tree(root: int) -> dict[int, int]:
    """root and its descendants: pid -> start time (a pid reused later has another one)."""
    stats = {int(d): _stat(int(d)) for d in os.listdir("/proc") if d.isdigit()}
    table = {p: st for p, st in stats.items() if st is not None}
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        if p in table and p not in out:
            out[p] = table[p][1]
            todo += [c for c, (ppid, _, _) in table.items() if ppid == p]
    return out


def _alive(procs: dict[int, int]) -> dict[int, int]:
    """Those still running: same start time, not a zombie."""
    out = {}
    for p, t in procs.items():
        st = _stat(p)
        if st is not None and st[1] == t and st[2] != "Z":
            out[p] = t
    return out


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _ip(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6}: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _listeners(procs: dict[int, int], netns_pid: int) -> list[Listener]:
    """Every listening TCP socket that one of procs holds open."""
    listening: dict[str, tuple[str, int]] = {}                    # socket inode -> (ip, port)
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{netns_pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == TCP_LISTEN:
                    addr, port = cols[1].split(":")
                    listening[cols[9]] = (_ip(addr), int(port, 16))
    out = []
    for p in procs:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in listening:
                out.append(Listener(p, _comm(p), *listening[inode]))
    return out


# -- the server --------------------------------------------------------------------------------------
def _spawn_serve(model_path: str, log_path, sigint: signal.Handlers = signal.SIG_DFL) -> tuple[subprocess.Popen, int]:
    """`ggml-dist serve --stages 2` in its own session; sigint: the SIGINT disposition it inherits (SIG_IGN:
    as a shell's background job starts), set here whatever this test process has."""
    port = free_port()
    with open(log_path, "wb") as log:                  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "ggml_dist.cli", "serve", "--model", model_path,
                                 "--stages", "2", "--port", str(port), "--ctx", "256", "--parallel", "2"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    return proc, port


def _start_serve(model_path: str, log_path, sigint: signal.Handlers = signal.SIG_DFL) -> tuple[subprocess.Popen, int]:
    """_spawn_serve, once /health answers ok (a deadline for a loaded machine, polled)."""
    proc, port = _spawn_serve(model_path, log_path, sigint)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}:\n{_read(log_path)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if json.load(r).get("status") == "ok":
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"serve was not ready within 600 s:\n{_read(log_path)}")


def _follow_until_exit(proc: subprocess.Popen, timeout_s: float) -> tuple[int, dict[int, int]]:
    """Wait for proc to exit, noting every process of its tree meanwhile (a process it starts while it
    stops is one to end too): (its return code, the processes seen)."""
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        seen.update(_tree(proc.pid))
        time.sleep(0.05)
    return proc.wait(timeout=max(1.0, deadline - time.monotonic())), seen


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _wait_gone(procs: dict[int, int], timeout_s: float) -> dict[int, int]:
    deadline = time.monotonic() + timeout_s
    left = _alive(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive(procs)
    return left


def _kill(procs: dict[int, int]) -> None:
    """What a failed test leaves behind, by pid (checked against its start time)."""
    for p in _alive(procs):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


# serve --stages 2: the server and its local Ray listen on loopback only; SIGTERM (SIGINT) stops it,
# and every process of that Ray ends too; SIGINT also where the server inherited it ignored (started as a
# shell's background job: uvicorn caught it, then raised it again into SIG_IGN and the server exited 0)
@pytest.mark.parametrize("sig,sigint", [(signal.SIGTERM, signal.SIG_DFL), (signal.SIGINT, signal.SIG_DFL),
                                        (signal.SIGINT, signal.SIG_IGN)],
                         ids=["SIGTERM", "SIGINT", "SIGINT-inherited-ignored"])
def test_serve_local_ray_loopback_and_stop(model_path, tmp_path, sig, sigint):
    proc, port = _start_serve(model_path, tmp_path / "serve.log", sigint)
    procs = _tree(proc.pid)
    try:
        comms = [_comm(p) for p in procs]
        assert {"gcs_server", "raylet", "ray::DashboardA", "ray::RuntimeEnv"} <= set(comms), comms
        assert comms.count("ray::StageActor") == 2, comms

        listeners = _listeners(procs, proc.pid)
        assert Listener(proc.pid, _comm(proc.pid), "127.0.0.1", port) in listeners   # the walk sees the HTTP port
        assert {"gcs_server", "raylet", "ray::StageActor"} <= {s.comm for s in listeners}, listeners
        wide = [s for s in listeners if s.ip not in LOOPBACK]
        assert not wide, f"listening beyond loopback: {wide}"

        os.kill(proc.pid, sig)
        rc, seen = _follow_until_exit(proc, 300)
        procs.update(seen)
        left = _wait_gone(procs, 60)
        assert not left, f"still running after the server exited: {[(p, _comm(p)) for p in left]}"
        assert rc == (143 if sig == signal.SIGTERM else 130), _read(tmp_path / "serve.log")
    finally:
        proc.kill()
        _kill(procs)


# Ctrl-C during the start-up: the moment the server's local Ray has its GCS (mid ray.init, no stage yet),
# and the moment the first stage actor exists (the pipeline launching): 130, and nothing left running, with
# SIGINT as inherited by default or ignored
@pytest.mark.parametrize("sigint", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "inherited-ignored"])
@pytest.mark.parametrize("moment", ["gcs_server", "ray::StageActor"])
def test_serve_sigint_during_start_up(model_path, tmp_path, moment, sigint):
    proc, _ = _spawn_serve(model_path, tmp_path / "serve.log", sigint)
    procs: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 600
        while not any(_comm(p) == moment for p in procs):
            assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{_read(tmp_path / 'serve.log')}"
            assert time.monotonic() < deadline, f"no {moment} within 600 s:\n{_read(tmp_path / 'serve.log')}"
            procs.update(_tree(proc.pid))
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGINT)
        rc, seen = _follow_until_exit(proc, 300)
        procs.update(seen)
        left = _wait_gone(procs, 60)
        assert not left, f"still running after the server exited: {[(p, _comm(p)) for p in left]}"
        assert rc == 130, _read(tmp_path / "serve.log")
    finally:
        proc.kill()
        _kill(procs)


# a `ray start` head left running on this machine is not joined unasked (a bare ray.init() would join
# it, and refuse the CPUs ggml-dist asks its own instance for): run starts a local Ray of its own
def test_run_starts_its_own_ray_beside_a_ray_start_head(model_path, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={free_port()}", "--num-cpus=0",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "head.log", "w"))
    try:
        deadline = time.time() + 60
        while not os.path.exists("/tmp/ray/ray_current_cluster") and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(2.0)                                       # its GCS up
        out = subprocess.run([sys.executable, "-m", "ggml_dist.cli", "run", "--model", model_path, "--stages", "2",
                              "--prompt", "x", "-n", "3", "--json", "--ctx", "256"],
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "started a local Ray" in out.stderr and len(json.loads(out.stdout)["tokens"]) == 3
    finally:
        procs = _tree(head.pid)
        head.terminate()                                      # `ray start --block` stops what it started
        try:
            head.wait(timeout=60)
        finally:
            _kill(_wait_gone(procs, 15))

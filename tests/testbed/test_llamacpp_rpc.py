"""ggml_dist/testbed/llamacpp_rpc.py: the batched-bench parser on a real captured output, the command lines, and
llama-batched-bench run through a real ggml-rpc-server on 127.0.0.1 (skipped without a build: CI has none).

tests/data/llamacpp_batched_bench.jsonl is the real stdout of the build of benchmarks/build_llama_rpc.sh
(llama-cpp-python 0.3.36's llama.cpp, 0.3.36-native-noamx) on this repo's 2-core VM, from the argv this module
builds (rpc_server_argv, then batched_bench_argv with npp=[128], ntg=32, npl=[1, 4], threads=1, ctx=1024):

    ggml-rpc-server -H 127.0.0.1 -p 50160 -t 1 &
    llama-batched-bench -m SmolLM2-135M-Instruct.Q4_1.gguf --rpc 127.0.0.1:50160 -ngl 99 -c 1024 -t 1 --fit off \\
        -npp 128 -ntg 32 -npl 1,4 --output-format jsonl -lv 4 > tests/data/llamacpp_batched_bench.jsonl
"""
from __future__ import annotations

import contextlib
import socket
import subprocess
from pathlib import Path

import pytest

from ggml_dist.testbed.llamacpp_rpc import (
    BIN_ENV,
    RpcBuild,
    RpcBuildError,
    batched_bench_argv,
    find_rpc_build,
    parse_batched_bench,
    parse_bench_log,
    rpc_server_argv,
    wait_rpc_ready,
)

FIXTURE = Path(__file__).parent.parent / "data" / "llamacpp_batched_bench.jsonl"
BUILD = find_rpc_build()
needs_build = pytest.mark.skipif(BUILD is None, reason="no llama.cpp RPC build (run benchmarks/build_llama_rpc.sh, "
                                                        f"or set {BIN_ENV}); CI has none, as expected")
PLACEHOLDER = RpcBuild(bin_dir=Path("/opt/llama/bin"), rpc_server=Path("/opt/llama/bin/ggml-rpc-server"),
                       batched_bench=Path("/opt/llama/bin/llama-batched-bench"), system_info=None)


def _check_rows(rows, pp: int, tg: int, npl: list[int]) -> None:
    assert [(r["pp"], r["tg"], r["b"]) for r in rows] == [(pp, tg, b) for b in npl]
    for r in rows:
        assert r["n_kv"] == r["b"] * (r["pp"] + r["tg"])
        assert min(r["s_pp_tok_s"], r["s_tg_tok_s"], r["s_tok_s"]) > 0
        assert r["t_s"] == pytest.approx(r["t_pp_s"] + r["t_tg_s"], abs=2e-3)
        assert r["s_tg_tok_s"] == pytest.approx(r["b"] * r["tg"] / r["t_tg_s"], rel=1e-3)


def _free_ports(n: int) -> list[int]:
    """n distinct loopback ports free now (held together while chosen, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


# the real jsonl of one run: one row per npl, keys renamed to the table's columns
def test_parse_captured_output():
    rows = parse_batched_bench(FIXTURE.read_text())
    _check_rows(rows, pp=128, tg=32, npl=[1, 4])
    # the fixture's own numbers, so that no two columns are swapped
    assert (rows[0]["t_pp_s"], rows[0]["s_pp_tok_s"]) == (0.707542, 180.90799)
    assert (rows[1]["t_tg_s"], rows[1]["s_tg_tok_s"], rows[1]["s_tok_s"]) == (1.372735, 93.244507, 166.945953)


# a line of another format is refused, not read as zeros; lines that are not JSON are skipped
def test_parse_rejects_unknown_jsonl():
    assert parse_batched_bench("\nmain: n_kv_max = 1024\n\n") == []
    with pytest.raises(ValueError, match="lacks"):
        parse_batched_bench('{"pp": 1, "tg": 2}\n')


# the server's flags as this version's --help names them
def test_rpc_server_argv():
    assert rpc_server_argv(PLACEHOLDER, "10.0.0.2", 50052, threads=2) == [
        "/opt/llama/bin/ggml-rpc-server", "-H", "10.0.0.2", "-p", "50052", "-t", "2"]
    assert rpc_server_argv(PLACEHOLDER, "10.0.0.2", 50052, threads=2, cache=True)[-1] == "-c"


# the bench: all layers on the servers, jsonl out, extra flags last
def test_batched_bench_argv():
    argv = batched_bench_argv(PLACEHOLDER, "m.gguf", ["10.0.0.2:50052", "10.0.0.3:50052"], npp=[128, 256],
                              ntg=32, npl=[1, 4], threads=1, ctx=2048, extra=["-fa", "off"])
    assert argv[0] == "/opt/llama/bin/llama-batched-bench"
    flags = dict(zip(argv[1:-2:2], argv[2:-2:2]))
    assert flags == {"-m": "m.gguf", "--rpc": "10.0.0.2:50052,10.0.0.3:50052", "-ngl": "99", "-c": "2048",
                     "-t": "1", "--fit": "off", "-npp": "128,256", "-ntg": "32", "-npl": "1,4",
                     "--output-format": "jsonl", "-lv": "4"}
    assert argv[-2:] == ["-fa", "off"]


# a context too small for the largest run would make batched-bench drop it silently
def test_batched_bench_argv_refuses_small_ctx():
    with pytest.raises(ValueError, match="1152"):
        batched_bench_argv(PLACEHOLDER, "m.gguf", ["h:1"], npp=[256], ntg=32, npl=[1, 4], threads=1, ctx=1024)


# a bin dir named in the environment that lacks the binaries is an error, not "no build"
def test_find_rpc_build_env_must_hold_binaries(tmp_path, monkeypatch):
    monkeypatch.setenv(BIN_ENV, str(tmp_path))
    with pytest.raises(RpcBuildError, match=BIN_ENV):
        find_rpc_build()


# the environment variable names the build that is used
@needs_build
def test_find_rpc_build_env(monkeypatch):
    assert BUILD is not None
    monkeypatch.setenv(BIN_ENV, str(BUILD.bin_dir))
    assert find_rpc_build() == BUILD


# the cached build has no AMX path: these VMs list AMX but do not grant it, and AMX code segfaults
@needs_build
def test_build_has_no_amx():
    assert BUILD is not None and BUILD.system_info is not None, "build_llama_rpc.sh writes system_info.txt"
    assert BUILD.system_info.startswith("system_info:")
    assert "AMX" not in BUILD.system_info


def _bench_through_servers(model: str, n_servers: int, log_dir: Path) -> subprocess.CompletedProcess[str]:
    """Start n_servers real ggml-rpc-servers (1 thread each) on loopback, run llama-batched-bench through them
    (npp 32, ntg 8, npl 1,2), and end the servers by their own pids."""
    assert BUILD is not None
    ports = _free_ports(n_servers)
    servers: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            with (log_dir / f"rpc-server-{port}.log").open("w") as log:
                servers.append(subprocess.Popen(rpc_server_argv(BUILD, "127.0.0.1", port, threads=1), stdout=log,
                                                stderr=subprocess.STDOUT))
            wait_rpc_ready("127.0.0.1", port, timeout=30, proc=servers[-1])
        out = subprocess.run(batched_bench_argv(BUILD, model, [f"127.0.0.1:{p}" for p in ports], npp=[32], ntg=8,
                                                npl=[1, 2], threads=1, ctx=512),
                             check=False, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        # the weights went to the servers (buffer names are RPC<device on that server>[endpoint]), not the head
        for port in ports:
            assert f"RPC0[127.0.0.1:{port}] model buffer size" in out.stderr, out.stderr[-4000:]
        assert all(s.poll() is None for s in servers), "a server serves the next client after this one leaves"
        return out
    finally:
        for s in servers:
            s.terminate()
            try:
                s.wait(timeout=10)
            except subprocess.TimeoutExpired:
                s.kill()
                s.wait()


# end to end: a real ggml-rpc-server (1 thread) on loopback, llama-batched-bench on SmolLM2 through it
@needs_build
def test_batched_bench_through_rpc_server(smollm2_path, tmp_path):
    out = _bench_through_servers(smollm2_path, 1, tmp_path)
    _check_rows(parse_batched_bench(out.stdout), pp=32, tg=8, npl=[1, 2])
    # flash attention at its default resolves to on; one device: no pipelining
    assert parse_bench_log(out.stderr) == {"flash_attn": True, "pipeline_parallel": False, "n_copies": 1,
                                           "n_splits": 2}


# two servers: llama.cpp turns on the scheduler's pipeline parallelism over RPC devices (4 copies)
@needs_build
def test_two_rpc_servers_pipeline(smollm2_path, tmp_path):
    out = _bench_through_servers(smollm2_path, 2, tmp_path)
    _check_rows(parse_batched_bench(out.stdout), pp=32, tg=8, npl=[1, 2])
    log = parse_bench_log(out.stderr)
    assert log["pipeline_parallel"] and log["n_copies"] == 4, log

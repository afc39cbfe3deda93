"""llama.cpp's RPC backend as the measured peer: `ggml-rpc-server` per host, `llama-batched-bench --rpc` on the head.

    build = find_rpc_build()                       # None: run benchmarks/build_llama_rpc.sh first
    server = subprocess.Popen(rpc_server_argv(build, "10.0.0.2", 50052, threads=1))
    wait_rpc_ready("10.0.0.2", 50052, timeout=30, proc=server)
    out = subprocess.run(batched_bench_argv(build, model, ["10.0.0.2:50052"], npp=[128], ntg=32, npl=[1, 4],
                                            threads=1, ctx=1024), capture_output=True, text=True, check=True)
    rows = parse_batched_bench(out.stdout)          # one row per (pp, tg, pl), tok/s of each phase
    log = parse_bench_log(out.stderr)               # flash attention as resolved, pipelining, n_copies

The binaries come from benchmarks/build_llama_rpc.sh (dev-only; nothing in the package needs them): llama.cpp as
vendored in the llama-cpp-python 0.3.36 sdist, built native without AMX, installed into
`$GGML_DIST_CACHE/llama-rpc/<key>/bin` (or a bin dir named by GGML_DIST_LLAMA_RPC_BIN). That llama.cpp calls the
server `ggml-rpc-server`; older ones call it `rpc-server`, and either is found.

Pipelining (the vendored source): RPC devices report async compute and events (ggml/src/ggml-rpc/ggml-rpc.cpp:2191,
ggml_backend_rpc_device_get_props), so with two or more RPC servers, -ngl above the layer count, --split-mode layer
and KQV offloaded, llama_context turns on the scheduler's pipeline parallelism (src/llama-context.cpp:430-457,
"pipeline parallelism requires support for async compute and events in all devices"; n_copies = 4,
ggml/src/ggml-backend.cpp:1888). With one server it stays off (n_devices() == 1). An RPC backend has no
cpy_tensor_async (ggml-rpc.cpp:1077), so an activation going from one server to the next goes through the head,
which first waits for the sending server (ggml-backend.cpp:1801-1808): stages overlap only across the ubatches of
one llama_decode (a prompt longer than -ub), never within a decode step.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

LLAMA_CPP_PYTHON_VERSION = "0.3.36"           # whose vendored llama.cpp build_llama_rpc.sh builds
FLAVOURS = ("native-noamx", "native")         # build_llama_rpc.sh's keys, <version>-<flavour>
BIN_ENV = "GGML_DIST_LLAMA_RPC_BIN"
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")   # this llama.cpp's name, then the older one
BATCHED_BENCH = "llama-batched-bench"
SYSTEM_INFO_FILE = "system_info.txt"          # written by build_llama_rpc.sh: the build's CPU features


class RpcBuildError(RuntimeError):
    pass


class RpcStartError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------
# the build

@dataclass(frozen=True, slots=True)
class RpcBuild:
    bin_dir: Path
    rpc_server: Path
    batched_bench: Path
    system_info: str | None     # "system_info: n_threads = ... | CPU : SSE3 = 1 | ..."; None if not recorded


def _cache_root() -> Path:
    return Path(os.environ.get("GGML_DIST_CACHE") or Path.home() / ".cache" / "ggml_dist") / "llama-rpc"


def _build_in(bin_dir: Path) -> RpcBuild | None:
    servers = [bin_dir / n for n in RPC_SERVER_NAMES if os.access(bin_dir / n, os.X_OK)]
    bench = bin_dir / BATCHED_BENCH
    if not servers or not os.access(bench, os.X_OK):
        return None
    info_file = bin_dir / SYSTEM_INFO_FILE
    info = info_file.read_text().strip() if info_file.is_file() else None
    return RpcBuild(bin_dir=bin_dir, rpc_server=servers[0], batched_bench=bench, system_info=info or None)


def find_rpc_build() -> RpcBuild | None:
    """The bin dir named by GGML_DIST_LLAMA_RPC_BIN, else the first cached flavour of build_llama_rpc.sh that holds
    both binaries; None when there is none (benchmarks/build_llama_rpc.sh makes one)."""
    named = os.environ.get(BIN_ENV)
    if named:
        build = _build_in(Path(named))
        if build is None:
            raise RpcBuildError(f"{BIN_ENV}={named} holds no executable {' or '.join(RPC_SERVER_NAMES)} and "
                                f"{BATCHED_BENCH}; point it at the bin dir benchmarks/build_llama_rpc.sh prints, "
                                f"or unset it")
        return build
    for flavour in FLAVOURS:
        build = _build_in(_cache_root() / f"{LLAMA_CPP_PYTHON_VERSION}-{flavour}" / "bin")
        if build is not None:
            return build
    return None


# ------------------------------------------------------------------------------------------------
# command lines

def rpc_server_argv(build: RpcBuild, host_ip: str, port: int, threads: int, cache: bool = False) -> list[str]:
    """`ggml-rpc-server -H ip -p port -t threads [-c]`. It serves every local device (here the CPU) with the memory
    the device reports, so it takes no memory size. -c keeps large tensors in a local file cache
    ($LLAMA_CACHE/rpc, by default ~/.cache/llama.cpp/rpc) so a second load skips sending them; it changes load
    time only. The server serves one client at a time."""
    argv = [str(build.rpc_server), "-H", host_ip, "-p", str(port), "-t", str(threads)]
    return [*argv, "-c"] if cache else argv


def batched_bench_argv(build: RpcBuild, model: str | Path, rpc_endpoints: Sequence[str], npp: Sequence[int],
                       ntg: int, npl: Sequence[int], threads: int, ctx: int,
                       extra: Sequence[str] = ()) -> list[str]:
    """`llama-batched-bench` with every layer on the RPC servers (`--rpc a:p,b:p -ngl 99`), results as jsonl.

    Left at llama.cpp's defaults, and so comparable with ours only as far as these go:
      flash attention  auto (-fa): llama.cpp probes the devices and turns it on where supported, which the CPU
                       behind an RPC server is (stderr says "... enabled"); ours runs the unfused
                       KQ -> softmax -> KQV chain. Pass extra=["-fa", "off"] for like with like.
      batch            -b 2048, -ub 512: a prompt of up to 512 tokens per sequence set is one ubatch, so prompt
                       processing does not pipeline across servers (module docstring).
      KV cache         F16 K and V, one stream per sequence (no --kv-unified), prompt not shared (no -pps):
                       each of the B sequences prefills its own PP tokens.
      split            --split-mode layer, layers by free device memory (-ts to set).
      --fit off        so llama.cpp does not shrink what was asked to fit device memory.
    -lv 4 makes stderr say what llama.cpp resolved (parse_bench_log); without it batched-bench logs nothing.
    -t threads is the head's (it runs only the token-embedding lookup, which stays on the CPU); the servers'
    threads are rpc_server_argv's. batched-bench silently skips a (pp, tg, pl) whose KV need pl*(pp+tg) exceeds
    the context (pp + pl*tg with -pps in extra), so too small a ctx is refused here."""
    shared = "-pps" in extra                      # one prompt, shared by the sequences: pp + pl * tg cells
    need = max(npp) + max(npl) * ntg if shared else max(npl) * (max(npp) + ntg)
    if ctx < need:
        formula = "max(npp) + max(npl) * ntg" if shared else "max(npl) * (max(npp) + ntg)"
        raise ValueError(f"ctx {ctx} < {need} = {formula}: llama-batched-bench would skip the largest runs "
                         f"without saying so; pass ctx >= {need}")
    csv = ",".join
    return [str(build.batched_bench), "-m", str(model), "--rpc", csv(rpc_endpoints), "-ngl", "99",
            "-c", str(ctx), "-t", str(threads), "--fit", "off",
            "-npp", csv(map(str, npp)), "-ntg", str(ntg), "-npl", csv(map(str, npl)),
            "--output-format", "jsonl", "-lv", "4", *extra]


# ------------------------------------------------------------------------------------------------
# results

class BenchRow(TypedDict):
    pp: int             # prompt tokens per sequence
    tg: int             # generated tokens per sequence
    b: int              # sequences in parallel (batched-bench's -npl, its jsonl's "pl")
    n_kv: int           # KV cells the run needs: b * (pp + tg)
    t_pp_s: float       # prompt processing, all b prompts
    s_pp_tok_s: float   # b * pp / t_pp_s
    t_tg_s: float       # generation, tg steps of b tokens
    s_tg_tok_s: float   # b * tg / t_tg_s
    t_s: float          # t_pp_s + t_tg_s
    s_tok_s: float      # b * (pp + tg) / t_s


# the table's columns (PP, TG, B, N_KV, T_PP s, S_PP t/s, T_TG s, S_TG t/s, T s, S t/s) as the jsonl names them
_JSONL_KEYS = {"pp": "pp", "tg": "tg", "b": "pl", "n_kv": "n_kv", "t_pp_s": "t_pp", "s_pp_tok_s": "speed_pp",
               "t_tg_s": "t_tg", "s_tg_tok_s": "speed_tg", "t_s": "t", "s_tok_s": "speed"}


def parse_batched_bench(stdout: str) -> list[BenchRow]:
    """The rows of `llama-batched-bench --output-format jsonl`'s stdout, in its order (npp, then ntg, then npl).
    Other lines (the blank line it ends with) are ignored; a JSON line without the result keys is an error."""
    rows: list[BenchRow] = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        d = json.loads(line)
        missing = [k for k in _JSONL_KEYS.values() if k not in d]
        if missing:
            raise ValueError(f"batched-bench jsonl line lacks {missing}: {line!r}; is this "
                             f"llama-batched-bench --output-format jsonl of another llama.cpp version?")
        rows.append(BenchRow(pp=int(d["pp"]), tg=int(d["tg"]), b=int(d["pl"]), n_kv=int(d["n_kv"]),
                             t_pp_s=float(d["t_pp"]), s_pp_tok_s=float(d["speed_pp"]),
                             t_tg_s=float(d["t_tg"]), s_tg_tok_s=float(d["speed_tg"]),
                             t_s=float(d["t"]), s_tok_s=float(d["speed"])))
    return rows


class BenchLog(TypedDict):
    flash_attn: bool | None     # what -fa auto resolved to; None when -fa was given (nothing to resolve)
    pipeline_parallel: bool     # llama_context turned on the scheduler's pipeline parallelism
    n_copies: int | None        # the scheduler's copies of each split's inputs (4 when pipelining, else 1)
    n_splits: int | None        # graph splits of the reserved graph (one per device change)


def parse_bench_log(stderr: str) -> BenchLog:
    """What llama.cpp decided, from the stderr of batched_bench_argv's command (it passes -lv 4). A reserve that
    fails with pipelining is retried without it, so the last "sched copies" is the one that ran."""
    fa = re.search(r"resolve_fused_ops: Flash Attention (enabled|not supported)", stderr)
    copies = re.findall(r"sched copies = (\d+)", stderr)
    splits = re.findall(r"graph: nodes = \d+, splits = (\d+)", stderr)
    return BenchLog(flash_attn=None if fa is None else fa.group(1) == "enabled",
                    pipeline_parallel=("pipeline parallelism enabled" in stderr
                                       and "retrying without pipeline parallelism" not in stderr),
                    n_copies=int(copies[-1]) if copies else None, n_splits=int(splits[-1]) if splits else None)


# ------------------------------------------------------------------------------------------------
# start-up

def wait_rpc_ready(ip: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until the server at ip:port accepts a TCP connection (it serves one client at a time, so this probe,
    closed at once, only delays the next client by one failed handshake). With proc, a server that exits first
    is reported at once with its exit status."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RpcStartError(f"rpc server for {ip}:{port} exited with status {proc.returncode} before "
                                f"listening; its stderr says why (argv {proc.args!r})")
        try:
            socket.create_connection((ip, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise RpcStartError(f"rpc server at {ip}:{port} not accepting after {timeout:.0f} s ({e}); "
                                    f"is it bound to that address, and reachable from this namespace?") from e
        time.sleep(0.1)

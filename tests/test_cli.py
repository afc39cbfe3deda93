"""The ggml-dist command: run/tokenize/logits/plan/pull on real files, bench's routing, and clear errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ggml_dist.cli import main
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.synthetic_moe import SyntheticMoESpec, write_moe


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_synthetic(tmp_path_factory.mktemp("cli") / "m.gguf", SyntheticSpec(n_layer=2, seed=9)))


def _run(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


# run --json prints one object with the fields; tokens are the generated ids only
def test_run_json(capsys, model):
    rc, out, _ = _run(capsys, "run", "--model", model, "--prompt", "abc", "-n", "5", "--json", "--ctx", "256")
    assert rc == 0
    d = json.loads(out)
    assert set(d) >= {"prompt_tokens", "tokens", "text", "timings"}
    assert len(d["tokens"]) == 5 and d["prompt_tokens"][0] == 1
    assert set(d["timings"]) == {"prompt_tok_s", "decode_tok_s"}


# streaming run prints the text and the speeds
def test_run_stream(capsys, model):
    rc, out, err = _run(capsys, "run", "--model", model, "--prompt", "abc", "-n", "4", "--ctx", "256")
    assert rc == 0 and "tok/s" in err and out.strip()


# run --parallel: N continuations of the prompt, seed + i each; --json lists them
def test_run_parallel(capsys, model):
    rc, out, _ = _run(capsys, "run", "--model", model, "--prompt", "abc", "-n", "5", "--json", "--ctx", "256",
                      "--parallel", "3", "--temp", "1.0", "--seed", "4")
    assert rc == 0
    seqs = json.loads(out)["sequences"]
    assert len(seqs) == 3 and all(len(s["tokens"]) == 5 and s["stop_reason"] == "length" for s in seqs)
    rc, out, err = _run(capsys, "run", "--model", model, "--prompt", "abc", "-n", "4", "--ctx", "256",
                        "--parallel", "2")
    assert rc == 0 and out.count("--- sequence") == 2 and "over 2 sequences" in err


# logits of every position of the given ids, no BOS added
def test_logits_npz(capsys, model, tmp_path):
    f = tmp_path / "l.npz"
    rc, _, _ = _run(capsys, "logits", "--model", model, "--tokens", "1,5,9", "--out", str(f), "--ctx", "256")
    assert rc == 0
    lg = np.load(f)["logits"]
    assert lg.shape == (3, 512) and lg.dtype == np.float32


def test_tokenize_json(capsys, model):
    rc, out, _ = _run(capsys, "tokenize", "--model", model, "--text", "ab", "--json")
    assert rc == 0 and json.loads(out)["tokens"][0] == 1


# plan prints a table; a budget too small is a clear error naming the stage
def test_plan(capsys, model):
    rc, out, _ = _run(capsys, "plan", "--model", model, "--stages", "2", "--ctx", "256")
    assert rc == 0 and "layers" in out and out.count("\n") == 3      # header + 2 stages
    assert " 0:1 " in out and " 1:2 " in out                           # first:end, as the JSON's pairs
    two = ["plan", "--model", model, "--stages", "2", "--ctx", "256", "--json", "--layers"]
    rc, js, _ = _run(capsys, *two, "0:1,1:2")
    rc2, js2, _ = _run(capsys, *two, "0-0,1-1")                      # the older inclusive form, the same split
    assert rc == rc2 == 0 and js == js2 and [s["layers"] for s in json.loads(js)["stages"]] == [[0, 1], [1, 2]]
    rc, _, err = _run(capsys, "plan", "--model", model, "--stages", "2", "--ctx", "256", "--budget-gib", "0.0001")
    assert rc == 1 and "stage 0" in err and "budget" in err


@pytest.mark.parametrize("argv,msg", [
    (["run", "--model", "/nonexistent.gguf", "--prompt", "x"], "neither a file nor a known model"),
    (["logits", "--model", "MODEL", "--tokens", "1,x", "--out", "o.npz"], "comma-separated integers"),
    (["run", "--model", "MODEL"], "no prompt"),
    (["run", "--model", "MODEL", "--prompt", "x", "--layers", "0-9"], "layer ranges"),
    (["run", "--model", "MODEL", "--prompt", "x", "--parallel", "0"], "--parallel must be >= 1"),
    (["run", "--model", "MODEL", "--prompt", "x", "--lookahead", "0"], "lookahead must be >= 1"),
])
def test_errors(capsys, model, argv, msg):
    argv = [model if a == "MODEL" else a for a in argv]
    rc, _, err = _run(capsys, *argv, *(["--stages", "2"] if "--layers" in argv else []))
    assert rc == 1 and msg in err


# run --tensor-parallel 2: the model split over two ranks (threads) gives the tokens of one process; what
# cannot be split is refused with the reason (beside stages: tests/workers/test_tp_stages.py)
def test_run_tensor_parallel(capsys, tmp_path):
    spec = SyntheticSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=32, n_head_kv=4, n_ff=512, wtype="Q4_0",
                         embd_type="Q4_0", tied=False, seed=6)     # TinyLlama's heads; greedy tokens that vary
    argv = ["run", "--model", str(write_synthetic(tmp_path / "gqa.gguf", spec)), "--prompt", "abc", "-n", "8",
            "--json", "--ctx", "256"]
    rc1, out1, _ = _run(capsys, *argv)
    rc2, out2, _ = _run(capsys, *argv, "--tensor-parallel", "2")
    assert rc1 == rc2 == 0 and json.loads(out2)["tokens"] == json.loads(out1)["tokens"]
    assert len(set(json.loads(out1)["tokens"])) > 2
    rc, _, err = _run(capsys, *argv, "--tensor-parallel", "3")
    assert rc == 1 and "head_count 32 does not divide into 3 ranks" in err


# a mixture of experts over 2 ranks (experts split, the router on both): one process's greedy tokens
def test_run_expert_parallel(capsys, tmp_path):
    spec = SyntheticMoESpec(arch="qwen3moe", n_embd=128, n_head=8, n_head_kv=4, n_vocab=512, n_expert=8,
                            n_expert_used=2, exp_type="Q4_0", seed=50)
    argv = ["run", "--model", str(write_moe(tmp_path / "moe.gguf", spec)), "--prompt", "abc", "-n", "8", "--json",
            "--ctx", "256"]
    rc1, out1, _ = _run(capsys, *argv)
    rc2, out2, _ = _run(capsys, *argv, "--tensor-parallel", "2")
    assert rc1 == rc2 == 0 and json.loads(out2)["tokens"] == json.loads(out1)["tokens"]
    rc, _, err = _run(capsys, *argv, "--tensor-parallel", "16")
    assert rc == 1 and "8 experts cannot give each of 16 ranks one" in err


# a corrupt file is refused by the loader with its clear error, not a traceback
def test_bad_gguf(capsys, tmp_path):
    f = tmp_path / "bad.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 16)
    rc, _, err = _run(capsys, "run", "--model", str(f), "--prompt", "x")
    assert rc == 1 and "bad.gguf" in err


# the console script is installed and answers --help
def test_console_script():
    r = subprocess.run([sys.executable, "-m", "ggml_dist.cli", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "pull" in r.stdout


# serve's --replicas must leave each replica a slot, and does not combine with a pipeline: a clear error
def test_serve_replicas_checked(capsys, model):
    code, _, err = _run(capsys, "serve", "--model", str(model), "--parallel", "2", "--replicas", "3")
    assert code == 1 and "--replicas must be 1..--parallel (2), got 3" in err
    code, _, err = _run(capsys, "serve", "--model", str(model), "--stages", "2", "--replicas", "2")
    assert code == 1 and "does not combine with a pipeline" in err


# `ggml-dist bench NAME ARGS...` hands ARGS to ggml_dist/bench/NAME.py's main (the benchmarks' one home)
@pytest.mark.parametrize("name,module", [("alloc", "alloc"), ("decode", "decode"), ("pipeline", "pipeline"),
                                         ("faults", "faults"), ("fuzz-gguf", "fuzz_gguf")])
def test_bench_routes_to_the_package(monkeypatch, capsys, name, module):
    import importlib
    mod = importlib.import_module(f"ggml_dist.bench.{module}")
    seen: list[list[str]] = []
    monkeypatch.setattr(mod, "main", lambda argv: seen.append(list(argv)) or 0)
    rc, _, _ = _run(capsys, "bench", name, "--cases", "3", "--json")
    assert rc == 0 and seen == [["--cases", "3", "--json"]]


CLI = [sys.executable, "-m", "ggml_dist.cli"]
RAY_NOTICES = ("Token authentication is", "SIGTERM handler is not set", "*** SIGTERM received", "PC: @",
               "Connecting to existing Ray cluster", "Pushing file package")


# --version names the package and what it runs on; every subcommand's --help shows its defaults, pull's
# the known models
def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("ggml-dist 0.")
    with pytest.raises(SystemExit):
        main(["pull", "--help"])
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out
    for cmd, want in [("serve", "(default: 8080)"), ("run", "(default: 40)"), ("plan", "(default 2048)"), ("plan", "(default: f16)"),
                      ("warmup", "--threads"), ("logits", "n_batch (default 512)"), ("tokenize", "--no-special")]:
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert want in out, (cmd, out)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    helps = " ".join(capsys.readouterr().out.split())
    assert "--port PORT (default: 8080)" in helps
    assert "--parallel PARALLEL sequences decoded together (KV slots) (default: 4)" in helps


# one memory account (issue 43): for SmolLM2 over 2 stages, `plan`'s table is run's stderr table, and
# `plan --json`'s stages are `run --json`'s plan, to the byte, with the planned compute buffers and the stage
# process (not the 0.0 run showed before); no Ray notice in run's output without --verbose
def test_one_memory_account(smollm2_path):
    args = ["--model", smollm2_path, "--stages", "2", "--ctx", "512"]
    plan = subprocess.run([*CLI, "plan", *args], capture_output=True, text=True, timeout=300, check=True).stdout
    plan_js = json.loads(subprocess.run([*CLI, "plan", *args, "--json"], capture_output=True, text=True, timeout=300,
                                        check=True).stdout)["stages"]
    r = subprocess.run([*CLI, "run", *args, "--prompt", "Hi", "-n", "2", "--json"], capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert plan.strip() in r.stderr                                   # the same table, character for character
    assert json.loads(r.stdout)["plan"] == plan_js                    # the same numbers, byte for byte
    from ggml_dist.workers.placement import STAGE_OVERHEAD_BYTES
    assert all(s["compute_bytes"] > 0 and s["overhead_bytes"] == STAGE_OVERHEAD_BYTES for s in plan_js)
    assert [s["layers"] for s in plan_js] == [[0, 17], [17, 30]] and " 0:17 " in plan
    assert not [n for n in RAY_NOTICES if n in r.stderr], r.stderr[-3000:]


def _health(port: int) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return json.load(resp).get("status") == "ok"
    except OSError:
        return False


# serve --stages 2 starts and stops on SIGTERM without Ray's crash-looking report ("*** SIGTERM received ...
# PC: @ ... epoll_pwait") or its "SIGTERM handler is not set" warning; with --verbose Ray's notices show
def test_serve_stops_cleanly_and_quietly(model, tmp_path):
    import signal
    import socket
    import time
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    with open(log, "w") as f:
        p = subprocess.Popen([*CLI, "serve", "--model", model, "--stages", "2", "--port", str(port), "--ctx", "256",
                              "--parallel", "2"], stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not _health(port):
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=90) == 143, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert not [n for n in RAY_NOTICES if n in text], text[-3000:]
    r = subprocess.run([*CLI, "run", "--model", model, "--stages", "2", "--prompt", "abc", "-n", "2", "--ctx", "256",
                        "--verbose"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0 and "Token authentication is enabled" in r.stderr, r.stderr[-3000:]


# ggml-dist warmup compiles the model's kernels for the thread counts asked (one marker each), says how long
# it took, and finds them cached the next time
def test_warmup(capsys, model):
    rc, out, _ = _run(capsys, "warmup", "--model", model, "--threads", "1", "--json")
    d = json.loads(out)
    assert rc == 0 and [c["threads"] for c in d["classes"]] == [1] and d["total_s"] >= 0
    assert len(d["load_average"]) == 3 and d["cache_dir"]
    rc, out, _ = _run(capsys, "warmup", "--model", model, "--threads", "1")
    assert rc == 0 and "already cached" in out and "ready in" in out


# plan --tensor-parallel K: each rank's weights (its rows, its experts) and KV cache (its kv heads), or
# the reason K cannot split the model
def test_plan_tensor_parallel(capsys, tmp_path):
    spec = SyntheticMoESpec(arch="qwen3moe", n_embd=128, n_head=8, n_head_kv=4, n_vocab=512, n_expert=6,
                            n_expert_used=2, exp_type="Q4_0", seed=51)
    path = str(write_moe(tmp_path / "moe.gguf", spec))
    rc, out, _ = _run(capsys, "plan", "--model", path, "--tensor-parallel", "4", "--ctx", "256", "--json")
    ranks = json.loads(out)["ranks"]
    assert rc == 0 and [r["experts"] for r in ranks] == [[0, 1], [1, 3], [3, 4], [4, 6]]
    one = LlamaModel.load(path)
    assert len({r["kv_bytes"] for r in ranks}) == 1 and ranks[0]["kv_bytes"] * 4 == \
        2 * 256 * one.hp.n_layer * (one.hp.n_embd_k_gqa + one.hp.n_embd_v_gqa)
    assert ranks[1]["weights_bytes"] > ranks[0]["weights_bytes"]      # two experts against one
    rc, out, _ = _run(capsys, "plan", "--model", path, "--tensor-parallel", "2", "--ctx", "256")
    assert rc == 0 and "0..2" in out and "3..5" in out
    rc, _, err = _run(capsys, "plan", "--model", path, "--tensor-parallel", "3", "--ctx", "256")
    assert rc == 1 and "head_count 8 does not divide into 3 ranks" in err
    # beside 2 stages: each rank's pipeline, its stages' weights its rows of their layers
    rc, out, _ = _run(capsys, "plan", "--model", path, "--tensor-parallel", "4", "--stages", "2", "--ctx", "256", "--json")
    pipes = json.loads(out)["ranks"]
    sums = [sum(s["weight_bytes"] for s in p["stages"]) for p in pipes]   # the last stage: its rows of the tied head
    assert rc == 0 and [b - sums[0] for b in sums] == [r["weights_bytes"] - ranks[0]["weights_bytes"] for r in ranks]
    head = one.weights["token_embd.weight"].nbytes // 4
    assert sums[0] == ranks[0]["weights_bytes"] + head
    assert all(s["kv_bytes"] * 4 * 2 == ranks[0]["kv_bytes"] * 4 for p in pipes for s in p["stages"])

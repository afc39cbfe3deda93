"""The ggml-dist command: run/tokenize/logits/plan/pull on real files, bench's routing, and clear errors."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ggml_dist.cli import main
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic


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

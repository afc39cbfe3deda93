"""`--deterministic` on the command line: `logits` gives the same bits at --ubatch 512 and 1, those of the
default numerics at --ubatch 1; refused with --exact, and by `serve` with a shared KV stream
yet."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.cli import main

TOKENS = "74,85,37938,359,28,253"          # "Zebras are" and two more


def _logits(tmp_path, smollm2_path, *flags: str) -> np.ndarray:
    out = tmp_path / f"l{len(list(tmp_path.iterdir()))}.npz"
    assert main(["logits", "--model", smollm2_path, "--tokens", TOKENS, "--out", str(out), "--ctx", "256",
                 *flags]) == 0
    return np.load(out)["logits"].view(np.uint32)


def test_logits_deterministic_at_any_ubatch(tmp_path, smollm2_path):
    det = _logits(tmp_path, smollm2_path, "--deterministic")
    assert np.array_equal(det, _logits(tmp_path, smollm2_path, "--deterministic", "--ubatch", "1"))
    # llama.cpp's numerics for the tokens one at a time (one ubatch without the mode differs:
    # tests/model/test_batch_invariant.py)
    assert np.array_equal(det, _logits(tmp_path, smollm2_path, "--ubatch", "1"))


@pytest.mark.parametrize("argv,msg", [
    (["run", "--prompt", "Hi", "-n", "1", "--deterministic", "--exact"], "does not combine with exact"),
    (["serve", "--deterministic", "--kv-unified", "on"], "KV stream per slot"),
])
def test_deterministic_refusals(capsys, smollm2_path, argv, msg):
    assert main([argv[0], "--model", smollm2_path, *argv[1:]]) != 0
    assert msg in capsys.readouterr().err

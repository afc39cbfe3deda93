"""Gemma 3 270M Q4_K_M (`ggml-dist pull gemma3-270m`) against llama.cpp (tests/data/gemma3_refs.json and
gemma3_tf.npz, from tests/data/make_reference.py --only gemma3 with llama-cpp-python 0.3.36, AVX2):
the tokenizer, the teacher-forced logits of a prompt longer than the 512-token sliding window, and
free-running greedy continuations (one token at a time, as llama.cpp made them)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.ubatch import Batch

from .refs import GEMMA3_N_CTX, GEMMA3_PROMPTS, gemma3_long_prompt

DATA = Path(__file__).resolve().parents[1] / "data"
REFS = json.loads((DATA / "gemma3_refs.json").read_text())
TF = np.load(DATA / "gemma3_tf.npz")
TOL = 1e-4


@pytest.fixture(scope="module")
def gemma3() -> LlamaModel:
    from ggml_dist.model.pull import ModelNotFoundError, pull
    try:
        path = pull("gemma3-270m", progress=False)
    except ModelNotFoundError as e:
        pytest.skip(f"gemma3-270m is not in the cache and cannot be pulled: {e}")
    return LlamaModel.load(path)


def test_gemma3_hparams(gemma3):
    hp = gemma3.hp
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_embd_head_k) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert hp.n_swa == 512 and hp.rope_freq_base_swa == 10000.0 and hp.rope_freq_base == 1e6
    assert [il for il in range(18) if not hp.is_swa(il)] == [5, 11, 17]
    assert hp.f_attention_scale == 0.0625
    # the converter stored Gemma's (1 + w): the norm weights are used as they are (centred near 1, not 0)
    assert float(np.median(_f32(gemma3, "blk.0.post_ffw_norm.weight"))) > 0.5


def _f32(model: LlamaModel, name: str) -> np.ndarray:
    from ggml_dist.backends.base import tensor_get
    return np.asarray(tensor_get(model.weights[name]), np.float32).reshape(-1)


def test_gemma3_tokenizer(gemma3):
    for e in REFS["prompts"]:
        assert gemma3.tokenizer.encode(e["prompt"]) == e["prompt_tokens"], e["prompt"]
    assert gemma3.tokenizer.encode(gemma3_long_prompt()) == TF["tokens"].tolist()


# 792 positions in ubatches of 512 + 280: the sliding-window layers' mask drops the first positions
def test_gemma3_teacher_forced_long(gemma3):
    toks = TF["tokens"].tolist()
    assert len(toks) > 512
    ctx = LlamaContext(gemma3, ContextParams(n_ctx=GEMMA3_N_CTX))
    # llama-cpp-python's eval: batches of n_batch = 512 (each one ubatch), every position an output
    lg = np.concatenate([ctx.decode(Batch.from_tokens(toks[:512], all_outputs=True)),
                         ctx.decode(Batch.from_tokens(toks[512:], pos0=512, all_outputs=True))])
    ids = TF["ids"].astype(np.int64)
    ours = np.take_along_axis(lg, ids, 1)
    d = np.abs(ours - TF["vals"]).max(1)
    assert np.array_equal(lg.argmax(1), ids[:, 0])
    assert d.max() <= TOL, f"max |dlogit| {d.max()} first at position {int(np.argmax(d > TOL))}"


def test_gemma3_greedy(gemma3):
    ctx = LlamaContext(gemma3, ContextParams(n_ctx=GEMMA3_N_CTX))
    same, worst = 0, 0.0
    for e in REFS["prompts"]:
        ctx.clear()
        lg = ctx.decode(Batch.from_tokens(e["prompt_tokens"]))[-1]
        gen = []
        for i, step in enumerate(e["steps"]):
            tok = int(np.argmax(lg))
            gen.append(tok)
            if gen == e["tokens"][:i + 1]:
                worst = max(worst, float(np.abs(lg[step["ids"]] - np.array(step["vals"], np.float32)).max()))
            if len(gen) == len(e["steps"]):
                break
            lg = ctx.decode(Batch.from_tokens([tok], pos0=len(e["prompt_tokens"]) + i))[0]
        same += gen == e["tokens"]
    assert same >= 9, f"{same}/10 greedy continuations identical"
    assert worst <= TOL, f"max |dlogit| {worst} along the identical steps"
    assert len(REFS["prompts"]) == len(GEMMA3_PROMPTS)

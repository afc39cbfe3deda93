"""Log-likelihoods through /v1/completions (serve/scoring.py): echo + logprobs score every prompt token
from one evaluation, equal to one process's logits of the same tokens; lm-evaluation-harness's
local-completions model on two local tasks gives the numbers of the direct computation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "openai"):     # the serve extras
    pytest.importorskip(_mod)

import httpx  # noqa: E402
import openai  # noqa: E402

from ggml_dist.model.context import ContextParams, LlamaContext  # noqa: E402
from ggml_dist.model.model import LlamaModel  # noqa: E402
from ggml_dist.model.ubatch import Batch  # noqa: E402

LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "data" / "lm_eval"
TOL = 1e-5


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return LlamaModel.load(smollm2_path)


@pytest.fixture(scope="module")
def smol_server(smollm2_path):
    from ggml_dist.serve import ServerThread
    from tests.serve.common import engine_config
    with ServerThread(engine_config(smollm2_path, n_parallel=2, n_ctx=2048), model_name="smol") as srv:
        yield srv


def direct_logprobs(model: LlamaModel, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1, from one batch of every position's logits (float64
    log-softmax, as the server's)."""
    ctx = LlamaContext(model, ContextParams(n_ctx=1024))
    x = ctx.decode(Batch.from_tokens(ids, all_outputs=True)).astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    lsm = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))
    return np.array([lsm[i - 1, ids[i]] for i in range(1, len(ids))])


def complete(srv, **body) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": "smol", "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


# score only (max_tokens 0) a token-id prompt while another slot decodes: every prompt token's logprob
# equals the direct computation, the first one's is null, the echo is the prompt's text
def test_echo_scores_every_prompt_token(smol, smol_server):
    tok = smol.tokenizer
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = tok.encode(text, add_special=False)
    want = direct_logprobs(smol, ids)
    busy = threading.Thread(target=complete, args=(smol_server,), kwargs={"prompt": "Once upon a time",
                                                                         "max_tokens": 24})
    busy.start()
    r = complete(smol_server, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    busy.join()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"] == text and ch["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert np.max(np.abs(np.array(lp["token_logprobs"][1:]) - want)) <= TOL
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    for chosen, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) == 2 and max(top.values()) >= chosen


# a batch of token-id prompts with one generated token (lm-eval's request), and a string prompt through
# the openai client: prompt scores then the generated token; the string prompt's echo is the string
def test_echo_batch_and_generation(smol, smol_server):
    tok = smol.tokenizer
    a = tok.encode("Zebras are", add_special=False)
    b = tok.encode("The sky is blue because", add_special=False)
    r = complete(smol_server, prompt=[a, b], echo=True, logprobs=1, max_tokens=1)
    for ids, ch in zip((a, b), sorted(r["choices"], key=lambda c: c["index"])):
        lp = ch["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        assert np.max(np.abs(np.array(lp["token_logprobs"][1:-1]) - direct_logprobs(smol, ids))) <= TOL
        assert ch["text"].startswith(tok.decode(ids, special=True))
        assert lp["text_offset"][-1] == len(tok.decode(ids, special=True))
    c = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = c.completions.create(model="smol", prompt="Zebras are", echo=True, logprobs=0, max_tokens=2, temperature=0)
    assert out.choices[0].text.startswith("Zebras are") and out.choices[0].logprobs.token_logprobs[0] is None
    assert len(out.choices[0].logprobs.tokens) == len(a) + 2
    # echo without logprobs takes the prompt cache and scores nothing; max_tokens 0 needs echo
    plain = complete(smol_server, prompt=b, echo=True, max_tokens=2)
    assert plain["choices"][0]["text"].startswith(tok.decode(b, special=True))
    assert plain["choices"][0]["logprobs"] is None
    r = httpx.post(smol_server.url + "/v1/completions", json={"prompt": b, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


# streamed: the echo chunk carries the prompt's scores, then each generated token's
def test_echo_streamed(smol, smol_server):
    ids = smol.tokenizer.encode("Water boils at", add_special=False)
    with httpx.stream("POST", smol_server.url + "/v1/completions", timeout=120,
                      json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                            "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    first = events[0]["choices"][0]
    assert first["text"] == smol.tokenizer.decode(ids, special=True)
    assert first["logprobs"]["token_logprobs"][0] is None
    assert np.max(np.abs(np.array(first["logprobs"]["token_logprobs"][1:]) - direct_logprobs(smol, ids))) <= TOL
    gen = [e["choices"][0] for e in events[1:] if e["choices"] and e["choices"][0]["logprobs"]]
    assert sum(len(g["logprobs"]["tokens"]) for g in gen) == 3


# lm-eval's remote tokenizer: /tokenizer_info and vLLM's /tokenize and /detokenize spellings
def test_tokenizer_endpoints_for_lm_eval(smol, smol_server):
    info = httpx.get(smol_server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    r = httpx.post(smol_server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert r["tokens"] == smol.tokenizer.encode("Hello world", add_special=False) and r["count"] == len(r["tokens"])
    assert httpx.post(smol_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"


def _encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM._encode_pair with its remote tokenizer (no special tokens added)."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special=False)
    ctx = tok.encode(context, add_special=False)
    return ctx, whole[len(ctx):]


def lm_eval_command(url: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "lm_eval", "--model", "local-completions",
            "--model_args", f"base_url={url}/v1/completions,model=smol,num_concurrent=1,max_retries=1",
            "--tasks", "tiny_capitals,tiny_perplexity", "--include_path", ".",
            "--output_path", str(out), "--log_samples"]


# lm-eval 0.4's local-completions (token-id prompts, its default; its tokenizer from the server) on a
# multiple-choice and a perplexity task: every loglikelihood and loglikelihood_rolling equals the direct
# computation from the model's logits
def test_lm_eval_local_completions(smol, smol_server, tmp_path):
    if not _importable("lm_eval"):
        pytest.skip("lm-eval is not installed (pip install lm-eval: the dev extra)")
    import lm_eval.utils
    if not hasattr(lm_eval.utils, "RemoteTokenizer"):
        pytest.skip("this lm-eval has no remote tokenizer (it would need the model's tokenizer from the hub)")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(lm_eval_command(smol_server.url, tmp_path), check=False, cwd=LM_EVAL_TASKS, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "remote tokenizer" in run.stderr, "lm-eval did not take the server's tokenizer"
    tok = smol.tokenizer
    prefix = tok.bos_id                     # the remote tokenizer's prefix token: bos, else eos
    samples = {p.name.split("_")[1] + "_" + p.name.split("_")[2]: [json.loads(line) for line in p.open()]
               for p in tmp_path.rglob("samples_*.jsonl")}
    mc = samples["tiny_capitals"]
    assert len(mc) == 6
    n_checked = 0
    for doc in mc:
        for k, args in enumerate(doc["arguments"].values()):
            ctx, cont = _encode_pair(tok, args["arg_0"], args["arg_1"])
            want = direct_logprobs(smol, ctx + cont)[len(ctx) - 1:].sum()
            got = float(doc["resps"][k][0][0])
            assert abs(got - want) <= TOL, (args, got, want)
            n_checked += 1
    assert n_checked == 18
    rolling = samples["tiny_perplexity"]
    assert len(rolling) == 4
    for doc in rolling:
        ids = [prefix, *tok.encode(doc["doc"]["text"], add_special=False)]
        want = direct_logprobs(smol, ids).sum()
        assert abs(float(doc["resps"][0][0]) - want) <= TOL, (doc["doc"], doc["resps"], want)


def _importable(name: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(name) is not None

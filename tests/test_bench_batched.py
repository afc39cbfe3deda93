"""bench batched: N sequences decoded together, ours next to llama.cpp on the same batches. A short real
run on a small synthetic mixture of experts (its tokens route to different experts in every layer): the
JSON's figures, and where llama-cpp-python is installed, the same greedy tokens for every sequence."""
from __future__ import annotations

import importlib.util
import json

import pytest

from ggml_dist.bench import batched
from ggml_dist.model.synthetic_moe import SyntheticMoESpec, write_moe

HAS_LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    spec = SyntheticMoESpec(arch="qwen3moe", n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_expert=16,
                            n_expert_used=4, n_ff_exp=64, exp_type="Q8_0", seed=2101)
    return write_moe(tmp_path_factory.mktemp("batched") / "moe.gguf", spec)


def test_batched_decode_next_to_llamacpp(moe_file, capsys):
    assert batched.main(["--model", str(moe_file), "--sequences", "3", "--prompt-len", "6", "--gen", "10",
                         "--rounds", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert (res["sequences"], res["prompt_len"], res["gen"], res["rounds"]) == (3, 6, 10, 2)
    assert res["ours"]["decode_tok_s"] > 0 and res["ours"]["prompt_tok_s"] > 0
    assert res["ours"]["decode_tok_s"] == pytest.approx(3 * res["ours"]["decode_steps_s"])
    if HAS_LLAMACPP:
        assert res["tokens_match"] is True, res.get("first_mismatch")
        assert res["decode_ratio"] > 0 and len(res["decode_chunk_ratio_quartiles"]) == 3
    else:
        assert "llama-cpp-python" in res["llamacpp"]["error"]


def test_the_prompts_differ_per_sequence_and_end_with_an_output():
    prompts = batched._prompts(1000, 3, 5)
    assert len({tuple(p) for p in prompts}) == 3
    toks, pos, seqs, outs = batched._prompt_batch(prompts)
    assert pos == [0, 1, 2, 3, 4] * 3 and seqs == [0] * 5 + [1] * 5 + [2] * 5
    assert [i for i, o in enumerate(outs) if o] == [4, 9, 14]


def test_a_mismatch_names_round_step_and_sequence():
    ours = [[[1, 2], [3, 4]], [[1, 2], [3, 5]]]
    ll = [[[1, 2], [3, 4]], [[1, 2], [3, 6]]]
    assert batched._token_check(ours, ours) == {"tokens_match": True}
    got = batched._token_check(ours, ll)
    assert got["first_mismatch"] == {"round": 1, "step": 1, "sequence": 1, "ours": 5, "llamacpp": 6}


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        batched.main(["--sequences", "0"])

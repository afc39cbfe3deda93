"""Synthetic Qwen3.5 files (ggml_dist/model/synthetic_hybrid.py: qwen35 and qwen35moe, 3 Gated DeltaNet
layers and 1 gated attention layer) against llama.cpp's logits on them (tests/data/qwen35_refs.npz, made
by `python tests/data/make_qwen35_reference.py` with the AVX2 build of llama-cpp-python 0.3.36).

Every logit is llama.cpp's bit for bit: the whole prompt as one ubatch, one token at a time (the
recurrent state carried from step to step), and a prompt then one token at a time; so are the experts
each layer of the mixture chose. Then what a recurrent state cannot do is refused by name: cutting a
sequence back to a prefix, a ubatch that does not continue its sequence. Needs no llama_cpp: the files are
rebuilt from their specs and checked to be the bytes llama.cpp ran.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ggml_dist.core.types import GGMLType
from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.recurrent_state import StateTrimError
from ggml_dist.model.synthetic import write_synthetic
from ggml_dist.model.synthetic_hybrid import QWEN35_SPECS, SyntheticHybridSpec
from ggml_dist.model.ubatch import Batch, BatchError

REFS = np.load(Path(__file__).resolve().parents[1] / "data" / "qwen35_refs.npz")
TOKENS = REFS["meta/tokens"].tolist()
SPLIT = int(REFS["meta/split"])
N_CTX = 256                     # make_reference._moe_context's context (MOE_N_CTX)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("qwen35")
    return {s.name: write_synthetic(d / f"{s.name}.gguf", s) for s in QWEN35_SPECS}


def _ctx(path: Path, numba: bool = True) -> LlamaContext:
    return LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=N_CTX, type_k=GGMLType.F16,
                                                             type_v=GGMLType.F16, numba=numba))


def _assert_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {got.shape}, llama.cpp {want.shape}"
    bad = np.argwhere(got != want)
    assert not len(bad), (f"{what}: {len(bad)} logits differ from llama.cpp's, first at (token, id) "
                          f"{bad[0].tolist()}, max|d| = {np.abs(got - want).max():.3g}")


@pytest.mark.parametrize("spec", QWEN35_SPECS, ids=lambda s: s.arch)
def test_the_files_are_the_ones_llama_cpp_ran(spec, files):
    assert np.array_equal(np.frombuffer(hashlib.sha256(files[spec.name].read_bytes()).digest(), np.uint8),
                          REFS[f"{spec.name}/sha256"]), "the writer changed: regenerate qwen35_refs.npz"
    for mode in ("batch", "single", "mixed"):
        assert REFS[f"{spec.name}/{mode}"].shape == (len(TOKENS), spec.n_vocab)


@pytest.mark.parametrize("numba", [True, False], ids=["compiled", "numpy"])
@pytest.mark.parametrize("spec", QWEN35_SPECS, ids=lambda s: s.arch)
def test_logits_equal_llama_cpp_bit_for_bit(spec, numba, files):
    ctx = _ctx(files[spec.name], numba)
    _assert_equal(ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True)), REFS[f"{spec.name}/batch"], "batch")
    ctx.clear()
    single = np.concatenate([ctx.decode(Batch.from_tokens([t], pos0=i)) for i, t in enumerate(TOKENS)])
    _assert_equal(single, REFS[f"{spec.name}/single"], "one token at a time")
    ctx.clear()
    mixed = [ctx.decode(Batch.from_tokens(TOKENS[:SPLIT], all_outputs=True))]
    mixed += [ctx.decode(Batch.from_tokens([t], pos0=SPLIT + i)) for i, t in enumerate(TOKENS[SPLIT:])]
    _assert_equal(np.concatenate(mixed), REFS[f"{spec.name}/mixed"], "a prompt, then one token at a time")


class _TopK:
    """The scheduler's eval callback: the nodes ffn_moe_topk-{il}, copied out once computed."""

    def __init__(self, n_layer: int) -> None:
        self.names = {f"ffn_moe_topk-{il}": il for il in range(n_layer)}
        self.rows: list[list[np.ndarray]] = [[] for _ in range(n_layer)]

    def __call__(self, t, ask: bool) -> bool:
        if ask:
            return t.name in self.names
        from ggml_dist.backends.base import tensor_get
        a = tensor_get(t)
        self.rows[self.names[t.name]].append(a.reshape(-1, a.shape[-1]))
        return True

    def take(self) -> np.ndarray:
        out = np.stack([np.concatenate(r) for r in self.rows])
        self.rows = [[] for _ in self.rows]
        return out


def test_moe_experts_equal_llama_cpps_and_differ_by_token(files):
    spec = next(s for s in QWEN35_SPECS if s.n_expert)
    ctx = _ctx(files[spec.name])
    taps = _TopK(spec.n_layer)
    ctx.sched.set_eval_callback(taps)
    ctx.decode(Batch.from_tokens(TOKENS, all_outputs=True))
    got = taps.take()
    assert np.array_equal(got, REFS[f"{spec.name}/experts"])
    assert all(len({tuple(sorted(t)) for t in layer}) > len(TOKENS) // 2 for layer in got), \
        "the synthetic router sends most tokens to the same experts: the test would not see routing"
    ctx.clear()
    for i, t in enumerate(TOKENS):
        ctx.decode(Batch.from_tokens([t], pos0=i))
    assert np.array_equal(taps.take(), REFS[f"{spec.name}/experts_single"])


# -- what a recurrent state cannot do ------------------------------------------------------------------
def test_a_sequence_cannot_be_cut_back_to_a_prefix(files):
    ctx = _ctx(files[QWEN35_SPECS[0].name])
    first = ctx.decode(Batch.from_tokens(TOKENS[:6], all_outputs=True))
    with pytest.raises(StateTrimError, match="cannot be cut back to a prefix"):
        ctx.seq_rm(0, 3)                                    # the KV cells are left as they were
    assert ctx.seq_pos_max(0) == 5
    with pytest.raises(BatchError, match="positions must stay consecutive"):
        ctx.decode(Batch.from_tokens([TOKENS[3]], pos0=3))  # a rollback by re-decoding a position
    ctx.seq_rm(0, 6)                                        # nothing of the state is past position 5
    ctx.seq_rm(0)                                           # the whole sequence: the state is zeroed
    again = ctx.decode(Batch.from_tokens(TOKENS[:6], all_outputs=True))
    assert np.array_equal(first, again)


def test_a_whole_state_is_copied_and_continues_as_the_original(files):
    ctx = LlamaContext(LlamaModel.load(files[QWEN35_SPECS[0].name]),
                       ContextParams(n_ctx=N_CTX, n_seq_max=2, type_k=GGMLType.F16, type_v=GGMLType.F16))
    ctx.decode(Batch.from_tokens(TOKENS[:SPLIT], all_outputs=True))
    ctx.seq_cp(0, 1)
    with pytest.raises(StateTrimError, match="whole recurrent state"):
        ctx.seq_cp(0, 1, 0, 3)
    nxt = TOKENS[SPLIT]
    b = [ctx.decode(Batch(np.array([nxt], np.int32), np.array([SPLIT], np.int32), [frozenset({s})],
                          np.array([True])))[0] for s in (1, 0)]
    assert np.array_equal(b[0], b[1]) and np.array_equal(b[0], REFS[f"{QWEN35_SPECS[0].name}/mixed"][SPLIT])


def test_sequences_in_a_ubatch(files):
    """Every token an output: a ubatch per sequence (split_seq, as llama_memory_hybrid), llama.cpp's bits.
    Otherwise equal groups of several sequences in one ubatch (split_equal), a state row each, with the
    bits of each sequence alone (batch-invariant numerics); a token of two sequences is refused."""
    from ggml_dist.model.ubatch import Ubatch
    path = files[QWEN35_SPECS[0].name]
    ctx = LlamaContext(LlamaModel.load(path),
                       ContextParams(n_ctx=N_CTX, n_seq_max=2, type_k=GGMLType.F16, type_v=GGMLType.F16))
    two = Batch(np.array([TOKENS[0], TOKENS[0]], np.int32), np.array([0, 0], np.int32),
                [frozenset({0}), frozenset({1})], np.array([True, True]))
    got = ctx.decode(two)
    assert np.array_equal(got[0], got[1]) and np.array_equal(got[0], REFS[f"{QWEN35_SPECS[0].name}/batch"][0])
    assert ctx.gf_res_prev.key.n_seqs == 1

    params = ContextParams(n_ctx=N_CTX, n_seq_max=2, batch_invariant=True)
    a, b = TOKENS[:5], TOKENS[5:10]
    alone = []
    for toks in (a, b):
        one = LlamaContext(LlamaModel.load(path), params)
        alone.append(one.decode(Batch.from_tokens(toks))[0])
        alone.append(one.decode(Batch.from_tokens([TOKENS[11]], pos0=len(toks)))[0])
    ctx = LlamaContext(LlamaModel.load(path), params)
    both = Batch(np.array(a + b, np.int32), np.array([*range(5), *range(5)], np.int32),
                 [frozenset({0})] * 5 + [frozenset({1})] * 5, np.array([False] * 4 + [True] + [False] * 4 + [True]))
    first = ctx.decode(both)
    assert ctx.gf_res_prev.key.n_seqs == 2
    step = Batch(np.array([TOKENS[11]] * 2, np.int32), np.array([5, 5], np.int32),
                 [frozenset({1}), frozenset({0})], np.array([False, True]))       # one output: split_equal
    second = ctx.decode(step)
    assert ctx.gf_res_prev.key.n_seqs == 2
    assert np.array_equal(first[0], alone[0]) and np.array_equal(first[1], alone[2])
    assert np.array_equal(second[0], alone[1])
    assert ctx.rs is not None
    with pytest.raises(ValueError, match="one sequence each"):
        ctx.rs.begin(Ubatch(np.ones(2, np.int32), np.array([6, 6], np.int32), [frozenset({0, 1})] * 2,
                            np.ones(2, bool), [0, 1], True, 1))


def test_the_spec_is_checked():
    with pytest.raises(ValueError, match="qwen35moe"):
        write_synthetic(Path("/nonexistent/x.gguf"), SyntheticHybridSpec(arch="qwen35moe"))


def test_a_ubatch_that_does_not_continue_the_state_is_refused(files):
    # the batch checks keep positions consecutive with the KV cells; the state checks them itself too
    from ggml_dist.model.ubatch import Ubatch
    ctx = _ctx(files[QWEN35_SPECS[0].name])
    ctx.decode(Batch.from_tokens(TOKENS[:6]))
    assert ctx.rs is not None

    def ub(pos: list[int]) -> Ubatch:
        n = len(pos)
        return Ubatch(np.ones(n, np.int32), np.array(pos, np.int32), [frozenset({0})] * n, np.ones(n, bool),
                      list(range(n)))

    with pytest.raises(StateTrimError, match="cannot continue it"):
        ctx.rs.begin(ub([9]))
    with pytest.raises(StateTrimError, match="follow one another"):
        ctx.rs.begin(ub([6, 8]))
    # sequence 0's state is in its second row (the prompt's ubatch wrote it there), the next goes to its first
    assert [r.tolist() for r in ctx.rs.begin(ub([6, 7]))] == [[1], [0]] and ctx.rs.pos[0] == 7


@pytest.mark.parametrize("spec", QWEN35_SPECS, ids=lambda s: s.arch)
def test_greedy_generation_equals_llama_cpps(spec, files):
    """generate() (what `ggml-dist run` calls) after a prompt of SPLIT tokens: llama.cpp's argmax tokens."""
    from ggml_dist.model.generate import generate
    ctx = _ctx(files[spec.name])
    want = REFS[f"{spec.name}/greedy"].tolist()
    res = generate(ctx, ctx.model.tokenizer, TOKENS[:SPLIT], len(want), stop_at_eog=False)
    assert res.tokens == want


def test_ggml_dist_run_generates_greedily_from_a_qwen35_file(files, capsys):
    import json

    from ggml_dist.cli import main
    from ggml_dist.model.generate import generate
    spec = next(s for s in QWEN35_SPECS if s.n_expert)
    path = str(files[spec.name])
    assert main(["run", "--model", path, "--prompt", "a b c", "-n", "8", "--json", "--ctx", "256"]) == 0
    out = json.loads(capsys.readouterr().out)
    ctx = _ctx(files[spec.name])
    want = generate(ctx, ctx.model.tokenizer, out["prompt_tokens"], 8)
    assert out["tokens"] == want.tokens and len(out["tokens"]) == 8

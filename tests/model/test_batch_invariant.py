"""ContextParams(batch_invariant=True): a token's logits do not depend on how its sequence is batched.

In the mode, every position's logits are those of the whole sequence decoded as one ubatch, whatever
the composition of the steps that carried it: chunked or a token at a time, alone or beside 1-7 other
sequences (each in its KV stream, prefilling or decoding), any n_ubatch, after a prompt cache hit (the
cached prefix kept, the rest evaluated later); and those are llama.cpp's logits for the tokens decoded
one at a time. Without the mode the tests pin down ggml's exception: a token's logits change with
whether other tokens of its own sequence share the ubatch (the attention's products, tinyBLAS from 2
rows) and, for F16/F32/BF16 and K-quant weights, with the ubatch's row count; a decode step's row beside other
sequences (one token per stream) on SmolLM2's weights does not. (In a unified KV cache a sequence's
attention follows the cells it was given, which the other sequences decide, in both modes:
tests/backends/cpu/test_batch_invariant.py shows it on the kernel.)"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch

from .refs import SYNTHETIC_SPECS, tokens_of
from .test_llama_refs import _check, _ctx, synthetic_models  # noqa: F401  (a fixture)

N_SLOTS = 8
# every weight type the kernels have (the layers' and the untied head's), shapes that K-quants take
WTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"]


def _spec(wtype: str) -> SyntheticSpec:
    return SyntheticSpec(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, wtype=wtype, embd_type="Q8_0",
                         tied=False, seed=21)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, LlamaModel]:
    d = tmp_path_factory.mktemp("bi")
    return {w: LlamaModel.load(write_synthetic(d / f"{w}.gguf", _spec(w))) for w in WTYPES}


def _streams(model: LlamaModel, batch_invariant: bool = True, n_ubatch: int = 512,
             unified: bool = False) -> LlamaContext:
    return LlamaContext(model, ContextParams(n_ctx=N_SLOTS * 256, n_seq_max=N_SLOTS, n_ubatch=n_ubatch,
                                             kv_unified=unified, batch_invariant=batch_invariant))


def _alone(model: LlamaModel, tokens: list[int], batch_invariant: bool = True) -> np.ndarray:
    """Every position's logits, the sequence decoded as one ubatch in stream 0."""
    return _streams(model, batch_invariant).decode(Batch.from_tokens(tokens, all_outputs=True))


def _run(ctx: LlamaContext, steps: list[list[tuple[int, list[int]]]], n_past: dict[int, int],
         watch: int) -> np.ndarray:
    """Decode steps of (sequence, its next tokens) chunks, every token an output, the batch in slot
    order as the server lists it; returns sequence `watch`'s rows in position order."""
    rows = []
    for step in steps:
        tok, pos, seq, which = [], [], [], []
        for s, chunk in sorted(step, key=lambda c: c[0]):
            tok += chunk
            pos += range(n_past.get(s, 0), n_past.get(s, 0) + len(chunk))
            seq += [frozenset({s})] * len(chunk)
            which += [s] * len(chunk)
            n_past[s] = n_past.get(s, 0) + len(chunk)
        out = ctx.decode(Batch(np.array(tok, np.int32), np.array(pos, np.int32), seq, np.ones(len(tok), bool)))
        rows += [r for r, s in zip(out, which) if s == watch]
    return np.stack(rows)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@st.composite
def compositions(draw):
    """A sequence's tokens and the steps that carry them: chunks of random sizes, beside up to 7 other
    sequences (in any slots) whose own chunks share the steps, then optionally a cache hit: the
    sequence's cells past `keep` dropped and its tail evaluated again in later steps."""
    n_other = draw(st.integers(0, N_SLOTS - 1))
    slots = draw(st.permutations(range(N_SLOTS)))[:n_other + 1]
    me, others = slots[0], slots[1:]
    tokens = draw(st.lists(st.integers(3, 511), min_size=2, max_size=16))
    other_tokens = {s: draw(st.lists(st.integers(3, 511), min_size=1, max_size=8)) for s in others}

    def schedule(left: dict[int, list[int]]) -> list[list[tuple[int, list[int]]]]:
        steps = []
        while any(left.values()):
            step = []
            for s, toks in left.items():
                longest = not step and s == max(left, key=lambda q: len(left[q]))
                if toks and (longest or draw(st.integers(0, 3)) < 3):
                    # (a sequence may sit a step out; the longest one left never sits out alone)
                    n = draw(st.sampled_from([len(toks), 1, 1, draw(st.integers(1, len(toks)))]))
                    step.append((s, toks[:n]))
                    left[s] = toks[n:]
            if step:
                steps.append(step)
        return steps

    first = schedule({me: list(tokens), **{s: list(t) for s, t in other_tokens.items()}})
    keep = draw(st.none() | st.integers(0, len(tokens) - 1))
    again = [] if keep is None else schedule({me: tokens[keep:], **{s: [5] for s in others if draw(st.booleans())}})
    return me, tokens, first, keep, again, draw(st.sampled_from([1, 3, 512]))


# any composition of the steps, per weight type: the watched sequence's logits are its logits alone, to
# the bit, after a cache hit too
@pytest.mark.parametrize("wtype", WTYPES)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=compositions())
def test_a_sequence_s_logits_do_not_depend_on_the_batch(models, wtype, case):
    me, tokens, first, keep, again, n_ubatch = case
    model = models[wtype]
    want = _alone(model, tokens)
    ctx = _streams(model, n_ubatch=n_ubatch)
    n_past: dict[int, int] = {}
    assert _same_bits(_run(ctx, first, n_past, me), want)
    if keep is not None:                                   # cache_prompt: the prefix stays, the tail again
        ctx.seq_rm(me, keep, -1)
        n_past[me] = keep
        assert _same_bits(_run(ctx, again, n_past, me), want[keep:])


# the mode's logits are llama.cpp's for the tokens decoded one at a time (n_ubatch 1), from one batch,
# for every synthetic reference model (weight types, qwen2/qwen3, llama3 rope over 320 positions)
@pytest.mark.parametrize("spec", SYNTHETIC_SPECS, ids=lambda s: s.name)
def test_the_mode_gives_llamacpp_s_one_token_logits(spec, synthetic_models):  # noqa: F811
    ctx = _ctx(synthetic_models[spec.name], spec, batch_invariant=True)
    _check(spec, "single", ctx.decode(Batch.from_tokens(tokens_of(spec), all_outputs=True)))


# -- SmolLM2 (Q4_1 layers, a Q8_0 tied head): what the server's scheduling does to a request -------
PROMPT = "Zebras are"                        # issue 44: -1.568735 fresh, -1.538422 cached
OTHERS = ["Once upon a time", "def fibonacci(n):", "Water boils at", "List of planets: Mercury, Venus,",
          "import numpy as np", "The three primary colors are", "In machine learning, overfitting"]
N_GEN = 5


@pytest.fixture(scope="module")
def smol(smollm2_path):
    model = LlamaModel.load(smollm2_path)
    enc = model.tokenizer.encode
    return model, enc(PROMPT, add_special=True, parse_special=True), \
        [enc(p, add_special=True, parse_special=True) for p in OTHERS]


def _smol_scenarios(model, prompt, others, batch_invariant):
    """The request's tokens (prompt + its greedy continuation, teacher-forced) under the server's
    scheduling events; returns {scenario: rows of the request's positions}."""
    ctxs = {n: _streams(model, batch_invariant, n_ubatch=n) for n in (512, 1)}

    def fresh(n_ubatch: int = 512) -> LlamaContext:
        ctxs[n_ubatch].clear()
        return ctxs[n_ubatch]
    ctx = fresh()
    toks = list(prompt)
    lg = ctx.decode(Batch.from_tokens(toks))[-1]
    for _ in range(N_GEN):                                  # the greedy continuation, alone
        toks.append(int(lg.argmax()))
        lg = ctx.decode(Batch.from_tokens(toks[-1:], pos0=len(toks) - 1))[-1]
    L, out = len(prompt), {}
    out["one ubatch"] = fresh().decode(Batch.from_tokens(toks, all_outputs=True))
    out["ubatch 1"] = fresh(1).decode(Batch.from_tokens(toks, all_outputs=True))
    # prompt in one chunk alone, then decoded beside k others that trickle their prompts in and decode
    for k in (0, 1, 3, 7):
        steps = [[(0, toks[:L])]] + [[(0, [t])] + [(s + 1, others[s][i:i + 1]) for s in range(k)
                                                   if i < len(others[s])] for i, t in enumerate(toks[L:])]
        out[f"decode among {k}"] = _run(fresh(), steps, {}, 0)
    # the request's prompt trickles in a token a step beside 7 decoding sequences (a busy server)
    steps = [[(s + 1, others[s]) for s in range(7)]]
    steps += [[(0, [t])] + [(s + 1, [9]) for s in range(7)] for t in toks]
    out["trickled among 7"] = _run(fresh(), steps, {}, 0)
    # a prompt cache hit: the prompt and its answer are cached, the same prompt comes again and only its
    # last token is evaluated (n_keep = L - 1), then its continuation a token a step
    ctx = fresh()
    ctx.decode(Batch.from_tokens(toks))
    ctx.seq_rm(0, L - 1, -1)
    out["cache hit"] = np.concatenate([np.zeros((L - 1, out["one ubatch"].shape[1]), np.float32),
                                       _run(ctx, [[(0, [t])] for t in toks[L - 1:]], {0: L - 1}, 0)])
    return out


# in the mode the request's every row is the same under every scheduling event
def test_smollm2_a_request_s_logits_under_every_scheduling_event(smol):
    model, prompt, others = smol
    rows = _smol_scenarios(model, prompt, others, True)
    want, L = rows["one ubatch"], len(prompt)
    for name, got in rows.items():
        sl = slice(L - 1, None) if name == "cache hit" else slice(None)
        assert _same_bits(got[sl], want[sl]), f"{name}: {np.abs(got[sl] - want[sl]).max()}"


# without the mode (llama.cpp's numerics) exactly this differs: a row computed with others of its own
# sequence in the ubatch (a prompt chunk) against the same row alone; a decode step's row beside other
# sequences is the row alone, and so is a prompt trickled a token a step beside them
def test_smollm2_default_mode_differs_only_where_a_sequence_has_several_rows(smol):
    model, prompt, others = smol
    rows = _smol_scenarios(model, prompt, others, False)
    L = len(prompt)
    chunked, single = rows["one ubatch"], rows["ubatch 1"]
    assert _same_bits(chunked[:2], single[:2])               # 1-2 cells: the sums associate alike
    assert not _same_bits(chunked[2:], single[2:])           # tinyBLAS over the chunk's rows
    for k in (1, 3, 7):                                     # prompt as one chunk, then one row a step
        assert _same_bits(rows[f"decode among {k}"], rows["decode among 0"])
    assert _same_bits(rows["decode among 0"][:L], chunked[:L])
    assert _same_bits(rows["trickled among 7"], single)     # one row a step: the rows alone
    assert not _same_bits(rows["cache hit"][L - 1], chunked[L - 1])   # the last prompt token alone

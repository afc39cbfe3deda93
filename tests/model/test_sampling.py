"""Sampling: greedy, seeded reproducibility, top-k/top-p/min-p truncation, penalties, bad params."""
import numpy as np
import pytest

from ggml_dist.model import sampling
from ggml_dist.model.sampling import Sampler, SamplingParams


LOGITS = np.array([1.0, 3.0, 2.0, 3.0, -1.0], np.float32)


# temperature 0 is argmax, first index on ties
def test_greedy():
    assert Sampler(SamplingParams(temperature=0)).sample(LOGITS) == 1


# the same seed gives the same draws
def test_seeded():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    a = [Sampler(p).sample(LOGITS) for _ in range(3)]
    s = Sampler(p)
    b = [s.sample(LOGITS) for _ in range(50)]
    assert len(set(a)) == 1 and len(set(b)) > 1
    again = Sampler(p)                                  # the whole sequence repeats with the seed
    assert [again.sample(LOGITS) for _ in range(50)] == b
    greedy = Sampler(SamplingParams(temperature=0)).sample(LOGITS)
    assert any(x != greedy for x in b)                  # temperature > 0 is not greedy


# top_k=1 always picks the best token whatever the temperature
def test_top_k_one():
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=0))
    assert {s.sample(LOGITS) for _ in range(20)} == {1}


# min_p drops tokens far below the best one
def test_min_p():
    x = np.array([10.0, 0.0, 0.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.01, seed=0))
    assert {s.sample(x) for _ in range(30)} == {0}


# the repetition penalty demotes recent tokens
def test_repeat_penalty():
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0))
    assert s.sample(LOGITS, history=[1]) == 3


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"min_p": 2}, {"top_k": -1},
                                {"repeat_penalty": 0}])
def test_bad_params(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


@pytest.mark.parametrize("k", [0, 1, 5, 40, 99, 100, 150])
def test_top_k_equals_the_stable_sort(k):
    """_top_k (a partition) picks exactly the first k of a stable descending argsort, ties included."""
    rng = np.random.default_rng(k)
    for x in (rng.standard_normal(100).astype(np.float32),
              np.round(rng.standard_normal(100), 1).astype(np.float32),        # many ties
              np.full(100, 2.0, np.float32),
              np.where(rng.random(100) < 0.1, np.nan, rng.standard_normal(100)).astype(np.float32)):
        want = np.argsort(-x, kind="stable")[:k or None]
        np.testing.assert_array_equal(sampling._top_k(x, k), want)


def test_row_sampling_is_the_samplers_choice():
    # a RowSampling carries everything a choice needs: the same id wherever it is made, and it
    # survives the wire's list form
    from ggml_dist.model.sampling import RowSampling, sample_row
    s = Sampler(SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, seed=77))
    rows = [s.row() for _ in range(1)]
    picks = [s.sample(LOGITS) for _ in range(20)]
    again = [sample_row(LOGITS, RowSampling(1.3, 0, 1.0, 0.0, 77, n)) for n in range(20)]
    assert picks == again and len(set(picks)) > 1
    assert RowSampling.from_list(rows[0].to_list()) == rows[0]
    with pytest.raises(ValueError):
        RowSampling.from_list([1, 2, "x"])


def test_bias_and_penalties_as_llama_cpp():
    # llama_sampler_logit_bias then llama_sampler_penalties: repeat divides a positive logit and
    # multiplies a non-positive one, then count * frequency + presence is subtracted
    p = SamplingParams(temperature=0, repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                       logit_bias=((4, 10.0),), repeat_last_n=4)
    s = Sampler(p)
    x = s.adjust(LOGITS, history=[2, 3, 1, 3, 0])                # the window: 3, 1, 3, 0
    want = LOGITS.copy()
    want[4] += 10.0
    for tok, count in ((1, 1), (3, 2), (0, 1)):
        v = want[tok]
        v = v * 2.0 if v <= 0 else v / 2.0
        want[tok] = v - (count * 0.25 + 0.5)
    np.testing.assert_array_equal(x, want.astype(np.float32))
    assert s.penalized and s.sample(LOGITS, [2, 3, 1, 3, 0]) == 4
    assert not Sampler(SamplingParams()).penalized


def test_allowed_mask_is_minus_inf_elsewhere():
    # sampling over the allowed tokens only chooses what the -inf mask would, greedy and seeded
    rng = np.random.default_rng(3)
    x = rng.standard_normal(300).astype(np.float32)
    allowed = rng.random(300) < 0.1
    for t in (0.0, 0.7):
        for top_k, top_p, min_p in ((40, 0.95, 0.05), (0, 1.0, 0.0), (3, 0.5, 0.0)):
            p = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p, seed=9)
            masked = np.where(allowed, x, np.float32(-np.inf)).astype(np.float32)
            a, b = Sampler(p), Sampler(p)
            assert [a.sample(x, allowed=allowed) for _ in range(10)] == [b.sample(masked) for _ in range(10)]

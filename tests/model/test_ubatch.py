"""Batch validation and the three ubatch split modes (ggml-mechanisms.md §4.5)."""
import numpy as np
import pytest

from ggml_dist.model.ubatch import Batch, BatchError, BatchSplitter


def _multi():
    # tokens of sequences 0, 1, 0, 1, 2 interleaved
    seqs = [0, 1, 0, 1, 2, 0]
    return Batch(np.arange(6, dtype=np.int32), np.array([0, 0, 1, 1, 0, 2], np.int32),
                 [frozenset({s}) for s in seqs], np.ones(6, bool))


# split_simple takes tokens in batch order, n_ubatch at a time
def test_split_simple():
    sp = BatchSplitter(Batch.from_tokens(list(range(10))))
    sizes = []
    while (ub := sp.split_simple(4)) is not None:
        sizes.append(ub.n_tokens)
        assert not ub.equal_seqs and ub.n_seqs == ub.n_tokens
    assert sizes == [4, 4, 2] and sp.n_used == 10


# only the last token of a prompt is an output; out_ids are ubatch rows
def test_outputs():
    ub = BatchSplitter(Batch.from_tokens([5, 6, 7])).split_simple(8)
    assert ub.n_outputs == 1 and list(ub.out_ids) == [2]


# split_equal takes the same number of tokens from each disjoint sequence set
def test_split_equal():
    sp = BatchSplitter(_multi())
    ub = sp.split_equal(6)
    assert ub.equal_seqs and ub.n_seqs == 3 and ub.n_seq_tokens == 1
    ub2 = sp.split_equal(6)
    assert ub2.n_seqs == 2 and ub2.n_tokens == 2      # sequence 1 has one token left


# split_seq follows one sequence set
def test_split_seq():
    sp = BatchSplitter(_multi())
    ub = sp.split_seq(8)
    assert ub.n_seqs == 1 and all(s == frozenset({0}) for s in ub.seq_ids) and ub.n_tokens == 3


# bad token ids and sequence ids are refused with the index named
def test_validate():
    with pytest.raises(BatchError, match="outside the vocabulary"):
        Batch.from_tokens([1, 99]).validate(50, 1)
    with pytest.raises(BatchError, match="sequence ids"):
        Batch.from_tokens([1], seq_id=3).validate(50, 2)
    with pytest.raises(BatchError, match="empty"):
        Batch.from_tokens([]).validate(50, 1)

"""KV cells: slot search, n_kv padding, the KQ mask, sequence edits, overflow; V index layout."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggml_dist.model.kv_cache import ContextFullError, KVCache, KVCells, kv_cells


# slots are taken from the head onwards and n_kv is padded to 256
def test_find_slot_and_n_kv():
    c = KVCells(512, 2)
    s = c.find_slot(3)
    assert list(s) == [0, 1, 2]
    c.apply(s, np.array([0, 1, 2]), [frozenset({0})] * 3)
    assert c.used == 3 and c.used_max_p1 == 3 and c.n_kv() == 256
    s2 = c.find_slot(300)
    assert list(s2[:2]) == [3, 4]
    c.apply(s2, np.arange(3, 303), [frozenset({0})] * 300)
    assert c.n_kv() == 512


# the mask lets a token see cells of its own sequence at positions <= its own
def test_kq_mask_causal_and_sequences():
    c = KVCells(256, 2)
    c.apply(np.array([0, 1, 2, 3]), np.array([0, 1, 0, 1]),
            [frozenset({0}), frozenset({0}), frozenset({1}), frozenset({1})])
    m = c.kq_mask(256, np.array([1, 1]), [frozenset({0}), frozenset({1})])
    assert m.shape == (2, 256)
    assert list(m[0, :4]) == [0, 0, -np.inf, -np.inf]
    assert list(m[1, :4]) == [-np.inf, -np.inf, 0, 0]
    assert np.all(np.isneginf(m[:, 4:]))


# removing a sequence frees its cells; copying shares cells between sequences
def test_seq_rm_cp_keep():
    c = KVCells(256, 3)
    c.apply(np.arange(4), np.arange(4), [frozenset({0})] * 4)
    c.seq_cp(0, 1, 0, 2)
    c.seq_rm(0, 2, -1)
    assert c.used == 2 and c.seq_pos_max(0) == 1 and c.seq_pos_max(1) == 1
    c.seq_rm(0)
    assert c.used == 2                      # still held by sequence 1
    c.seq_keep(2)
    assert c.used == 0


# a ubatch larger than the free cells is a clear error, not a wrap-around
def test_context_full():
    c = KVCells(256, 1)
    c.apply(np.arange(250), np.arange(250), [frozenset({0})] * 250)
    with pytest.raises(ContextFullError, match="context full"):
        c.find_slot(10)


# the transposed V cache takes element (token i, dim j) at row j*kv_size + cell
def test_v_idxs_layout():
    kv = KVCache(8, 4, 256, range(1))
    idx = kv.v_idxs(np.array([5, 9]))
    assert list(idx[:4]) == [5, 256 + 5, 512 + 5, 768 + 5]
    assert list(idx[4:]) == [9, 256 + 9, 512 + 9, 768 + 9]
    assert kv.kv_size == 256 and kv.k_l[0].ne[:2] == (8, 256) and kv.v_l[0].ne[:2] == (256, 4)


# a stream per sequence: slots are absolute cells (stream * size + cell) found in the sequence's own
# stream from its own head; n_kv is the max over the ubatch's streams
def test_streams_slots_heads_n_kv():
    c = KVCells(256, 3, n_stream=3)
    assert c.stream_of(2) == 2 and KVCells(256, 3).stream_of(2) == 0
    s = c.find_slot_ubatch([frozenset({1})] * 2 + [frozenset({2})] * 2, n_seqs=2)
    assert list(s) == [256, 257, 512, 513]
    c.apply(s, np.array([0, 1, 0, 1]), [frozenset({1})] * 2 + [frozenset({2})] * 2)
    assert c.heads == [0, 2, 2] and c.used_in(0) == 0 and c.used_in(1) == 2
    c.apply(c.find_slot(254, 2), np.arange(2, 256), [frozenset({2})] * 254)
    assert c.n_kv([1]) == 256 and c.n_kv([0, 1, 2]) == 256
    with pytest.raises(ContextFullError, match="sequence 2's stream"):
        c.find_slot(2, 2)
    c.seq_rm(2, 10, -1)                         # frees cells in stream 2 only
    assert c.used_in(2) == 10 and c.used_in(1) == 2 and c.find_slot(1, 2)[0] == 512 + 10


# the mask of a multi-stream ubatch is [n_seqs, n_tokens / n_seqs, n_kv], over each group's stream
def test_streams_kq_mask():
    c = KVCells(256, 2, n_stream=2)
    c.apply(np.array([0, 1, 256]), np.array([0, 1, 0]), [frozenset({0})] * 2 + [frozenset({1})])
    m = c.kq_mask(256, np.array([1, 0]), [frozenset({0}), frozenset({1})], n_seqs=2)
    assert m.shape == (2, 1, 256)
    assert list(m[0, 0, :3]) == [0, 0, -np.inf] and list(m[1, 0, :2]) == [0, -np.inf]


# between streams, seq_cp copies the whole sequence: dst's stream becomes src's cells, cell for cell, with
# src's head; a part of a sequence is refused (llama.cpp asserts the same)
def test_streams_seq_cp_whole_stream():
    c = KVCells(256, 3, n_stream=3)
    c.apply(np.array([0, 1, 2, 256 + 5]), np.array([0, 1, 2, 0]), [frozenset({0})] * 3 + [frozenset({1})])
    c.seq_rm(0, 1, 2)                                   # a hole at cell 1
    with pytest.raises(ValueError, match="whole sequence"):
        c.seq_cp(0, 1, 0, 2)
    c.seq_cp(0, 1)
    assert list(c.pos[256:259]) == [0, -1, 2] and c.used_in(1) == 2 and c.heads[1] == c.heads[0] == 1
    assert c.seq_pos_max(1) == 2 and c.seq_pos_max(0) == 2 and c.used_in(0) == 2
    with pytest.raises(ValueError, match="n_stream"):
        KVCells(256, 4, n_stream=2)


# seq_swap: two sequences, each alone in its stream, trade streams cell for cell with their heads;
# a unified cache or a stream shared with another sequence is refused
def test_streams_seq_swap():
    c = KVCells(256, 3, n_stream=3)
    c.apply(np.array([0, 1, 2, 256 + 0]), np.array([0, 1, 2, 0]), [frozenset({0})] * 3 + [frozenset({1})])
    c.seq_rm(0, 1, 2)                                   # a hole at cell 1
    c.seq_swap(0, 1)
    assert list(c.pos[:3]) == [0, -1, -1] and list(c.pos[256:259]) == [0, -1, 2]
    assert c.seq_pos_max(0) == 0 and c.seq_pos_max(1) == 2 and c.heads[:2] == [1, 1]
    assert c.used_in(0) == 1 and c.used_in(1) == 2 and c.seq_pos_max(2) == -1
    with pytest.raises(ValueError, match="share a KV stream"):
        KVCells(256, 2).seq_swap(0, 1)


# per stream, V is transposed in its own block of n_embd_v_gqa rows of kv_size cells; K and V are 3-d
def test_streams_tensors_and_v_idxs():
    kv = KVCache(8, 4, 1024, range(1), n_seq_max=4, unified=False)
    assert kv.kv_size == 256 and kv.n_stream == 4 and kv.n_cells == 1024
    assert kv.k_l[0].ne[:3] == (8, 256, 4) and kv.v_l[0].ne[:3] == (256, 4, 4)
    idx = kv.v_idxs(np.array([2 * 256 + 5]))
    assert list(idx) == [(2 * 4 + j) * 256 + 5 for j in range(4)]
    assert KVCache(8, 4, 1000, range(1), n_seq_max=3, unified=False).kv_size == 512   # 1024 / 3 -> 512


# cells per stream and streams, as KVCache and a pipeline's placement count them
def test_kv_cells():
    assert kv_cells(1000) == (1024, 1) and kv_cells(2048, 8, unified=False) == (256, 8)
    assert kv_cells(1000, 3, unified=False) == (512, 3)


# moving streams' K and V (copy_stream, swap_streams) touches only the cells below n_cells: K's cells are
# its rows, the transposed V's its columns
def test_stream_moves_stop_at_n_cells():
    from ggml_dist.backends.base import tensor_array
    from ggml_dist.backends.cpu.backend import CPUBufferType
    kv = KVCache(8, 4, 1024, range(2), n_seq_max=4, unified=False)
    kv.allocate(CPUBufferType("CPU"))
    rng = np.random.default_rng(0)
    arrays = [tensor_array(t) for t in kv.tensors()]
    for a in arrays:
        a[...] = rng.integers(0, 1 << 15, a.shape)
    before = [a.copy() for a in arrays]
    kv.swap_streams(1, 3, 5)
    kv.copy_stream(0, 2, 7)
    for i, (a, b) in enumerate(zip(arrays, before)):
        k = i % 2 == 0                                   # K [1, stream, cell, row]; V [1, stream, dim, cell]
        lo = (lambda x, n: x[:n]) if k else (lambda x, n: x[:, :n])
        hi = (lambda x, n: x[n:]) if k else (lambda x, n: x[:, n:])
        assert np.array_equal(lo(a[0, 1], 5), lo(b[0, 3], 5)) and np.array_equal(lo(a[0, 3], 5), lo(b[0, 1], 5))
        assert np.array_equal(hi(a[0, 1], 5), hi(b[0, 1], 5)) and np.array_equal(hi(a[0, 3], 5), hi(b[0, 3], 5))
        assert np.array_equal(lo(a[0, 2], 7), lo(b[0, 0], 7)) and np.array_equal(hi(a[0, 2], 7), hi(b[0, 2], 7))
        assert np.array_equal(a[0, 0], b[0, 0])


# the summaries KVCells keeps (per stream its used cells, per sequence its cells' positions) equal a
# recount from the cells' arrays after any sequence of edits
def _check_summaries(c: KVCells) -> None:
    for s in range(c.n_stream):
        cells = c.pos[s * c.size:(s + 1) * c.size]
        assert c.used_cells[s] == np.flatnonzero(cells >= 0).tolist()
    assert np.array_equal(c.pos < 0, c.seq == 0)                 # an empty cell holds no sequence
    for q in range(c.n_seq_max):               # (no cell holds a sequence id >= n_seq_max here)
        s = c.stream_of(q)
        cells = slice(s * c.size, (s + 1) * c.size)
        held = (c.seq[cells] >> np.uint64(q)) & np.uint64(1) != 0
        assert c.seq_pos[q] == sorted(c.pos[cells][held].tolist())
        assert c.seq_pos_max(q) == (int(c.pos[cells][held].max()) if held.any() else -1)
        assert c.seq_pos_min(q) == (int(c.pos[cells][held].min()) if held.any() else -1)


_EDITS = st.lists(st.tuples(st.sampled_from(["apply", "rm", "cp", "keep", "clear", "swap"]),
                            st.integers(0, 3), st.integers(0, 3), st.integers(-1, 30), st.integers(-1, 30),
                            st.integers(1, 40)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.integers(1, 4), _EDITS)
def test_summaries_follow_edits(unified, n_seq, edits):
    c = KVCells(64, n_seq, 1 if unified else n_seq)
    next_pos = [0] * n_seq
    for op, a, b, p0, p1, n in edits:
        x, y = a % n_seq, b % n_seq
        try:
            if op == "apply":                   # a ubatch of sequence x (shared with y in a unified cache)
                seqs = frozenset({x, y}) if unified and n % 2 else frozenset({x})
                slot = c.find_slot(n, c.stream_of(x))
                c.apply(slot, np.arange(next_pos[x], next_pos[x] + n), [seqs] * n)
                for q in seqs:
                    next_pos[q] = next_pos[x] + n
            elif op == "rm":
                c.seq_rm(x if n % 5 else -1, p0, p1)
            elif op == "cp":
                c.seq_cp(x, y, p0, p1) if n % 2 else c.seq_cp(x, y)
            elif op == "keep":
                c.seq_keep(x)
            elif op == "clear":
                c.clear()
            else:
                c.seq_swap(x, y)
        except (ContextFullError, ValueError):
            pass
        _check_summaries(c)


# apply into a cell still held empties it first (its position leaves its sequences)
def test_apply_over_held_cell():
    c = KVCells(256, 2)
    c.apply(np.arange(3), np.arange(3), [frozenset({0, 1})] * 3)
    c.apply(np.array([1]), np.array([7]), [frozenset({1})])
    assert c.seq_pos[0] == [0, 2] and c.seq_pos[1] == [0, 2, 7] and c.used == 3
    _check_summaries(c)


# the compiled attention inputs (backends/cpu/kv_inputs.py) equal the numpy reference's masks and indices
# for any cells, ubatch (streams in groups, shared sequences where unified), n_kv and sliding window
@settings(max_examples=150, deadline=None)
@given(st.booleans(), st.integers(1, 4), _EDITS, st.integers(1, 3), st.integers(1, 4), st.integers(0, 9),
       st.data())
def test_compiled_attn_inputs_equal_reference(unified, n_seq, edits, n_groups, g, n_swa, data):
    kv = KVCache(4, 3, 64 * n_seq, range(1), n_seq_max=n_seq, unified=unified)
    c = kv.cells
    for op, a, b, p0, _, n in edits:                # a state of the cells: ubatches and removals
        x, y = a % n_seq, b % n_seq
        try:
            if op in ("apply", "cp"):
                seqs = frozenset({x, y}) if unified else frozenset({x})
                c.apply(c.find_slot(n, c.stream_of(x)), np.arange(p0 + 1, p0 + 1 + n), [seqs] * n)
            elif op == "rm":
                c.seq_rm(x, p0, p0 + n)
        except ContextFullError:
            pass
    n_groups = 1 if unified else min(n_groups, n_seq)
    group_seq = data.draw(st.lists(st.integers(0, n_seq - 1), min_size=n_groups, max_size=n_groups,
                                   unique=not unified))
    seq_ids = [frozenset({q, (q + k) % n_seq}) if unified and k % 2 else frozenset({q})
               for q in group_seq for k in range(g)]
    n = len(seq_ids)
    pos = np.array(data.draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), np.int32)
    slot = np.array([c.stream_of(min(s)) * c.size + data.draw(st.integers(0, c.size - 1)) for s in seq_ids],
                    np.int64)
    n_kv = data.draw(st.sampled_from([64, 128, c.size]))
    mask, mask_swa = np.empty((n, n_kv), np.float32), np.empty((n, n_kv), np.float32)
    k_idxs, v_idxs = np.empty(n, np.int64), np.empty(n * 3, np.int64)
    kv.attn_inputs_into(n_kv, pos, seq_ids, n_groups, slot, n_swa, mask, mask_swa if n_swa else None,
                        k_idxs, v_idxs)
    assert np.array_equal(mask, c.kq_mask(n_kv, pos, seq_ids, n_groups).reshape(n, n_kv))
    if n_swa:
        assert np.array_equal(mask_swa, c.kq_mask(n_kv, pos, seq_ids, n_groups, n_swa).reshape(n, n_kv))
    assert np.array_equal(k_idxs, kv.k_idxs(slot)) and np.array_equal(v_idxs, kv.v_idxs(slot))

"""A step's attention inputs in one compiled call: the KQ mask(s), k_idxs and v_idxs that llama.cpp's
set_input loops write for each ubatch (model/kv_cache.py's KVCells.kq_mask and KVCache.k_idxs/v_idxs
are the numpy reference, kept where the compiled kernels are off).

    attn_inputs(mask, mask_swa, n_swa, cell_pos, cell_seq, stream_size, n_groups, tok_pos, tok_seq,
                k_idxs, v_idxs, slot, kv_size, n_embd_v)

mask, mask_swa: f32 [n_tokens, n_kv] (mask_swa [0, *] where the model has no sliding window). The tokens
are n_groups equal groups, the first token's smallest sequence id (tok_seq) naming the group's stream: its
cells start at stream * stream_size (stream_size 0: one unified stream). Mask row t is 0 where cell j of
its stream holds sequence tok_seq[t] at a position <= the token's (and, for mask_swa, less than n_swa
before it), -inf elsewhere. k_idxs[i] = slot[i]; v_idxs[i * n_embd_v + j] = the row of dim j of the
absolute cell slot[i] in the transposed V (KVCache.v_idxs). In a decode step the numpy reference is a
dozen calls (~100 us where the step's weights have evicted numpy's code and data); this is one.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import kernel_cache  # noqa: F401  (the cache locator, registered before any kernel is defined)

_NEG_INF = np.float32(-np.inf)


@njit(cache=True)
def attn_inputs(mask, mask_swa, n_swa, cell_pos, cell_seq, stream_size, n_groups, tok_pos, tok_seq, k_idxs,
                v_idxs, slot, kv_size, n_embd_v):
    n, n_kv = mask.shape
    g = n // n_groups
    for t in range(n):
        p, o = tok_pos[t], tok_seq[t // g * g] * stream_size
        bit = np.uint64(1) << np.uint64(tok_seq[t])
        for j in range(n_kv):
            c = cell_pos[o + j]
            ok = (cell_seq[o + j] & bit) != 0 and c <= p
            mask[t, j] = 0.0 if ok else _NEG_INF
            if mask_swa.shape[0]:
                mask_swa[t, j] = 0.0 if ok and p - c < n_swa else _NEG_INF
    for i in range(slot.shape[0]):
        c = slot[i]
        k_idxs[i] = c
        d0 = (c // kv_size * n_embd_v) * kv_size + c % kv_size
        for j in range(n_embd_v):
            v_idxs[i * n_embd_v + j] = d0 + j * kv_size

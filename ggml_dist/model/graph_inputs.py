"""llama's set_input: a ubatch's tokens, positions, output ids and attention inputs (KQ masks, the K
and V cell indices) written into a graph's input tensors. Where a tensor is host memory the values go
straight into it through a view, kept per graph (a new view costs several us a step); the attention
inputs by one compiled call where the compiled kernels are on (KVCache.attn_inputs_into), else by the
numpy reference. A tensor elsewhere (a pipeline stage's) is given the bytes."""
from __future__ import annotations

import numpy as np

from ..backends.base import tensor_array, tensor_set
from ..core.tensor import Tensor
from .kv_cache import KVCache
from .llama import GraphResult
from .recurrent_state import RecurrentState
from .ubatch import Ubatch


class GraphInputs:
    def __init__(self, kv: KVCache, n_swa: int, rs: RecurrentState | None = None) -> None:
        self.kv, self.n_swa, self.rs = kv, n_swa, rs
        self._views: tuple[GraphResult | None, dict] = (None, {})   # the current graph's views

    def set(self, res: GraphResult, ub: Ubatch, slot: np.ndarray, n_kv: int, compiled: bool) -> None:
        """res's inputs for ubatch ub on cells slot, attending over n_kv cells."""
        inp = res.inputs
        self.put(res, inp.tokens, ub.tokens)
        if inp.pos.nelements == ub.n_tokens:
            self.put(res, inp.pos, ub.pos)
        else:                               # multi-section rope: text positions are (p, p, p, 0)
            self.put(res, inp.pos, np.concatenate([ub.pos, ub.pos, ub.pos, np.zeros_like(ub.pos)]))
        if inp.s_copy is not None and inp.s_dst is not None:
            assert self.rs is not None
            read, write = self.rs.begin(ub)
            self.put(res, inp.s_copy, read)
            self.put(res, inp.s_dst, write)
        if inp.out_ids is not None:
            self.put(res, inp.out_ids, ub.out_ids)
        kv, n_swa = self.kv, self.n_swa
        if not compiled:
            tensor_set(inp.kq_mask, kv.cells.kq_mask(n_kv, ub.pos, ub.seq_ids, ub.n_seqs))
            if inp.kq_mask_swa is not None:
                tensor_set(inp.kq_mask_swa, kv.cells.kq_mask(n_kv, ub.pos, ub.seq_ids, ub.n_seqs, n_swa))
            tensor_set(inp.k_idxs, kv.k_idxs(slot))
            tensor_set(inp.v_idxs, kv.v_idxs(slot))
            return
        n = ub.n_tokens
        specs = ((inp.kq_mask, (n, n_kv), np.float32), (inp.kq_mask_swa, (n, n_kv), np.float32),
                 (inp.k_idxs, (n,), np.int64), (inp.v_idxs, (n * kv.n_embd_v_gqa,), np.int64))
        views = [self.view(res, t, shape) for t, shape, _ in specs]
        arrays = [np.empty(shape, dt) if v is None and t is not None else v
                  for v, (t, shape, dt) in zip(views, specs, strict=True)]
        mask, mask_swa, k_idxs, v_idxs = arrays
        assert mask is not None and k_idxs is not None and v_idxs is not None
        kv.attn_inputs_into(n_kv, ub.pos, ub.seq_ids, ub.n_seqs, slot, n_swa, mask, mask_swa, k_idxs, v_idxs)
        for v, a, (t, _, _) in zip(views, arrays, specs, strict=True):
            if v is None and t is not None and a is not None:     # not host memory (a pipeline's stage)
                tensor_set(t, a)

    def view(self, res: GraphResult | None, t: Tensor | None, shape: tuple[int, ...]) -> np.ndarray | None:
        """A tensor of graph res as an array of shape (C order) where it is host memory, else None;
        kept while the tensor stays where it is. Only the current graph's views are kept: a kept view
        holds its buffer's memory."""
        if t is None or t.buffer is None or t.buffer.base is None:
            return None
        if self._views[0] is not res:
            self._views = (res, {})
        views = self._views[1]
        hit = views.get(id(t))
        if hit is None or hit[0] is not t or hit[1] is not t.buffer or hit[2] != t.data:
            hit = views[id(t)] = (t, t.buffer, t.data, tensor_array(t).reshape(shape))
        return hit[3]

    def put(self, res: GraphResult, t: Tensor, value: np.ndarray) -> None:
        """tensor_set(t, value) of an I32 input, through the host view where there is one (which casts as
        it copies; another buffer is given int32 bytes)."""
        view = self.view(res, t, (t.nelements,))
        if view is None:
            tensor_set(t, np.asarray(value, np.int32))
        else:
            view[...] = value

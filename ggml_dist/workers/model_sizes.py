"""What placement needs to know of a model (workers/placement.py): the weight bytes of each layer and of
the first and last stages' extras, what every stage maps, and each layer's cache (the KV cache of an
attention layer at the planned context; a hybrid model's recurrent layers keep two state rows per
sequence instead), read from the GGUF's tensor table without loading a weight.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model import layout
from ..model.archs import LlamaHParams
from ..model.gguf import GGUFFile

MIB = 2**20

# Stages are balanced by decode time, modelled as weight bytes read plus a fixed cost per layer: the
# dispatch of its ~30 ops, which small models' decode steps are made of. Fitted by
# `python benchmarks/layer_cost.py` (SmolLM2-135M Q4_1, one thread per stage, 2-vCPU EPYC): 0.042 ms per
# MiB read and 0.28 ms per layer, so a layer costs what reading 6.5 MiB more would. By bytes alone the
# 2-stage split was 22 | 8 + head (7.5 + 4.3 ms); this model gives 16 | 14 + head. For large layers
# (TinyLlama's 28 MB) it barely moves the split.
LAYER_DISPATCH_BYTES = 6 * MIB


@dataclass(frozen=True)
class ModelSizes:
    """What placement needs to know of a model: bytes per layer and of the first/last stage's extras."""
    per_layer: list[int]           # weight bytes of each layer
    first: int                     # the token embeddings
    last: int                      # output norm + head (+ the embeddings again when the head is tied)
    tied: bool
    kv_per_layer: int              # KV cache bytes of one attention layer at the planned context
    every: int = 0                 # what each stage maps whatever its layers (layout.EVERY_STAGE)
    recurrent: frozenset[int] = frozenset()    # a hybrid model's recurrent layers: state rows, no KV
    state_per_layer: int = 0       # their rows' bytes (two per sequence: model/recurrent_state.py)

    def __post_init__(self) -> None:
        acc = [0]
        for b in self.per_layer:
            acc.append(acc[-1] + b)
        object.__setattr__(self, "_prefix", acc)     # layer sums in O(1): placement tries many splits

    def layer_bytes(self, lo: int, hi: int) -> int:
        return self._prefix[hi] - self._prefix[lo]   # type: ignore[attr-defined]

    @classmethod
    def of(cls, f: GGUFFile, hp: LlamaHParams, n_ctx: int, kv_type_size: int = 2, n_seq: int = 1) -> ModelSizes:
        per, first, last, every = layer_weight_bytes(f, hp.n_layer)
        recurrent = frozenset(il for il in range(hp.n_layer) if hp.is_recurrent(il))
        state = (hp.n_embd_r + hp.n_embd_s) * 4 * 2 * n_seq if recurrent else 0
        return cls(per, first, last, hp.tie_word_embeddings,
                   (hp.n_embd_k_gqa + hp.n_embd_v_gqa) * n_ctx * kv_type_size, every, recurrent, state)

    def cache_bytes(self, lo: int, hi: int) -> int:
        """The KV cache of layers lo..hi-1, and the state rows of the recurrent ones among them."""
        n_rec = sum(lo <= il < hi for il in self.recurrent)
        return (hi - lo - n_rec) * self.kv_per_layer + n_rec * self.state_per_layer

    @property
    def n_layer(self) -> int:
        return len(self.per_layer)

    def weights(self, lo: int, hi: int, first: bool, last: bool) -> int:
        w = self.layer_bytes(lo, hi) + (self.first if first else 0) + (self.last if last else 0) + self.every
        if first and last and self.tied:
            w -= self.first                           # one stage maps the tied embeddings once
        return w

    def read_per_token(self, lo: int, hi: int, last: bool) -> int:
        """A stage's decode cost in bytes-read equivalents: its weights, plus LAYER_DISPATCH_BYTES per
        layer (the balancing objective)."""
        return self.layer_bytes(lo, hi) + (hi - lo) * LAYER_DISPATCH_BYTES + (self.last if last else 0)


def layer_weight_bytes(f: GGUFFile, n_layer: int) -> tuple[list[int], int, int, int]:
    """Bytes per layer, of the first stage's extras (embeddings), of the last's (norm + head), of what
    every stage maps (model/layout.py says which is which)."""
    per = [0] * n_layer
    first = last = every = 0
    tied = layout.tied_head(f)
    for name, info in f.tensors.items():
        role, il = layout.tensor_role(name)
        if role == "layer":
            per[il] += info.nbytes
        elif role == "embd":
            first += info.nbytes
            if tied:
                last += info.nbytes        # the last stage maps the embeddings too, as its head
        elif role == "every":
            every += info.nbytes
        else:
            last += info.nbytes
    return per, first, last, every

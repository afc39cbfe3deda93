"""The pieces synthetic GGUF files are made of, dense (synthetic.py) or mixtures of experts
(synthetic_moe.py): a valid SPM vocabulary of any size, and random K-quant blocks with sane scales (the
gguf package cannot quantize to the K-quants)."""
from __future__ import annotations

import numpy as np

from ..core.types import TYPE_TRAITS, GGMLType


def spm_vocab(n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, the 256 byte tokens, then filler pieces: a valid SPM vocabulary of any size."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256          # UNKNOWN, CONTROL, CONTROL, BYTE
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        piece = "\u2581" + letters[i % 26] + (letters[(i // 26) % 26] if i >= 26 else "") + \
            (str(i // 676) if i >= 676 else "")
        tokens.append(piece)
        types.append(1)
        i += 1
    scores = [0.0] * 259 + [-float(j) for j in range(len(tokens) - 259)]
    return tokens[:n_vocab], scores[:n_vocab], types[:n_vocab]


def random_kquant(rng: np.random.Generator, t: GGMLType, rows: int, ne0: int) -> np.ndarray:
    """Random K-quant blocks whose f16 super-block scales keep weights around +-0.1."""
    tt = TYPE_TRAITS[t]
    nb = ne0 // tt.blck_size
    blocks = rng.integers(0, 256, size=(rows, nb, tt.type_size), dtype=np.uint8)
    d = np.full((rows, nb), 1e-4, np.float16).view(np.uint8).reshape(rows, nb, 2)
    if t in (GGMLType.Q4_K, GGMLType.Q5_K):          # d, dmin lead the block
        blocks[..., 0:2] = d
        blocks[..., 2:4] = d
    elif t == GGMLType.Q6_K:                          # d trails; int8 scales before it
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 2e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    elif t == GGMLType.Q2_K:                          # d, dmin trail
        blocks[..., tt.type_size - 4: tt.type_size - 2] = np.full((rows, nb), 5e-3, np.float16) \
            .view(np.uint8).reshape(rows, nb, 2)
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 5e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    elif t == GGMLType.Q3_K:                          # d trails
        blocks[..., tt.type_size - 2:] = np.full((rows, nb), 5e-3, np.float16).view(np.uint8) \
            .reshape(rows, nb, 2)
    else:
        raise ValueError(f"no random-block writer for {t.name}")
    return blocks.reshape(rows, nb * tt.type_size)

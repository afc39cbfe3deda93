"""Which tensors of a GGUF file a stage owns, and how many bytes they are: the one answer the model
loader, a stage actor, the driver's graph and placement share.

A stage is a layer range [lo, hi) plus, on the first stage, the token embeddings and, on the last, the
output norm and head. Three quirks live here and nowhere else:

    tied head       no output.weight in the file: the head is token_embd.weight, which the last stage
                    maps as well (one stage that is both maps it once)
    EVERY_STAGE     non-layer tensors every layer reads: llama3 rope scaling's frequency factors
                    (llama.cpp gives each layer its own view, blk.{il}.rope_freqs.weight, so that it
                    lives with the layer's backend); every stage maps them
    anything else   that is not blk.{il}.* (output_norm, output) is the last stage's

    tied_head(f)                        the file's head is its embeddings
    tensor_role(name)                   ("layer", il) | ("embd", -1) | ("every", -1) | ("head", -1)
    stage_owns(name, layers, first, last, tied)
    stage_tensors(names, layers, first, last, tied)   the names a stage maps, in the file's order
    stage_weight_bytes(f, layers, first, last)        their bytes (placement's per-stage weights)
    bytes_read_per_token(f, n_expert, n_expert_used)  the weight bytes one token's decode step reads
"""
from __future__ import annotations

from collections.abc import Iterable

from .gguf import GGUFFile

EVERY_STAGE = frozenset({"rope_freqs.weight"})
EMBD = "token_embd.weight"
HEAD = "output.weight"


def tied_head(f: GGUFFile) -> bool:
    return HEAD not in f.tensors


def tensor_role(name: str) -> tuple[str, int]:
    if name.startswith("blk."):
        return "layer", int(name.split(".")[1])
    if name == EMBD:
        return "embd", -1
    if name in EVERY_STAGE:
        return "every", -1
    return "head", -1


def stage_owns(name: str, layers: tuple[int, int] | range, first: bool, last: bool, tied: bool) -> bool:
    role, il = tensor_role(name)
    lo, hi = (layers.start, layers.stop) if isinstance(layers, range) else layers
    if role == "layer":
        return lo <= il < hi
    if role == "embd":
        return first or (last and tied)
    return role == "every" or last


def stage_tensors(names: Iterable[str], layers: tuple[int, int] | range, first: bool, last: bool,
                  tied: bool) -> list[str]:
    return [n for n in names if stage_owns(n, layers, first, last, tied)]


def stage_weight_bytes(f: GGUFFile, layers: tuple[int, int], first: bool, last: bool) -> int:
    return sum(f.tensors[n].nbytes for n in stage_tensors(f.tensors, layers, first, last, tied_head(f)))


def bytes_read_per_token(f: GGUFFile, n_expert: int = 0, n_expert_used: int = 0) -> int:
    """The weight bytes one token's decode step reads: every weight once, but of the token embeddings one
    row (all of them where they are the tied head), and of each stacked expert tensor (ffn_*_exps) the
    top-k experts' share, n_expert_used / n_expert of it."""
    total = 0
    for name, t in f.tensors.items():
        if name == EMBD and not tied_head(f):
            total += t.nbytes // max(1, t.ne[1])
        elif "_exps." in name and n_expert:
            total += t.nbytes * n_expert_used // n_expert
        else:
            total += t.nbytes
    return total

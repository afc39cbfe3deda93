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

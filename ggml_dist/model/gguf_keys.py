"""Reading a GGUF file's metadata keys the way llama_model_loader does: a key of a kind (int, float, str,
bool), with a default or required, and the values the loaders share. Each error names the file and the key."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .gguf import GGUFError, GGUFFile


def key(f: GGUFFile, name: str, kind: type, default: Any = None, required: bool = True) -> Any:
    if name not in f.metadata:
        if required and default is None:
            raise GGUFError(f"{f.path}: missing metadata key '{name}'")
        return default
    v = f.metadata[name]
    if kind is int and isinstance(v, int) and not isinstance(v, bool):
        return v
    if kind is float and isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if kind is str and isinstance(v, str):
        return v
    if kind is bool and isinstance(v, bool):
        return v
    raise GGUFError(f"{f.path}: metadata key '{name}' has value {v!r} ({type(v).__name__}), "
                    f"expected {kind.__name__}")


def short(v: Any) -> str:
    return f"[{len(v)} values]" if isinstance(v, (list, np.ndarray)) else repr(v)


def rope_freq_base(f: GGUFFile, name: str) -> float:
    """rope.freq_base (or _swa): pair i turns at base^(-2i/n_rot) of the position, which slows with i only
    for a base above 1; ROPE's yarn_corr_dims divides by log(base), so 1, 0, negatives and NaN cannot run."""
    base = key(f, name, float, default=10000.0)
    if not (math.isfinite(base) and base > 1.0):
        raise GGUFError(f"{f.path}: {name} = {base!r} must be a finite number above 1")
    return base


def key_int_per_layer(f: GGUFFile, name: str, n_layer: int, default: int | None = None) -> int:
    """An int key that llama.cpp also takes as a per-layer array (get_key_or_arr): one value for every
    layer is what the graphs here build; an array of differing values is refused by name."""
    v = f.metadata.get(name, default)
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, list):
        if len(v) != n_layer or len(set(v)) != 1:
            raise GGUFError(f"{f.path}: {name} = {short(v)}: a different value per layer is not implemented")
        v = v[0]
    if v is None:
        raise GGUFError(f"{f.path}: missing metadata key '{name}'")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise GGUFError(f"{f.path}: metadata key '{name}' = {v!r} must be a non-negative integer")
    return v

"""A loaded model: the GGUF file, its hyperparameters, its weights (mapped) and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.tensor import Tensor
from . import layout
from .archs import LlamaHParams
from .gguf import GGUFFile, load_gguf
from .hparams import hparams_from_gguf
from .tensors import check_tensors
from .tokenizer import Tokenizer
from .weights import MappedBuffer, load_weights


@dataclass
class LlamaModel:
    path: Path
    file: GGUFFile
    hp: LlamaHParams
    weights: dict[str, Tensor]
    tokenizer: Tokenizer

    @classmethod
    def load(cls, path: str | Path, layers: range | None = None) -> LlamaModel:
        """Validate the file, then map the weights (all, or those of `layers` plus embeddings/head)."""
        f = load_gguf(path)
        hp = hparams_from_gguf(f)
        check_tensors(f, hp)
        names = None if layers is None else layout.stage_tensors(f.tensors, layers, True, True, hp.tie_word_embeddings)
        weights = load_weights(f, names, MappedBuffer(str(f.path)))
        return cls(Path(path), f, hp, weights, Tokenizer.from_gguf(f))

    @property
    def name(self) -> str:
        return str(self.file.get("general.name", self.path.stem))

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.weights.values())

    def bytes_read_per_token(self) -> int:
        """The weight bytes one token's decode step reads (layout.bytes_read_per_token)."""
        return layout.bytes_read_per_token(self.file, self.hp.n_expert, self.hp.n_expert_used)

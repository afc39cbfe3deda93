"""A host-memory buffer type for allocator tests: settable alignment, max_size and alloc-size padding."""
from __future__ import annotations

import numpy as np

from ggml_dist.alloc.tallocr import SIZE_MAX
from typing import Callable

from ggml_dist.backends.base import Buffer, BufferType
from ggml_dist.core.tensor import Tensor


class FakeBuffer(Buffer):
    """A chunk of host memory: `.size` and a numpy uint8 `.base`; counts resets (the protocol's other
    optional slots keep their defaults)."""

    def __init__(self, buft: "FakeBufferType", size: int) -> None:
        self.buft = buft
        self.size = size
        self.base = np.zeros(size, dtype=np.uint8)
        self.n_resets = 0

    def reset(self) -> None:
        self.n_resets += 1

    def __repr__(self) -> str:
        return f"FakeBuffer({self.buft.name}, {self.size})"


class FakeBufferType(BufferType):
    """Satisfies alloc.gallocr.BufferTypeLike; not host memory (is_host keeps its default, False).
    `extra` pads get_alloc_size beyond nbytes (backend padding); it may be a function of the tensor, as a
    backend's padding may depend on more than the layout."""

    def __init__(self, alignment: int = 32, max_size: int = SIZE_MAX, name: str = "fake",
                 extra: int | Callable[[Tensor], int] = 0) -> None:
        self.name = name
        self.alignment = alignment
        self.max_size = max_size
        self.extra = extra
        self.allocated: list[FakeBuffer] = []

    def get_alloc_size(self, t: Tensor) -> int:
        n = t.nbytes
        if n == 0:
            return 0
        return n + (self.extra(t) if callable(self.extra) else self.extra)

    def alloc_buffer(self, size: int) -> FakeBuffer:
        buf = FakeBuffer(self, size)
        self.allocated.append(buf)
        return buf

    def __repr__(self) -> str:
        return f"FakeBufferType({self.name}, align={self.alignment}, max={self.max_size})"

"""struct ggml_context: a metadata arena with a fixed budget (ggml-mechanisms.md §1.3).

The arena never grows. Each object costs a header plus its padded payload, as in ggml, so a context sized
the way llama.cpp sizes it (tensor_overhead * max_nodes + graph_overhead) behaves the same. With
no_alloc=False the tensors' bytes are carved from the arena too, which is backed by a host byte array.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tensor import MAX_DIMS, Tensor, default_nb, nbytes
from .types import TYPE_TRAITS, GGMLType

MEM_ALIGN = 16
OBJECT_SIZE = 32                    # sizeof(struct ggml_object)
TENSOR_SIZE = 336                   # sizeof(struct ggml_tensor) on 64-bit targets
TENSOR_OVERHEAD = OBJECT_SIZE + TENSOR_SIZE


class ContextError(MemoryError):
    """The context's metadata arena is full (ggml logs 'not enough space in the context's memory pool')."""


def pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


class HostMemory:
    """The byte arena of a context created with no_alloc=False; also a minimal host 'buffer'."""
    is_host = True

    def __init__(self, size: int, name: str = "ctx") -> None:
        self.name = name
        self.base = np.zeros(size, dtype=np.uint8)
        self.size = size


class Context:
    """Mirrors ggml_context: counts every object against mem_size and refuses to exceed it."""

    def __init__(self, mem_size: int, no_alloc: bool = True, name: str = "ctx") -> None:
        if mem_size < 0:
            raise ValueError(f"context size must be >= 0, got {mem_size}")
        self.mem_size = pad(mem_size or MEM_ALIGN, MEM_ALIGN)
        self.no_alloc = no_alloc
        self.name = name
        self.mem_used = 0
        self.n_objects = 0
        self.tensors: list[Tensor] = []
        self.memory = None if no_alloc else HostMemory(self.mem_size, name)

    # -- arena ------------------------------------------------------------------------------
    def new_object(self, size: int, what: str) -> int:
        """ggml_new_object: header + padded payload; returns the payload's offset in the arena."""
        need = OBJECT_SIZE + pad(size, MEM_ALIGN)
        if self.mem_used + need > self.mem_size:
            raise ContextError(
                f"context '{self.name}': not enough space for {what} ({need} B needed, "
                f"{self.mem_size - self.mem_used} B free of a {self.mem_size} B budget, "
                f"{self.n_objects} objects); create the context with a larger mem_size")
        offs = self.mem_used + OBJECT_SIZE
        self.mem_used += need
        self.n_objects += 1
        return offs

    def reset(self) -> None:
        """ggml_reset: forget every object, keep the memory."""
        self.mem_used = 0
        self.n_objects = 0
        self.tensors.clear()

    # -- tensors ----------------------------------------------------------------------------
    def new_tensor(self, type: GGMLType, ne: Sequence[int], view_src: Tensor | None = None,
                   view_offs: int = 0) -> Tensor:
        """Mirrors ggml_new_tensor_impl: dense strides, root flattening for views of views."""
        if not 1 <= len(ne) <= MAX_DIMS:
            raise ValueError(f"a tensor has 1 to {MAX_DIMS} dimensions, got {len(ne)}")
        ne4 = tuple(int(n) for n in ne) + (1,) * (MAX_DIMS - len(ne))
        if any(n < 0 for n in ne4):
            raise ValueError(f"negative dimension in ne={list(ne4)}")
        bs = TYPE_TRAITS[GGMLType(type)].blck_size
        if ne4[0] % bs != 0:
            raise ValueError(f"ne[0]={ne4[0]} is not a multiple of the {GGMLType(type).name} "
                             f"block size {bs}")
        t = Tensor(type=GGMLType(type), ne=ne4, nb=default_nb(GGMLType(type), ne4))  # type: ignore[arg-type]
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs           # views never chain: point at the root
            view_src = view_src.view_src
        data_size = nbytes(t)
        if view_src is not None:
            if data_size > 0 and view_offs + data_size > nbytes(view_src):
                raise ValueError(
                    f"view of {data_size} B at offset {view_offs} does not fit in "
                    f"'{view_src.name}' ({nbytes(view_src)} B)")
            t.view_src, t.view_offs = view_src, view_offs
            if view_src.data is not None:             # a view of allocated memory is pre-allocated
                t.data = view_src.data + view_offs
        obj_size = TENSOR_SIZE + (data_size if view_src is None and not self.no_alloc else 0)
        offs = self.new_object(obj_size, f"tensor {list(ne4)} {t.type.name}")
        if view_src is None and not self.no_alloc:
            assert self.memory is not None
            t.buffer, t.data = self.memory, offs + TENSOR_SIZE
        self.tensors.append(t)
        return t

    def view_tensor(self, src: Tensor) -> Tensor:
        """ggml_view_tensor: a full-size view with src's strides (op NONE)."""
        t = self.new_tensor(src.type, src.ne, src, 0)
        t.nb = src.nb
        t.name = f"{src.name} (view)"[:63]
        return t

    def get_tensor(self, name: str) -> Tensor | None:
        """ggml_get_tensor: linear search by name."""
        for t in self.tensors:
            if t.name == name:
                return t
        return None

    def new_graph(self, size: int = 2048, grads: bool = False):  # -> Graph (import cycle)
        from .graph import Graph, graph_nbytes
        self.new_object(graph_nbytes(size, grads), f"graph of {size} nodes")
        return Graph(size)


def tensor_overhead() -> int:
    """ggml_tensor_overhead: what one no_alloc tensor costs in a context."""
    return TENSOR_OVERHEAD


def graph_overhead(size: int = 2048, grads: bool = False) -> int:
    """ggml_graph_overhead_custom."""
    from .graph import graph_nbytes
    return OBJECT_SIZE + pad(graph_nbytes(size, grads), MEM_ALIGN)

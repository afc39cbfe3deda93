"""struct ggml_tensor: metadata only (ggml-mechanisms.md §1.1, §1.2).

A Tensor never holds data. After allocation it is bound to (buffer, data), where `data` is the byte
offset inside `buffer`: the Python spelling of ggml's data pointer. Backends turn that pair into an
array view (backends/base.py: tensor_array).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .types import TYPE_TRAITS, GGMLType

MAX_DIMS = 4
MAX_SRC = 10
MAX_NAME = 64
MAX_OP_PARAMS = 16   # int32 slots in ggml; here a tuple of at most 16 Python scalars


class Op(enum.IntEnum):
    """ggml_op: the operations this runtime builds and computes (ggml's names and order kept)."""
    NONE = 0
    DUP = enum.auto()
    ADD = enum.auto()
    ADD_ID = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()
    SUM_ROWS = enum.auto()
    SCALE = enum.auto()
    NORM = enum.auto()
    RMS_NORM = enum.auto()
    MUL_MAT = enum.auto()
    MUL_MAT_ID = enum.auto()
    CPY = enum.auto()
    CONT = enum.auto()
    RESHAPE = enum.auto()
    VIEW = enum.auto()
    PERMUTE = enum.auto()
    TRANSPOSE = enum.auto()
    GET_ROWS = enum.auto()
    SET_ROWS = enum.auto()
    SOFT_MAX = enum.auto()
    ROPE = enum.auto()
    CLAMP = enum.auto()
    CONCAT = enum.auto()
    ARGMAX = enum.auto()
    ARGSORT = enum.auto()
    FLASH_ATTN_EXT = enum.auto()
    UNARY = enum.auto()
    GLU = enum.auto()
    L2_NORM = enum.auto()
    SSM_CONV = enum.auto()
    GATED_DELTA_NET = enum.auto()
    ALL_GATHER = enum.auto()     # not a ggml op: tensor parallelism's exchange (core/ops_collective.py)
    EXPERT_IDS = enum.auto()     # not a ggml op: the selected experts a rank computes (ops_collective.py)
    GATHER_EXPERTS = enum.auto() # not a ggml op: expert parallelism's exchange (core/ops_collective.py)


class UnaryOp(enum.IntEnum):
    """ggml_unary_op (stored in op_params[0] of a UNARY node)."""
    SIGMOID = 7
    GELU = 8
    SILU = 10
    SOFTPLUS = 15           # log(1 + exp(x)), x past 20 passed through (Qwen3.5's delta-net gate)


class GLUOp(enum.IntEnum):
    """ggml_glu_op (stored in op_params[0] of a GLU node)."""
    REGLU = 0
    GEGLU = 1
    SWIGLU = 2
    SWIGLU_OAI = 3          # op_params (op, swapped, alpha, limit): gpt-oss's clamped SwiGLU


class SortOrder(enum.IntEnum):
    """ggml_sort_order (op_params[0] of an ARGSORT node)."""
    ASC = 0
    DESC = 1


class TensorFlag(enum.IntFlag):
    """ggml_tensor_flag."""
    INPUT = 1
    OUTPUT = 2
    PARAM = 4
    LOSS = 8
    COMPUTE = 16


VIEW_OPS = frozenset({Op.VIEW, Op.RESHAPE, Op.PERMUTE, Op.TRANSPOSE})

@dataclass(eq=False, slots=True)
class Tensor:
    """Mirrors struct ggml_tensor. Identity is the key everywhere (graphs dedupe by identity)."""
    type: GGMLType
    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    op: Op = Op.NONE
    op_params: tuple[Any, ...] = ()
    flags: TensorFlag = TensorFlag(0)
    src: list[Tensor | None] = field(default_factory=list)
    view_src: Tensor | None = None
    view_offs: int = 0
    name: str = ""
    buffer: Any = None           # the backend buffer that owns the bytes, once allocated
    data: int | None = None      # byte offset inside `buffer` (ggml's data pointer)
    extra: Any = None            # backend-private

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.type.name}, ne={list(self.ne)}, op={self.op.name})"

    # -- shape helpers ---------------------------------------------------------------------
    @property
    def n_dims(self) -> int:
        """ggml_n_dims: index of the last dimension > 1, plus one (at least 1)."""
        for i in range(MAX_DIMS - 1, 0, -1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nrows(self) -> int:
        return self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nbytes(self) -> int:
        return nbytes(self)

    @property
    def is_view(self) -> bool:
        """ggml_impl_is_view: owns no memory (used by the allocator)."""
        return self.view_src is not None

    @property
    def is_view_op(self) -> bool:
        """ggml_is_view_op: VIEW/RESHAPE/PERMUTE/TRANSPOSE (used by the scheduler)."""
        return self.op in VIEW_OPS

    def op_param(self, i: int, default: Any = 0) -> Any:
        return self.op_params[i] if i < len(self.op_params) else default

    def set_name(self, name: str) -> Tensor:
        """ggml_set_name: names are truncated to MAX_NAME-1 characters, as in ggml."""
        self.name = name[: MAX_NAME - 1]
        return self

    def set_input(self) -> Tensor:
        """ggml_set_input: only this tensor."""
        self.flags |= TensorFlag.INPUT
        return self

    def set_output(self) -> Tensor:
        """ggml_set_output: this tensor and its view root, so the root's memory is kept too."""
        t: Tensor | None = self
        while t is not None:
            t.flags |= TensorFlag.OUTPUT
            t = t.view_src
        return self

    def set_param(self) -> Tensor:
        assert self.op == Op.NONE, "ggml_set_param needs a tensor with op NONE"
        self.flags |= TensorFlag.PARAM
        return self


def default_nb(type: GGMLType, ne: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """Strides of a fresh tensor: nb[0]=type_size, nb[1]=row size, then dense (no row padding)."""
    tt = TYPE_TRAITS[type]
    nb0 = tt.type_size
    nb1 = nb0 * (ne[0] // tt.blck_size)
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def nbytes(t: Tensor) -> int:
    """ggml_nbytes: the byte extent of a possibly strided tensor (0 if any ne is 0). Unrolled: the
    allocator asks for it ~10^4 times per graph plan."""
    ne, nb = t.ne, t.nb
    if ne[0] <= 0 or ne[1] <= 0 or ne[2] <= 0 or ne[3] <= 0:
        return 0
    tt = TYPE_TRAITS[t.type]
    rest = (ne[1] - 1) * nb[1] + (ne[2] - 1) * nb[2] + (ne[3] - 1) * nb[3]
    if tt.blck_size == 1:
        return tt.type_size + (ne[0] - 1) * nb[0] + rest
    return ne[0] * nb[0] // tt.blck_size + rest


def is_contiguous(t: Tensor) -> bool:
    """ggml_is_contiguous: strides are exactly the dense ones (dims of size 1 do not matter)."""
    tt = TYPE_TRAITS[t.type]
    next_nb = tt.type_size
    if t.ne[0] != tt.blck_size and t.nb[0] != next_nb:
        return False
    next_nb *= t.ne[0] // tt.blck_size
    for i in range(1, MAX_DIMS):
        if t.ne[i] != 1:
            if t.nb[i] != next_nb:
                return False
            next_nb *= t.ne[i]
    return True


def is_contiguous_rows(t: Tensor) -> bool:
    """Each row is dense (nb[0] == type_size); rows may be strided."""
    return t.ne[0] == TYPE_TRAITS[t.type].blck_size or t.nb[0] == TYPE_TRAITS[t.type].type_size


def are_same_shape(a: Tensor, b: Tensor) -> bool:
    return a.ne == b.ne


def can_repeat(a: Tensor, b: Tensor) -> bool:
    """ggml_can_repeat: b's shape is a multiple of a's in every dimension (a broadcasts to b)."""
    if a.nelements == 0:
        return b.nelements == 0
    return all(b.ne[i] % a.ne[i] == 0 for i in range(MAX_DIMS))


def view_root(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t

"""Element types and their block layout (ggml's type_traits, the size part only).

Every type a GGUF file can hold is listed, with block size and bytes per block read from the gguf
package's GGML_QUANT_SIZES table rather than retyped. How to turn blocks into floats is data work and
lives in backends/cpu/quants.py; core only needs sizes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

# GGMLType mirrors gguf's enum value-for-value, so a type id read from a GGUF file is a GGMLType.
if TYPE_CHECKING:
    # what the type checker sees: the members of gguf 0.19 (ggml.h's values). At run time the enum is built
    # from the installed gguf, so a type that gguf adds is a GGMLType without an edit here.
    class GGMLType(enum.IntEnum):
        """ggml_type: element type of a tensor (values as in ggml.h and GGUF files)."""
        F32 = 0
        F16 = 1
        Q4_0 = 2
        Q4_1 = 3
        Q5_0 = 6
        Q5_1 = 7
        Q8_0 = 8
        Q8_1 = 9
        Q2_K = 10
        Q3_K = 11
        Q4_K = 12
        Q5_K = 13
        Q6_K = 14
        Q8_K = 15
        IQ2_XXS = 16
        IQ2_XS = 17
        IQ3_XXS = 18
        IQ1_S = 19
        IQ4_NL = 20
        IQ3_S = 21
        IQ2_S = 22
        IQ4_XS = 23
        I8 = 24
        I16 = 25
        I32 = 26
        I64 = 27
        F64 = 28
        IQ1_M = 29
        BF16 = 30
        TQ1_0 = 34
        TQ2_0 = 35
        MXFP4 = 39
        NVFP4 = 40
        Q1_0 = 41
else:
    GGMLType = enum.IntEnum("GGMLType", {t.name: t.value for t in GGMLQuantizationType})
    GGMLType.__doc__ = "ggml_type: element type of a tensor (values as in ggml.h and GGUF files)."

_FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}
_INT_TYPES = {"I8", "I16", "I32", "I64"}


@dataclass(frozen=True, slots=True)
class TypeTraits:
    """Mirrors the size fields of ggml_type_traits: elements per block and bytes per block."""
    name: str
    blck_size: int
    type_size: int
    is_quantized: bool


TYPE_TRAITS: dict[GGMLType, TypeTraits] = {
    GGMLType(t.value): TypeTraits(
        name=t.name,
        blck_size=GGML_QUANT_SIZES[t][0],
        type_size=GGML_QUANT_SIZES[t][1],
        is_quantized=t.name not in _FLOAT_TYPES | _INT_TYPES,
    )
    for t in GGMLQuantizationType
    if t in GGML_QUANT_SIZES
}


def blck_size(t: GGMLType) -> int:
    return TYPE_TRAITS[t].blck_size


def type_size(t: GGMLType) -> int:
    return TYPE_TRAITS[t].type_size


def is_quantized(t: GGMLType) -> bool:
    return TYPE_TRAITS[t].is_quantized


def row_size(t: GGMLType, ne0: int) -> int:
    """ggml_row_size: bytes of one row of ne0 elements (ne0 must be a multiple of the block size)."""
    tt = TYPE_TRAITS[t]
    if ne0 % tt.blck_size != 0:
        raise ValueError(f"a row of {ne0} elements is not a whole number of {tt.name} blocks "
                         f"({tt.blck_size} elements each)")
    return ne0 // tt.blck_size * tt.type_size


def type_from_name(name: str) -> GGMLType:
    """Parse a type name such as 'q4_0' or 'F16' (CLI and config files)."""
    try:
        return GGMLType[name.upper()]
    except KeyError:
        known = ", ".join(m.name for m in GGMLType)
        raise ValueError(f"unknown ggml type '{name}'; known types: {known}") from None

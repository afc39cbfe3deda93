"""core/types.py: block layout of every GGUF type, row_size, name parsing."""
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ggml_dist.core.types import (GGMLType, TYPE_TRAITS, blck_size, is_quantized, row_size,
                                  type_from_name, type_size)


# every GGUF type: block size and bytes per block equal gguf's GGML_QUANT_SIZES
@pytest.mark.parametrize("qt", list(GGML_QUANT_SIZES), ids=lambda q: q.name)
def test_sizes_match_gguf(qt):
    t = GGMLType(qt.value)
    assert t.name == qt.name
    assert (blck_size(t), type_size(t)) == GGML_QUANT_SIZES[qt]
    assert TYPE_TRAITS[t].name == qt.name


# the enum mirrors gguf's value-for-value, so a type id read from a file is a GGMLType
def test_enum_values_mirror_gguf():
    for qt in GGMLQuantizationType:
        assert GGMLType(qt.value).name == qt.name


# float and integer types are not quantized; block formats are
def test_is_quantized():
    for name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
        assert not is_quantized(GGMLType[name])
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert is_quantized(GGMLType[name])


# row_size is blocks * bytes per block, for plain and block types
def test_row_size():
    assert row_size(GGMLType.F32, 7) == 28
    assert row_size(GGMLType.F16, 7) == 14
    assert row_size(GGMLType.Q4_0, 64) == 2 * 18
    assert row_size(GGMLType.Q8_0, 32) == 34
    assert row_size(GGMLType.Q4_K, 512) == 2 * 144
    assert row_size(GGMLType.Q6_K, 256) == 210


# a row that is not a whole number of blocks is refused with the type and block size named
def test_row_size_error():
    with pytest.raises(ValueError, match=r"33 elements.*Q4_0.*32"):
        row_size(GGMLType.Q4_0, 33)
    with pytest.raises(ValueError, match="Q4_K"):
        row_size(GGMLType.Q4_K, 128)


# type names parse case-insensitively; unknown names list the known ones
def test_type_from_name():
    assert type_from_name("q4_0") is GGMLType.Q4_0
    assert type_from_name("F16") is GGMLType.F16
    with pytest.raises(ValueError, match="unknown ggml type 'q3_x'.*Q4_0"):
        type_from_name("q3_x")

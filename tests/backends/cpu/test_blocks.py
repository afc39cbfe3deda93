"""blocks.py, the one table of block formats: it agrees with gguf's sizes and with ggml's structs, every
module that needs a block's layout reads it from there, and a quantizer's fields are checked against
their sizes."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import blocks, quants
from ggml_dist.backends.cpu import ops as cpu_ops
from ggml_dist.core.types import TYPE_TRAITS
from ggml_dist.core.types import GGMLType as T


def test_sizes_are_gguf_s():
    for t, f in blocks.BLOCKS.items():
        assert (f.elems, f.nbytes) == (TYPE_TRAITS[t].blck_size, TYPE_TRAITS[t].type_size), t.name


def test_fields_and_offsets():
    # ggml-common.h: block_q5_1 {d, m, qh[4], qs[16]}, block_q6_K {ql[128], qh[64], scales[16], d}
    q5_1, q6_K = blocks.BLOCKS[T.Q5_1], blocks.BLOCKS[T.Q6_K]
    assert [q5_1.off(f) for f in ("d", "m", "qh", "qs")] == [0, 2, 4, 8]
    assert q6_K["scales"] == slice(192, 208) and q6_K.off("d") == 208
    with pytest.raises(KeyError, match="no field"):
        q5_1.off("dmin")


def test_everyone_reads_the_table():
    assert quants.VEC_DOT_TYPE is blocks.VEC_DOT_TYPE
    assert cpu_ops._PACKABLE == blocks.QPACK_TYPES and cpu_ops._KPACKABLE == blocks.KPACK_TYPES
    assert blocks.VEC_DOT_TYPE[T.Q4_1] == T.Q8_1 and blocks.VEC_DOT_TYPE[T.Q6_K] == T.Q8_K
    assert T.Q8_K not in blocks.VEC_DOT_TYPE                # an activation type, not a weight type


def test_compiled_kernels_read_the_table():
    qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")
    qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")
    kpack = pytest.importorskip("ggml_dist.backends.cpu.kpack")
    assert {t: blocks.BLOCKS[t].gguf_kind for t in blocks.GGUF_KINDS} == qk._KIND
    assert tuple(blocks.BLOCKS[t].nbytes for t in blocks.GGUF_KINDS) == qk._BS
    assert qpack.PACKABLE == blocks.QPACK_TYPES and kpack.PACKABLE == blocks.KPACK_TYPES
    assert qpack._BLOCK[T.Q5_0] == (22, 6) and kpack._BLOCK[T.Q6_K] == 210


def test_assemble_checks_names_and_sizes():
    z = np.zeros((3, 2), np.uint8)
    parts = blocks.assemble(T.Q8_0, qs=np.zeros((3, 32), np.uint8), d=z)
    assert [p.shape[-1] for p in parts] == [2, 32]         # the table's byte order, not the call's
    with pytest.raises(ValueError, match="fields"):
        blocks.assemble(T.Q8_0, d=z)
    with pytest.raises(AssertionError):
        blocks.assemble(T.Q8_0, d=z, qs=z)

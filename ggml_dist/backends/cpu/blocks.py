"""The block formats of the CPU backend, one table (ggml-common.h's block_* structs).

Each row says, for one element type: the fields of a block in byte order (name, bytes), the elements a
block holds, what a MUL_MAT converts the activations to (ggml's vec_dot_type), and which compiled
kernels take its weights: ``gguf_kind`` is qkernels' code for the per-block decode of the file's rows,
``packed`` our repacked layout ("qpack": 64-row groups of blocks, "kpack": of superblocks), ``repack``
whether llama.cpp's x86 AVX2 build repacks it (its CPU_REPACK buffer, 8 rows interleaved; MUL_MAT then runs
that buffer's gemv/gemm, not vec_dot: other bits, quants.mul_mat's ``repacked``). Every other
module reads block bytes, field offsets, vec_dot types and kernel coverage from here: quants.py (numpy
decode and quantize), qkernels.py, qpack.py and kpack.py (packing and the kernels' offsets), ops.py
(which weights are packed). numba reads the module-level constants as compile-time constants, so the
kernels' numerics are those of the literals they replace.

The byte counts are checked against gguf's GGML_QUANT_SIZES (core.types.TYPE_TRAITS) at import.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...core.types import TYPE_TRAITS, GGMLType

T = GGMLType


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One block of `type`: ``fields`` in byte order, (name, bytes) each, covering the block."""
    type: GGMLType
    elems: int                                  # elements per block
    fields: tuple[tuple[str, int], ...]
    vec_dot: GGMLType | None                    # activations' type in a MUL_MAT; None: not a weight type
    gguf_kind: int | None = None                # qkernels' kind code; None: qkernels does not take it
    packed: str | None = None                   # "qpack" / "kpack": the repacked layout; None: unpacked
    repack: bool = False                        # llama.cpp's AVX2 build repacks it (ggml_repack_get_optimal_
                                                # repack_type), when ne[1] % 8 == 0

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.fields)

    def off(self, name: str) -> int:
        """Byte offset of field `name` in the block."""
        o = 0
        for f, n in self.fields:
            if f == name:
                return o
            o += n
        raise KeyError(f"{self.type.name} blocks have no field {name!r}: {[f for f, _ in self.fields]}")

    def __getitem__(self, name: str) -> slice:
        """The field's bytes as a slice of a block (``b[..., Q4_0["qs"]]``)."""
        o = self.off(name)
        return slice(o, o + dict(self.fields)[name])


# d, m: f16 scales (Q8_K: f32 d); e: an E8M0 scale (a power of two); qs: the codes; qh/hmask: high bits;
# scales: packed sub-block scales; bsums: int16 sums of 16 codes. Q8_1 has no row: its blocks are never
# stored (the activations stay arrays, quants.quantize_q8_1), and gguf's size for it (40 bytes, f32 d and s)
# is not ggml's (36).
BLOCKS: dict[GGMLType, BlockFormat] = {f.type: f for f in (
    BlockFormat(T.F32, 1, (("v", 4),), T.F32),
    BlockFormat(T.F16, 1, (("v", 2),), T.F16),
    BlockFormat(T.BF16, 1, (("v", 2),), T.BF16),
    BlockFormat(T.Q4_0, 32, (("d", 2), ("qs", 16)), T.Q8_0, 0, "qpack", repack=True),
    BlockFormat(T.Q4_1, 32, (("d", 2), ("m", 2), ("qs", 16)), T.Q8_1, 1, "qpack"),
    BlockFormat(T.Q5_0, 32, (("d", 2), ("qh", 4), ("qs", 16)), T.Q8_0, 2, "qpack"),
    BlockFormat(T.Q5_1, 32, (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)), T.Q8_1, 3, "qpack"),
    BlockFormat(T.Q8_0, 32, (("d", 2), ("qs", 32)), T.Q8_0, 4, "qpack"),
    BlockFormat(T.Q4_K, 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)), T.Q8_K, 5, "kpack",
                repack=True),
    BlockFormat(T.Q5_K, 256, (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)), T.Q8_K, 6,
                "kpack"),
    BlockFormat(T.Q6_K, 256, (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)), T.Q8_K, 7, "kpack"),
    BlockFormat(T.Q2_K, 256, (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)), T.Q8_K, 8),
    BlockFormat(T.Q3_K, 256, (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)), T.Q8_K, 9),
    BlockFormat(T.Q8_K, 256, (("d", 4), ("qs", 256), ("bsums", 32)), None),
    # gpt-oss's experts; no gguf_kind: qkernels has a kernel of its own for it (_mm_mxfp4); qpack packs it
    # where ggml repacks it (its chain order, int8 kernels) and keeps the file's rows elsewhere
    BlockFormat(T.MXFP4, 32, (("e", 1), ("qs", 16)), T.Q8_0, packed="qpack", repack=True),
)}

for _f in BLOCKS.values():          # an invariant: the table agrees with the file format's sizes
    _tt = TYPE_TRAITS[_f.type]
    assert (_f.elems, _f.nbytes) == (_tt.blck_size, _tt.type_size), (_f.type.name, _f.elems, _f.nbytes)

# what a MUL_MAT converts the activations to, per weight type (ggml's type_traits_cpu[].vec_dot_type)
VEC_DOT_TYPE: dict[GGMLType, GGMLType] = {t: f.vec_dot for t, f in BLOCKS.items() if f.vec_dot is not None}
QPACK_TYPES = frozenset(t for t, f in BLOCKS.items() if f.packed == "qpack")
KPACK_TYPES = frozenset(t for t, f in BLOCKS.items() if f.packed == "kpack")
REPACK_TYPES = frozenset(t for t, f in BLOCKS.items() if f.repack)
# qkernels' kinds in code order: GGUF_KINDS[k] is the type of kind k
GGUF_KINDS: tuple[GGMLType, ...] = tuple(sorted((t for t, f in BLOCKS.items() if f.gguf_kind is not None),
                                                key=lambda t: BLOCKS[t].gguf_kind or 0))
assert [BLOCKS[t].gguf_kind for t in GGUF_KINDS] == list(range(len(GGUF_KINDS)))


def ggml_repacks(type: GGMLType, n_rows: int) -> bool:
    """Whether llama.cpp's x86 AVX2 build puts a weight of `type` with n_rows rows (ne[1]) in its CPU_REPACK
    buffer, where MUL_MAT / MUL_MAT_ID run the repack kernels. A weight that is not in that buffer (a tied
    token embedding used as the output head) is not repacked whatever this says."""
    return type in REPACK_TYPES and n_rows % 8 == 0


def assemble(type: GGMLType, **parts) -> list:
    """A quantizer's fields (uint8 arrays [..., bytes]) in the table's byte order, each checked against its
    size: the list to concatenate along the last axis into blocks of `type`."""
    fmt = BLOCKS[type]
    if set(parts) != {f for f, _ in fmt.fields}:
        raise ValueError(f"{type.name} fields are {[f for f, _ in fmt.fields]}, got {sorted(parts)}")
    out = []
    for f, n in fmt.fields:
        assert parts[f].shape[-1] == n, (type.name, f, parts[f].shape, n)
        out.append(parts[f])
    return out

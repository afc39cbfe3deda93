"""GGUF loader: round trips against gguf.GGUFWriter/GGUFReader, the real SmolLM2 file, and malformed
files (every one must raise GGUFError, quickly, never crash or allocate past the file size)."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from ggml_dist.core.types import GGMLType
from ggml_dist.model.gguf import GGUFError, GGUFFile, GGUFValueType, TensorInfo, load_gguf
from ggml_dist.model.hparams import hparams_from_gguf
from ggml_dist.model.tensors import check_tensors

# ---------------------------------------------------------------------------------------------------
# synthetic files


def write_small(path: Path, alignment: int | None = None) -> Path:
    """A GGUF with every value type and three tensors (f32, f16, q4_0 raw bytes)."""
    w = gguf.GGUFWriter(str(path), "test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 1.5)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ▁ 🤗")
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, 1.5])
    w.add_array("t.arr_str", ["a", "", "ccc"])
    w.add_tensor("w.a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("w.b", np.ones((2, 2, 2), dtype=np.float16))
    q = np.arange(2 * 18, dtype=np.uint8)          # two Q4_0 blocks = one row of 64 elements
    w.add_tensor("w.c", q.reshape(1, 36), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def small(tmp_path: Path) -> Path:
    return write_small(tmp_path / "small.gguf")


def test_small_file_round_trip(small: Path) -> None:
    f = load_gguf(small)
    md = f.metadata
    assert f.version == 3 and f.alignment == 32
    assert md["general.architecture"] == "test"
    assert (md["t.u8"], md["t.i8"], md["t.u16"], md["t.i16"]) == (200, -100, 60000, -30000)
    assert (md["t.u32"], md["t.i32"], md["t.u64"], md["t.i64"]) == (4_000_000_000, -2_000_000_000,
                                                                    2**63 + 5, -(2**62))
    assert md["t.f32"] == 1.5 and md["t.f64"] == 0.1 and md["t.bool"] is True
    assert md["t.str"] == "héllo ▁ 🤗"
    assert md["t.arr_i32"].tolist() == [1, -2, 3] and md["t.arr_i32"].dtype == np.int32
    assert md["t.arr_f32"].tolist() == [0.5, 1.5]
    assert md["t.arr_str"] == ["a", "", "ccc"]
    assert f.metadata_types["t.u64"] == GGUFValueType.UINT64

    a, b, c = f.tensors["w.a"], f.tensors["w.b"], f.tensors["w.c"]
    assert (a.type, a.ne, a.nbytes) == (GGMLType.F32, (4, 3, 1, 1), 48)
    assert (b.type, b.ne, b.nbytes) == (GGMLType.F16, (2, 2, 2, 1), 16)
    assert (c.type, c.ne, c.nbytes) == (GGMLType.Q4_0, (64, 1, 1, 1), 36)
    assert a.n_dims == 2 and b.n_dims == 3 and c.n_dims == 1
    assert np.array_equal(f.data("w.a").view(np.float32), np.arange(12, dtype=np.float32))
    assert np.array_equal(f.data("w.c"), np.arange(36, dtype=np.uint8))
    assert isinstance(f.data("w.a"), np.memmap)       # a view of the map, no copy

    # offsets agree with gguf's own reader
    r = gguf.GGUFReader(str(small))
    for t in r.tensors:
        assert f.tensors[t.name].offset == t.data_offset
        assert f.tensors[t.name].nbytes == t.n_bytes
    with pytest.raises(GGUFError, match="no tensor named 'zz'"):
        f.data("zz")


def test_custom_alignment(tmp_path: Path) -> None:
    f = load_gguf(write_small(tmp_path / "a.gguf", alignment=64))
    assert f.alignment == 64
    assert all(t.offset % 64 == 0 for t in f.tensors.values())
    assert np.array_equal(f.data("w.a").view(np.float32), np.arange(12, dtype=np.float32))


# ---------------------------------------------------------------------------------------------------
# malformed files


def _patch(src: Path, dst: Path, offset: int, data: bytes) -> Path:
    b = bytearray(src.read_bytes())
    b[offset:offset + len(data)] = data
    dst.write_bytes(bytes(b))
    return dst


def _tensor_info_offset(raw: bytes, name: str) -> int:
    """Offset of the n_dims field of tensor `name`'s info (right after its name string)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    i = raw.index(key)
    return i + len(key)


def test_truncated_everywhere(small: Path, tmp_path: Path) -> None:
    raw = small.read_bytes()
    f = load_gguf(small)
    end_of_data = max(t.offset + t.nbytes for t in f.tensors.values())
    p = tmp_path / "trunc.gguf"
    for n in range(end_of_data):
        p.write_bytes(raw[:n])
        with pytest.raises(GGUFError):
            load_gguf(p)


def test_random_corruption_never_crashes(small: Path, tmp_path: Path) -> None:
    raw = small.read_bytes()
    header_end = load_gguf(small).data_offset
    rng = np.random.default_rng(0)
    p = tmp_path / "fuzz.gguf"
    for _ in range(400):
        b = bytearray(raw)
        for _ in range(int(rng.integers(1, 4))):
            i = int(rng.integers(0, header_end))
            b[i] = int(rng.integers(0, 256))
        p.write_bytes(bytes(b))
        try:
            load_gguf(p)
        except GGUFError:
            pass


@pytest.mark.parametrize("case, match", [
    ("magic", "bad magic"), ("version1", "version 1"), ("version4", "version 4"),
    ("big_endian", "big-endian"), ("n_tensors", "n_tensors=1152921504606846976"), ("n_kv", "n_kv=1099511627776"),
    ("string_len", "string length 9223372036854775808"), ("array_len", "array of 2305843009213693952 INT32"),
    ("value_type", "unknown value type 99"), ("n_dims", "n_dims 5"), ("ne_zero", r"ne\[0\] = 0"),
    ("ne_huge", r"ne\[0\] = 9223372036854775809"), ("type_unknown", "unknown ggml type id 1000"),
    ("type_removed", "unknown ggml type id 4"),
    ("ne0_block", "ne\\[0\\] = 48 is not a multiple of the Q4_0 block size 32"),
    ("offset_eof", "runs past the end of the file"), ("offset_unaligned", "not a multiple of the alignment 32"),
    ("alignment", "power-of-two"), ("empty", "too small"), ("tiny", "too small"),
])
def test_bad_files(case: str, match: str, small: Path, tmp_path: Path) -> None:
    raw = small.read_bytes()
    dst = tmp_path / f"{case}.gguf"
    ti_c = _tensor_info_offset(raw, "w.c")          # n_dims | ne[0] ne[1] | type | offset
    ti_a = _tensor_info_offset(raw, "w.a")          # n_dims | ne[0] ne[1] | type | offset
    key = struct.pack("<Q", len("t.arr_i32")) + b"t.arr_i32"
    arr = raw.index(key) + len(key) + 4 + 4       # the array's u64 count (after ARRAY tag, INT32 tag)
    patches = {
        "magic": (0, b"GGUG"),
        "version1": (4, struct.pack("<I", 1)),
        "version4": (4, struct.pack("<I", 4)),
        "big_endian": (4, struct.pack(">I", 3)),
        "n_tensors": (8, struct.pack("<Q", 2**60)),
        "n_kv": (16, struct.pack("<Q", 2**40)),
        "string_len": (24, struct.pack("<Q", 2**63)),
        "array_len": (arr, struct.pack("<Q", 2**61)),
        "value_type": (24 + 8 + len("general.architecture"), struct.pack("<I", 99)),
        "n_dims": (ti_a, struct.pack("<I", 5)),
        "ne_zero": (ti_a + 4, struct.pack("<Q", 0)),
        "ne_huge": (ti_a + 4, struct.pack("<Q", 2**63 + 1)),
        "type_unknown": (ti_c + 4 + 16, struct.pack("<I", 1000)),
        "type_removed": (ti_c + 4 + 16, struct.pack("<I", 4)),     # Q4_2, removed from ggml
        "ne0_block": (ti_c + 4, struct.pack("<Q", 48)),          # not a multiple of 32
        "offset_eof": (ti_c + 4 + 16 + 4, struct.pack("<Q", 2**40)),
        "offset_unaligned": (ti_c + 4 + 16 + 4, struct.pack("<Q", 64 + 3)),
    }
    if case == "empty":
        dst.write_bytes(b"")
    elif case == "tiny":
        dst.write_bytes(b"GGUF\x03\x00\x00\x00")
    elif case == "alignment":
        write_small(tmp_path / "al.gguf", alignment=64)
        raw = (tmp_path / "al.gguf").read_bytes()
        key = struct.pack("<Q", len("general.alignment")) + b"general.alignment"
        _patch(tmp_path / "al.gguf", dst, raw.index(key) + len(key) + 4, struct.pack("<I", 48))
    else:
        _patch(small, dst, *patches[case])
    with pytest.raises(GGUFError, match=match) as e:
        load_gguf(dst)
    assert str(dst) in str(e.value)   # the message names the file


def test_error_messages_name_field_and_numbers(small: Path, tmp_path: Path) -> None:
    raw = small.read_bytes()
    with pytest.raises(GGUFError, match=r"n_tensors=1152921504606846976"):
        load_gguf(_patch(small, tmp_path / "x.gguf", 8, struct.pack("<Q", 2**60)))
    ti_c = _tensor_info_offset(raw, "w.c")
    with pytest.raises(GGUFError, match=r"tensor 'w.c': unknown ggml type id 1000"):
        load_gguf(_patch(small, tmp_path / "y.gguf", ti_c + 20, struct.pack("<I", 1000)))
    with pytest.raises(GGUFError, match=r"bad magic"):
        load_gguf(_patch(small, tmp_path / "z.gguf", 0, b"GGML"))


def test_duplicate_key_and_tensor(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "d.gguf"), "test")
    w.add_uint32("k.one", 1)
    w.add_uint32("k.two", 2)
    w.add_tensor("t1", np.zeros(4, np.float32))
    w.add_tensor("t2", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = (tmp_path / "d.gguf").read_bytes()
    dup_kv = tmp_path / "dk.gguf"
    dup_kv.write_bytes(raw.replace(b"k.two", b"k.one"))
    with pytest.raises(GGUFError, match="duplicate metadata key 'k.one'"):
        load_gguf(dup_kv)
    dup_t = tmp_path / "dt.gguf"
    dup_t.write_bytes(raw.replace(b"t2", b"t1"))
    with pytest.raises(GGUFError, match="duplicate tensor name 't1'"):
        load_gguf(dup_t)


# ---------------------------------------------------------------------------------------------------
# the real model


def test_smollm2_loads(smollm2_gguf: GGUFFile) -> None:
    f = smollm2_gguf
    assert f.version == 3 and len(f.tensors) == 272
    assert f.metadata["general.architecture"] == "llama"
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    emb = f.tensors["token_embd.weight"]
    assert emb.type == GGMLType.Q8_0 and emb.ne == (576, 49152, 1, 1)
    assert f.data("token_embd.weight").nbytes == emb.nbytes == 49152 * 576 // 32 * 34
    # tensors are aligned, inside the file, and do not overlap
    spans = sorted((t.offset, t.offset + t.nbytes) for t in f.tensors.values())
    assert spans[0][0] == f.data_offset and spans[-1][1] <= Path(f.path).stat().st_size
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(t.offset % f.alignment == 0 for t in f.tensors.values())
    norm = f.data("output_norm.weight").view(np.float32)
    assert norm.shape == (576,) and np.isfinite(norm).all() and norm.mean() > 0


def test_smollm2_hparams(smollm2_gguf: GGUFFile) -> None:
    hp = hparams_from_gguf(smollm2_gguf)
    assert (hp.arch, hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer) == ("llama", 49152, 8192, 576, 30)
    assert (hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_rot) == (9, 3, 1536, 64)
    assert hp.rope_freq_base == 100000.0 and hp.rope_freq_scale == 1.0
    assert hp.f_norm_rms_eps == pytest.approx(1e-5)
    assert hp.tie_word_embeddings and hp.n_embd_k_gqa == 192 and hp.n_gqa == 3
    check_tensors(smollm2_gguf, hp)


def test_tensor_info_is_frozen() -> None:
    ti = TensorInfo("x", GGMLType.F32, (1, 1, 1, 1), 0, 4)
    with pytest.raises(AttributeError):
        ti.offset = 3  # type: ignore[misc]

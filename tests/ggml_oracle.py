"""llama.cpp's own ggml as a test oracle (dev-only): one op, or a tiny graph, on the CPU backend of the
installed llama-cpp-python wheel, through ggml's public C API (ctypes), so our kernels can be compared bit
for bit with the real thing.

    g = Graph(n_threads=1)                        # one ggml context (no_alloc) and a CPU backend
    w = g.tensor(GGMLType.MXFP4, (K, M), w_bytes, repack=True)   # ne in ggml order, raw bytes
    x = g.array(x_f32)                            # ne = the array's shape reversed
    y = g.op("mul_mat", w, x)                     # the real builder, ggml_mul_mat(ctx, w, x)
    out = g.compute(y)                            # numpy: ne[:n_dims] reversed, read through nb

and the helpers built on it: ``mul_mat``, ``mul_mat_id``, ``run`` (one op on arrays), ``quantize``
(ggml_quantize_chunk) and ``dequantize`` (GET_ROWS).

Weights and the repack buffer. llama.cpp places a weight whose type its CPU build repacks (on AVX2: Q4_0,
Q4_K, IQ4_NL and MXFP4, each when ne[1] % 8 == 0) in the extra buffer type CPU_REPACK, and MUL_MAT /
MUL_MAT_ID then run the repack kernels (gemv/gemm) instead of vec_dot: other bits. ``repack=True`` puts a
leaf in its own context, allocated from that buffer type (ggml_backend_dev_get_extra_bufts), whose
set_tensor interleaves the rows; ``Graph.buffer_name`` says where a tensor lives. Everything else is
allocated in the plain CPU buffer type, one buffer for the context, every tensor its own bytes.

Only the head of struct ggml_tensor is mirrored (type, buffer, ne, nb: ggml.h of 0.25.3), to read a
result's shape and strides; data goes through ggml_backend_tensor_set/get. A failed GGML_ASSERT aborts
the process, so the helpers check shapes before they call ggml.

Unavailable (no llama-cpp-python, as in CI's `.[test]`): ``unavailable()`` gives the reason, and tests
skip with it: ``pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")`` with
``REASON = unavailable()``, as test_ggml_oracle.py does (test_mxfp4.py marks only its oracle tests).
"""
from __future__ import annotations

import ctypes
import importlib.util
from ctypes import POINTER, c_bool, c_char_p, c_float, c_int, c_int64, c_size_t, c_void_p
from functools import cache
from pathlib import Path
from typing import overload

import numpy as np

from ggml_dist.core.types import GGMLType, row_size

T = GGMLType

# the types whose weights llama.cpp's AVX2 build repacks (ggml_repack_get_optimal_repack_type), when
# ne[1] % 8 == 0; asking for another gives a tensor without repack traits, which ggml dereferences
REPACK_TYPES = frozenset({T.Q4_0, T.Q4_K, T.IQ4_NL, T.MXFP4})

# numpy dtype of an element type that a result can have
_DTYPE = {T.F32: np.float32, T.F16: np.float16, T.I32: np.int32}
_ARRAY_TYPE = {np.dtype(np.float32): T.F32, np.dtype(np.float16): T.F16, np.dtype(np.int32): T.I32}


class OracleUnavailable(RuntimeError):
    """llama-cpp-python (its libggml) is not installed here."""


# ------------------------------------------------------------------------------------------------
# the library
class _TensorHead(ctypes.Structure):
    """The leading fields of struct ggml_tensor (ggml.h, GGML_MAX_DIMS = 4); nothing after nb is read."""
    _fields_ = [("type", c_int), ("buffer", c_void_p), ("ne", c_int64 * 4), ("nb", c_size_t * 4)]


class _InitParams(ctypes.Structure):
    """struct ggml_init_params, passed by value to ggml_init."""
    _fields_ = [("mem_size", c_size_t), ("mem_buffer", c_void_p), ("no_alloc", c_bool)]


# ggml.h builders: name -> the kinds of the arguments after ctx ("t" tensor, "f" float, "i" int);
# each returns the new tensor
_BUILDERS: dict[str, str] = {
    "mul_mat": "tt", "mul_mat_id": "ttt", "get_rows": "tt",
    "add": "tt", "mul": "tt", "div": "tt", "add_id": "ttt",
    "scale": "tf", "clamp": "tff", "sum_rows": "t", "cont": "t",
    "sigmoid": "t", "silu": "t", "soft_max": "t", "soft_max_ext": "ttff", "swiglu_oai": "ttff",
    "argsort": "ti", "argsort_top_k": "ti", "top_k": "ti",
    "ssm_conv": "tt", "l2_norm": "tf", "softplus": "t", "concat": "tti",
    "gated_delta_net": "ttttttl",           # q, k, v, g, beta, state, int64_t K (state snapshots kept)
    "rope_multi": "tttipiiffffff",          # a, pos, freq_factors, n_dims, sections[4], mode, n_ctx_orig, ...
}
_KIND = {"t": c_void_p, "f": c_float, "i": c_int, "p": POINTER(c_int), "l": c_int64}

# plain C functions (no context): name -> (argtypes, restype)
_FUNCS: dict[str, tuple[list, object]] = {
    "ggml_init": ([_InitParams], c_void_p),
    "ggml_free": ([c_void_p], None),
    "ggml_tensor_overhead": ([], c_size_t),
    "ggml_graph_overhead": ([], c_size_t),
    "ggml_new_tensor": ([c_void_p, c_int, c_int, POINTER(c_int64)], c_void_p),
    "ggml_new_graph": ([c_void_p], c_void_p),
    "ggml_build_forward_expand": ([c_void_p, c_void_p], None),
    "ggml_nbytes": ([c_void_p], c_size_t),
    "ggml_n_dims": ([c_void_p], c_int),
    "ggml_soft_max_add_sinks": ([c_void_p, c_void_p], None),
    "ggml_quantize_chunk": ([c_int, c_void_p, c_void_p, c_int64, c_int64, c_int64, c_void_p], c_size_t),
    "ggml_backend_alloc_ctx_tensors_from_buft": ([c_void_p, c_void_p], c_void_p),
    "ggml_backend_buffer_free": ([c_void_p], None),
    "ggml_backend_buffer_name": ([c_void_p], c_char_p),
    "ggml_backend_buft_name": ([c_void_p], c_char_p),
    "ggml_backend_tensor_set": ([c_void_p, c_void_p, c_size_t, c_size_t], None),
    "ggml_backend_tensor_get": ([c_void_p, c_void_p, c_size_t, c_size_t], None),
    "ggml_backend_graph_compute": ([c_void_p, c_void_p], c_int),
    "ggml_backend_free": ([c_void_p], None),
    "ggml_backend_cpu_init": ([], c_void_p),
    "ggml_backend_cpu_set_n_threads": ([c_void_p, c_int], None),
    "ggml_backend_cpu_buffer_type": ([], c_void_p),
    "ggml_backend_cpu_reg": ([], c_void_p),
    "ggml_backend_reg_dev_get": ([c_void_p, c_size_t], c_void_p),
    "ggml_backend_reg_get_proc_address": ([c_void_p, c_char_p], c_void_p),
}


def lib_dir() -> Path:
    """llama_cpp's lib/ folder (found without importing llama_cpp, which would load libllama)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise OracleUnavailable("llama-cpp-python is not installed (pip install -e '.[dev]' installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "lib"


@cache
def _lib() -> ctypes.CDLL:
    """libggml-cpu (and, loaded first, libggml-base: the core, ggml-alloc and ggml-backend), every function
    this module calls declared once."""
    d = lib_dir()
    for name in ("libggml-base.so", "libggml-cpu.so"):
        if not (d / name).exists():
            raise OracleUnavailable(f"{d / name} is missing: llama-cpp-python was built without a shared libggml")
    ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)      # dlsym finds base's too
    for name, (argtypes, restype) in _FUNCS.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, restype
    for name, kinds in _BUILDERS.items():
        f = getattr(lib, "ggml_" + name)
        f.argtypes, f.restype = [c_void_p] + [_KIND[k] for k in kinds], c_void_p
    return lib


def unavailable() -> str | None:
    """Why the oracle cannot run here, or None if it can."""
    try:
        _lib()
    except (OracleUnavailable, OSError, AttributeError) as e:
        return f"llama.cpp's ggml oracle unavailable: {e}"
    return None


@cache
def repack_buft() -> int:
    """The CPU device's extra buffer type named CPU_REPACK (ggml_backend_dev_get_extra_bufts)."""
    lib = _lib()
    reg = lib.ggml_backend_cpu_reg()
    get_extra = ctypes.CFUNCTYPE(POINTER(c_void_p), c_void_p)(
        lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
    bufts = get_extra(lib.ggml_backend_reg_dev_get(reg, 0))      # NULL-terminated
    i = 0
    while bufts[i]:
        if lib.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return int(bufts[i])
        i += 1
    raise OracleUnavailable("this libggml-cpu has no CPU_REPACK buffer type (built without GGML_CPU_REPACK)")


# ------------------------------------------------------------------------------------------------
# a graph
class Graph:
    """One ggml context (no_alloc: headers only) plus one for repacked leaves, and a CPU backend.
    Build with tensor/array/op, then compute() once: it allocates every tensor, sets the leaves, runs
    ggml_backend_graph_compute and reads the results back. A context manager; close() frees it all."""

    def __init__(self, n_threads: int = 1, max_tensors: int = 64) -> None:
        self.lib = lib = _lib()
        mem = max_tensors * lib.ggml_tensor_overhead() + lib.ggml_graph_overhead()
        self.ctx = lib.ggml_init(_InitParams(mem, None, True))
        self.wctx = lib.ggml_init(_InitParams(max_tensors * lib.ggml_tensor_overhead(), None, True))
        self.backend = lib.ggml_backend_cpu_init()
        lib.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        self.leaves: list[tuple[int, np.ndarray]] = []         # (tensor, its bytes), set after allocation
        self.buffers: list[int] = []
        self.n_repacked = 0
        self.computed = False

    def __enter__(self) -> Graph:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        lib = self.lib
        for b in self.buffers:
            lib.ggml_backend_buffer_free(b)
        self.buffers = []
        if self.ctx:
            lib.ggml_free(self.ctx)
            lib.ggml_free(self.wctx)
            lib.ggml_backend_free(self.backend)
            self.ctx = self.wctx = self.backend = None

    # leaves
    def tensor(self, type: GGMLType, ne: tuple[int, ...], data: np.ndarray | bytes, repack: bool = False) -> int:
        """A leaf of `type` with ne (ggml order) holding `data` (its rows of blocks, as bytes). repack: in
        the CPU_REPACK buffer (a weight of REPACK_TYPES with ne[1] % 8 == 0)."""
        type = GGMLType(type)
        ne = tuple(int(n) for n in ne)
        assert 1 <= len(ne) <= 4, ne
        raw = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data).view(np.uint8)
        want = row_size(type, ne[0]) * int(np.prod(ne[1:], dtype=np.int64))
        if raw.size != want:
            raise ValueError(f"{type.name} tensor of ne {ne} needs {want} bytes, got {raw.size}")
        if repack and (type not in REPACK_TYPES or len(ne) < 2 or ne[1] % 8):
            raise ValueError(f"llama.cpp does not repack a {type.name} tensor of ne {ne} on AVX2 "
                             f"(types {sorted(t.name for t in REPACK_TYPES)}, ne[1] % 8 == 0)")
        ctx = self.wctx if repack else self.ctx
        t = self.lib.ggml_new_tensor(ctx, int(type), len(ne), (c_int64 * len(ne))(*ne))
        assert tuple(self.head(t).ne[:len(ne)]) == ne, "struct ggml_tensor's head is not this ggml.h's"
        self.leaves.append((t, raw.reshape(-1)))
        self.n_repacked += repack
        return t

    def array(self, x: np.ndarray) -> int:
        """A leaf holding a float32 / float16 / int32 array; ne = its shape reversed."""
        x = np.asarray(x)
        if x.dtype not in _ARRAY_TYPE:
            raise TypeError(f"array leaves are float32, float16 or int32, not {x.dtype}")
        return self.tensor(_ARRAY_TYPE[x.dtype], x.shape[::-1] or (1,), x)

    # nodes
    def op(self, name: str, *args) -> int:
        """ggml_<name>(ctx, *args) for a builder of _BUILDERS: tensors, then the op's scalar parameters."""
        kinds = _BUILDERS.get(name)
        if kinds is None:
            raise KeyError(f"no builder {name!r} declared here; add its argument kinds to _BUILDERS")
        if len(args) != len(kinds):
            raise TypeError(f"ggml_{name} takes {len(kinds)} arguments after ctx ({kinds}), got {len(args)}")
        t = getattr(self.lib, "ggml_" + name)(self.ctx, *args)
        assert t, f"ggml_{name} returned NULL"
        return t

    def soft_max_add_sinks(self, t: int, sinks: int) -> None:
        """ggml_soft_max_add_sinks: the sinks (F32 [n_head]) as src[2] of a SOFT_MAX node."""
        self.lib.ggml_soft_max_add_sinks(t, sinks)

    # inspection
    @staticmethod
    def head(t: int) -> _TensorHead:
        return _TensorHead.from_address(t)

    def buffer_name(self, t: int) -> str:
        """The name of the buffer t was allocated in (after compute): "CPU", "CPU_REPACK"."""
        return self.lib.ggml_backend_buffer_name(self.head(t).buffer).decode()

    # run
    @overload
    def compute(self, out: int, /) -> np.ndarray: ...
    @overload
    def compute(self, out: int, out2: int, /, *more: int) -> list[np.ndarray]: ...

    def compute(self, *outs: int) -> np.ndarray | list[np.ndarray]:
        """Allocate, set the leaves, compute the graph of outs, read them back (an array for one out, a list
        for several)."""
        assert not self.computed, "a Graph computes once"
        self.computed = True
        lib = self.lib
        gf = lib.ggml_new_graph(self.ctx)
        for o in outs:
            lib.ggml_build_forward_expand(gf, o)
        if self.n_repacked:
            self._alloc(self.wctx, repack_buft())
        self._alloc(self.ctx, lib.ggml_backend_cpu_buffer_type())
        for t, raw in self.leaves:
            assert raw.size == lib.ggml_nbytes(t)
            lib.ggml_backend_tensor_set(t, raw.ctypes.data, 0, raw.size)      # the repack buffer repacks here
        status = lib.ggml_backend_graph_compute(self.backend, gf)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute failed: status {status}")
        res = [self.read(o) for o in outs]
        return res[0] if len(res) == 1 else res

    def _alloc(self, ctx: int, buft: int) -> None:
        buf = self.lib.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
        if not buf:
            raise RuntimeError(f"ggml_backend_alloc_ctx_tensors_from_buft({self.lib.ggml_backend_buft_name(buft)}) "
                               f"failed")
        self.buffers.append(buf)

    def read(self, t: int) -> np.ndarray:
        """t's elements as numpy, shape = ne[:ggml_n_dims] reversed (ggml's trailing 1s dropped), read through
        its nb: views such as argsort_top_k's too."""
        h = self.head(t)
        nd = self.lib.ggml_n_dims(t)
        type = GGMLType(h.type)
        if type not in _DTYPE:
            raise TypeError(f"reading {type.name} tensors is not supported (F32, F16, I32)")
        n = self.lib.ggml_nbytes(t)
        raw = np.empty(n, np.uint8)
        self.lib.ggml_backend_tensor_get(t, raw.ctypes.data, 0, n)
        itemsize = np.dtype(_DTYPE[type]).itemsize
        raw = np.concatenate([raw, np.zeros(-n % itemsize, np.uint8)])
        flat = raw.view(_DTYPE[type])
        return np.lib.stride_tricks.as_strided(flat, tuple(h.ne)[:nd][::-1], tuple(h.nb)[:nd][::-1]).copy()


# ------------------------------------------------------------------------------------------------
# helpers
def _weight_ne(wtype: GGMLType, w: np.ndarray, K: int) -> tuple[int, ...]:
    """ne of a weight given as uint8 rows [..., row bytes] (or float32 [..., K] for F32)."""
    lead = w.shape[:-1]
    nbytes = w.shape[-1] * w.dtype.itemsize
    if nbytes != row_size(wtype, K):
        raise ValueError(f"{wtype.name} rows of {K} elements have {row_size(wtype, K)} bytes, not {nbytes}")
    return (K, *lead[::-1])


def mul_mat(wtype: GGMLType, w: np.ndarray, x: np.ndarray, repack: bool = False, n_threads: int = 1) -> np.ndarray:
    """MUL_MAT of a weight w (uint8 rows [M, row bytes], ne (K, M)) and x (f32 [N, K]) -> f32 [N, M], the
    weight in the plain CPU buffer (vec_dot / llamafile / tiled) or, repack=True, in CPU_REPACK."""
    x = np.ascontiguousarray(x, np.float32)
    with Graph(n_threads) as g:
        wt = g.tensor(wtype, _weight_ne(wtype, w, x.shape[-1]), w, repack=repack)
        out = g.compute(g.op("mul_mat", wt, g.array(x)))
        assert g.buffer_name(wt) == ("CPU_REPACK" if repack else "CPU"), g.buffer_name(wt)
    return out.reshape(x.shape[0], w.shape[0])


def mul_mat_id(wtype: GGMLType, w: np.ndarray, x: np.ndarray, ids: np.ndarray, repack: bool = False,
               n_threads: int = 1) -> np.ndarray:
    """MUL_MAT_ID: w uint8 [n_expert, M, row bytes] (ne (K, M, n_expert)); x f32 [n_tokens, n_b, K] with
    n_b = 1 (every chosen expert reads the token's row) or n_used; ids int32 [n_tokens, n_used] ->
    f32 [n_tokens, n_used, M]: out[t, i] = w[ids[t, i]] . x[t, i % n_b]."""
    x = np.ascontiguousarray(x, np.float32)
    ids = np.ascontiguousarray(ids, np.int32)
    n_expert = w.shape[0]
    if x.ndim != 3 or ids.ndim != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] % x.shape[1]:
        raise ValueError(f"mul_mat_id: x {x.shape} (n_tokens, n_b, K), ids {ids.shape} (n_tokens, n_used)")
    if ids.size and not (ids.min() >= 0 and ids.max() < n_expert):
        raise ValueError(f"mul_mat_id: expert ids outside 0..{n_expert - 1}")
    with Graph(n_threads) as g:
        wt = g.tensor(wtype, _weight_ne(wtype, w, x.shape[-1]), w, repack=repack)
        out = g.compute(g.op("mul_mat_id", wt, g.array(x), g.array(ids)))
        assert g.buffer_name(wt) == ("CPU_REPACK" if repack else "CPU"), g.buffer_name(wt)
    return out.reshape(*ids.shape, w.shape[1])


def run(name: str, *args, n_threads: int = 1) -> np.ndarray:
    """One op on arrays: numpy arrays become leaves (None stays NULL: an absent mask), other values are
    the op's scalar parameters, e.g. run("soft_max_ext", kq, mask, 0.125, 0.0), run("argsort", x, 1)."""
    with Graph(n_threads) as g:
        targs = [g.array(a) if isinstance(a, np.ndarray) else a for a in args]
        return g.compute(g.op(name, *targs))


def quantize(type: GGMLType, x: np.ndarray) -> np.ndarray:
    """ggml_quantize_chunk (the ggml-base quantize_<type>, i.e. quantize_row_<type>_ref where there is no
    importance matrix): f32 [rows, K] -> uint8 [rows, row bytes]."""
    x = np.ascontiguousarray(x, np.float32)
    rows, K = x.shape
    out = np.zeros((rows, row_size(type, K)), np.uint8)
    n = _lib().ggml_quantize_chunk(int(type), x.ctypes.data, out.ctypes.data, 0, rows, K, None)
    assert n == out.size, (n, out.size)
    return out


def dequantize(type: GGMLType, rows: np.ndarray, K: int) -> np.ndarray:
    """GET_ROWS of every row (the CPU backend's dequantize_row_<type>): uint8 [rows, row bytes] ->
    f32 [rows, K]."""
    n = rows.shape[0]
    with Graph() as g:
        t = g.tensor(type, (K, n), rows)
        return g.compute(g.op("get_rows", t, g.array(np.arange(n, dtype=np.int32)))).reshape(n, K)


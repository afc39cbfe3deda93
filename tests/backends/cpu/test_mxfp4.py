"""MXFP4 (gpt-oss's expert weights) in the CPU backend: the block format, decode and quantize as ggml's,
quants.mul_mat's two orders (ggml_vec_dot_mxfp4_q8_0; the repack kernels' chain) against a scalar reading
of the C, qkernels' compiled twin against numpy bit for bit, and, where llama.cpp's ggml is installed
(tests/ggml_oracle.py), all of them against the real kernels, plain and repacked, MUL_MAT and MUL_MAT_ID."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.backends.cpu import blocks
from ggml_dist.backends.cpu import quants as Q
from ggml_dist.backends.cpu.ops import ComputeOptions, weights_mul_mat
from ggml_dist.core.types import GGMLType as T
from ggml_dist.core.types import row_size
from tests import ggml_oracle as O

from .test_quants import random_rows

F32 = np.float32
F64 = np.float64
ORACLE = O.unavailable()
needs_oracle = pytest.mark.skipif(ORACLE is not None, reason=ORACLE or "")


def rng(seed):
    return np.random.default_rng(seed)


def weights(M, K, seed):
    """Random codes with sane scales (quantized Gaussians with a random magnitude per row, every code byte
    then redrawn), an all-zero first block in every third row, and one row whose last block is all +12: its
    products need more than 24 bits, which makes vec_dot's tail fma show (module docstring of quants)."""
    w = random_rows(T.MXFP4, M, K, seed=seed).reshape(M, K // 32, 17)
    w[::3, 0] = 0
    w[min(1, M - 1), -1, 1:] = 0x77
    return w.reshape(M, -1)


def activations(N, K, seed):
    x = (rng(seed).standard_normal((N, K)) * 2).astype(F32)
    x[0, :32] = 0                                      # a zero Q8_0 block (d = 0)
    x[-1, -32:] = np.abs(x[-1, -32:]) + 3              # near its max: codes of 100+ for the +12 row's tail
    return x


# ------------------------------------------------------------------------------------------------
# the format
def test_block_format_and_repack_rule():
    # ggml-common.h block_mxfp4 {e, qs[16]}; vec_dot_type Q8_0; AVX2 repacks it when ne[1] % 8 == 0
    f = blocks.BLOCKS[T.MXFP4]
    assert (f.elems, f.nbytes, f.off("e"), f["qs"]) == (32, 17, 0, slice(1, 17))
    assert blocks.VEC_DOT_TYPE[T.MXFP4] == T.Q8_0 and f.gguf_kind is None
    assert {T.Q4_0, T.Q4_K, T.MXFP4} == blocks.REPACK_TYPES
    assert blocks.ggml_repacks(T.MXFP4, 2880) and not blocks.ggml_repacks(T.MXFP4, 12)
    assert not blocks.ggml_repacks(T.Q8_0, 64)


def test_e8m0_half():
    # GGML_E8M0_TO_FP32_HALF: 2^(e-128), the subnormals for e = 0, 1, and 2^127 (not NaN) for 255
    e = np.array([0, 1, 2, 127, 128, 200, 254, 255], np.uint8)
    want = np.array([2.0 ** -128, 2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0 ** 72, 2.0 ** 126, 2.0 ** 127], F32)
    np.testing.assert_array_equal(Q.e8m0_to_fp32_half(e).view(np.uint32), want.view(np.uint32))


def test_dequantize_element_order_and_values():
    # byte j: low nibble -> element j, high -> element j+16; value = kvalues_mxfp4[code] * 2^(e-128)
    b = np.zeros(17, np.uint8)
    b[0] = 129                                         # scale 2
    b[1:] = np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4)
    y = Q.dequantize(T.MXFP4, b[None], 32)[0]
    kv = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], F32)
    np.testing.assert_array_equal(y[:16], 2 * kv)
    np.testing.assert_array_equal(y[16:], 2 * kv[::-1])


def test_quantize_round_trip():
    # values on the grid come back: random codes with a +-12 in every block, so quantize finds the same e
    r = rng(1)
    b = np.zeros((6, 90, 17), np.uint8)
    b[..., 0] = r.integers(100, 150, (6, 90))
    b[..., 1:] = r.integers(0, 256, (6, 90, 16))
    b[..., 1] = 0x7F                                   # elements 0 and 16: +12, -12
    y = Q.dequantize(T.MXFP4, b.reshape(6, -1), 2880)
    b2 = Q.quantize(T.MXFP4, y)
    assert b2.shape == (6, row_size(T.MXFP4, 2880))
    np.testing.assert_array_equal(Q.dequantize(T.MXFP4, b2, 2880), y)
    assert np.array_equal(b2.reshape(6, 90, 17)[..., 0], b[..., 0])
    # off the grid: every value within 4 of its block's scale (12 is the largest code, amax/d < 16)
    x = (r.standard_normal((4, 256)) * r.uniform(1e-3, 1e3, (4, 1))).astype(F32)
    bq = Q.quantize(T.MXFP4, x).reshape(4, 8, 17)
    d = np.repeat(Q.e8m0_to_fp32_half(bq[..., 0]), 32, axis=1)
    assert np.all(np.abs(Q.dequantize(T.MXFP4, bq.reshape(4, -1), 256) - x) <= 4 * d)


# ------------------------------------------------------------------------------------------------
# mul_mat, numpy: a scalar reading of ggml_vec_dot_mxfp4_q8_0 (AVX2) and of the repack kernels
def _fma(a, b, c) -> F32:
    return F32(F64(a) * F64(b) + F64(c))             # exact product, one rounding (as quants emulates it)


def ref_dot(wrow, xrow, repacked):
    """One output, scalar: the decoded codes and Q8_0 activations, exact integer sums, then the float steps
    of the C (module docstring of quants)."""
    qy, dy = Q.quantize_q8_0(xrow)
    nb = len(dy)
    blk = wrow.reshape(nb, 17)
    d = [F32(F32(dy[b]) * Q.e8m0_to_fp32_half(blk[b, 0])) for b in range(nb)]
    vals = [Q.KVALUES_MXFP4[np.concatenate([blk[b, 1:] & 15, blk[b, 1:] >> 4])].astype(int) for b in range(nb)]
    lanes = [[int(np.dot(vals[b][4 * k:4 * k + 4], qy[b][4 * k:4 * k + 4].astype(int))) for k in range(8)]
             for b in range(nb)]
    if repacked:                                       # gemv/gemm: acc = fma(f32(isum), f32(e*dy), acc)
        acc = F32(0)
        for b in range(nb):
            acc = _fma(sum(lanes[b]), d[b], acc)
        return acc
    acc1, acc2 = [F32(0)] * 8, [F32(0)] * 8            # blocks in pairs: two 8-lane accumulators
    for b in range(0, nb - nb % 2, 2):
        acc1 = [_fma(d[b], lanes[b][k], acc1[k]) for k in range(8)]
        acc2 = [_fma(d[b + 1], lanes[b + 1][k], acc2[k]) for k in range(8)]
    s = [F32(acc1[k] + acc2[k]) for k in range(8)]
    sumf = F32(F32(F32(s[0] + s[4]) + F32(s[2] + s[6])) + F32(F32(s[1] + s[5]) + F32(s[3] + s[7])))   # HA
    if nb % 2:                                         # the scalar tail: sumf += d*isum, contracted
        sumf = _fma(d[-1], sum(lanes[-1]), sumf)
    return sumf


@pytest.mark.parametrize("K", [32, 96, 256])
def test_mul_mat_is_the_c_read_as_scalars(K):
    # K = 32: the tail only; 96: a pair and a tail; 256: pairs only
    M, N = 5, 3
    w, x = weights(M, K, seed=K), activations(N, K, seed=K + 1)
    for repacked in (False, True):
        out = Q.mul_mat(T.MXFP4, w, x, repacked=repacked)
        ref = np.array([[ref_dot(w[m], x[n], repacked) for m in range(M)] for n in range(N)], F32)
        np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    # "fast" is the chain; ggml's rule repacks from 8 rows on (ne[1] % 8 == 0), not below
    np.testing.assert_array_equal(Q.mul_mat(T.MXFP4, w, x, order="fast"), Q.mul_mat(T.MXFP4, w, x, repacked=True))
    np.testing.assert_array_equal(Q.mul_mat(T.MXFP4, w, x), Q.mul_mat(T.MXFP4, w, x, repacked=False))
    w8 = weights(8, K, seed=K + 2)
    np.testing.assert_array_equal(Q.mul_mat(T.MXFP4, w8, x), Q.mul_mat(T.MXFP4, w8, x, repacked=True))


def test_orders_differ_and_activation_quantization_dominates():
    # vec_dot and the chain round differently (guards against one silently running for the other); both
    # are within the Q8_0 activation quantization of the exact product
    K, M, N = 2880, 16, 4
    w, x = weights(M, K, seed=3), activations(N, K, seed=4)
    a, b = Q.mul_mat(T.MXFP4, w, x, repacked=False), Q.mul_mat(T.MXFP4, w, x, repacked=True)
    assert (a != b).mean() > 0.2
    wd = Q.dequantize(T.MXFP4, w, K).astype(F64)
    exact = x.astype(F64) @ wd.T
    scale = np.abs(x).astype(F64) @ np.abs(wd).T
    assert np.all(np.abs(a - exact) / scale < 2e-2) and np.all(np.abs(a - b) / scale < 1e-6)
    np.testing.assert_allclose(Q.mul_mat(T.MXFP4, w, x, exact=True), exact, rtol=0, atol=1e-5 * scale.max())


# ------------------------------------------------------------------------------------------------
# the compiled twin
@pytest.mark.parametrize("K,M", [(64, 5), (96, 8), (2880, 64)])
def test_compiled_twin_bit_identical(K, M):
    # qkernels.mul_mat_q == quants.mul_mat for both orders, plain and repacked, N in {1, 3, 4, 8, 17}
    qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")
    assert T.MXFP4 in qk.COVERED
    w = weights(M, K, seed=K + M)
    for N in (1, 3, 4, 8, 17):
        x = activations(N, K, seed=N)
        for order in ("ggml", "fast"):
            for repacked in (False, True):
                got = qk.mul_mat_q(T.MXFP4, w, x, order=order, repacked=repacked)
                ref = Q.mul_mat(T.MXFP4, w, x, order=order, repacked=repacked)
                assert got.shape == (N, M) and got.dtype == F32
                assert np.array_equal(got, ref), f"K={K} M={M} N={N} {order} repacked={repacked}"


def test_compiled_twin_threads_readonly_and_non_finite(monkeypatch):
    # 1 thread and all threads, a read-only strided weight view, an inf activation (numpy's quantizer)
    qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")
    from ggml_dist.backends.cpu import threads as kt
    K, M = 256, 40
    w, x = weights(M, K, seed=5), activations(6, K, seed=6)
    ref = Q.mul_mat(T.MXFP4, w, x, repacked=False)
    n0 = kt.get_threads()
    try:
        kt.set_threads(1)
        np.testing.assert_array_equal(qk.mul_mat_q(T.MXFP4, w, x, order="ggml"), ref)
    finally:
        kt.set_threads(n0)
    monkeypatch.setattr(qk, "_SERIAL_WORK", 0)          # the parallel launch even for this small product
    np.testing.assert_array_equal(qk.mul_mat_q(T.MXFP4, w, x, order="ggml"), ref)
    big = np.zeros((M, 2, w.shape[1] + 3), np.uint8)
    big[:, 0, 3:] = w
    view = big[:, 0, 3:]
    view.flags.writeable = False
    np.testing.assert_array_equal(qk.mul_mat_q(T.MXFP4, view, x, order="ggml"), ref)
    x[2, 7] = np.inf
    with np.errstate(all="ignore"):
        ref = Q.mul_mat(T.MXFP4, w, x, repacked=False)
        np.testing.assert_array_equal(qk.mul_mat_q(T.MXFP4, w, x, order="ggml"), ref)


@pytest.mark.parametrize("K,M", [(64, 8), (96, 72), (2880, 136), (96, 12)])
def test_packed_int8_kernels_bit_identical(K, M):
    # qpack's MXFP4 (vnni.py / avx2.py: vpshufb of the values, the repack kernels' chain) == quants.mul_mat
    # repacked, for every token count and 1 and 2 threads; M % 8 != 0 (vec_dot's order) keeps the file's
    # rows (qkernels' product), the same bits as the reference's
    qpack = pytest.importorskip("ggml_dist.backends.cpu.qpack")
    from ggml_dist.backends.cpu import threads as kt
    kernels = (["avx2"] if qpack.avx2.AVAILABLE else []) + (["vnni"] if qpack.vnni.AVAILABLE else [])
    if not kernels:
        pytest.skip("no int8 kernels on this CPU")
    w = weights(M, K, seed=K + M)
    x = activations(17, K, seed=M)
    x[3, :32] *= 1e-30                                 # a block of tiny activations: small d
    n0 = kt.get_threads()
    try:
        for kern in kernels:
            pw = qpack.PackedWeight(T.MXFP4, w, kernels=kern)
            assert (pw.raw is None) == (M % 8 == 0) and pw.chain == (M % 8 == 0)
            for n_threads in {1, min(2, kt._numba_num_threads())}:
                kt.set_threads(n_threads)
                for N in (1, 2, 3, 4, 9, 17):
                    got = pw.mul_mat(x[:N])
                    ref = Q.mul_mat(T.MXFP4, w, x[:N], order="ggml", repacked=M % 8 == 0)
                    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), f"{kern} K={K} M={M} N={N}"
    finally:
        kt.set_threads(n0)


def test_cpu_backend_entry_point():
    # ops.weights_mul_mat: the compiled twin and the numpy reference give one answer (a weight whose row
    # count llama.cpp does not repack: ops' own repack rule still names only Q4_0/Q4_K)
    K, M = 96, 12
    w, x = weights(M, K, seed=7), activations(3, K, seed=8)
    ref = Q.mul_mat(T.MXFP4, w, x, repacked=False)
    for numba in (False, True):
        np.testing.assert_array_equal(weights_mul_mat(T.MXFP4, w, x, ComputeOptions(numba=numba)), ref)


# ------------------------------------------------------------------------------------------------
# llama.cpp's own kernels
@needs_oracle
def test_quantize_and_dequantize_are_ggml_s():
    # quantize_row_mxfp4_ref (via ggml_quantize_chunk), dequantize_row_mxfp4 (via GET_ROWS), bit for bit:
    # all-zero, constant, tiny (subnormal scales) and huge blocks, random bytes with every e
    r = rng(9)
    x = (r.standard_normal((16, 2880)) * r.uniform(1e-4, 1e4, (16, 1))).astype(F32)
    x[0, :32] = 0
    x[1, :32] = 1.0
    x[2, :32] *= F32(2.0 ** -120)
    x[3, :32] *= F32(2.0 ** 100)
    np.testing.assert_array_equal(Q.quantize(T.MXFP4, x), O.quantize(T.MXFP4, x))
    b = r.integers(0, 256, (8, row_size(T.MXFP4, 2880)), dtype=np.uint8)
    b.reshape(8, 90, 17)[0, :, 0] = np.arange(90, dtype=np.uint8) + 166        # up to e = 255
    np.testing.assert_array_equal(Q.dequantize(T.MXFP4, b, 2880).view(np.uint32),
                                  O.dequantize(T.MXFP4, b, 2880).view(np.uint32))


@needs_oracle
@pytest.mark.parametrize("K", [32, 96, 2880])
def test_mul_mat_is_llama_cpp_s(K):
    # plain buffer (vec_dot for every row count) and CPU_REPACK (gemm for 4 rows at a time, gemv for the
    # rest): numpy and the compiled twin give llama.cpp's bits for N in {1, 3, 4, 8, 17}
    qk = pytest.importorskip("ggml_dist.backends.cpu.qkernels")
    M = 16
    w = weights(M, K, seed=K + 10)
    for N in (1, 3, 4, 8, 17):
        x = activations(N, K, seed=N + 20)
        for repack in (False, True):
            want = O.mul_mat(T.MXFP4, w, x, repack=repack)
            np.testing.assert_array_equal(Q.mul_mat(T.MXFP4, w, x, repacked=repack), want)
            np.testing.assert_array_equal(qk.mul_mat_q(T.MXFP4, w, x, order="ggml", repacked=repack), want)
    # the two buffers really take two paths (not at K = 32: one block is f32(d*isum) in both)
    x = activations(17, K, seed=30)
    plain = O.mul_mat(T.MXFP4, w, x)
    rep = O.mul_mat(T.MXFP4, w, x, repack=True)
    assert not np.array_equal(plain, rep) or K == 32
    # gemm and gemv have the same bits per row: 8 rows together = each row alone
    np.testing.assert_array_equal(rep[:8], np.concatenate([O.mul_mat(T.MXFP4, w, x[i:i + 1], repack=True)
                                                           for i in range(8)]))


@needs_oracle
def test_tail_fma_is_llama_cpp_s():
    # an odd block count whose last block's d*isum needs more than 24 bits: the contracted tail (one
    # rounding) is llama.cpp's, an f32 product then an add is not, on a good share of these outputs
    K, M, N = 2912, 16, 16
    w = weights(M, K, seed=40).reshape(M, K // 32, 17)
    w[:, -1, 1:] = 0x77                                # +12 everywhere in the tail block
    w = w.reshape(M, -1)
    x = activations(N, K, seed=41)
    x[:, -32:] = (rng(42).uniform(0.9, 1.0, (N, 32)) * rng(43).uniform(0.5, 3, (N, 1))).astype(F32)
    want = O.mul_mat(T.MXFP4, w, x)
    np.testing.assert_array_equal(Q.mul_mat(T.MXFP4, w, x, repacked=False), want)
    qy, dy = Q.quantize_q8_0(x)
    d = (Q.e8m0_to_fp32_half(w.reshape(M, -1, 17)[:, -1, 0])[None, :] * dy[:, -1:]).astype(F32)     # [N, M]
    isum = (qy[:, -1].astype(F64) @ Q.dequantize(T.MXFP4, w, K)[:, -32:].T.astype(F64)
            / Q.e8m0_to_fp32_half(w.reshape(M, -1, 17)[:, -1, 0])[None, :]).astype(F32)
    head = Q.mul_mat(T.MXFP4, w.reshape(M, -1, 17)[:, :-1].reshape(M, -1), x[:, :-32], repacked=False)
    unfused = (head + (d * isum).astype(F32)).astype(F32)
    assert (unfused != want).mean() > 0.02


@needs_oracle
@pytest.mark.parametrize("repack", [False, True])
def test_mul_mat_id_is_llama_cpp_s(repack):
    # gpt-oss's MUL_MAT_ID: 4 experts of 16 x 2880, 2 chosen per token, x shared (n_b = 1) or per choice
    # (n_b = n_used): each output row is quants.mul_mat of the chosen expert, vec_dot or (repacked) gemv
    n_expert, n_used, n_tok, K, M = 4, 2, 5, 2880, 16
    w = weights(n_expert * M, K, seed=50).reshape(n_expert, M, -1)
    ids = rng(51).permuted(np.tile(np.arange(n_expert, dtype=np.int32), (n_tok, 1)), axis=1)[:, :n_used]
    for n_b in (1, n_used):
        x = (rng(52 + n_b).standard_normal((n_tok, n_b, K)) * 2).astype(F32)
        got = O.mul_mat_id(T.MXFP4, w, x, ids, repack=repack)
        for t in range(n_tok):
            for i in range(n_used):
                want = Q.mul_mat(T.MXFP4, w[ids[t, i]], x[t, i % n_b], repacked=repack)
                np.testing.assert_array_equal(got[t, i], want)

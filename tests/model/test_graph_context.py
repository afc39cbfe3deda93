"""model/graph_context.py, llama.py, qwen3.py: the shared blocks and each architecture's graph, by
structure (their logits are checked against llama.cpp in test_llama_refs.py)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ggml_dist.core.context import Context
from ggml_dist.core.ops import ROPE_TYPE_NEOX, ROPE_TYPE_NORM
from ggml_dist.core.tensor import Op
from ggml_dist.core.types import GGMLType
from ggml_dist.model.graph_context import GraphKey, kq_scale
from ggml_dist.model.archs import ARCHS
from ggml_dist.model.kv_cache import KVCache
from ggml_dist.model.llama import ARCH_GRAPHS, LlamaGraphBuilder
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic


def _graph(path: Path, n_tokens: int = 3):
    m = LlamaModel.load(path)
    kv = KVCache(m.hp.n_embd_k_gqa, m.hp.n_embd_v_gqa, 256, range(m.hp.n_layer))
    res = LlamaGraphBuilder(m.hp, m.weights, kv).build(GraphKey(n_tokens, n_tokens, 256))
    return m, {t.name: t for t in res.graph.nodes}


# every architecture hparams accepts has a builder
def test_every_arch_has_a_builder():
    assert set(ARCH_GRAPHS) == set(ARCHS)


# the KQ scale is llama.cpp's 1.0f/sqrtf(d) in f32; a double 1/sqrt(d) rounded to f32 is an ulp off for
# some head sizes, which moved qwen3 (head 24) logits by 0.29 against llama.cpp
@pytest.mark.parametrize("d", [16, 24, 64, 72, 96, 128])
def test_kq_scale_is_f32(d):
    assert kq_scale(d) == np.float32(1) / np.sqrt(np.float32(d))
    if d in (24, 72, 96):
        assert kq_scale(d) != float(np.float32(1 / math.sqrt(d)))


# llama3 rope scaling: both ROPEs of every layer take rope_freqs.weight as their third source
def test_llama3_graph_uses_rope_freqs(tmp_path):
    spec = SyntheticSpec(rope_scaling="llama3", rope_freq_base=500000.0, n_ctx_train=131072)
    m, nodes = _graph(write_synthetic(tmp_path / "l3.gguf", spec))
    ropes = [t for t in nodes.values() if t.op == Op.ROPE]
    assert len(ropes) == 2 * m.hp.n_layer
    assert all(len(t.src) == 3 and t.src[2] is m.weights["rope_freqs.weight"] for t in ropes)
    assert all(t.op_params[2] == ROPE_TYPE_NORM and t.op_params[4] == 131072 for t in ropes)


# qwen3: Q and K of every layer are RMS-normed per head (ne[0] = head size) before a NeoX rope without
# factors; Wq widens to n_head * 24 = 96 and Wo narrows back to n_embd = 64
def test_qwen3_graph_norms_heads_before_rope(tmp_path):
    spec = SyntheticSpec(arch="qwen3", head_dim=24, n_head_kv=2)
    m, nodes = _graph(write_synthetic(tmp_path / "q3.gguf", spec))
    for il in range(m.hp.n_layer):
        for x in "QK":
            rope = nodes[f"{x}cur-{il}"]
            assert rope.op == Op.ROPE and len(rope.src) == 2 and rope.op_params[2] == ROPE_TYPE_NEOX
            normed = rope.src[0]
            assert normed.name == f"{x}cur_normed-{il}" and normed.op == Op.MUL
            assert normed.src[0].op == Op.RMS_NORM and normed.src[0].ne[0] == 24
            assert normed.src[1] is m.weights[f"blk.{il}.attn_{x.lower()}_norm.weight"]
        assert nodes[f"kqv_out-{il}"].ne[:2] == (96, 3) and nodes[f"attn_out-{il}"].ne[:2] == (64, 3)
    assert nodes["result_output"].src[0] is m.weights["token_embd.weight"]     # tied head


# a per-layer duplicate of rope_freqs.weight (llama.cpp's TENSOR_DUPLICATED), where the weights hold one,
# is what that layer's ROPEs read: a pipeline can keep each stage's copy with the stage (a file cannot
# hold the name: test_hparams)
def test_llama3_per_layer_rope_freqs(tmp_path):
    spec = SyntheticSpec(rope_scaling="llama3", rope_freq_base=500000.0, n_ctx_train=131072)
    m = LlamaModel.load(write_synthetic(tmp_path / "l3.gguf", spec))
    dup = Context(4096, no_alloc=True).new_tensor(GGMLType.F32, (8,)).set_name("blk.1.rope_freqs.weight")
    kv = KVCache(m.hp.n_embd_k_gqa, m.hp.n_embd_v_gqa, 256, range(m.hp.n_layer))
    weights = m.weights | {"blk.1.rope_freqs.weight": dup}
    nodes = {t.name: t for t in LlamaGraphBuilder(m.hp, weights, kv).build(GraphKey(3, 3, 256)).graph.nodes}
    assert nodes["Qcur-0"].src[2] is m.weights["rope_freqs.weight"]
    assert nodes["Qcur-1"].src[2] is dup and nodes["Kcur-1"].src[2] is dup


# a layer's Q, K and V products are consecutive nodes, Q's first (llama.cpp's order has K's rope and cache
# store between them): the allocator places them side by side, and the CPU backend runs them as one call
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])      # synthetic archs; gemma3 shares build_qkv
def test_qkv_products_are_consecutive(tmp_path, arch):
    m, _ = _graph(write_synthetic(tmp_path / f"{arch}.gguf", SyntheticSpec(arch=arch)))
    kv = KVCache(m.hp.n_embd_k_gqa, m.hp.n_embd_v_gqa, 256, range(m.hp.n_layer))
    nodes = LlamaGraphBuilder(m.hp, m.weights, kv).build(GraphKey(3, 3, 256)).graph.nodes
    for il in range(m.hp.n_layer):
        ws = [m.weights[f"blk.{il}.attn_{x}.weight"] for x in "qkv"]
        at = [k for k, t in enumerate(nodes) if t.op == Op.MUL_MAT and t.src[0] in ws]
        assert [nodes[k].src[0] for k in at] == ws and at == list(range(at[0], at[0] + 3))

"""Synthetic mixtures of experts (ggml_dist/model/synthetic_moe.py) and llama.cpp's references on them
(tests/data/moe_refs.npz, made by `python tests/data/make_reference.py --only moe` with an AVX2 build of
llama-cpp-python 0.3.36).

The first part needs only the writer and the data: the files are deterministic and are the ones llama.cpp
ran, every spec of MOE_SPECS has complete references, and no reference token sits near a routing tie.
The second part compares ggml_dist with llama.cpp (logits of a batch and of one token at a time, and the
experts each layer chose) for the architectures hparams.ARCHS runs as mixtures of experts; the others skip.
The chosen experts are read as llama.cpp's are: the graph node named "ffn_moe_topk-{il}" (I32, ne = (k,
n_tokens): the first k columns of the descending argsort of the router scores), taken with the scheduler's
eval callback (ctx.sched.set_eval_callback) when the node has been computed.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from ggml_dist.model import archs as hparams
from ggml_dist.model.gguf import load_gguf
from ggml_dist.model.synthetic import SHAPES, write_synthetic
from ggml_dist.model.synthetic_moe import (
    MOE_ARCHS,
    MOE_SHAPES,
    SyntheticMoESpec,
    moe_nbytes,
    qwen3_30b_a3b,
    tensor_types,
)

from .refs import MOE_N_CTX, MOE_SPECS, MOE_TIE_MIN, MOE_TOKENS, TOP_K

DATA = Path(__file__).resolve().parents[1] / "data"
MOE = np.load(DATA / "moe_refs.npz")
DIRECT = [s for s in MOE_SPECS if not s.quantize]          # written without llama.cpp

# sha256 of the files the writer makes (a change here invalidates moe_refs.npz: regenerate it)
SHA256 = {
    "qwen3moe-q8_0-e64-l2-h4-kv2-hd32-x16k4-f64-v512-tied-s2101":
        "cf10a2913604e95b8b75e97dc097daa1bade8aeeb014e3f188c60bf5ce05880c",
    "qwen3moe-q4_0-e64-l2-h4-kv2-x8k2-f64-v512-untied-s102":
        "67e417b03fa8ffc6d168571b8fb9451c2731345414be9abcfe33e8f650878bf7",
    "qwen3moe-f16-e64-l2-h4-kv2-x8k2-f64-v512-tied-s1103-wtypeF16":
        "bcc0e0c253a1ce7bec7dbcbba4ffad08973af985a099db6ad7dc1eae2b4fa6c3",
    "qwen3moe-q4_k-e256-l2-h4-kv2-x8k2-f256-v512-untied-s1104":
        "8928c199bb825899bd8d7cb1171725bd812497713c962d4974973fb4f8859abf",
    "qwen3moe-q5_k-e256-l2-h4-kv2-x8k2-f256-v512-untied-s1110-down_typeQ6_K":
        "fb5c33bc86c2fe64c3af22c18a43d1316003d1d61449a1fa75771b762348671f",
    "qwen2moe-q4_1-e64-l2-h4-kv2-x8k2-f64-v512-untied-s106":
        "716d40cb3533462724b565c580f676a72b7a02c5657249c0c0cf87569171fe0b",
    "llama-q5_0-e64-l2-h4-kv2-x8k2-f64-v512-untied-s2107":
        "6920752e2ec3daf7375eada6481d05f9d96b1cdeb9d34f6c849aba4b5e00a3ae",
    "llama-f32-e64-l2-h4-kv2-x8k2-f64-v512-tied-s3108":
        "7dbf0cf9444999b3e9c0843288acf4e4d370eab362b761ee427a236fedf26647",
    "gpt-oss-mxfp4-e96-l2-h4-kv2-hd32-x8k4-f64-v512-untied-s1109-exp_std3.0-n_swa8":
        "d9604f681f27c46e37983f97130c470dd3e5cc95db2b7dc04fb0f2a1d89543ff",
}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe")


@pytest.fixture(scope="module")
def moe_models(moe_dir) -> dict[str, Path]:
    return {s.name: write_synthetic(moe_dir / f"{s.name}.gguf", s) for s in DIRECT}


def _model_path(spec: SyntheticMoESpec, moe_models: dict[str, Path], moe_dir: Path) -> Path:
    """The spec's file; the Q4_K_M one is llama.cpp's quantization of an F16 file (needs llama_cpp)."""
    if spec.name in moe_models:
        return moe_models[spec.name]
    pytest.importorskip("llama_cpp", reason="a quantize= spec is made by llama.cpp's llama_model_quantize")
    path = moe_dir / f"{spec.name}.gguf"
    if not path.is_file():
        write_synthetic(path, spec)
    return path


# -- the files --------------------------------------------------------------------------------------
def test_spec_names_unique():
    assert len({s.name for s in MOE_SPECS}) == len(MOE_SPECS)
    assert set(SHA256) == {s.name for s in DIRECT}


# same spec, same bytes: those llama.cpp ran (sha256 in the references) and those fixed here
@pytest.mark.parametrize("spec", DIRECT, ids=lambda s: s.name)
def test_files_deterministic(spec, moe_models, tmp_path):
    again = write_synthetic(tmp_path / "again.gguf", spec)
    assert again.read_bytes() == moe_models[spec.name].read_bytes()
    sha = _sha(again)
    assert sha == MOE[f"{spec.name}/sha256"].tobytes().hex(), "not the file the references were made on"
    assert sha == SHA256[spec.name]


# llama.cpp's Q4_K_M quantization of the F16 file is deterministic too (dev only)
@pytest.mark.parametrize("spec", [s for s in MOE_SPECS if s.quantize], ids=lambda s: s.name)
def test_quantized_file_is_the_reference_one(spec, moe_dir):
    pytest.importorskip("llama_cpp")
    path = _model_path(spec, {}, moe_dir)
    assert _sha(path) == MOE[f"{spec.name}/sha256"].tobytes().hex()
    types = {name: t.type.name for name, t in load_gguf(path).tensors.items()}
    assert {types[f"blk.{il}.ffn_{w}_exps.weight"] for il in range(spec.n_layer) for w in ("gate", "up", "down")} \
        == {"Q4_K", "Q6_K"}
    assert types["blk.0.attn_output.weight"] == "Q5_K" and types["blk.0.attn_k.weight"] == "Q8_0"


# what each architecture's file holds: the `{arch}.` keys and one layer's tensors (ggml ne), as
# llama.cpp's load_arch_hparams / load_arch_tensors read them
COMMON_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length",
               "attention.head_count", "attention.head_count_kv", "rope.dimension_count", "rope.freq_base",
               "attention.layer_norm_rms_epsilon", "expert_count", "expert_used_count", "vocab_size"}
ARCH_KEYS = {
    "qwen3moe": {"expert_feed_forward_length"},
    "qwen2moe": {"expert_feed_forward_length", "expert_shared_feed_forward_length"},
    "llama": set(),
    "gpt-oss": {"expert_feed_forward_length", "attention.key_length", "attention.value_length",
                "attention.sliding_window", "rope.scaling.type", "rope.scaling.factor",
                "rope.scaling.original_context_length"},
}


def _layer_tensors(s: SyntheticMoESpec) -> dict[str, tuple[int, ...]]:
    E, hd, F, X = s.n_embd, s.n_embd_head, s.n_ff_exp, s.n_expert
    q, kv = hd * s.n_head, hd * s.n_head_kv
    t = {"attn_norm.weight": (E,), "attn_q.weight": (E, q), "attn_k.weight": (E, kv), "attn_v.weight": (E, kv),
         "attn_output.weight": (q, E), "ffn_gate_inp.weight": (E, X), "ffn_gate_exps.weight": (E, F, X),
         "ffn_up_exps.weight": (E, F, X), "ffn_down_exps.weight": (F, E, X)}
    if s.arch == "qwen3moe":
        t |= {"attn_q_norm.weight": (hd,), "attn_k_norm.weight": (hd,)}
    if s.arch in ("qwen2moe", "gpt-oss"):
        t |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if s.arch == "qwen2moe":
        S = s.ff_shexp
        t |= {"ffn_gate_inp_shexp.weight": (E,), "ffn_gate_shexp.weight": (E, S), "ffn_up_shexp.weight": (E, S),
              "ffn_down_shexp.weight": (S, E)}
    if s.arch == "gpt-oss":
        t |= {"attn_output.bias": (E,), "attn_sinks.weight": (s.n_head,), "post_attention_norm.weight": (E,),
              "ffn_gate_inp.bias": (X,), "ffn_gate_exps.bias": (F, X), "ffn_up_exps.bias": (F, X),
              "ffn_down_exps.bias": (E, X)}
    else:
        t["ffn_norm.weight"] = (E,)
    return t


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_keys_and_tensors(arch, moe_models):
    spec = next(s for s in DIRECT if s.arch == arch)
    f = load_gguf(moe_models[spec.name])
    a = arch + "."
    assert {k[len(a):] for k in f.metadata if k.startswith(a)} == \
        COMMON_KEYS | ARCH_KEYS[arch] | ({"attention.key_length", "attention.value_length"} if spec.head_dim else set())
    assert f.metadata[a + "expert_count"] == spec.n_expert
    assert f.metadata[a + "expert_used_count"] == spec.n_expert_used
    if arch == "llama":
        assert f.metadata[a + "feed_forward_length"] == spec.n_ff_exp      # the experts' width
    if arch == "gpt-oss":
        assert f.metadata[a + "rope.scaling.type"] == "yarn"
        assert f.metadata[a + "attention.sliding_window"] == spec.swa
    want = {f"blk.{il}.{n}": ne for il in range(spec.n_layer) for n, ne in _layer_tensors(spec).items()}
    want |= {"token_embd.weight": (spec.n_embd, spec.n_vocab), "output_norm.weight": (spec.n_embd,)}
    if not spec.tied:
        want["output.weight"] = (spec.n_embd, spec.n_vocab)
    got = {n: tuple(int(x) for x in t.ne[:len(want.get(n, t.ne))]) for n, t in f.tensors.items()}
    assert got == want
    assert all(int(x) == 1 for t in f.tensors.values() for x in t.ne[len(want[t.name]):])
    assert {n: ne for n, (ne, _) in tensor_types(spec).items()} == want
    assert f.tensors["blk.0.ffn_gate_inp.weight"].type.name == "F32"
    assert f.tensors["blk.0.ffn_gate_exps.weight"].type.name == spec.exp_type


def test_sizes(moe_models):
    for s in DIRECT:
        size = moe_models[s.name].stat().st_size
        assert moe_nbytes(s) < size < moe_nbytes(s) + 64 * 1024           # + the header (vocabulary)
    # the benchmark shapes (not written here): Q4_0 experts are 604M weights a layer, 340 MB
    assert set(MOE_SHAPES) <= set(SHAPES)
    per_layer = moe_nbytes(qwen3_30b_a3b(2)) - moe_nbytes(qwen3_30b_a3b(1))
    assert per_layer == 3 * 128 * 768 * 2048 // 32 * 18 + (2048 * (4096 + 2 * 512) + 4096 * 2048) // 32 * 34 + \
        (2 * 2048 + 2 * 128) * 4 + 2048 * 128 * 4
    assert 5.3 < moe_nbytes(MOE_SHAPES["qwen3-30b-a3b-16l"]) / 2**30 < 5.6


def test_spec_validation():
    with pytest.raises(ValueError, match=r"output\.weight"):
        SyntheticMoESpec(arch="qwen2moe")
    with pytest.raises(ValueError, match=r"output\.weight"):
        SyntheticMoESpec(arch="gpt-oss")
    with pytest.raises(ValueError, match="not 'mixtral'"):
        SyntheticMoESpec(arch="mixtral")
    with pytest.raises(ValueError, match="expert_used_count"):
        SyntheticMoESpec(n_expert=4, n_expert_used=5)
    with pytest.raises(ValueError, match="head size"):
        SyntheticMoESpec(arch="qwen2moe", tied=False, head_dim=32)
    assert SyntheticMoESpec(arch="gpt-oss", tied=False, n_layer=4).swa_layers() == [True, False, True, False]


# -- the references -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", MOE_SPECS, ids=lambda s: s.name)
def test_refs_complete(spec):
    n, L, T, k = spec.name, spec.n_layer, len(MOE_TOKENS), spec.n_expert_used
    assert MOE[f"{n}/tokens"].tolist() == MOE_TOKENS
    for mode in ("batch", "single"):
        ids, vals = MOE[f"{n}/{mode}/ids"], MOE[f"{n}/{mode}/vals"]
        assert ids.shape == vals.shape == (T, TOP_K)
        assert ids.min() >= 0 and ids.max() < spec.n_vocab and np.all(np.diff(vals, axis=1) <= 0)
    for key in ("experts", "experts_single"):
        e = MOE[f"{n}/{key}"]
        assert e.shape == (L, T, k)
        assert e.min() >= 0 and e.max() < spec.n_expert
        assert all(len(set(row)) == k for row in e.reshape(-1, k).tolist())
    # routing that means something: every expert is taken in every layer, by different tokens
    for il in range(L):
        assert len(np.unique(MOE[f"{n}/experts"][il])) == spec.n_expert
        assert len({tuple(sorted(r)) for r in MOE[f"{n}/experts"][il].tolist()}) >= T // 4
    # llama.cpp's batch and one-token runs chose the same experts
    assert np.array_equal(np.sort(MOE[f"{n}/experts"], -1), np.sort(MOE[f"{n}/experts_single"], -1))


# no reference token is within MOE_TIE_MIN (router-logit units) of a different choice of experts
@pytest.mark.parametrize("spec", MOE_SPECS, ids=lambda s: s.name)
def test_refs_tie_margin(spec):
    margin = MOE[f"{spec.name}/margin"]
    assert margin.shape == (spec.n_layer, len(MOE_TOKENS))
    assert float(MOE[f"{spec.name}/min_margin"]) <= margin.min() + 1e-12
    assert float(MOE[f"{spec.name}/min_margin"]) > MOE_TIE_MIN


# -- ggml_dist against llama.cpp (runs once hparams.ARCHS runs the arch as a mixture of experts) --------
def _runs_moe(arch: str) -> bool:
    return getattr(hparams.ARCHS.get(arch), "moe", None) is not None


SUPPORTED = {a for a in MOE_ARCHS if _runs_moe(a)}
TOL = 1e-4          # the bound; measured: every spec bit-equal, batch and one token at a time


def _cases():
    return [pytest.param(s, id=s.name, marks=pytest.mark.skipif(s.arch not in SUPPORTED,
                                                               reason=f"{s.arch} MoE is not implemented yet"))
            for s in MOE_SPECS]


def _ctx(path: Path):
    from ggml_dist.core.types import GGMLType
    from ggml_dist.model.context import ContextParams, LlamaContext
    from ggml_dist.model.model import LlamaModel
    return LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=MOE_N_CTX, type_k=GGMLType.F16,
                                                             type_v=GGMLType.F16))


def _check(spec: SyntheticMoESpec, mode: str, logits: np.ndarray) -> float:
    ids = MOE[f"{spec.name}/{mode}/ids"].astype(np.int64)
    vals = MOE[f"{spec.name}/{mode}/vals"]
    assert logits.shape == (len(MOE_TOKENS), spec.n_vocab)
    assert np.array_equal(logits.argmax(1), ids[:, 0]), f"{spec.name} {mode}: argmax differs"
    d = float(np.abs(np.take_along_axis(logits, ids, 1) - vals).max())
    assert d <= TOL, f"{spec.name} {mode}: max |dlogit| {d}"
    assert d == 0.0, f"{spec.name} {mode}: within {TOL} of llama.cpp but not bit-equal (max |dlogit| {d:.3g})"
    return d


@pytest.mark.parametrize("spec", _cases())
def test_moe_batch(spec, moe_models, moe_dir):
    from ggml_dist.model.ubatch import Batch
    ctx = _ctx(_model_path(spec, moe_models, moe_dir))
    _check(spec, "batch", ctx.decode(Batch.from_tokens(MOE_TOKENS, all_outputs=True)))


@pytest.mark.parametrize("spec", _cases())
def test_moe_one_token(spec, moe_models, moe_dir):
    from ggml_dist.model.ubatch import Batch
    ctx = _ctx(_model_path(spec, moe_models, moe_dir))
    rows = [ctx.decode(Batch.from_tokens([t], pos0=i))[0] for i, t in enumerate(MOE_TOKENS)]
    _check(spec, "single", np.stack(rows))


class _TopK:
    """The scheduler's eval callback: wants the nodes "ffn_moe_topk-{il}", copies each out once computed."""

    def __init__(self, n_layer: int) -> None:
        self.names = {f"ffn_moe_topk-{il}": il for il in range(n_layer)}
        self.rows: list[list[np.ndarray]] = [[] for _ in range(n_layer)]

    def __call__(self, t, ask: bool) -> bool:
        if ask:
            return t.name in self.names
        from ggml_dist.backends.base import tensor_get
        if t.name in self.names:
            a = tensor_get(t)                           # ne (k, n_tokens): numpy (1, 1, n_tokens, k)
            self.rows[self.names[t.name]].append(a.reshape(-1, a.shape[-1]))
        return True

    def take(self) -> np.ndarray:
        """(n_layer, n_tokens, k) of everything seen since the last take."""
        out = np.stack([np.concatenate(r) if r else np.zeros((0, 0), np.int32) for r in self.rows])
        self.rows = [[] for _ in self.rows]
        return out


@pytest.mark.parametrize("spec", _cases())
def test_moe_experts(spec, moe_models, moe_dir):
    """The experts each layer chose, in llama.cpp's order (the order their outputs are summed in), for the
    batch and for one token at a time."""
    from ggml_dist.model.ubatch import Batch
    ctx = _ctx(_model_path(spec, moe_models, moe_dir))
    taps = _TopK(spec.n_layer)
    ctx.sched.set_eval_callback(taps)
    ctx.decode(Batch.from_tokens(MOE_TOKENS, all_outputs=True))
    got = taps.take()
    want = MOE[f"{spec.name}/experts"]
    assert got.shape == want.shape, f"ffn_moe_topk-{{il}}: {got.shape}, llama.cpp {want.shape}"
    bad = np.argwhere(np.any(got != want, axis=-1))
    assert not len(bad), (f"batch: (layer, token) {bad[:8].tolist()} chose {got[tuple(bad[0])]} "
                          f"not llama.cpp's {want[tuple(bad[0])]}")
    ctx.clear()
    for i, t in enumerate(MOE_TOKENS):
        ctx.decode(Batch.from_tokens([t], pos0=i))
    got = taps.take()
    assert np.array_equal(got, MOE[f"{spec.name}/experts_single"]), "one token at a time: other experts"

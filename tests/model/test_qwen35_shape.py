"""The Qwen3.5-shaped benchmark file (synthetic_hybrid.qwen35_0_8b, SHAPES "qwen3.5-0.8b"): Qwen3.5-0.8B's
layer dimensions, and a benchmark's --model name resolving to the file written into the cache."""
from __future__ import annotations

from dataclasses import replace

from ggml_dist.model import pull
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SHAPES, model_path
from ggml_dist.model.synthetic_hybrid import qwen35_0_8b


def test_the_shape_has_qwen35_0_8b_layers():
    s = SHAPES["qwen3.5-0.8b"]
    assert s == qwen35_0_8b(8) and s.arch == "qwen35" and s.tied
    assert (s.n_embd, s.n_ff, s.n_head, s.n_head_kv, s.head_dim, s.n_rot, s.sections) == \
        (1024, 3584, 8, 2, 256, 64, (11, 11, 10, 0))
    assert (s.d_state, s.n_group, s.dt_rank, s.d_conv, s.full_attention_interval) == (128, 16, 16, 4, 4)


def test_a_shape_name_resolves_to_its_file_written_once(tmp_path, monkeypatch):
    one = replace(qwen35_0_8b(1), n_vocab=512)              # one Gated DeltaNet layer of the real width
    monkeypatch.setitem(SHAPES, "qwen35-one-layer", one)
    monkeypatch.setattr(pull, "cache_dir", lambda: tmp_path)
    path = model_path("qwen35-one-layer")
    assert path.parent == tmp_path and path.is_file()
    stamp = path.stat().st_mtime_ns
    assert model_path("qwen35-one-layer") == path and path.stat().st_mtime_ns == stamp
    hp = LlamaModel.load(str(path)).hp
    assert (hp.n_embd, hp.n_layer, hp.ssm_d_state, hp.ssm_n_group, hp.ssm_dt_rank, hp.ssm_d_conv) == \
        (1024, 1, 128, 16, 16, 4)
    assert hp.ssm_d_inner == 16 * 128

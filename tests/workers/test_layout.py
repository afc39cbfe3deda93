"""One weight layout (model/layout.py): the bytes placement plans for a stage are the bytes that stage
maps, for the head tied and untied, llama3's rope factors (every stage's) and Gemma 3."""
from __future__ import annotations

import pytest

from ggml_dist.model import layout
from ggml_dist.model.context import ContextParams
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.workers.placement import place
from ggml_dist.workers.stage import StageWorker
from ggml_dist.workers.stage_data import StageSpec

SPECS = {
    "untied": SyntheticSpec(n_layer=4, tied=False, seed=3),
    "tied": SyntheticSpec(n_layer=4, tied=True, seed=3),
    "llama3": SyntheticSpec(n_layer=4, tied=False, rope_scaling="llama3", seed=3),
    "qwen3-tied": SyntheticSpec(arch="qwen3", n_layer=4, tied=True, seed=3),
}


def mapped_bytes(path, n_stages: int) -> list[tuple[int, int]]:
    """(planned, mapped) weight bytes of each stage of an n_stages placement."""
    model = LlamaModel.load(path)
    pl = place(model.file, model.hp, n_stages, 64)
    out = []
    for sp in pl.stages:
        w = StageWorker(StageSpec(sp.stage, str(path), sp.layers, sp.stage == 0, sp.stage == n_stages - 1,
                                  ContextParams(n_ctx=64), model.hp.n_embd_k_gqa, model.hp.n_embd_v_gqa))
        # a name of the file is one mapping; the aliases (tied head, each layer's rope factors) are views
        out.append((sp.weight_bytes, sum(t.nbytes for n, t in w.weights.items() if n in model.file.tensors)))
    return out


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_planned_bytes_are_mapped_bytes(tmp_path, name, n_stages):
    path = write_synthetic(tmp_path / f"{name}.gguf", SPECS[name])
    for planned, mapped in mapped_bytes(path, n_stages):
        assert planned == mapped


def test_gemma3_planned_bytes_are_mapped_bytes():
    from ggml_dist.model.pull import pull
    try:
        path = pull("gemma3-270m", progress=False)
    except Exception as e:                       # offline and not cached
        pytest.skip(f"gemma3-270m is not in the cache and cannot be pulled: {e}")
    for planned, mapped in mapped_bytes(path, 2):
        assert planned == mapped


def test_rope_factors_on_every_stage_head_on_the_last():
    names = ["token_embd.weight", "rope_freqs.weight", "blk.0.attn_q.weight", "blk.1.attn_q.weight",
             "output_norm.weight", "output.weight"]
    assert layout.stage_tensors(names, (0, 1), True, False, tied=False) == names[:3]
    assert layout.stage_tensors(names, (1, 2), False, True, tied=False) == [names[1], names[3], *names[4:]]
    # tied: the last stage maps the embeddings as its head; a middle stage neither
    assert layout.stage_tensors(names[:5], (1, 2), False, True, tied=True) == [names[0], names[1], names[3], names[4]]
    assert layout.stage_tensors(names[:5], (1, 2), False, False, tied=True) == [names[1], names[3]]

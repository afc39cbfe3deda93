"""llama.cpp's logits on the synthetic Qwen3.5 files (dev only: needs llama-cpp-python 0.3.36, the AVX2
build of ../shared/wheels; see make_reference.py):

    python tests/data/make_qwen35_reference.py [--out tests/data]

Writes qwen35_refs.npz: for every spec of synthetic_hybrid.QWEN35_SPECS, over QWEN35_TOKENS in a context
of QWEN35_N_CTX cells (F16 KV cache, flash attention off, one sequence), the whole logits of every
position, evaluated
  batch   as one ubatch,
  single  one token at a time,
  mixed   the first QWEN35_SPLIT tokens as one ubatch, then the rest one at a time (the recurrent state
          handed from a prompt to decoding);
the experts each layer chose (the graph's ffn_moe_topk-{il}) in the batch and single runs of a mixture of
experts, and the sha256 of each file llama.cpp ran. The files are rebuilt from their specs by the tests.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ggml_dist.model.synthetic import write_synthetic
from ggml_dist.model.synthetic_hybrid import QWEN35_SPECS
from tests.data.make_reference import _GraphTaps, _moe_context, _moe_decode, _quiet_llama_logs, _sha256

QWEN35_TOKENS = [1, 300, 17, 402, 259, 260, 511, 299, 333, 42, 270, 480, 77, 5, 404, 123]
QWEN35_SPLIT = 7
QWEN35_N_GREEDY = 16


def qwen35_run(path: Path, spec) -> dict[str, np.ndarray]:
    import llama_cpp
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp cannot load {path}"
    n_vocab, toks, k = spec.n_vocab, QWEN35_TOKENS, QWEN35_SPLIT
    taps = _GraphTaps(("ffn_moe_topk",))
    r: dict[str, np.ndarray] = {}
    try:
        ctx = _moe_context(model, taps if spec.n_expert else None)
        mem = llama_cpp.llama_get_memory(ctx)
        r["batch"] = _moe_decode(ctx, toks, 0, n_vocab)
        if spec.n_expert:
            r["experts"] = np.stack(taps.take("ffn_moe_topk", spec.n_layer)).astype(np.int16)
        llama_cpp.llama_memory_clear(mem, True)
        r["single"] = np.concatenate([_moe_decode(ctx, [t], i, n_vocab) for i, t in enumerate(toks)])
        if spec.n_expert:
            r["experts_single"] = np.stack(taps.take("ffn_moe_topk", spec.n_layer)).astype(np.int16)
        llama_cpp.llama_memory_clear(mem, True)
        r["mixed"] = np.concatenate([_moe_decode(ctx, toks[:k], 0, n_vocab)] +
                                    [_moe_decode(ctx, [t], k + i, n_vocab) for i, t in enumerate(toks[k:])])
        taps.take("ffn_moe_topk", spec.n_layer)
        llama_cpp.llama_memory_clear(mem, True)
        r["greedy"] = np.array(_greedy(ctx, toks[:k], n_vocab), np.int32)
        taps.take("ffn_moe_topk", spec.n_layer)
        llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    assert not taps.errors, taps.errors
    return r


def _greedy(ctx, prompt: list[int], n_vocab: int) -> list[int]:
    """QWEN35_N_GREEDY greedy tokens after the prompt (one ubatch), each the first argmax."""
    out: list[int] = []
    logits = _moe_decode(ctx, prompt, 0, n_vocab)[-1]
    for i in range(QWEN35_N_GREEDY):
        out.append(int(np.argmax(logits)))
        logits = _moe_decode(ctx, [out[-1]], len(prompt) + i, n_vocab)[0]
    return out


def qwen35_refs(out: Path) -> None:
    import llama_cpp
    _quiet_llama_logs()
    arrays: dict[str, np.ndarray] = {"meta/llama_cpp_python": np.array(llama_cpp.__version__),
                                     "meta/tokens": np.array(QWEN35_TOKENS, np.int32),
                                     "meta/split": np.array(QWEN35_SPLIT, np.int32),
                                     "meta/n_greedy": np.array(QWEN35_N_GREEDY, np.int32)}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in QWEN35_SPECS:
            path = write_synthetic(Path(tmp) / f"{spec.name}.gguf", spec)
            r = qwen35_run(path, spec)
            arrays[f"{spec.name}/sha256"] = _sha256(path)
            for key, v in r.items():
                arrays[f"{spec.name}/{key}"] = v
            info = f"{spec.name}: batch vs single max|d| {np.abs(r['batch'] - r['single']).max():.3g}"
            if spec.n_expert:
                sets = [len({tuple(sorted(t)) for t in layer}) for layer in r["experts"]]
                info += f", distinct expert sets per layer {sets}"
            print(info)
    np.savez_compressed(out / "qwen35_refs.npz", **arrays)
    print(f"{out / 'qwen35_refs.npz'}: {(out / 'qwen35_refs.npz').stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    qwen35_refs(ap.parse_args().out)

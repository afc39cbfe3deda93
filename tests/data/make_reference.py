"""Regenerate llama.cpp reference logits for the model tests (dev only: needs llama-cpp-python).

    python tests/data/make_reference.py [--smollm2 PATH] [--out tests/data]

llama-cpp-python must be built for AVX2 without AVX-512/AMX, the numerics ggml-numerics.md describes:
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
                -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" pip install llama-cpp-python
(0.3.36, the version the stored references come from; ../shared/wheels holds such a build, prebuilt).
Writes:
- synthetic_refs.npz: for every spec in SYNTHETIC_SPECS, top-k logits of each position of its tokens
  (refs.tokens_of: TOKENS, or the 320 LONG_TOKENS for LONG_SPECS, in a context of refs.n_ctx_of cells),
  evaluated (a) as one batch and (b) one token at a time. The GGUF files are rebuilt from their specs by
  the tests.
- streams_refs.npz: for every spec in STREAM_SPECS and SmolLM2, the top-k logits of every output of
  refs.stream_batches(), decoded with a KV stream per sequence (kv_unified=False), in batch order.
- gemma3_refs.json / gemma3_tf.npz: Gemma 3 270M Q4_K_M, greedy continuations of refs.GEMMA3_PROMPTS
  and the teacher-forced top-k logits of refs.gemma3_long_prompt() (longer than the sliding window).
- smollm2_refs.json: for each prompt, llama.cpp's free-running greedy continuation (prompt as one batch,
  then one token at a time) with top-k logits per step, and the teacher-forced batch (prompt plus
  continuation in one ubatch) with per-position argmax, top-1/top-2 gap and top-k logits.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.model.refs import (N_STREAMS, SMOLLM2_PROMPTS, STREAM_SPECS, SYNTHETIC_SPECS,  # noqa: E402
                              N_GEN, TOP_K, kv_type_of, n_ctx_of, stream_batches, tokens_of,
                              GEMMA3_N_CTX, GEMMA3_N_GEN, GEMMA3_PROMPTS, gemma3_long_prompt)
from ggml_dist.model.synthetic import write_synthetic  # noqa: E402


def _llama(path: Path, n_ctx: int, kv_f32: bool):
    import llama_cpp
    t = llama_cpp.GGML_TYPE_F32 if kv_f32 else llama_cpp.GGML_TYPE_F16
    return llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=2,
                           logits_all=True, flash_attn=False, type_k=t, type_v=t, verbose=False,
                           seed=0)


def _topk(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.argsort(-x, kind="stable")[:k]
    return ids.astype(np.int32), x[ids].astype(np.float32)


def synthetic_refs(out: Path) -> None:
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in SYNTHETIC_SPECS:
            path = write_synthetic(Path(tmp) / f"{spec.name}.gguf", spec)
            tokens = tokens_of(spec)
            llm = _llama(path, n_ctx_of(spec), kv_type_of(spec) == "f32")
            llm.reset()
            llm.eval(tokens)
            batched = np.array(llm.scores[: len(tokens)], dtype=np.float32)
            llm.reset()
            single = []
            for tok in tokens:
                llm.eval([tok])
                single.append(np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32))
            for mode, logits in (("batch", batched), ("single", np.stack(single))):
                tk = [_topk(row, TOP_K) for row in logits]
                arrays[f"{spec.name}/{mode}/ids"] = np.stack([t[0] for t in tk])
                arrays[f"{spec.name}/{mode}/vals"] = np.stack([t[1] for t in tk])
            print(f"{spec.name}: batch vs single max|d| = {np.abs(batched - np.stack(single)).max():.3g}")
            del llm
    np.savez_compressed(out / "synthetic_refs.npz", **arrays)


def stream_refs(smollm2: Path, out: Path) -> None:
    """llama.cpp's C API (the Llama class has no kv_unified): one context per model, n_seq_max streams."""
    arrays: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = [(s.name, write_synthetic(Path(tmp) / f"{s.name}.gguf", s)) for s in STREAM_SPECS]
        for name, path in models + [("smollm2", smollm2)]:
            rows = _stream_logits(path)
            tk = [_topk(row, TOP_K) for row in rows]
            arrays[f"{name}/ids"] = np.stack([t[0] for t in tk])
            arrays[f"{name}/vals"] = np.stack([t[1] for t in tk])
            print(f"{name}: {len(rows)} output rows over {len(stream_batches())} batches")
    np.savez_compressed(out / "streams_refs.npz", **arrays)


def _stream_logits(path: Path) -> list[np.ndarray]:
    import llama_cpp
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = N_STREAMS * 256, 512, 512, N_STREAMS
    cp.n_threads = cp.n_threads_batch = 2
    cp.kv_unified, cp.flash_attn_type = False, 0                # LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama_cpp.llama_init_from_model(model, cp)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, N_STREAMS)
    rows = []
    try:
        for items in stream_batches():
            batch.n_tokens = len(items)
            for i, (tok, pos, seq, o) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, o
                batch.seq_id[i][0] = seq
            assert llama_cpp.llama_decode(ctx, batch) == 0, "llama_decode failed"
            for i, (_, _, _, o) in enumerate(items):
                if o:
                    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
                    rows.append(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).astype(np.float32))
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return rows


def _greedy(llm, prompt: str, n_gen: int) -> tuple[list[int], list[int], list[dict]]:
    """llama.cpp's free-running greedy continuation: the prompt as one batch, then a token at a time;
    (prompt tokens, generated tokens, the top-k logits of each step)."""
    ptoks = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ptoks)
    gen, steps = [], []
    for _ in range(n_gen):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        ids, vals = _topk(row, TOP_K)
        tok = int(np.argmax(row))
        gen.append(tok)
        steps.append({"ids": ids.tolist(), "vals": [round(float(v), 5) for v in vals]})
        llm.eval([tok])
    return ptoks, gen, steps


def smollm2_refs(model: Path, out: Path) -> None:
    import llama_cpp
    llm = _llama(model, 512, False)
    entries = []
    for prompt in SMOLLM2_PROMPTS:
        ptoks, gen, steps = _greedy(llm, prompt, N_GEN)
        llm.reset()
        allt = ptoks + gen
        llm.eval(allt)
        tf = np.array(llm.scores[: len(allt)], dtype=np.float32)
        part = np.partition(-tf, 1, axis=1)
        tf_entry = {"argmax": np.argmax(tf, axis=1).tolist(),
                    "gap": [round(float(g), 5) for g in (part[:, 1] - part[:, 0])],
                    "top": [{"ids": i.tolist(), "vals": [round(float(v), 5) for v in vs]}
                            for i, vs in (_topk(r, TOP_K) for r in tf)]}
        entries.append({"prompt": prompt, "prompt_tokens": ptoks, "tokens": gen, "steps": steps,
                        "teacher_forced": tf_entry})
        print(f"{prompt[:40]!r}: {llm.detokenize(gen).decode('utf-8', 'replace')[:60]!r}")
    meta = {"llama_cpp_python": llama_cpp.__version__, "n_gen": N_GEN, "top_k": TOP_K}
    (out / "smollm2_refs.json").write_text(json.dumps({"meta": meta, "prompts": entries}))


def gemma3_refs(model: Path, out: Path) -> None:
    """gemma3_refs.json: per prompt the greedy continuation (prompt as one batch, then one token at a
    time; swa_full, llama.cpp's default) with top-k logits per step; gemma3_tf.npz: the top-k logits of
    every position of the long prompt (teacher-forced, ubatches of 512)."""
    import llama_cpp
    llm = _llama(model, GEMMA3_N_CTX, False)
    entries = []
    for prompt in GEMMA3_PROMPTS:
        ptoks, gen, steps = _greedy(llm, prompt, GEMMA3_N_GEN)
        entries.append({"prompt": prompt, "prompt_tokens": ptoks, "tokens": gen, "steps": steps})
        print(f"{prompt[:40]!r}: {llm.detokenize(gen).decode('utf-8', 'replace')[:60]!r}")
    meta = {"llama_cpp_python": llama_cpp.__version__, "n_gen": GEMMA3_N_GEN, "top_k": TOP_K,
            "n_ctx": GEMMA3_N_CTX, "swa_full": True}
    (out / "gemma3_refs.json").write_text(json.dumps({"meta": meta, "prompts": entries}))
    toks = llm.tokenize(gemma3_long_prompt().encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(toks)
    tf = np.array(llm.scores[: len(toks)], dtype=np.float32)
    tk = [_topk(r, TOP_K) for r in tf]
    np.savez_compressed(out / "gemma3_tf.npz", tokens=np.array(toks, np.int32),
                        ids=np.stack([t[0] for t in tk]), vals=np.stack([t[1] for t in tk]))
    print(f"gemma3 long prompt: {len(toks)} tokens")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", type=Path, default=None, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--gemma3", type=Path, default=None, help="gemma-3-270m-q4_k_m.gguf")
    ap.add_argument("--only", choices=["synthetic", "streams", "smollm2", "gemma3"], default=None)
    a = ap.parse_args()
    if a.only in (None, "synthetic"):
        synthetic_refs(a.out)
    if a.only in (None, "streams", "smollm2") and a.smollm2 is None:
        from ggml_dist.model.pull import pull
        a.smollm2 = pull("smollm2-135m")
    if a.only in (None, "streams"):
        stream_refs(a.smollm2, a.out)
    if a.only in (None, "smollm2"):
        smollm2_refs(a.smollm2, a.out)
    if a.only in (None, "gemma3"):
        if a.gemma3 is None:
            from ggml_dist.model.pull import pull
            a.gemma3 = pull("gemma3-270m")
        gemma3_refs(a.gemma3, a.out)


if __name__ == "__main__":
    main()

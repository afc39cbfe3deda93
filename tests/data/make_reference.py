"""Regenerate llama.cpp reference logits for the model tests (dev only: needs llama-cpp-python).

    python tests/data/make_reference.py [--smollm2 PATH] [--out tests/data] [--only moe]

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
- moe_refs.npz: for every spec in MOE_SPECS (synthetic mixtures of experts, synthetic_moe.py), over
  MOE_TOKENS in a context of MOE_N_CTX cells: the top-k logits of each position, evaluated as one batch and
  one token at a time, and llama.cpp's chosen experts per layer and token (the graph's ffn_moe_topk-{il},
  read with an eval callback) in both modes, with the router's tie margin (see moe_refs).
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
from tests.model.refs import (MOE_N_CTX, MOE_SPECS, MOE_TIE_MIN, MOE_TOKENS,  # noqa: E402
                              N_STREAMS, SMOLLM2_PROMPTS, STREAM_SPECS, SYNTHETIC_SPECS,
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


# -- mixtures of experts -------------------------------------------------------------------------------
_GGML_I32, _GGML_F32 = 26, 0
_MOE_NAMES = ("ffn_moe_topk", "ffn_moe_probs", "ffn_moe_gate_biased", "ffn_moe_up_biased")


class _GraphTaps:
    """llama.cpp's eval callback (llama_context_params.cb_eval, a ggml_backend_sched_eval_callback): asked
    (ask=True) about every graph node, it wants those named `{name}-{il}` for the names given; shown one
    (ask=False) once computed, it copies it out with ggml_backend_tensor_get. ne and nb are read from the
    ggml_tensor struct of this ggml (ggml.h: enum type, 4 bytes of padding, buffer pointer, then int64 ne[4]
    at offset 16 and size_t nb[4] at offset 48; checked against ggml_nelements / ggml_nbytes), so strided
    views (ffn_moe_topk is a view of the first k columns of ffn_moe_argsort) come out right."""

    def __init__(self, names: tuple[str, ...]) -> None:
        import ctypes

        import llama_cpp
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        lib.ggml_get_name.restype, lib.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        lib.ggml_nbytes.restype, lib.ggml_nbytes.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
        lib.ggml_nelements.restype, lib.ggml_nelements.argtypes = ctypes.c_int64, [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.lib, self.ctypes, self.names = lib, ctypes, names
        self.seen: dict[str, list[np.ndarray]] = {}
        self.errors: list[str] = []
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._cb)    # kept alive with self

    def _wanted(self, name: str) -> bool:
        base, _, il = name.rpartition("-")
        return base in self.names and il.isdigit()

    def _cb(self, t, ask, _user) -> bool:
        try:
            name = self.lib.ggml_get_name(t).decode()
            if ask:
                return self._wanted(name)
            if self._wanted(name):
                self.seen.setdefault(name, []).append(self._read(t))
        except Exception as e:  # noqa: BLE001 - an exception must not cross into C (it would stop the graph)
            self.errors.append(repr(e))
        return True

    def _read(self, t) -> np.ndarray:
        c = self.ctypes
        typ = c.c_int32.from_address(t).value
        ne = list((c.c_int64 * 4).from_address(t + 16))
        nb = list((c.c_size_t * 4).from_address(t + 48))
        assert int(np.prod(ne)) == self.lib.ggml_nelements(t), (ne, self.lib.ggml_nelements(t))
        dtype = {_GGML_I32: np.int32, _GGML_F32: np.float32}[typ]
        assert nb[0] == 4
        n = self.lib.ggml_nbytes(t)
        buf = (c.c_uint8 * n)()
        self.lib.ggml_backend_tensor_get(t, buf, 0, n)
        flat = np.frombuffer(buf, dtype=np.uint8)
        arr = np.lib.stride_tricks.as_strided(flat, shape=(ne[3], ne[2], ne[1], ne[0] * 4),
                                              strides=(nb[3], nb[2], nb[1], 1))
        return np.ascontiguousarray(arr).view(dtype).reshape(ne[3], ne[2], ne[1], ne[0]).copy()

    def take(self, base: str, n_layer: int) -> list[np.ndarray]:
        """The captures of `{base}-{il}` per layer since the last take, rows (one per token) stacked."""
        out = [np.concatenate([a.reshape(-1, a.shape[-1]) for a in self.seen.pop(f"{base}-{il}", [])] or
                              [np.zeros((0, 0))]) for il in range(n_layer)]
        return out


def _moe_context(model, taps: _GraphTaps | None):
    import llama_cpp
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = MOE_N_CTX, 512, 512, 1
    cp.n_threads = cp.n_threads_batch = 2
    cp.flash_attn_type = 0                                  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.type_k = cp.type_v = llama_cpp.GGML_TYPE_F16
    if taps is not None:
        cp.cb_eval = taps.callback
    ctx = llama_cpp.llama_init_from_model(model, cp)
    assert ctx, "llama_init_from_model failed"
    return ctx


def _moe_decode(ctx, tokens: list[int], pos0: int, n_vocab: int) -> np.ndarray:
    import llama_cpp
    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        batch.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos0 + i, 1, True
            batch.seq_id[i][0] = 0
        assert llama_cpp.llama_decode(ctx, batch) == 0, "llama_decode failed"
        return np.stack([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                         .astype(np.float32) for i in range(len(tokens))])
    finally:
        llama_cpp.llama_batch_free(batch)


def _router_margin(spec, probs: np.ndarray) -> np.ndarray:
    """Per token, how far the k-th router score is from the (k+1)-th, in router-logit units: log(p_k /
    p_k+1) for softmax gating (~ the relative gap of the probabilities), l_k - l_k+1 for gpt-oss, whose
    ffn_moe_probs are the (biased) logits themselves (SOFTMAX_WEIGHT: the softmax comes after the top-k)."""
    k = spec.n_expert_used
    s = -np.sort(-probs.astype(np.float64), axis=1)
    if spec.arch == "gpt-oss":
        return (s[:, k - 1] - s[:, k]).astype(np.float32)
    return (np.log(s[:, k - 1]) - np.log(s[:, k])).astype(np.float32)


def _quiet_llama_logs() -> None:
    import llama_cpp
    global _LOG_CB
    _LOG_CB = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(_LOG_CB, None)


_LOG_CB = None


def moe_run(path: Path, spec, tokens: list[int]) -> dict[str, np.ndarray]:
    """llama.cpp on one MoE file: logits of the batch (with and without the eval callback: the same bits)
    and of one token at a time, the chosen experts and router scores of both."""
    import llama_cpp
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    assert model, f"llama.cpp cannot load {path}"
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    L, T = spec.n_layer, len(tokens)
    taps = _GraphTaps(_MOE_NAMES)
    try:
        plain = _moe_context(model, None)
        ref = _moe_decode(plain, tokens, 0, n_vocab)
        llama_cpp.llama_free(plain)
        ctx = _moe_context(model, taps)
        batched = _moe_decode(ctx, tokens, 0, n_vocab)
        r: dict[str, np.ndarray] = {"batch": batched, "plain": ref}
        for base in _MOE_NAMES:
            got = taps.take(base, L)
            if got[0].size:
                r[f"{base}/batch"] = np.stack(got)
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        r["single"] = np.concatenate([_moe_decode(ctx, [tok], i, n_vocab) for i, tok in enumerate(tokens)])
        for base in _MOE_NAMES:
            got = taps.take(base, L)
            if got[0].size:
                r[f"{base}/single"] = np.stack(got)
        llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    assert not taps.errors, taps.errors
    for mode in ("batch", "single"):
        assert r[f"ffn_moe_topk/{mode}"].shape == (L, T, spec.n_expert_used), r[f"ffn_moe_topk/{mode}"].shape
        assert r[f"ffn_moe_probs/{mode}"].shape == (L, T, spec.n_expert)
    return r


def _sha256(path: Path) -> np.ndarray:
    import hashlib
    return np.frombuffer(hashlib.sha256(path.read_bytes()).digest(), np.uint8)


def moe_refs(out: Path, specs=None, write: bool = True) -> dict[str, dict]:
    """moe_refs.npz, per spec name: tokens; batch/ and single/ top-k ids and vals; experts (L, T, k: the
    batch run's ffn_moe_topk, llama.cpp's order) and experts_single; margin (L, T: _router_margin of the
    batch run) and min_margin (over both runs); sha256 of the file llama.cpp ran."""
    _quiet_llama_logs()
    arrays: dict[str, np.ndarray] = {}
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in specs or MOE_SPECS:
            path = write_synthetic(Path(tmp) / f"{spec.name}.gguf", spec)
            tokens = MOE_TOKENS
            r = moe_run(path, spec, tokens)
            n = spec.name
            assert np.array_equal(r["plain"], r["batch"]), f"{n}: the eval callback changed the logits"
            arrays[f"{n}/tokens"] = np.array(tokens, np.int32)
            arrays[f"{n}/sha256"] = _sha256(path)
            for mode in ("batch", "single"):
                tk = [_topk(row, TOP_K) for row in r[mode]]
                arrays[f"{n}/{mode}/ids"] = np.stack([t[0] for t in tk])
                arrays[f"{n}/{mode}/vals"] = np.stack([t[1] for t in tk])
            topk_b, topk_s = r["ffn_moe_topk/batch"], r["ffn_moe_topk/single"]
            arrays[f"{n}/experts"] = topk_b.astype(np.int16)
            arrays[f"{n}/experts_single"] = topk_s.astype(np.int16)
            margins = {m: np.stack([_router_margin(spec, p) for p in r[f"ffn_moe_probs/{m}"]])
                       for m in ("batch", "single")}
            arrays[f"{n}/margin"] = margins["batch"]
            min_margin = float(min(margins["batch"].min(), margins["single"].min()))
            arrays[f"{n}/min_margin"] = np.float32(min_margin)
            # the top-k is the argsort of the scores; sets per token agree between the runs
            for m, tk_ in (("batch", topk_b), ("single", topk_s)):
                p = r[f"ffn_moe_probs/{m}"]
                mine = np.argsort(-p, axis=-1, kind="stable")[..., :spec.n_expert_used]
                assert np.array_equal(np.sort(mine, -1), np.sort(tk_, -1)), f"{n} {m}: top-k is not the argsort"
            rows = [np.bincount(topk_b[il].ravel(), minlength=spec.n_expert) for il in range(spec.n_layer)]
            d = float(np.abs(r["batch"] - r["single"]).max())
            info = {"batch_vs_single": d, "min_margin": min_margin,
                    "experts_equal": bool(np.array_equal(np.sort(topk_b, -1), np.sort(topk_s, -1))),
                    "rows_per_expert_max": [int(x.max()) for x in rows],
                    "experts_used": [int((x > 0).sum()) for x in rows],
                    "distinct_sets": [len({tuple(sorted(t)) for t in topk_b[il]}) for il in range(spec.n_layer)],
                    "size": path.stat().st_size}
            for base, lim in (("ffn_moe_gate_biased", "gate>7"), ("ffn_moe_up_biased", "|up|>7")):
                if f"{base}/batch" in r:
                    v = r[f"{base}/batch"]
                    info[lim] = float(((v > 7) if base.endswith("gate_biased") else (np.abs(v) > 7)).mean())
            report[n] = info
            print(f"{n}: {info['size'] / 1024:.0f} KiB, batch vs single max|d| = {d:.3g}, "
                  f"min router margin {min_margin:.3g}, experts batch == single: {info['experts_equal']}, "
                  f"experts used per layer {info['experts_used']}/{spec.n_expert}, distinct sets "
                  f"{info['distinct_sets']}, max rows per expert {info['rows_per_expert_max']}" +
                  "".join(f", {k} {info[k]:.2%}" for k in ("gate>7", "|up|>7") if k in info))
            if min_margin < MOE_TIE_MIN:
                print(f"  WARNING {n}: a router near-tie ({min_margin:.3g} < {MOE_TIE_MIN})")
    if write:
        import llama_cpp
        arrays["meta/llama_cpp_python"] = np.array(llama_cpp.__version__)
        np.savez_compressed(out / "moe_refs.npz", **arrays)
    return report


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
    ap.add_argument("--only", choices=["synthetic", "moe", "streams", "smollm2", "gemma3"], default=None)
    a = ap.parse_args()
    if a.only in (None, "synthetic"):
        synthetic_refs(a.out)
    if a.only in (None, "moe"):
        moe_refs(a.out)
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

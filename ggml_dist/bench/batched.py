"""Batched decode next to llama.cpp on the same file: N sequences decoded together, one token each per
step, as a server with N busy slots runs them. On a mixture of experts this is where a batch stops
amortising the weights: each token reads its own top-k experts, so a step of N tokens reads up to N times
one token's expert bytes (bench decode measures one sequence).

    ggml-dist bench batched [--model qwen3-30b-a3b] [--sequences 4] [--prompt-len 32] [--gen 32]
                            [--rounds 2] [--threads 2] [--llamacpp-flash-attn off] --json

Both engines in one process, taking turns as `bench decode --paired` does (each round's prompts from an
empty cache; then decode chunks of PAIRED_CHUNK steps, ABBA). Each sequence has its own prompt; the N
prompts go in one batch (positions 0.., sequence s), then each step decodes one token per sequence, each
its own greedy choice fed back. llama.cpp runs through llama-cpp-python's low-level API (llama_batch with
one sequence id per token, a unified KV cache), so both see the same batches. "tokens_match": both chose
the same tokens for every sequence in every round ("first_mismatch" where not). Without llama-cpp-python
(the dev extra) ours is measured alone and "llamacpp" says why.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .decode import PAIRED_CHUNK, _prompt, peak_rss_mb
from .llamacpp import FLASH_ATTN_CHOICES, _fa_name, _fa_request
from .simd import ours_info, parse_system_info


def _prompts(n_vocab: int, n_seq: int, prompt_len: int) -> list[list[int]]:
    return [[(t + 97 * s) % n_vocab for t in _prompt(n_vocab, prompt_len)] for s in range(n_seq)]


class _OursBatched:
    """Our LlamaContext with n_seq_max sequences: prompt() -> each sequence's greedy next token, step()."""

    def __init__(self, path: str, n: int, prompt_len: int, gen: int, threads: int) -> None:
        from ..backends.cpu import threads as kernel_threads
        from ..model.context import ContextParams, LlamaContext
        from ..model.model import LlamaModel
        kernel_threads.set_threads(threads)
        self.model = LlamaModel.load(path)
        self.prompts = _prompts(self.model.hp.n_vocab, n, prompt_len)
        n_ctx = n * (prompt_len + gen + 16)
        self.ctx = LlamaContext(self.model, ContextParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_seq_max=n))
        self.pos = 0

    def _decode(self, toks: list[int], pos: list[int], seqs: list[int], outs: list[bool]) -> list[int]:
        from ..model.ubatch import Batch
        lg = self.ctx.decode(Batch(np.array(toks, np.int32), np.array(pos, np.int32),
                                   [frozenset({s}) for s in seqs], np.array(outs, bool)))
        return [int(np.argmax(row)) for row in lg]

    def prompt(self) -> list[int]:
        self.ctx.clear()
        return self._decode(*_prompt_batch(self.prompts))

    def step(self, toks: list[int]) -> list[int]:
        return self._decode(toks, [self.pos] * len(toks), list(range(len(toks))), [True] * len(toks))


class _LlamaCppBatched:
    """llama.cpp on the same batches: llama_decode of a llama_batch, one sequence id per token."""

    def __init__(self, path: str, prompts: list[list[int]], gen: int, threads: int, flash_attn: str) -> None:
        self.lib = L = importlib.import_module("llama_cpp")
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        n = len(prompts)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n * (len(prompts[0]) + gen + 16), 512, 512, n
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True
        fa = _fa_request(L, flash_attn)
        if hasattr(cp, "flash_attn_type"):
            cp.flash_attn_type = int(fa)
        else:
            cp.flash_attn = bool(fa)
        self.fa = {"setting": flash_attn, "requested": _fa_name(L, fa)}
        self.ctx = L.llama_init_from_model(self.model, cp)
        self.batch = L.llama_batch_init(max(512, n * len(prompts[0])), 0, n)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.prompts, self.pos = prompts, 0

    def _decode(self, toks: list[int], pos: list[int], seqs: list[int], outs: list[bool]) -> list[int]:
        b = self.batch
        b.n_tokens = len(toks)
        for i, (t, p, s, o) in enumerate(zip(toks, pos, seqs, outs)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, o
            b.seq_id[i][0] = s
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [self.lib.llama_get_logits_ith(self.ctx, i) for i, o in enumerate(outs) if o]
        return [int(np.argmax(np.ctypeslib.as_array(r, shape=(self.n_vocab,)))) for r in rows]

    def prompt(self) -> list[int]:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        return self._decode(*_prompt_batch(self.prompts))

    def step(self, toks: list[int]) -> list[int]:
        return self._decode(toks, [self.pos] * len(toks), list(range(len(toks))), [True] * len(toks))

    def info(self) -> dict[str, Any]:
        return {"version": getattr(self.lib, "__version__", None),
                **parse_system_info(self.lib.llama_print_system_info()), "flash_attn": self.fa}


def _prompt_batch(prompts: list[list[int]]) -> tuple[list[int], list[int], list[int], list[bool]]:
    """The N prompts as one batch: tokens, positions, sequence ids, and an output at each prompt's end."""
    n = len(prompts[0])
    toks = [t for p in prompts for t in p]
    pos = [i for _ in prompts for i in range(n)]
    seqs = [s for s in range(len(prompts)) for _ in range(n)]
    return toks, pos, seqs, [i % n == n - 1 for i in range(len(toks))]


def measure(path: str, n_seq: int, prompt_len: int, gen: int, threads: int, flash_attn: str,
            rounds: int) -> dict[str, Any]:
    ours = _OursBatched(path, n_seq, prompt_len, gen, threads)
    engines: dict[str, Any] = {"ours": ours}
    ll_error = None
    try:
        engines["llamacpp"] = _LlamaCppBatched(path, ours.prompts, gen, threads, flash_attn)
    except ImportError as e:
        ll_error = f"{type(e).__name__}: {e} (llama-cpp-python, the dev extra, measures llama.cpp)"
    for eng in engines.values():                                # warm: the prompts and two steps
        eng.pos = prompt_len
        eng.step(eng.prompt())
    spent = {k: [0.0, 0.0] for k in engines}                     # prompt s, decode s over all rounds
    chosen: dict[str, list[list[list[int]]]] = {k: [] for k in engines}     # [round][step][sequence]
    ratios = []
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        tok = {}
        for k in order:
            t = time.perf_counter()
            tok[k] = engines[k].prompt()
            spent[k][0] += time.perf_counter() - t
            engines[k].pos = prompt_len
            chosen[k].append([tok[k]])
        for i, c0 in enumerate(range(0, gen, PAIRED_CHUNK)):
            this = {}
            for k in order if i % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                for _ in range(min(PAIRED_CHUNK, gen - c0)):
                    tok[k] = engines[k].step(tok[k])
                    engines[k].pos += 1
                    chosen[k][-1].append(tok[k])
                this[k] = time.perf_counter() - t
                spent[k][1] += this[k]
            if "llamacpp" in this:
                ratios.append(this["llamacpp"] / this["ours"])
    res: dict[str, Any] = {k: {"prompt_tok_s": rounds * n_seq * prompt_len / spent[k][0],
                               "decode_tok_s": rounds * n_seq * gen / spent[k][1],
                               "decode_steps_s": rounds * gen / spent[k][1]} for k in engines}
    res["ours"].update(ours_info=ours_info(), weight_bytes=ours.model.weight_bytes())
    if ll_error is not None:
        res["llamacpp"] = {"error": ll_error}
    else:
        res["llamacpp"]["info"] = engines["llamacpp"].info()
        res["decode_ratio"] = res["ours"]["decode_tok_s"] / res["llamacpp"]["decode_tok_s"]
        res["prompt_ratio"] = res["ours"]["prompt_tok_s"] / res["llamacpp"]["prompt_tok_s"]
        res["decode_chunk_ratio_quartiles"] = [round(float(q), 3) for q in np.quantile(ratios, [0.25, 0.5, 0.75])]
        res.update(_token_check(chosen["ours"], chosen["llamacpp"]))
    res.update(model=path, sequences=n_seq, prompt_len=prompt_len, gen=gen, rounds=rounds, threads=threads,
               peak_rss_mb=peak_rss_mb())
    return res


def _token_check(ours: list[list[list[int]]], ll: list[list[list[int]]]) -> dict[str, Any]:
    for r, (a, b) in enumerate(zip(ours, ll)):
        for step, (x, y) in enumerate(zip(a, b)):
            if x != y:
                seq = next(s for s, (u, v) in enumerate(zip(x, y)) if u != v)
                where = {"round": r, "step": step, "sequence": seq, "ours": x[seq], "llamacpp": y[seq]}
                return {"tokens_match": False, "first_mismatch": where}
    return {"tokens_match": True}


def _resolve(name: str) -> Path:
    """A path, a known model name (pulled), or a synthetic shape's name (written once into the cache)."""
    from ..model.pull import resolve_model
    from ..model.synthetic import SHAPES, cached_synthetic
    return cached_synthetic(SHAPES[name]) if name in SHAPES else resolve_model(name)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ggml-dist bench batched", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a GGUF path, a known name or a synthetic shape "
                    "(qwen3-30b-a3b, qwen3-30b-a3b-q4_k, gpt-oss-20b, ...)")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp-flash-attn", choices=FLASH_ATTN_CHOICES, default="off",
                    help="off: the graph ours runs (the same tokens)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.sequences < 1 or a.prompt_len < 1 or a.gen < 1 or a.rounds < 1:
        ap.error("--sequences, --prompt-len, --gen and --rounds must be at least 1")
    res = measure(str(_resolve(a.model)), a.sequences, a.prompt_len, a.gen, a.threads,
                  a.llamacpp_flash_attn, a.rounds)
    if a.json:
        print(json.dumps(res))
    else:
        ll = res["llamacpp"]
        print(f"{a.sequences} sequences: ours prompt {res['ours']['prompt_tok_s']:.1f} tok/s, decode "
              f"{res['ours']['decode_tok_s']:.1f} tok/s" + ("" if "error" in ll else
              f"; llama.cpp {ll['prompt_tok_s']:.1f} / {ll['decode_tok_s']:.1f} ({res['prompt_ratio']:.2f}x / "
              f"{res['decode_ratio']:.2f}x), tokens_match {res['tokens_match']}"))
    return 0 if res.get("tokens_match", True) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Log-likelihoods as evaluation harnesses read them (lm-evaluation-harness's local-completions, and any
client of OpenAI's legacy completions with echo): every prompt token's logprob, from one evaluation.

    prompt          a string, token ids, or a list of either (lm-eval sends a batch of token-id lists);
                    one choice each
    echo            the choice's text starts with the prompt (a token-id prompt: its tokens' text)
    echo + logprobs the prompt is scored: the engine evaluates it whole, every row an output
                    (Request.prompt_logprobs), in chunks of --batch, each a step of its own and never
                    from the prompt cache, so its rows are those of one process's batch of the same
                    tokens (`ggml-dist logits`, LlamaContext with all_outputs); logprobs then lists the
                    prompt's tokens before the generated ones, the first with null token_logprobs and
                    top_logprobs (nothing precedes it), as OpenAI's legacy API did
    max_tokens 0    score only: nothing is generated

lm-eval's local-completions, with tokenized requests (its default), sends context + continuation as
token ids with echo, logprobs 1 and max_tokens 1, and sums token_logprobs[len(context):-1]. The
tokenizer it needs comes from the server (its "remote" tokenizer, found by probing GET /tokenizer_info):
tokenizer_info() here, and vLLM's spelling of /tokenize and /detokenize (`prompt`), which app.py accepts
beside llama-server's (`content`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .protocol import APIError

Piece = Callable[[int], bytes]      # token id -> its bytes (Tokenizer.token_to_piece)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request's `prompt` (already validated as a string, token ids or a
    list of strings and token-id lists): one entry per choice."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    if not prompt:
        return [[]]
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _text(piece: Piece, t: int) -> str:
    return piece(t).decode("utf-8", errors="replace")


def echo_text(ids: Sequence[int], piece: Piece) -> str:
    """The text a token-id prompt echoes: its tokens' bytes, joined, then decoded (special tokens
    spelled out, as the prompt holds them)."""
    return b"".join(piece(t) for t in ids).decode("utf-8", errors="replace")


def prompt_logprobs_body(ids: Sequence[int], scored: Sequence[Any], piece: Piece) -> dict[str, Any]:
    """The completions logprobs object of a scored prompt: its tokens, their logprobs given the tokens
    before (engine TokenLogprobs for ids[1:]), null for the first, and character offsets from 0."""
    assert len(scored) == len(ids) - 1, f"{len(scored)} scored tokens for a prompt of {len(ids)}"
    toks = [_text(piece, t) for t in ids]
    offs, at = [], 0
    for s in toks:
        offs.append(at)
        at += len(s)
    lps: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    for _tok, lp, top in scored:
        lps.append(lp)
        tops.append({_text(piece, t): v for t, v in top})
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}


def join_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """A prompt's logprobs object followed by the generated tokens' (whose offsets already count the
    echoed text)."""
    if then is None:
        return first
    return {k: [*first[k], *then[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def check_scoring(echo: bool, logprobs: int | None, max_tokens: int, n: int, stream: bool) -> int | None:
    """How many top logprobs a prompt's tokens get (None: the prompt is not scored); a 400 for the
    combinations that have no meaning here."""
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens 0 generates nothing: it needs echo (with logprobs to score the prompt)",
                       param="max_tokens", code="invalid_value")
    if not (echo and logprobs is not None):
        return None
    if n > 1:
        raise APIError(400, "echo with logprobs scores the prompt once: n must be 1", param="n",
                       code="invalid_value")
    return logprobs


def tokenizer_info(tok: Any, chat_template: str | None, n_ctx_slot: int) -> dict[str, Any]:
    """GET /tokenizer_info (vLLM's): the special tokens and template a client-side tokenizer needs;
    lm-eval's remote tokenizer takes its prefix token (bos, else eos) and stop string from it."""
    def text(i: int | None) -> str | None:
        return None if i is None else tok.tokens[i]
    return {"tokenizer_class": "ggml_dist", "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id),
            "pad_token": text(getattr(tok, "pad_id", None)), "add_bos_token": bool(tok.add_bos),
            "add_eos_token": bool(getattr(tok, "add_eos", False)), "chat_template": chat_template,
            "model_max_length": n_ctx_slot, "vocab_size": tok.n_vocab}

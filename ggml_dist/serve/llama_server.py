"""llama-server's own API beside the OpenAI one, for scripts and clients written against llama.cpp's
server (tools/server/README.md there): its native fields, response shapes and error types.

    POST /completion        prompt (a string, token ids, the two mixed in one prompt, {"prompt_string"},
                            or a list of prompts: then a list of answers), n_predict (-1: until the end
                            of the context), temperature, top_k, top_p, min_p, seed, stop, stream,
                            n_probs (completion_probabilities, with ids), cache_prompt, grammar,
                            json_schema, return_tokens, response_fields, the penalties and logit_bias
                            (llama-server's [[token or text, bias or false]] form too); timings in every
                            final answer. Sampling defaults are llama-server's (0.8, top_k 40, top_p
                            0.95, min_p 0.05). Fields that would change the answer and are not
                            implemented (REFUSED) are a 400 that names them, as on the OpenAI routes
    GET /props              the default generation settings, slots, template and special tokens
    GET /slots              each slot: whether it is processing (busy slots sit at the bottom: the engine
                            packs them), its context; POST /slots/{id} (actions) is refused: without
                            --api-key anyone could change another client's slot, and with one, slot
                            save/restore/erase are not implemented
    POST /apply-template    {"messages"} -> {"prompt"}: the chat template's rendering
    POST /embedding, /embeddings  llama-server's embeddings: with --pooling none each token's final-norm
                            row (not normalized); pooled, [one vector] per input
The answer is the OpenAI one's (app.py's _generate), written in llama-server's shape (body, stream here).
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationError

from .protocol import APIError, _Sampling, validation_error

# fields of llama-server's /completion that change the answer and are not implemented here
REFUSED: dict[str, str] = {
    "mirostat": "mirostat sampling", "typical_p": "typical sampling", "tfs_z": "tail-free sampling",
    "dry_multiplier": "DRY sampling", "xtc_probability": "XTC sampling", "top_n_sigma": "top-n-sigma sampling",
    "dynatemp_range": "dynamic temperature", "ignore_eos": "ignore_eos", "post_sampling_probs":
    "post-sampling probabilities (n_probs gives the logprobs of the raw logits)", "lora": "LoRA adapters",
    "multimodal_data": "multimodal input", "n_indent": "n_indent", "t_max_predict_ms": "t_max_predict_ms",
    "samplers": "a sampler order (llama.cpp's default order is the one implemented)",
    "return_progress": "prompt progress events", "suffix": "infill", "input_extra": "infill",
}
NEUTRAL = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
           "top_n_sigma": -1.0, "dynatemp_range": 0.0, "ignore_eos": False, "post_sampling_probs": False,
           "return_progress": False, "n_indent": 0, "t_max_predict_ms": 0}


class NativeCompletion(_Sampling):
    """/completion's request after its prompt and logit_bias are read (native_request)."""
    temperature: StrictFloat = Field(default=0.8, ge=0.0)
    top_p: StrictFloat = Field(default=0.95, gt=0.0, le=1.0)
    n_predict: StrictInt = Field(default=-1, ge=-1)
    n_probs: StrictInt = Field(default=0, ge=0, le=100)
    cache_prompt: StrictBool = True
    return_tokens: StrictBool = False
    response_fields: list[str] | None = None
    seed: StrictInt | None = Field(default=None, ge=-1, le=2**63 - 1)

    def n_logprobs(self) -> int:
        return self.n_probs          # always some: the answer's tokens come with their ids

    def max_tokens_or_default(self, room: int) -> int:
        return room if self.n_predict < 0 else self.n_predict


def prompt_parts(x: Any, param: str = "prompt") -> list[list[str | int]]:
    """llama-server's prompts: a string; token ids, with strings among them (one prompt, the strings
    tokenized in place); {"prompt_string": s} or {"content": [text parts]}; or a list of those, one
    prompt each. Each prompt as its pieces."""
    def one(v: Any) -> list[str | int] | None:
        if isinstance(v, str):
            return [v]
        if isinstance(v, dict):
            if isinstance(v.get("prompt_string"), str) and set(v) <= {"prompt_string", "multimodal_data"}:
                if v.get("multimodal_data"):
                    raise APIError(400, "this model takes no images or audio (multimodal_data)", param=param)
                return [v["prompt_string"]]
            parts = v.get("content")
            if isinstance(parts, list) and parts and all(isinstance(p, dict) for p in parts):
                if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
                    raise APIError(400, f"only text content parts are supported in '{param}'", param=param)
                return ["".join(p["text"] for p in parts)]
            return None
        if isinstance(v, list) and v and all(isinstance(t, (int, str)) and not isinstance(t, bool) for t in v) \
                and any(isinstance(t, int) for t in v):
            return list(v)
        return None
    single = one(x)
    if single is not None:
        return [single]
    if isinstance(x, list) and x:
        out = [one(v) for v in x]
        if all(p is not None for p in out):
            return [p for p in out if p is not None]
    raise APIError(400, f"'{param}' must be a string, token ids (strings may be mixed in), an object with "
                   f"'prompt_string' or text 'content' parts, or a non-empty list of those", param=param)


def tokenize_parts(parts: list[str | int], tok: Any, param: str = "prompt") -> list[int]:
    """A prompt's pieces as token ids: a string encoded with special tokens parsed (the model's BOS
    before the first piece, as llama-server's tokenize_mixed), ids checked against the vocabulary."""
    ids: list[int] = []
    for i, p in enumerate(parts):
        if isinstance(p, str):
            ids += tok.encode(p, add_special=i == 0, parse_special=True)
        else:
            if not 0 <= p < tok.n_vocab:
                raise APIError(400, f"token id {p} is outside the vocabulary (0..{tok.n_vocab - 1})", param=param)
            ids.append(p)
    return ids


def _logit_bias(v: Any, tok: Any) -> dict[str, float] | None:
    """llama-server's logit_bias: {"id or text": bias} or [[id or text, bias or false], ...]; a text's
    every token gets the bias, false bans (-100, this server's floor)."""
    if v is None:
        return None
    pairs = list(v.items()) if isinstance(v, dict) else v
    if not isinstance(pairs, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
        raise APIError(400, "'logit_bias' must be an object or a list of [token, bias] pairs", param="logit_bias")
    out: dict[str, float] = {}
    for key, bias in pairs:
        b = -100.0 if bias is False else bias
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise APIError(400, f"logit_bias for {key!r} must be a number or false", param="logit_bias")
        if isinstance(key, int) or (isinstance(key, str) and key.isascii() and key.isdigit()):
            out[str(int(key))] = max(-100.0, min(100.0, float(b)))
        elif isinstance(key, str):
            for t in tok.encode(key, add_special=False, parse_special=False):
                out[str(t)] = max(-100.0, min(100.0, float(b)))
        else:
            raise APIError(400, f"a logit_bias key must be a token id or a text, got {key!r}", param="logit_bias")
    return out


def native_request(body: dict[str, Any], tok: Any) -> tuple[NativeCompletion, list[list[int]], list[str]]:
    """/completion's body as a request, its prompts' token ids and their texts (the answers' `prompt`)."""
    for name, what in REFUSED.items():
        if name in body and body[name] is not None and body[name] != NEUTRAL.get(name):
            raise APIError(400, f"'{name}' is not supported by this server ({what})", param=name,
                           code="unsupported_parameter")
    if "prompt" not in body:
        raise APIError(400, "'prompt' is required", param="prompt")
    parts = prompt_parts(body["prompt"])
    fields = {k: v for k, v in body.items() if k not in ("prompt", "logit_bias", "n", "echo", "logprobs")}
    if body.get("seed") == 0xFFFFFFFF:
        fields["seed"] = -1                              # llama.cpp's LLAMA_DEFAULT_SEED: random
    try:
        req = NativeCompletion.model_validate({**fields, "logit_bias": _logit_bias(body.get("logit_bias"), tok)})
    except ValidationError as e:
        raise validation_error(e) from None
    if req.seed is not None and req.seed < 0:
        req = req.model_copy(update={"seed": None})     # -1: a random seed
    prompts = [tokenize_parts(p, tok) for p in parts]
    texts = [b"".join(tok.token_to_piece(t) for t in ids).decode("utf-8", errors="replace") for ids in prompts]
    return req, prompts, texts


def generation_settings(req: NativeCompletion, n_predict: int) -> dict[str, Any]:
    return {"n_predict": n_predict, "max_tokens": n_predict, "seed": req.seed if req.seed is not None else -1,
            "temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "min_p": req.min_p,
            "repeat_penalty": req.repeat_penalty, "repeat_last_n": 64, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "n_probs": req.n_probs, "stream": req.stream,
            "stop": list(req.stop_list()), "cache_prompt": req.cache_prompt, "grammar": req.grammar or "",
            "typical_p": 1.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "ignore_eos": False,
            "post_sampling_probs": False, "adaptive_target": -1.0, "adaptive_decay": 0.9,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"]}


def _probs(entries: list, piece: Callable[[int], bytes]) -> list[dict[str, Any]]:
    """completion_probabilities: per token its id, text, bytes, logprob and the n_probs top ones."""
    def one(t: int, lp: float) -> dict[str, Any]:
        b = piece(t)
        return {"id": t, "token": b.decode("utf-8", errors="ignore"), "bytes": list(b), "logprob": lp}
    return [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries]


def _nested(fields: list[str], res: dict[str, Any]) -> dict[str, Any]:
    """response_fields: each "a/b" path's value, under that path's name (llama-server's
    json_get_nested_values); paths that are not there are left out."""
    out = {}
    for f in fields:
        v: Any = res
        for k in f.split("/"):
            if not isinstance(v, dict) or k not in v:
                break
            v = v[k]
        else:
            out[f] = v
    return out


class Native:
    """A /completion request's answer in llama-server's shape, from app.py's _Answer: body() the whole
    one (a list for several prompts), stream() its chunks (`stop` false per piece, then a final one per
    prompt with stop true and everything a final answer has)."""

    def __init__(self, req: NativeCompletion, texts: list[str], n_predict: int, model: str, piece: Any) -> None:
        self.req, self.texts, self.n_predict, self.model, self.piece = req, texts, n_predict, model, piece

    def final(self, answer: Any, c: int) -> dict[str, Any]:
        ch = answer.choices[c]
        entries = list(ch.logprobs)
        word = self._stop_word(ch.text, entries) if ch.finish == "stop" else ""
        stop_type = "limit" if ch.finish == "length" else "word" if word else "eos"
        n_prompt = len(answer.prompts[c])
        t = answer.timings()
        t = {**t, "prompt_n": n_prompt - ch.n_cached, "cache_n": ch.n_cached, "predicted_n": ch.n_gen}
        tokens = [e[0] for e in entries] if self.req.return_tokens and not self.req.stream else []   # streamed: sent
        res = {"index": c, "content": "" if self.req.stream else ch.text, "tokens": tokens,
               "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": ch.n_gen,
               "tokens_evaluated": n_prompt, "generation_settings": generation_settings(self.req, self.n_predict),
               "prompt": self.texts[c], "has_new_line": "\n" in ch.text, "truncated": False, "stop_type": stop_type,
               "stopping_word": word, "tokens_cached": self.kv_tokens(n_prompt, ch.n_gen, stop_type), "timings": t}
        if self.req.n_probs > 0 and not self.req.stream:
            res["completion_probabilities"] = _probs(entries, self.piece)
        return _nested(self.req.response_fields, res) if self.req.response_fields else res

    @staticmethod
    def kv_tokens(n_prompt: int, n_gen: int, stop_type: str) -> int:
        """tokens_cached as llama-server counts it: the slot's cells at the end, the prompt and every
        generated token but the last one sampled, which no step evaluated (an end of generation is not
        counted in n_gen here, and every token before it was evaluated)."""
        return n_prompt + n_gen - (1 if n_gen and stop_type != "eos" else 0)

    def _stop_word(self, content: str, entries: list) -> str:
        """The stop string that ended the answer: the generated tokens' text goes on past the content
        with it (a stop string is cut from the content)."""
        stops = self.req.stop_list()
        if not stops:
            return ""
        full = b"".join(self.piece(e[0]) for e in entries).decode("utf-8", errors="replace")
        rest = full[len(content):]
        return next((w for w in stops if rest.startswith(w)), "")

    def body(self, answer: Any) -> Any:
        out = [self.final(answer, c) for c in range(len(answer.choices))]
        return out[0] if len(out) == 1 else out

    async def stream(self, answer: Any, chunks: AsyncIterator[dict[str, Any] | None]) -> AsyncIterator[str]:
        async for ch in chunks:
            if ch is None:
                return
            if "error" in ch:
                yield f"data: {json.dumps(ch)}\n\n"
                continue
            if not ch.get("choices"):
                continue
            choice = ch["choices"][0]
            c = choice["index"]
            entries = ch.get("_entries", [])
            if choice["finish_reason"] is None and (choice["text"] or entries):
                part: dict[str, Any] = {"index": c, "content": choice["text"], "tokens": [e[0] for e in entries],
                                        "stop": False, "id_slot": -1,
                                        "tokens_predicted": len(answer.choices[c].logprobs),
                                        "tokens_evaluated": len(answer.prompts[c])}
                if self.req.n_probs > 0:
                    part["completion_probabilities"] = _probs(entries, self.piece)
                yield f"data: {json.dumps(part)}\n\n"
            elif choice["finish_reason"] is not None:
                yield f"data: {json.dumps(self.final(answer, c))}\n\n"


def props(model_name: str, model_path: str, n_parallel: int, n_ctx_slot: int, template: str | None,
          tok: Any, fingerprint: str) -> dict[str, Any]:
    """GET /props."""
    defaults = NativeCompletion()
    def text(i: int | None) -> str:
        return "" if i is None else tok.tokens[i]
    return {"default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx_slot, "speculative": False,
                                            "is_processing": False,
                                            "params": generation_settings(defaults, -1)},
            "total_slots": n_parallel, "model_alias": model_name, "model_path": model_path,
            "modalities": {"vision": False, "video": False, "audio": False}, "endpoint_slots": True,
            "endpoint_props": True, "endpoint_metrics": True, "chat_template": template or "",
            "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id), "build_info": fingerprint,
            "is_sleeping": False}


def slots(n_parallel: int, n_running: int, n_ctx_slot: int) -> list[dict[str, Any]]:
    """GET /slots: the engine keeps its busy slots at the bottom (Slots.compact), so slot i processes
    when i < n_running."""
    return [{"id": i, "id_task": -1, "n_ctx": n_ctx_slot, "speculative": False, "is_processing": i < n_running}
            for i in range(n_parallel)]


def timings(n_prompt: int, n_cached: int, n_gen: int, prompt_s: float, gen_s: float) -> dict[str, Any]:
    """llama-server's `timings` object (prompt_n counts the tokens evaluated, cache_n those the prompt
    cache held). Measured where the answer is assembled: prompt_ms from the request's submission to its
    first generated text (queueing included), predicted_ms from there to its end."""
    prompt_ms, gen_ms = prompt_s * 1e3, gen_s * 1e3
    return {"cache_n": n_cached, "prompt_n": n_prompt, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
            "prompt_per_second": n_prompt / prompt_s if prompt_s > 0 else 0.0,
            "predicted_n": n_gen, "predicted_ms": gen_ms,
            "predicted_per_token_ms": gen_ms / n_gen if n_gen else 0.0,
            "predicted_per_second": n_gen / gen_s if gen_s > 0 and n_gen else 0.0}

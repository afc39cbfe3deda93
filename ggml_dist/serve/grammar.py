"""Constrained decoding: a grammar as a token mask at sampling time, through llguidance.

llguidance (guidance-ai; the library llama.cpp's `LLAMA_LLGUIDANCE` build uses) compiles JSON schemas,
Lark/GBNF grammars and regexes, and gives per step the set of tokens that keep the output inside the
grammar (a bitmask over the vocabulary, computed in native code: tens of microseconds for a 49K vocab).
Chosen over xgrammar and outlines-core because it is maintained, needs no torch, reads llama.cpp's
GBNF, and works from the token byte strings we already hold.

    grammar_of(response_format=..., grammar=...) -> llguidance grammar text | None (APIError on bad input)
    Constraint(tokenizer_of(tok), grammar): allowed() -> bool mask over the vocabulary; accept(token)

A sequence with a constraint is sampled on the driver (model/sampling.Sampler.sample's `allowed`):
every token outside the mask gets -inf before the sampler chain, as llama.cpp applies its grammar
sampler. The grammar's end allows only end-of-generation; the engine then finishes the request.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any

import numpy as np

from ..model.tokenizer import Tokenizer, TokenType, _spm_tokenize
from .protocol import APIError

try:
    import llguidance
    import llguidance.numpy as llg_np
    _HAVE_LLGUIDANCE = True
except ImportError:                     # pragma: no cover - a dependency of the serve extra
    _HAVE_LLGUIDANCE = False            # every use of llguidance is behind _need()

_LOCK = threading.Lock()
_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


def available() -> bool:
    return _HAVE_LLGUIDANCE


def _need() -> None:
    if not _HAVE_LLGUIDANCE:
        raise APIError(400, "structured output needs the llguidance package (pip install llguidance)",
                       param="response_format", code="unsupported_parameter")


def grammar_of(response_format: Any = None, grammar: Any = None, json_schema: Any = None) -> str | None:
    """The llguidance grammar of a request: OpenAI's response_format (json_object, json_schema) or
    llama-server's `grammar` (GBNF) / `json_schema`; None for plain text. Bad input: APIError (400)."""
    given = [(n, v) for n, v in (("response_format", response_format), ("grammar", grammar),
                                 ("json_schema", json_schema)) if v is not None]
    if not given or (given[0][0] == "response_format" and len(given) == 1 and response_format == {"type": "text"}):
        return None
    if len(given) > 1:
        raise APIError(400, f"give one of {', '.join(n for n, _ in given)}", param=given[1][0])
    name, v = given[0]
    _need()
    try:
        if name == "grammar":
            if not isinstance(v, str):
                raise APIError(400, "'grammar' must be a GBNF grammar string", param=name)
            text = llguidance.grammar_from("gbnf", v)
        elif name == "json_schema":
            text = _json(v)
        else:
            text = _response_format(v)
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - llguidance's compile errors (ValueError, RuntimeError): a 400
        raise APIError(400, f"invalid {name}: {e}", param=name) from None
    err = llguidance.LLMatcher.validate_grammar(text)
    if err and not err.startswith("WARNING"):
        raise APIError(400, f"invalid {name}: {err}", param=name)
    return text


def _response_format(v: Any) -> str:
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise APIError(400, "'response_format' must be an object with a 'type'", param="response_format")
    kind = v["type"]
    if kind == "json_object":
        return _json({"type": "object"})
    if kind == "json_schema":
        js = v.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema' object",
                           param="response_format")
        return _json(js.get("schema", {}))
    raise APIError(400, f"response_format type '{kind}' is not supported (text, json_object, json_schema)",
                   param="response_format")


def _json(schema: Any) -> str:
    """JSON in the compact form (no whitespace between tokens, as OpenAI's structured outputs): with
    whitespace allowed, a model can fill its whole budget with newlines inside an object."""
    if not isinstance(schema, dict):
        raise APIError(400, "a JSON schema must be an object", param="response_format")
    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                          defaults={"whitespace_flexible": False})


class _Wrapped:
    """What llguidance.LLTokenizer reads of a tokenizer: every token's bytes (control tokens marked
    with a 0xFF prefix, as llguidance's llama.cpp bridge does), EOS and BOS, and an encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tokens = []
        special = []
        for i in range(tok.n_vocab):
            b = tok.token_to_piece(i, special=True)
            if tok.token_types[i] == TokenType.CONTROL or (
                    tok.token_types[i] == TokenType.USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
                b = b"\xff" + b
                special.append(i)
            self.tokens.append(b)
        self.special_token_ids = special
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else 0
        self.bos_token_id = tok.bos_id
        self._tok = tok

    def __call__(self, s: str | bytes) -> list[int]:
        """The tokens of a piece of output text (llguidance re-tokenizes forced bytes): without the
        space SentencePiece puts before a prompt, which would not be in the output."""
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        if self._tok.model == "gpt2" or not self._tok.add_space_prefix:
            return self._tok.encode(text, add_special=False, parse_special=False)
        return _spm_tokenize(text.replace(" ", "\u2581"), self._tok)


def tokenizer_of(tok: Tokenizer) -> Any:
    """The model's llguidance tokenizer, built once (a pass over the vocabulary, ~1 s for 50K tokens)."""
    _need()
    with _LOCK:
        lt = _TOKENIZERS.get(tok)
        if lt is None:
            w = _Wrapped(tok)
            eog = sorted(i for i in range(tok.n_vocab) if tok.is_eog(i)) or [w.eos_token_id]
            lt = _TOKENIZERS[tok] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), eos_token=eog)
        return lt


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, lltok: Any, grammar: str, n_vocab: int) -> None:
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self.n_vocab = n_vocab
        self._mask = llg_np.allocate_token_bitmask(1, lltok.vocab_size)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens that keep the output inside the grammar."""
        llg_np.fill_next_token_bitmask(self.matcher, self._mask)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")[:self.n_vocab]
        return bits.astype(bool)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"grammar: token {token} was not allowed: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output must end)."""
        return bool(self.matcher.is_stopped())

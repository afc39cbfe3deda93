"""Tokenizer from GGUF metadata: GPT-2 byte-level BPE and SentencePiece-style (SPM), as llama-vocab.cpp.

Sections, bottom-up: byte-level unicode mapping, BPE session (pre-tokenizers: pretokenize.py), SPM session,
special-token partition (tokenizer_st_partition), the Tokenizer (encode/decode, ids), chat templates.
Token ids must equal llama.cpp's for the same file and text; tests compare against ids that llama.cpp
produced (tests/data/make_tokenizer_ref.py).
"""
from __future__ import annotations

import enum
import functools
import heapq
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import regex

from ggml_dist.model import pretokenize as pt
from ggml_dist.model.gguf import GGUFError, GGUFFile

log = logging.getLogger(__name__)

class TokenType(enum.IntEnum):
    """llama_token_type as stored in tokenizer.ggml.token_type."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ---------------------------------------------------------------------------------------------------
# byte-level mapping (GPT-2's bytes_to_unicode; llama.cpp unicode_byte_to_utf8)

def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_BYTE_ENCODE_TABLE = [BYTE_TO_UNICODE[b] for b in range(256)]


def byte_encode(text: str) -> str:
    return "".join(_BYTE_ENCODE_TABLE[b] for b in text.encode("utf-8"))


def byte_decode(text: str) -> bytes:
    """llama_decode_text: map each char back to its byte; chars outside the table pass as UTF-8."""
    out = bytearray()
    for c in text:
        b = UNICODE_TO_BYTE.get(c)
        if b is None:
            out += c.encode("utf-8", errors="surrogateescape")
        else:
            out.append(b)
    return bytes(out)


# ---------------------------------------------------------------------------------------------------
# BPE session (llm_tokenizer_bpe_session::tokenize for one pre-token)

def _bpe_merge(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the lowest-rank adjacent pair first, leftmost on ties, as llama.cpp's work queue does."""
    sym = list(word)                       # one symbol per code point
    if len(sym) < 2:
        return sym
    n = len(sym)
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[int, int, int, str, str]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        r = ranks.get((sym[left], sym[right]))
        if r is not None:
            heapq.heappush(heap, (r, left, right, sym[left], sym[right]))

    for i in range(n - 1):
        add(i, i + 1)
    while heap:
        _, left, right, ltext, rtext = heapq.heappop(heap)
        # stale entry: one side was merged away or grew since the pair was queued
        if sym[left] != ltext or sym[right] != rtext or nxt[left] != right:
            continue
        sym[left] = ltext + rtext
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    return [s for s in sym if s]


# ---------------------------------------------------------------------------------------------------
# SPM session (llm_tokenizer_spm_session::tokenize): score-ordered merges, byte fallback

def _spm_tokenize(text: str, tok: Tokenizer) -> list[int]:
    sym = list(text)
    n = len(sym)
    if n == 0:
        return []
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, int]] = []
    vocab, scores = tok.token_to_id, tok.scores

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        tid = vocab.get(sym[left] + sym[right])
        if tid is None:
            return
        # highest score first, leftmost on ties; size detects stale entries
        heapq.heappush(heap, (-float(scores[tid]), left, right, len(sym[left]) + len(sym[right])))

    for i in range(1, n):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left] or not sym[right] or len(sym[left]) + len(sym[right]) != size:
            continue
        sym[left] += sym[right]
        sym[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] != -1:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])

    out: list[int] = []
    i = 0
    while i != -1:
        tid = vocab.get(sym[i])
        if tid is not None:
            out.append(tid)
        else:
            # every merged symbol is a token, so only single characters get here: emit their bytes
            out.extend(tok.byte_to_token(b) for b in sym[i].encode("utf-8"))
        i = nxt[i]
    return out


# ---------------------------------------------------------------------------------------------------
# Tokenizer

# llama.cpp 0.3.36 (llama_vocab::impl::load) finds these tokens by their text
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
              "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
              "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
              "<｜end▁of▁sentence｜>", "[e~[")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


class Tokenizer:
    """llama_vocab: ids, scores and types of every token, and the encode/decode of its model type."""

    source: str | None = None       # the file it was read from (from_gguf), named in its errors

    def __init__(self, model: str, tokens: list[str], scores: np.ndarray | None = None,
                 token_types: np.ndarray | None = None, merges: Sequence[str] = (),
                 pre: str = "default", bos_id: int | None = None, eos_id: int | None = None,
                 unk_id: int | None = None, eot_id: int | None = None, eom_id: int | None = None,
                 pad_id: int | None = None, add_bos: bool | None = None, add_eos: bool | None = None,
                 add_space_prefix: bool | None = None, chat_template: str | None = None,
                 fim_pad_id: int | None = None, fim_rep_id: int | None = None,
                 fim_sep_id: int | None = None) -> None:
        if model not in ("gpt2", "llama"):
            raise GGUFError(f"tokenizer model '{model}' is not supported (gpt2, llama)")
        self.model = model
        self.tokens = list(tokens)
        n = len(self.tokens)
        self.scores = np.zeros(n, np.float32) if scores is None else np.asarray(scores, np.float32)
        self.token_types = (np.full(n, TokenType.NORMAL, np.int32) if token_types is None
                            else np.asarray(token_types, np.int32))
        if len(self.scores) != n or len(self.token_types) != n:
            raise GGUFError(f"tokenizer: {n} tokens but {len(self.scores)} scores and "
                            f"{len(self.token_types)} token types")
        self.token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self.token_to_id.setdefault(t, i)   # first id wins, as llama.cpp's token_to_id
        self.pre = pre
        self.chat_template = chat_template

        if model == "gpt2":
            if pre not in pt.PRE_TOKENIZERS:
                raise GGUFError(f"unknown BPE pre-tokenizer '{pre}'; known: {', '.join(pt.PRE_TOKENIZERS)}")
            self._patterns = [regex.compile(p) for p in pt.PRE_TOKENIZERS[pre]]
            self.ranks: dict[tuple[str, str], int] = {}
            for rank, m in enumerate(merges):
                pos = m.find(" ", 1)
                if pos == -1:
                    raise GGUFError(f"tokenizer: merge {rank} '{m}' has no separating space")
                self.ranks.setdefault((m[:pos], m[pos + 1:]), rank)
            self.ignore_merges = pre in pt.IGNORE_MERGES
            self.clean_spaces = pre not in pt.NO_CLEAN_SPACES
            default_bos = default_eos = 11   # llama.cpp's defaults for gpt2 vocabs
            self.add_bos = pre in pt.ADD_BOS_DEFAULT_BPE if add_bos is None else add_bos
            self.add_space_prefix = False if add_space_prefix is None else add_space_prefix
            unk_default = None
        else:
            default_bos, default_eos = 1, 2
            self.clean_spaces = False
            self.add_bos = True if add_bos is None else add_bos
            self.add_space_prefix = True if add_space_prefix is None else add_space_prefix
            unk_default = 0
        self.add_eos = False if add_eos is None else add_eos
        # llama.cpp: a special id outside the vocabulary is "bad": warn and keep the default id
        self.bos_id = self._id_or_none(self._special(bos_id, default_bos, "bos"))
        self.eos_id = self._id_or_none(self._special(eos_id, default_eos, "eos"))
        self.unk_id = self._id_or_none(self._special(unk_id, unk_default, "unk"))
        self.pad_id = self._id_or_none(pad_id)
        self.fim_pad_id = self._id_or_none(fim_pad_id)
        self.fim_rep_id = self._id_or_none(fim_rep_id)
        self.fim_sep_id = self._id_or_none(fim_sep_id)
        self.eot_id = self._id_or_none(eot_id)
        self.eom_id = self._id_or_none(eom_id)
        self._find_eog()
        # special tokens matched in the text, longest first (llama_vocab cache_special_tokens)
        special_types = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        self._special_ids = sorted((i for i in range(n) if self.token_types[i] in special_types
                                    and self.tokens[i]), key=lambda i: -len(self.tokens[i].encode("utf-8")))
        self._bpe_cache: dict[str, tuple[int, ...]] = {}
        self._pieces: dict[bool, list[bytes | None]] = {True: [None] * n, False: [None] * n}

    def _special(self, i: int | None, default: int | None, what: str) -> int | None:
        if i is None:
            return default
        if not 0 <= i < len(self.tokens):
            log.warning("bad special token: '%s' = %d, using default id %s", what, i, default)
            return default
        return i

    def _id_or_none(self, i: int | None) -> int | None:
        if i is None or i < 0 or i >= len(self.tokens):
            return None
        return int(i)

    def _find_eog(self) -> None:
        """llama_vocab::impl::load: EOT, EOM, FIM and EOG tokens found by their text (and made CONTROL)
        where the metadata names none, the eos/eot/eom ids added to EOG, then its per-vocab fix-ups, in
        llama.cpp's order. Where a vocab has several candidates of one kind llama.cpp takes the first in
        its hash map's order, here the first of the list: for EOT that changes eot_id (which nothing
        reads) but not EOG, as every EOT text is an EOG text; two FIM pad or repo tokens would differ."""
        types, ids = self.token_types, self.token_to_id
        if self.eot_id is None:
            self.eot_id = next((ids[t] for t in _EOT_TEXTS if t in ids), None)
            if self.eot_id is not None:
                types[self.eot_id] = TokenType.CONTROL
        if self.eom_id is None and "<|eom_id|>" in ids:
            self.eom_id = ids["<|eom_id|>"]
        # fill-in-the-middle pad, repo and file-separator tokens end the generation too
        for attr, candidates in (("fim_pad_id", _FIM_PAD_TEXTS), ("fim_rep_id", _FIM_REP_TEXTS),
                                 ("fim_sep_id", ("<|file_sep|>",))):
            if getattr(self, attr) is None:
                tid = next((ids[t] for t in candidates if t in ids), None)
                if tid is not None:
                    setattr(self, attr, tid)
                    types[tid] = TokenType.CONTROL
        eog = {ids[t] for t in _EOG_TEXTS if t in ids}
        for i in eog:
            types[i] = TokenType.CONTROL
        eog |= {i for i in (self.fim_pad_id, self.fim_rep_id, self.fim_sep_id) if i is not None}
        # gpt-oss (o200k_harmony): these are always parsed and always rendered
        for t in _ALWAYS_USER_DEFINED:
            if t in ids:
                types[ids[t]] = TokenType.USER_DEFINED
        for tid in (self.eos_id, self.eot_id, self.eom_id):
            if tid is not None:
                eog.add(tid)
        texts = {self.tokens[i]: i for i in sorted(eog)}
        # o200k_harmony and solar-open: "<|end|>" ends a message, not the generation
        has_call = "<|call|>" in texts or "<|calls|>" in texts
        if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
            eog.discard(texts["<|end|>"])
            types[texts["<|end|>"]] = TokenType.USER_DEFINED
        # gemma4 and plamo: "</s>" is a normal token
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            types[texts["</s>"]] = TokenType.NORMAL
        self.eog_ids = frozenset(eog)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        md = f.metadata
        model = md.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise GGUFError(f"{f.path}: missing metadata key 'tokenizer.ggml.model'")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise GGUFError(f"{f.path}: 'tokenizer.ggml.tokens' must be a non-empty string array")
        merges = md.get("tokenizer.ggml.merges", [])
        if model == "gpt2" and (not isinstance(merges, list) or not all(isinstance(m, str) for m in merges)):
            raise GGUFError(f"{f.path}: gpt2 tokenizer needs a string array 'tokenizer.ggml.merges'")

        def arr(key: str) -> np.ndarray | None:
            v = md.get(key)
            if v is None:
                return None
            if not isinstance(v, np.ndarray) or len(v) != len(tokens):
                raise GGUFError(f"{f.path}: '{key}' must be a numeric array of {len(tokens)} entries")
            return v

        def opt(key: str, kind: type) -> Any:
            v = md.get(key)
            if v is not None and (not isinstance(v, kind) or (kind is int and isinstance(v, bool))):
                raise GGUFError(f"{f.path}: '{key}' = {v!r} is not a {kind.__name__}")
            return v

        try:
            tok = cls._from_metadata(model, tokens, arr, opt, merges)
        except GGUFError as e:
            msg = str(e)
            raise GGUFError(msg if msg.startswith(str(f.path)) else f"{f.path}: {msg}") from None
        tok.source = str(f.path)
        return tok

    @classmethod
    def _from_metadata(cls, model, tokens, arr, opt, merges) -> Tokenizer:
        return cls(model, tokens, scores=arr("tokenizer.ggml.scores"),
                   token_types=arr("tokenizer.ggml.token_type"), merges=merges,
                   pre=opt("tokenizer.ggml.pre", str) or "default",
                   bos_id=opt("tokenizer.ggml.bos_token_id", int),
                   eos_id=opt("tokenizer.ggml.eos_token_id", int),
                   unk_id=opt("tokenizer.ggml.unknown_token_id", int),
                   eot_id=opt("tokenizer.ggml.eot_token_id", int),
                   eom_id=opt("tokenizer.ggml.eom_token_id", int),
                   pad_id=opt("tokenizer.ggml.padding_token_id", int),
                   fim_pad_id=opt("tokenizer.ggml.fim_pad_token_id", int),
                   fim_rep_id=opt("tokenizer.ggml.fim_rep_token_id", int),
                   fim_sep_id=opt("tokenizer.ggml.fim_sep_token_id", int),
                   add_bos=opt("tokenizer.ggml.add_bos_token", bool),
                   add_eos=opt("tokenizer.ggml.add_eos_token", bool),
                   add_space_prefix=opt("tokenizer.ggml.add_space_prefix", bool),
                   chat_template=opt("tokenizer.chat_template", str))

    def _fail(self, msg: str) -> GGUFError:
        """A vocabulary that cannot encode this text: the file's fault, so the file is named."""
        return GGUFError(f"{self.source}: {msg}" if self.source else msg)

    # -- ids -----------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    def byte_to_token(self, b: int) -> int:
        """llama_vocab::byte_to_token for SPM: <0xXX>, else the byte as text, else unk."""
        tid = self.token_to_id.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self.token_to_id.get(chr(b)) if b < 128 else None
        if tid is None:
            if self.unk_id is None:
                raise self._fail(f"tokenizer: no token for byte 0x{b:02X} and no unknown token")
            tid = self.unk_id
        return tid

    # -- encode --------------------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """tokenizer_st_partition: split text around special tokens (ints), longest tokens first."""
        frags: list[str | int] = [text]
        for tid in self._special_ids:
            ttype = self.token_types[tid]
            if not parse_special and ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
                continue   # user-defined tokens are always matched
            s = self.tokens[tid]
            out: list[str | int] = []
            for fr in frags:
                if isinstance(fr, int) or s not in fr:
                    out.append(fr)
                    continue
                pos = 0
                while (m := fr.find(s, pos)) != -1:
                    if m > pos:
                        out.append(fr[pos:m])
                    out.append(tid)
                    pos = m + len(s)
                if pos < len(fr):
                    out.append(fr[pos:])
            frags = out
        return frags

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        cached = self._bpe_cache.get(word)
        if cached is not None:
            return cached
        vocab = self.token_to_id
        if self.ignore_merges and word in vocab:
            ids: tuple[int, ...] = (vocab[word],)
        else:
            out: list[int] = []
            for s in _bpe_merge(word, self.ranks):
                tid = vocab.get(s)
                if tid is not None:
                    out.append(tid)
                else:   # llama.cpp tries each byte of the symbol as a token and drops the misses
                    for b in s.encode("utf-8"):
                        t = vocab.get(chr(b)) if b < 128 else None
                        if t is not None:
                            out.append(t)
            ids = tuple(out)
        if len(self._bpe_cache) < 100_000:
            self._bpe_cache[word] = ids
        return ids

    def _encode_bpe(self, text: str) -> list[int]:
        out: list[int] = []
        for w in pt.regex_split(text, self._patterns):
            out.extend(self._bpe_word(byte_encode(w)))
        return out

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize: text -> token ids (add_special adds BOS/EOS as the vocab asks)."""
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise self._fail("tokenizer wants a BOS token but has none")
            out.append(self.bos_id)
        frags = self._partition(text, parse_special) if text else []
        if self.model == "gpt2":
            for fr in frags:
                out.extend(self._encode_bpe(fr) if isinstance(fr, str) else (fr,))
        else:
            is_prev_special = True   # prefix the first fragment, and any after a special token
            for fr in frags:
                if isinstance(fr, int):
                    out.append(fr)
                    is_prev_special = True
                    continue
                piece = " " + fr if self.add_space_prefix and is_prev_special else fr
                out.extend(_spm_tokenize(piece.replace(" ", "\u2581"), self))
                is_prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise self._fail("tokenizer wants an EOS token but has none")
            out.append(self.eos_id)
        return out

    # -- decode --------------------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """llama_token_to_piece: the bytes of one token; control and unknown tokens only if special."""
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} outside the vocabulary (0..{len(self.tokens) - 1})")
        cache = self._pieces[special]
        piece = cache[token_id]
        if piece is None:
            piece = cache[token_id] = self._token_to_piece(token_id, special)
        return piece

    def _token_to_piece(self, token_id: int, special: bool) -> bytes:
        text = self.tokens[token_id]
        ttype = int(self.token_types[token_id])
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8", errors="surrogateescape") if special else b""
        if ttype == TokenType.USER_DEFINED:
            return text.encode("utf-8", errors="surrogateescape")
        if ttype == TokenType.NORMAL:
            if self.model == "gpt2":
                return byte_decode(text)
            return text.replace("\u2581", " ").encode("utf-8", errors="surrogateescape")
        if ttype == TokenType.BYTE and self.model == "llama":
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b""
        return b""   # unused and undefined tokens print nothing

    def detokenize(self, ids: Iterable[int], special: bool = False, remove_special: bool = False) -> bytes:
        """llama_detokenize: special renders control tokens; remove_special drops the added BOS/EOS."""
        ids = [int(i) for i in ids]
        remove_space = self.add_space_prefix   # the space SPM put in front of the text
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        pieces = [self.token_to_piece(i, special) for i in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        out = b"".join(pieces)
        return _clean_spaces(out) if self.clean_spaces else out

    def decode(self, ids: Iterable[int], special: bool = False, remove_special: bool = False) -> str:
        """Token ids -> text; invalid UTF-8 (a token stream cut mid-character) becomes U+FFFD."""
        return self.detokenize(ids, special, remove_special).decode("utf-8", errors="replace")

    # -- chat template -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs: Any) -> str:
        """Render tokenizer.chat_template with jinja2, with the variables HF and llama-cpp-python pass."""
        src = template or self.chat_template
        if not src:
            raise GGUFError("the model has no tokenizer.chat_template; pass template=")
        return _compile_template(src).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._text_of(self.bos_id), eos_token=self._text_of(self.eos_id), **kwargs)

    def _text_of(self, i: int | None) -> str:
        return "" if i is None else self.tokens[i]


def _clean_spaces(text: bytes) -> bytes:
    """The clean_spaces passes of llama_detokenize: " ?", " !", " .", " ," lose their space; " ' "
    loses both; " 's", " 'm", " 're", " 've" lose theirs (but not " 't", " 'd", " 'll")."""
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == 0x20 and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    text, out = bytes(out), bytearray(text[:1])
    i, n = 1, len(text)
    while i < n:
        x = text[i]
        if x == 0x27 and i + 1 < n and text[i - 1] == 0x20 and text[i + 1] == 0x20:
            out.pop()
            i += 1   # drop the space after it too
        out.append(x)
        i += 1
    text, out = bytes(out), bytearray(text[:1])
    n = len(text)
    for i in range(1, n):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < n and (
                text[i + 1] in b"sm" or (i + 2 < n and text[i + 1:i + 3] in (b"re", b"ve"))):
            out.pop()
        out.append(x)
    return bytes(out)


def _raise_exception(message: str) -> None:
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile_template(src: str) -> Any:
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        import datetime
        return datetime.datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(src)

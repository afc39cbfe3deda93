"""BPE pre-tokenizers (llm_tokenizer_bpe's regex lists, src/llama-vocab.cpp) and the split that applies
them as llama.cpp's unicode_regex_split does, with llama.cpp's Unicode tables (15.1) where the `regex`
module knows a newer Unicode. Each regex splits every piece left by the previous one into its matches and
the unmatched gaps between them.
"""
from __future__ import annotations

from collections.abc import Sequence

import regex

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
           r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# LLAMA_VOCAB_PRE_TYPE_GPT4O (o200k, o200k_harmony of gpt-oss): llama.cpp's rewrite of the tokenizer.json
# regex, whose [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+ std::regex cannot express. llama.cpp
# runs it with std::regex on its collapsed text (one code per class for every non-ASCII code point), so
# only ASCII letters have a case: any other letter is both "upper" and "lower", and \p{M} is no letter.
# Not HF's splits ("ÉCOLE" is "É" "COLE"; "é" as e + U+0301 loses its accent), but llama.cpp's: the
# same pattern with the `regex` module's \p{L} cuts where llama.cpp does (with regex_split's remapping
# of the newer characters below), checked against llama.cpp's own unicode_regex_split.
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
          r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
          r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "qwen2": [_QWEN2],
    "deepseek-r1-qwen": [_QWEN2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    # the names llama.cpp maps to LLAMA_VOCAB_PRE_TYPE_GPT4O, and minimax-m2 (its own type, same regex)
    "gpt-4o": [_GPT4O],
    "llama4": [_GPT4O],
    "kanana2": [_GPT4O],
    "talkie": [_GPT4O],
    "minimax-m2": [_GPT4O],
}
# pre-tokenizer names whose vocab sets ignore_merges (a whole pre-token found in the vocab is one token)
IGNORE_MERGES = {"llama3", "llama-bpe"}
ADD_BOS_DEFAULT_BPE = {"llama3", "llama-bpe"}
# BPE vocabs detokenize with clean_spaces (drop the space in " ," " 's" ...) except these
NO_CLEAN_SPACES = {"smollm", "qwen2", "deepseek-r1-qwen", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"}


# llama.cpp classifies each code point with its own tables (src/unicode-data.cpp of 0.3.36: Unicode 15.1),
# both in its hand-written splitters (gpt2, llama3, qwen2 regexes) and for std::regex, which sees one
# collapsed code per character class. The `regex` module knows a newer Unicode (17.0): the characters
# Unicode 16.0 and 17.0 added are letters, digits, marks, punctuation or symbols to it, but unassigned
# ("other": none of \p{L} \p{N} \p{P} \p{S} \p{M} \s) to llama.cpp. regex_split matches on a copy of
# the text where they are U+E000 (private use: "other" to both), so it splits where llama.cpp does.
# tests/model/test_tokenizer_gpt4o.py checks these ranges against llama.cpp's table for the installed
# `regex` (a `regex` with a newer Unicode needs its additions here).
_NEWER_UNICODE = (
    (0x0088F, 0x0088F), (0x00897, 0x00897), (0x00C5C, 0x00C5C), (0x00CDC, 0x00CDC), (0x01ACF, 0x01ADD),
    (0x01AE0, 0x01AEB), (0x01B4E, 0x01B4F), (0x01B7F, 0x01B7F), (0x01C89, 0x01C8A), (0x020C1, 0x020C1),
    (0x02427, 0x02429), (0x02B96, 0x02B96), (0x031E4, 0x031E5), (0x0A7CB, 0x0A7CF), (0x0A7D2, 0x0A7D2),
    (0x0A7D4, 0x0A7D4), (0x0A7DA, 0x0A7DC), (0x0A7F1, 0x0A7F1), (0x0FBC3, 0x0FBD2), (0x0FD90, 0x0FD91),
    (0x0FDC8, 0x0FDCE), (0x105C0, 0x105F3), (0x10940, 0x10959), (0x10D40, 0x10D65), (0x10D69, 0x10D85),
    (0x10D8E, 0x10D8F), (0x10EC2, 0x10EC7), (0x10ED0, 0x10ED8), (0x10EFA, 0x10EFC), (0x11380, 0x11389),
    (0x1138B, 0x1138B), (0x1138E, 0x1138E), (0x11390, 0x113B5), (0x113B7, 0x113C0), (0x113C2, 0x113C2),
    (0x113C5, 0x113C5), (0x113C7, 0x113CA), (0x113CC, 0x113D5), (0x113D7, 0x113D8), (0x113E1, 0x113E2),
    (0x116D0, 0x116E3), (0x11B60, 0x11B67), (0x11BC0, 0x11BE1), (0x11BF0, 0x11BF9), (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9), (0x11F5A, 0x11F5A), (0x13460, 0x143FA), (0x16100, 0x16139), (0x16D40, 0x16D79),
    (0x16EA0, 0x16EB8), (0x16EBB, 0x16ED3), (0x16FF2, 0x16FF6), (0x187F8, 0x187FF), (0x18CFF, 0x18CFF),
    (0x18D09, 0x18D1E), (0x18D80, 0x18DF2), (0x1CC00, 0x1CCFC), (0x1CD00, 0x1CEB3), (0x1CEBA, 0x1CED0),
    (0x1CEE0, 0x1CEF0), (0x1E5D0, 0x1E5FA), (0x1E5FF, 0x1E5FF), (0x1E6C0, 0x1E6DE), (0x1E6E0, 0x1E6F5),
    (0x1E6FE, 0x1E6FF), (0x1F6D8, 0x1F6D8), (0x1F777, 0x1F77A), (0x1F8B2, 0x1F8BB), (0x1F8C0, 0x1F8C1),
    (0x1F8D0, 0x1F8D8), (0x1FA54, 0x1FA57), (0x1FA89, 0x1FA8A), (0x1FA8E, 0x1FA8F), (0x1FABE, 0x1FABE),
    (0x1FAC6, 0x1FAC6), (0x1FAC8, 0x1FAC8), (0x1FACD, 0x1FACD), (0x1FADC, 0x1FADC), (0x1FADF, 0x1FADF),
    (0x1FAE9, 0x1FAEA), (0x1FAEF, 0x1FAEF), (0x1FBCB, 0x1FBEF), (0x1FBFA, 0x1FBFA), (0x2B73A, 0x2B73F),
    (0x2CEA2, 0x2CEAD), (0x323B0, 0x33479),
)
_NEWER_UNICODE_RE = regex.compile("[" + "".join(f"\\U{a:08x}-\\U{b:08x}" for a, b in _NEWER_UNICODE) + "]")


def as_llama_cpp_sees(text: str) -> str:
    """text with the characters llama.cpp's tables do not know replaced by U+E000 (same length)."""
    if text.isascii() or not _NEWER_UNICODE_RE.search(text):
        return text
    return _NEWER_UNICODE_RE.sub("\ue000", text)


def regex_split(text: str, patterns: Sequence[regex.Pattern[str]]) -> list[str]:
    """unicode_regex_split: successive splits keeping both matches and the gaps between them."""
    seen = as_llama_cpp_sees(text)
    words = [seen]
    for pat in patterns:
        out: list[str] = []
        for w in words:
            pos = 0
            for m in pat.finditer(w):
                if m.start() > pos:
                    out.append(w[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(w):
                out.append(w[pos:])
        words = out
    if seen is text:
        return words
    pieces, pos = [], 0     # the same cuts in the original text
    for w in words:
        pieces.append(text[pos:pos + len(w)])
        pos += len(w)
    return pieces

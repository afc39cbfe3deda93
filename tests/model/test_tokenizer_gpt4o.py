"""The "gpt-4o" pre-tokenizer (o200k_harmony, gpt-oss) against llama.cpp: a synthetic byte-level BPE
vocab built by tests/data/make_tokenizer_gpt4o_ref.py, its stored llama.cpp ids, detokenized text and
pre-token splits (tests/data/tokenizer_gpt4o.json), llama.cpp's code point classes, the special
tokens' roles after llama.cpp's gpt-oss fix-ups, and live comparisons with llama.cpp when llama_cpp
(llama-cpp-python) is installed."""
from __future__ import annotations

import functools
import importlib.util
import json
import random
from pathlib import Path

import numpy as np
import pytest
import regex

from ggml_dist.model.gguf import load_gguf
from ggml_dist.model.pretokenize import PRE_TOKENIZERS, as_llama_cpp_sees, regex_split
from ggml_dist.model.tokenizer import Tokenizer, TokenType

DATA = Path(__file__).resolve().parents[1] / "data"
GPT4O_NAMES = ["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"]


def _load_ref_script():
    spec = importlib.util.spec_from_file_location("make_tokenizer_gpt4o_ref",
                                                  DATA / "make_tokenizer_gpt4o_ref.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ref = _load_ref_script()


@functools.lru_cache(maxsize=1)
def _data() -> dict:
    return json.loads((DATA / "tokenizer_gpt4o.json").read_text())


@pytest.fixture(scope="module")
def gpt4o_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("gpt4o") / "gpt4o.gguf"
    ref.write_gpt4o_vocab(p)
    return p


@pytest.fixture(scope="module")
def tok(gpt4o_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(load_gguf(gpt4o_path))


def _patterns(pre: str = "gpt-4o") -> list[regex.Pattern[str]]:
    return [regex.compile(p) for p in PRE_TOKENIZERS[pre]]


# ---------------------------------------------------------------------------------------------------
# stored references (no llama_cpp needed)


def test_stored_refs_are_for_this_vocab_and_corpus() -> None:
    d = _data()
    assert d["vocab_sha256"] == ref.vocab_sha256(), "vocab changed: rerun make_tokenizer_gpt4o_ref.py"
    assert {c[0] for c in d["cases"]} == set(ref.CORPUS)
    assert [t for t, _ in d["splits"]] == ref.CORPUS
    assert d["regex"] == ref.GPT4O_REGEX == PRE_TOKENIZERS["gpt-4o"][0]


def test_matches_stored_llama_cpp_ids_and_text(tok: Tokenizer) -> None:
    cases = _data()["cases"]
    assert len(cases) == 4 * len(ref.CORPUS) >= 400
    bad = []
    for text, add_special, parse_special, ids, d_special, d_none, d_rm in cases:
        d_plain = d_special if d_none is None else d_none
        d_removed = d_plain if d_rm is None else d_rm
        got = tok.encode(text, add_special=add_special, parse_special=parse_special)
        if got != ids:
            bad.append(("encode", text, add_special, parse_special, ids, got))
        for want, special, remove_special in ((d_special, True, False), (d_plain, False, False),
                                              (d_removed, False, True)):
            out = tok.detokenize(ids, special=special, remove_special=remove_special)
            if out != want.encode("utf-8"):
                bad.append(("detokenize", text, special, remove_special, want, out))
    assert not bad, "\n".join(map(repr, bad[:10]))


def test_splits_match_stored_llama_cpp() -> None:
    """The pre-token pieces themselves, as llama.cpp's unicode_regex_split cut them (token ids alone can
    hide a different cut where no merge crosses it)."""
    pats = _patterns()
    bad = [(t, want, got) for t, want in _data()["splits"] if (got := regex_split(t, pats)) != want]
    assert not bad, "\n".join(map(repr, bad[:10]))


def test_unicode_classes_match_llama_cpp_tables() -> None:
    """Every code point >= 128 falls in the same class for the `regex` module (after the remapping of
    the characters llama.cpp's Unicode 15.1 tables lack) as in llama.cpp's tables: a `regex` with a newer
    Unicode than pretokenize._NEWER_UNICODE covers fails here."""
    runs = ref.parse_llama_classes(_data()["llama_classes"])
    n = 0x110000
    llama = np.empty(n, np.uint8)
    for (start, cls), nxt in zip(runs, [r[0] for r in runs[1:]] + [n]):
        llama[start:nxt] = ord(cls)
    cps = np.r_[128:0xD800, 0xE000:n]
    text = as_llama_cpp_sees("".join(map(chr, cps.tolist())))
    ours = np.full(len(cps), ord("O"), np.uint8)
    # general categories are disjoint; \s first, as llama.cpp's whitespace flag wins over Zs
    for cls, pat in (("M", r"\p{M}+"), ("S", r"\p{S}+"), ("P", r"\p{P}+"), ("N", r"\p{N}+"),
                     ("L", r"\p{L}+"), ("W", r"\s+")):
        for m in regex.finditer(pat, text):
            ours[m.start():m.end()] = ord(cls)
    diff = np.nonzero(ours != llama[cps])[0]
    assert len(diff) == 0, [(hex(int(cps[i])), chr(llama[cps[i]]), chr(ours[i])) for i in diff[:20]]


def test_newer_unicode_is_remapped() -> None:
    # U+1C89 (Cyrillic, Unicode 16.0) is a letter to `regex` but unassigned to llama.cpp 0.3.36, which
    # cuts "aᲉb" around it with every pre-tokenizer
    assert regex_split("a\u1c89b", _patterns()) == ["a", "\u1c89b"]
    assert regex_split("a\u1c89b", _patterns("gpt-2")) == ["a", "\u1c89", "b"]
    assert regex_split("a\u1c89b", _patterns("llama-bpe")) == ["a", "\u1c89b"]
    assert as_llama_cpp_sees("a\u1c89b\U000323b0") == "a\ue000b\ue000"
    s = "plain ascii"
    assert as_llama_cpp_sees(s) is s


def test_gpt4o_splits() -> None:
    pats = _patterns()
    assert regex_split("HTTPServer camelCase they'LL I'm 1234567", pats) == \
        ["HTTPServer", " camel", "Case", " they'LL", " I'm", " ", "123", "456", "7"]
    assert regex_split("x/\ny  \n\n\tz", pats) == ["x", "/\n", "y", "  \n\n", "\tz"]
    # llama.cpp, unlike the tokenizer.json regex (HF tokenizers, tiktoken): marks are not letters, so a
    # decomposed "é" loses its accent; a non-ASCII letter is lower case too, so "ÉCOLE" is "É" "COLE"
    assert regex_split("cafe\u0301s ÉCOLE École", pats) == ["cafe", "\u0301s", " É", "COLE", " École"]


def test_vocab_flags(tok: Tokenizer) -> None:
    """llama.cpp's flags for LLAMA_VOCAB_PRE_TYPE_GPT4O and its gpt-oss token fix-ups."""
    assert tok.pre == "gpt-4o" and not tok.add_bos and not tok.add_eos
    assert not tok.clean_spaces and not tok.ignore_merges
    ids = {t: tok.token_to_id[t] for t in ref.SPECIALS}
    assert tok.bos_id == ids["<|startoftext|>"] and tok.eos_id == ids["<|return|>"]
    assert tok.eog_ids == {ids["<|return|>"], ids["<|call|>"], ids["<|endoftext|>"]}
    assert not tok.is_eog(ids["<|end|>"])          # with <|return|> and <|call|>: ends a message only
    for t in ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"):
        assert tok.token_types[ids[t]] == TokenType.USER_DEFINED, t
        # parsed even without parse_special, rendered even without special
        assert tok.encode(t, add_special=False, parse_special=False) == [ids[t]]
        assert tok.token_to_piece(ids[t], special=False) == t.encode()
    for t in ("<|return|>", "<|call|>", "<|startoftext|>", "<|endoftext|>"):
        assert tok.token_types[ids[t]] == TokenType.CONTROL, t
        assert tok.encode(t, add_special=False, parse_special=False) != [ids[t]]
        assert tok.token_to_piece(ids[t], special=False) == b""
    # the whole harmony turn: every special one token, text between them byte-level BPE
    text = "<|start|>assistant<|channel|>final<|message|>Hi there.<|return|>"
    got = tok.encode(text, add_special=False)
    assert [tok.tokens[i] for i in got if i >= ids["<|startoftext|>"]] == \
        ["<|start|>", "<|channel|>", "<|message|>", "<|return|>"]
    assert tok.decode(got, special=True) == text
    assert tok.decode(got) == "<|start|>assistant<|channel|>final<|message|>Hi there."


def test_other_names_share_the_pre_tokenizer(gpt4o_path: Path, tmp_path: Path) -> None:
    base = Tokenizer.from_gguf(load_gguf(gpt4o_path))
    for name in GPT4O_NAMES[1:]:
        assert PRE_TOKENIZERS[name] == PRE_TOKENIZERS["gpt-4o"]
        p = tmp_path / f"{name}.gguf"
        ref.write_gpt4o_vocab(p, pre=name)
        t = Tokenizer.from_gguf(load_gguf(p))
        assert (t.pre, t.add_bos, t.clean_spaces, t.ignore_merges) == (name, False, False, False)
        for text in ref.CORPUS[::7]:
            assert t.encode(text) == base.encode(text), (name, text)


# ---------------------------------------------------------------------------------------------------
# live, with llama.cpp


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        pytest.skip("llama_cpp (llama-cpp-python) not installed")
    return llama_cpp


_ALPHABET = [*"abcxyzABCXYZ  \n\t\r'’0123456789.,;:!?-_()[]<>|/\\\"@#$%^&*+=~`smvrdlSMVRDLte",
    "é", "É", "ß", "Ω", "ω", "Σ", "д", "Д", "中", "語", "한", "ا", "١", "²", "½", "Ⅳ", "🤗", "\u200d", "\u00a0",
     "\u3000", "\u2028", "\u0301", "\u0308", "𝔘", "ǅ", "ʰ", "ª", "\u0085", "\x1c", "\x0b", "\x0c", "\x00",
    "\x7f", "'S", "'LL", "\r\n", "\u1c89", "\ua7cb", "\U00010d40", "\U00011380", "\ue000", "ﬁ", "Ａ", "ａ",
    "０", "\u180e", "\u200b", "\ufeff", "<|end|>", "<|start|>", "<|message|>", "<|return|>", "<|call|>"]


def test_live_regenerated_refs(gpt4o_path: Path, tok: Tokenizer) -> None:
    """The stored references, made again by the installed llama.cpp (the file is current)."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(model_path=str(gpt4o_path), vocab_only=True, verbose=False)
    assert ref.refs(llm, ref.CORPUS) == _data()["cases"]


def test_live_special_tokens(gpt4o_path: Path, tok: Tokenizer) -> None:
    """EOG set, token attributes (after llama.cpp's gpt-oss fix-ups), BOS/EOS and add_bos/add_eos."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(model_path=str(gpt4o_path), vocab_only=True, verbose=False)
    v = llama_cpp.llama_model_get_vocab(llm.model)
    assert {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(v, i)} == tok.eog_ids
    attr_to_type = {1 << 0: TokenType.UNKNOWN, 1 << 2: TokenType.NORMAL, 1 << 3: TokenType.CONTROL,
                    1 << 4: TokenType.USER_DEFINED}
    assert [attr_to_type[llama_cpp.llama_vocab_get_attr(v, i)] for i in range(tok.n_vocab)] == \
        tok.token_types.tolist()
    assert (llama_cpp.llama_vocab_bos(v), llama_cpp.llama_vocab_eos(v)) == (tok.bos_id, tok.eos_id)
    assert (llama_cpp.llama_vocab_get_add_bos(v), llama_cpp.llama_vocab_get_add_eos(v)) == \
        (tok.add_bos, tok.add_eos)


_VOCAB_FILES = ["gpt-2", "llama-bpe", "qwen2", "starcoder", "refact", "llama-spm", "phi-3"]


@pytest.mark.parametrize("name", ["smollm2", "gemma3", *_VOCAB_FILES])
def test_live_eog_of_real_vocabs(name: str) -> None:
    """The EOG set of real vocabularies (llama.cpp's vocab test files, and the cached SmolLM2 and Gemma 3
    GGUFs where present) equals llama.cpp's: EOG texts, FIM tokens, the gpt-oss and gemma fix-ups."""
    llama_cpp = _llama_cpp()
    cache = Path.home() / ".cache" / "ggml_dist" / "models"
    path = {"smollm2": cache / "SmolLM2-135M-Instruct.Q4_1.gguf",
            "gemma3": cache / "gemma-3-270m-q4_k_m.gguf"}.get(
        name, ref.LLAMA_CPP_SRC / "models" / f"ggml-vocab-{name}.gguf")
    if not path.exists():
        pytest.skip(f"{path} not here")
    tok = Tokenizer.from_gguf(load_gguf(path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    v = llama_cpp.llama_model_get_vocab(llm.model)
    assert {i for i in range(tok.n_vocab) if llama_cpp.llama_vocab_is_eog(v, i)} == tok.eog_ids


@pytest.mark.parametrize("pre", GPT4O_NAMES)
def test_live_random_text(pre: str, tmp_path: Path) -> None:
    llama_cpp = _llama_cpp()
    path = tmp_path / f"{pre}.gguf"
    ref.write_gpt4o_vocab(path, pre=pre)
    tok = Tokenizer.from_gguf(load_gguf(path))
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    rng = random.Random(GPT4O_NAMES.index(pre))
    for _ in range(600 if pre == "gpt-4o" else 100):   # llama.cpp compiles its std::regex per call: slow
        text = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 40)))
        parse_special = rng.random() < 0.7
        want = llm.tokenize(text.encode(), add_bos=True, special=parse_special)
        assert tok.encode(text, parse_special=parse_special) == want, repr(text)
        for special in (False, True):
            assert tok.detokenize(want, special=special) == ref._detokenize(llm, want, special), repr(text)


@pytest.fixture(scope="module")
def llama_split(tmp_path_factory: pytest.TempPathFactory):
    _llama_cpp()
    split = ref.llama_cpp_splitter(tmp_path_factory.mktemp("shim"))
    if split is None:
        pytest.skip("cannot build the unicode_regex_split shim (g++, libllama.so)")
    return split


@pytest.mark.parametrize("pre", ["gpt-4o", "gpt-2", "llama-bpe", "qwen2", "smollm", "default"])
def test_live_splits(pre: str, llama_split) -> None:
    """Pre-token pieces against llama.cpp's unicode_regex_split itself (needs g++ for the shim), with
    random text over all of Unicode: the remapping holds for every pre-tokenizer."""
    rng = random.Random(11)

    def char() -> str:
        r = rng.random()
        if r < 0.5:
            return rng.choice(_ALPHABET)
        if r < 0.75:
            return chr(rng.randint(0, 0x2FFF))
        c = rng.randint(128, 0x10FFFF)
        return chr(c) if not 0xD800 <= c < 0xE000 else "x"

    pats = _patterns(pre)
    for _ in range(1000):
        text = "".join(char() for _ in range(rng.randint(1, 40)))
        assert regex_split(text, pats) == llama_split(text, PRE_TOKENIZERS[pre]), repr(text)

"""Regenerate tests/data/tokenizer_gpt4o.json with llama.cpp (llama-cpp-python):

    python tests/data/make_tokenizer_gpt4o_ref.py

A synthetic byte-level BPE vocab with tokenizer.ggml.pre = "gpt-4o" (the o200k_harmony pre-tokenizer
of gpt-oss): the 256 byte tokens of GPT-2's byte-to-unicode mapping, MERGES merges learned from
TRAINING_TEXT (deterministic, so the tests rebuild the file byte for byte with write_gpt4o_vocab), and
the harmony special tokens (<|start|>, <|channel|>, <|message|>, <|end|>, <|return|>, <|call|>, ...)
in o200k_harmony's order, CONTROL as in gpt-oss GGUFs. The json holds vocab_sha256 (of the tokens and
merges, so a changed trainer shows), CORPUS and, for each text and each of
add_special x parse_special, the ids of llama_tokenize and the text of llama_detokenize of those ids
with special=True, special=False, and special=False with remove_special=True (see refs); the pieces
llama.cpp's own pre-tokenizer (unicode_regex_split, called in libllama.so through a small C++ shim
built with g++) cuts each text into; and llama.cpp's class of every code point >= 128 (llama_classes),
read from its source (LLAMA_CPP_SRC). Parts that cannot be remade here are kept from the old file.
"""
from __future__ import annotations

import collections
import itertools
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "tokenizer_gpt4o.json"
LLAMA_CPP_SRC = Path(os.environ.get(
    "LLAMA_CPP_SRC",
    "/root/.cache/ggml_dist/llama-rpc/src/llama_cpp_python-0.3.36/vendor/llama.cpp"))

MERGES = 400

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. The dog didn't care; it's the fox that they'll remember.
In the beginning there was the word, and the word was tokenized into pieces that the model could read.
I'm sure you're right, but we've seen that they'd rather not. She said: "It's not what it seems!"
Large language models predict the next token given the previous tokens in the context window.
def tokenize(text: str) -> list[int]:
    return [vocab[piece] for piece in pre_tokenize(text) if piece in vocab]

for (int i = 0; i < n; ++i) { sum += values[i] * weights[i]; }
import numpy as np
x = np.zeros((4, 8), dtype=np.float32)  # the shape of the input
if __name__ == "__main__":
    main()
<|start|>user<|message|>What is the capital of France?<|end|>
<|start|>assistant<|channel|>final<|message|>The capital of France is Paris.<|return|>
HTTPServer JSONParser getElementById XMLHttpRequest camelCaseWords snake_case_words CONSTANT_VALUE
1234567890 2024-01-15 3.14159 100,000 0x1F 42 7 99 365 1000000
Ünïcödé façade naïve crème brûlée Straße Ça va très bien, merci. Où est la gare ?
Привет, мир! Как дела? Это тест токенизатора.
Γειά σου Κόσμε, αυτό είναι ένα τεστ.
日本語のテキストと中文文本和한국어 텍스트
مرحبا بالعالم שלום עולם नमस्ते दुनिया
getValue setValue getValue setValue camelCase camelCase PascalCase XMLHttpRequest x86_64 x86_64 utf8 utf8
1234567 1234567 12345 12345 123456 2024 2025 2026 v1 v2 h1 h2 mp3 mp3
they'LL they'LL I'M I'M It'S It'S don't don't won't can't
café café naïve naïve
path/to/dir/\npath/to/dir/\r\n  \n  \n\t\tindent\t\tindent
"""

# harmony special tokens with their o200k_harmony ids relative to the first (199998), and reserved
# fillers, as in gpt-oss GGUFs (all CONTROL)
SPECIALS = [
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
    "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
    "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-unicode table (own copy: the file must not depend on the code under test)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def learn_merges(text: str, n_merges: int) -> list[str]:
    """Plain BPE training over words split by a simple regex (own split, not the pre-tokenizer under
    test); ties broken by the pair's text so the result is deterministic."""
    b2u = _bytes_to_unicode()
    words = collections.Counter(
        tuple(b2u[b] for b in w.encode("utf-8"))
        for w in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    merges: list[str] = []
    while len(merges) < n_merges:
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, c in words.items():
            for a, b in itertools.pairwise(w):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        new: collections.Counter[tuple[str, ...]] = collections.Counter()
        for w, c in words.items():
            out: list[str] = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    return merges


def vocab() -> tuple[list[str], list[str]]:
    """The synthetic vocab's tokens (byte tokens, merged tokens, SPECIALS) and merges."""
    b2u = _bytes_to_unicode()
    merges = learn_merges(TRAINING_TEXT, MERGES)
    tokens = [b2u[b] for b in range(256)]
    seen = set(tokens)
    for m in merges:
        t = m.replace(" ", "")
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens + SPECIALS, merges


def vocab_sha256() -> str:
    import hashlib
    return hashlib.sha256(json.dumps(vocab(), ensure_ascii=False).encode()).hexdigest()


def write_gpt4o_vocab(path: str | os.PathLike[str], pre: str = "gpt-4o") -> None:
    """Write the synthetic vocab as a vocab-only llama GGUF (deterministic)."""
    import gguf

    tokens, merges = vocab()
    n_normal = len(tokens) - len(SPECIALS)
    types = [int(gguf.TokenType.NORMAL)] * n_normal + [int(gguf.TokenType.CONTROL)] * len(SPECIALS)
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n_normal + SPECIALS.index("<|startoftext|>"))
    w.add_eos_token_id(n_normal + SPECIALS.index("<|return|>"))
    w.add_pad_token_id(n_normal + SPECIALS.index("<|endoftext|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


CORPUS = [
    # whitespace
    "", " ", "  ", "   ", "\n", "\n\n", " \n", "\n ", "\t", "\t\t x", "a\tb", "a  b", "a   b    c",
    "   leading", "trailing   ", "\r\n", "line one\r\nline two\r\n\r\n", "x\r\ry", " \n \n ", "a\n\n\nb",
    "\u00a0nbsp\u3000ideographic\u2028sep\u2029par\u0085nel", "\x0bvt\x0cff\x1cfs\x1fus",
    # English, contractions
    "Hello world!", "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'LL say we're fine, you've seen it, she'd go, it's don't",
    "I'M THEY'RE WE'VE HE'D IT'S DON'T", "'s 'S 'll 'LL 're 'Re 'x '", "rock'n'roll o'clock y'all",
    "‘curly’ “quotes” don’t", "McDonald's", "Hello 's", "x'sy",
    # case
    "CamelCase camelCase lowerUPPER UPPERlower", "HTTPServer JSONParser XMLHttpRequest getElementById",
    "ALLCAPS WORDS HERE", "iPhone eBay macOS iOS", "ABCdef ABcDeF aBC", "A a AA aa Aa aA",
    "ÉCOLE École école ÀÉÎÕÜ", "ΣΑΣ Σας σας", "ДЖ Дж дж", "ǅemal ǈ ǋ", "ʰʲ ªº ɐɑ", "ﬁne ﬂow",
    # numbers
    "1", "12", "123", "1234", "12345", "123456", "1234567", "12345678901234567890",
    "3.14159 1,000,000 0.5e-10 -42 +7", "v1.2.3 x86_64 2024-01-15 12:34:56", "a1b22c333d4444",
    "١٢٣٤٥ ٦ ۷۸ ९०१२", "①②③④ ⅣⅤⅫ ½¾ ²³¹", "𝟏𝟐𝟑 ０１２３４",
    # punctuation
    "!!!", "?!?!", "...", "—–-", "$$$ %%% ^^^ ~~~ ||| ___ ---", "a/b//c///d", "x/\ny", "!/\r\n/",
    "(((nested)))", "[]{}<>", "@user #tag", "e.g. i.e. etc.", "\"quoted\" 'single'",
    "foo!\n\nbar", " !\n", "!? \n\n", ";\n  ", "::\r\n\r\nx",
    # code
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "if (x != null && y >= 10) {\n\treturn x->y;\n}",
    "<html><body class=\"x\">text&nbsp;here</body></html>",
    "SELECT * FROM users WHERE id = 42;", "const fn = async () => { await fetch('/api/v1'); };",
    "path/to/file.txt C:\\Windows\\System32 https://example.com/a?b=c&d=e#frag",
    # scripts
    "Ünïcödé façade naïve crème brûlée Straße", "Привет мир, как дела?", "Γειά σου Κόσμε",
    "日本語のテキストと中文文本和한국어", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "ქართული Հայերեն ᏣᎳᎩ", "漢字かなカナ混じり文", "Ελληνικά και English mixed",
    # marks, emoji, odd code points
    "combining e\u0301 a\u0308 n\u0303", "\u0301\u0302 lone marks", "x\u0301Y\u0301z",
    "ZWJ a\u200db \ufeffBOM zero\u200bwidth", "🤗🤗 emoji 👍🏽 👨‍👩‍👧 family 🇫🇷 flag", "😀😃😄",
    "a😀b c😀D", "\x00nul\x01ctl\x7fdel", "\ue000private\U000f0000use", "ᲀ Ᲊ Ᲊ ᲊ Ꟍ ꟍ",
    "Garay 𐵀𐵁 digits", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝐁𝐨𝐥𝐝",
    # letters and digits Unicode 16.0/17.0 added: unassigned to llama.cpp 0.3.36's tables
    "a\u1c89b c\ua7cbd Xꟍy", "x\U00010d40\U00010d41y 1\U00010d402", "\U00011380\U00011381abc \U000323b0\U000323b1",
    # special tokens
    "<|start|>user<|message|>Hi!<|end|>", "<|start|>assistant<|channel|>analysis<|message|>think<|end|>",
    "<|start|>assistant<|channel|>final<|message|>Answer.<|return|>",
    "<|start|>assistant to=functions.get<|channel|>commentary <|constrain|>json<|message|>{\"a\":1}<|call|>",
    "<|startoftext|><|endoftext|>", "a<|end|>b", "<|start|", "<|start|><|start|>", " <|end|> spaced ",
    "<|reserved_200000|>x", "<|return|>\n<|call|>",
    "Mixed 日本 text with 123 numbers and émojis 🎉!",
]


def _detokenize(llm, ids: list[int], special: bool, remove_special: bool = False) -> bytes:
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, special)
    assert n >= 0, f"detokenize buffer too small ({-n} needed)"
    return buf.raw[:n]


def refs(llm, texts: list[str]) -> list[list]:
    """[text, add_special, parse_special, ids, detok special, detok, detok remove_special]; a detok
    equal to the one before it is null (keeps the file small)."""
    out = []
    for text in texts:
        for add_special in (False, True):
            for parse_special in (True, False):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
                ds = _detokenize(llm, ids, special=True).decode("utf-8")
                dn = _detokenize(llm, ids, special=False).decode("utf-8")
                dr = _detokenize(llm, ids, special=False, remove_special=True).decode("utf-8")
                out.append([text, add_special, parse_special, ids, ds, None if dn == ds else dn,
                            None if dr == dn else dr])
    return out


# llama.cpp classifies a code point >= 128 by its own table (src/unicode-data.cpp, generated from the
# UnicodeData.txt of its day) before any pre-tokenizer regex sees it: W (whitespace), or the category
# L, N, P, S or M, or O (anything else, unassigned included).
def llama_classes(src: Path) -> str:
    """Runs over 128..0x10FFFF, "<first code point in hex><class>" separated by spaces."""
    text = (src / "src" / "unicode-data.cpp").read_text()
    i = text.index("unicode_ranges_flags")
    ranges = [(int(a, 16), int(b, 16)) for a, b in
              re.findall(r"\{0x([0-9A-Fa-f]+), 0x([0-9A-Fa-f]+)\}", text[i:text.index("};", i)])]
    i = text.index("unicode_set_whitespace")
    ws = {int(x, 16) for x in re.findall(r"0x([0-9A-Fa-f]+)", text[i:text.index("};", i)])}
    names = {0x02: "N", 0x04: "L", 0x10: "M", 0x20: "P", 0x40: "S"}
    runs: list[tuple[int, str]] = []
    for (a, f), (b, _) in itertools.pairwise(ranges):
        for c in range(max(a, 128), min(b, 0x110000)):
            cls = "W" if c in ws else names.get(f & 0xFF, "O")
            if not runs or runs[-1][1] != cls:
                runs.append((c, cls))
    return " ".join(f"{c:x}{cls}" for c, cls in runs)


def parse_llama_classes(runs: str) -> list[tuple[int, str]]:
    return [(int(r[:-1], 16), r[-1]) for r in runs.split()]


_SHIM = r"""
#include <cstdint>
#include <string>
#include <vector>
std::vector<std::string> unicode_regex_split(const std::string & text, const std::vector<std::string> & regex_exprs,
                                             bool byte_encode);
// the byte lengths of the pieces llama.cpp splits text into with the regexes (separated by '\x01')
extern "C" int split_lengths(const char * text, size_t len, const char * regexes, int64_t * out, int cap) {
    std::vector<std::string> exprs;
    std::string r(regexes);
    for (size_t p = 0;;) {
        size_t q = r.find('\x01', p);
        exprs.push_back(r.substr(p, q == std::string::npos ? std::string::npos : q - p));
        if (q == std::string::npos) break;
        p = q + 1;
    }
    std::vector<std::string> words;
    try { words = unicode_regex_split(std::string(text, len), exprs, false); } catch (...) { return -1; }
    int n = 0;
    for (auto & w : words) { if (n < cap) out[n] = (int64_t) w.size(); n++; }
    return n;
}
"""


def llama_cpp_splitter(build_dir: str | os.PathLike[str]):
    """split(text, regexes) -> pieces, by llama.cpp's unicode_regex_split in the installed llama_cpp's
    libllama.so; None where that cannot be built (no llama_cpp, no g++, symbol not exported)."""
    import ctypes
    import shutil
    import subprocess

    try:
        import llama_cpp
    except ImportError:
        return None
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    gxx = shutil.which("g++")
    if gxx is None or not (lib_dir / "libllama.so").exists():
        return None
    src, so = Path(build_dir) / "shim.cpp", Path(build_dir) / "libsplit.so"
    src.write_text(_SHIM)
    r = subprocess.run([gxx, "-O1", "-shared", "-fPIC", str(src), "-o", str(so), f"-L{lib_dir}", "-lllama",
                        f"-Wl,-rpath,{lib_dir}"], capture_output=True, check=False)
    if r.returncode != 0:
        return None
    lib = ctypes.CDLL(str(so))
    lib.split_lengths.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                  ctypes.POINTER(ctypes.c_int64), ctypes.c_int]

    def split(text: str, regexes: list[str]) -> list[str]:
        b = text.encode("utf-8")
        cap = len(b) + 1
        out = (ctypes.c_int64 * cap)()
        n = lib.split_lengths(b, len(b), "\x01".join(regexes).encode(), out, cap)
        assert 0 <= n <= cap, n
        pieces, pos = [], 0
        for i in range(n):
            pieces.append(b[pos:pos + out[i]].decode("utf-8"))
            pos += out[i]
        assert pos == len(b)
        return pieces

    return split


# llama.cpp 0.3.36's regex for LLAMA_VOCAB_PRE_TYPE_GPT4O (src/llama-vocab.cpp), copied here so the
# stored splits do not depend on the code under test
GPT4O_REGEX = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
               r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
               r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
               r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def main() -> None:
    import tempfile

    import llama_cpp

    old = json.loads(OUT.read_text()) if OUT.exists() else {}
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "gpt4o.gguf")
        write_gpt4o_vocab(p)
        llm = llama_cpp.Llama(model_path=p, vocab_only=True, verbose=False)
        data: dict = {"llama_cpp_version": llama_cpp.__version__, "vocab_sha256": vocab_sha256(),
                      "regex": GPT4O_REGEX, "cases": refs(llm, CORPUS)}
        split = llama_cpp_splitter(d)
        if split is not None:
            data["splits"] = [[t, split(t, [GPT4O_REGEX])] for t in CORPUS]
        elif "splits" in old and {t for t, _ in old["splits"]} == set(CORPUS):
            data["splits"] = old["splits"]
        else:
            sys.exit("cannot build the unicode_regex_split shim (needs g++) and no stored splits fit CORPUS")
    if (LLAMA_CPP_SRC / "src" / "unicode-data.cpp").exists():
        data["llama_classes"] = llama_classes(LLAMA_CPP_SRC)
    elif "llama_classes" in old:
        data["llama_classes"] = old["llama_classes"]
    else:
        sys.exit(f"llama.cpp source not found at {LLAMA_CPP_SRC} (set LLAMA_CPP_SRC)")
    OUT.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))
    print(f"wrote {len(data['cases'])} cases, {len(data['splits'])} splits, "
          f"{len(data['llama_classes'].split())} class runs to {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

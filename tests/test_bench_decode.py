"""bench decode: the SIMD both sides ran (the host's flags, our kernel path, the llama.cpp build's), the
flash-attention setting llama.cpp ran with, the greedy tokens both chose (the same, or where they part),
a crashed llama.cpp child explained, and short real runs on a tiny synthetic model and on SmolLM2."""
from __future__ import annotations

import importlib.util
import itertools
import json
import sys

import pytest

from ggml_dist.bench import decode, llamacpp, simd

needs_llamacpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                    reason="llama-cpp-python (a dev-only extra) is not installed")

# llama_print_system_info() of the portable wheel in ../shared/wheels (llama-cpp-python 0.3.36)
AVX2_BUILD = (b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
              b"LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
# a GGML_NATIVE=ON build on a Sapphire Rapids host
VNNI_BUILD = (b"CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
              b"BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | "
              b"LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
# older llama.cpp (2024): every flag, 0 or 1, no backend prefix
OLD_FORMAT = ("AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | AVX512 = 0 | AVX512_VBMI = 0 | AVX512_VNNI = 0 | "
              "AVX512_BF16 = 0 | FMA = 1 | NEON = 0 | SVE = 0 | ARM_FMA = 0 | F16C = 1 | FP16_VA = 0 | "
              "RISCV_VECT = 0 | WASM_SIMD = 0 | BLAS = 0 | SSE3 = 1 | SSSE3 = 1 | VSX = 0 | MATMUL_INT8 = 0 | "
              "LLAMAFILE = 1 | ")
CUDA_BUILD = ("CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | SSSE3 = 1 | "
              "AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | OPENMP = 1 | ")

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme pni ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512bw avx512vl \
avx512vbmi avx512_vnni avx512_bf16 hypervisor

processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu vme pni ssse3 fma sse4_1 sse4_2 avx f16c bmi1 avx2 bmi2 avx512f avx512dq avx512bw avx512vl \
avx512vbmi avx512_vnni avx512_bf16 hypervisor
"""
LSCPU_AVX2 = """Architecture:                            x86_64
Vendor ID:                               GenuineIntel
Model name:                              Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz
Flags:                                   fpu pni ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 erms
"""


def test_system_info_avx2_build():
    info = decode.parse_system_info(AVX2_BUILD)
    assert info["simd"] == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2"]
    assert info["features"] == ["LLAMAFILE", "OPENMP", "REPACK"]
    assert info["system_info"].startswith("CPU : SSE3 = 1")
    assert "backends" not in info
    assert decode.best_tier(info["simd"]) == "AVX2"


def test_system_info_avx512_vnni_build():
    info = decode.parse_system_info(VNNI_BUILD)
    assert {"AVX512", "AVX512_VNNI", "AVX_VNNI", "AVX512_BF16", "AMX_INT8", "AVX2"} <= set(info["simd"])
    assert "REPACK" not in info["simd"] and "OPENMP" in info["features"]
    assert decode.best_tier(info["simd"]) == "AMX_INT8"
    assert decode.best_tier([f for f in info["simd"] if f != "AMX_INT8"]) == "AVX512_VNNI"


def test_system_info_old_format_and_other_backends():
    old = decode.parse_system_info(OLD_FORMAT)
    assert old["simd"] == ["AVX", "AVX2", "FMA", "F16C", "SSE3", "SSSE3"]     # the "= 0" ones left out
    assert old["features"] == ["LLAMAFILE"]
    cuda = decode.parse_system_info(CUDA_BUILD)
    assert cuda["backends"] == {"CUDA": {"ARCHS": "890", "USE_GRAPHS": "1", "PEER_MAX_BATCH_SIZE": "128"}}
    assert cuda["simd"] == ["SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "AVX512"]
    assert decode.parse_system_info("") == {"system_info": "", "simd": [], "features": []}


def test_cpuinfo_and_lscpu_flags():
    model, flags = simd.parse_cpuinfo(CPUINFO)
    assert model == "AMD EPYC 9R14 96-Core Processor"
    assert "avx512_vnni" in flags and "avx2" in flags and "hypervisor" not in flags and "bmi1" not in flags
    assert simd.simd_names(flags) == ["SSE3", "SSSE3", "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512",
                                        "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"]
    model, flags = simd.parse_cpuinfo(LSCPU_AVX2)
    assert model.startswith("Intel(R) Core(TM) i7-8700")
    assert flags == ["pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"]
    assert decode.best_tier(simd.simd_names(flags)) == "AVX2"
    assert simd.parse_cpuinfo("") == ("", [])


def test_host_info_of_this_host(monkeypatch):
    monkeypatch.setenv("GGML_DIST_FORCE_AVX2", "1")
    host = decode.host_info()
    assert host["cpu"] and host["machine"]
    assert set(host["flags"]) <= set(simd._X86_FLAGS)
    assert host["simd"] == simd.simd_names(host["flags"])
    assert host["env"]["GGML_DIST_FORCE_AVX2"] == "1"
    json.dumps(host)


def test_ours_info_names_the_kernel_path():
    from ggml_dist.backends.cpu import qpack
    ours = decode.ours_info()
    assert ours["kernels"] in ("vnni", "avx2", "float", "numpy")
    if ours["kernels"] != "numpy":
        assert ours["kernels"] == qpack.default_kernels().value
    assert ours["simd"] == {"vnni": "AVX512_VNNI", "avx2": "AVX2"}.get(ours["kernels"], "float")
    assert ours["flash_attn"] is False and "masked cells skipped" in ours["attention"]


def test_flash_attention_log():
    auto = ("llama_context: n_ctx = 256\nllama_context: flash_attn            = auto\n"
            "llama_context: kv_unified = true\nresolve_fused_ops: Flash Attention enabled\n")
    assert llamacpp.parse_fa_log(auto) == "enabled"
    assert llamacpp.parse_fa_log("llama_context: flash_attn            = disabled\n") == "disabled"
    assert llamacpp.parse_fa_log("llama_context: flash_attn = auto\n") == "auto"         # unresolved
    assert llamacpp.parse_fa_log("llama_new_context_with_model: flash_attn = 0\n") == "disabled"
    assert llamacpp.parse_fa_log("llama_context: Flash Attention was auto, set to enabled\n") == "enabled"
    assert llamacpp.parse_fa_log("llama_context: n_ctx = 256\n") is None


def test_simd_comparison_and_summary_without_llamacpp():
    ours = {"kernels": "vnni", "simd": "AVX512_VNNI", "flash_attn": False, "attention": "x"}
    ll = decode.parse_system_info(AVX2_BUILD)
    assert decode.simd_comparison(ours, ll, ["AVX2", "AVX512", "AVX512_VNNI"]) == \
        "ours vnni (AVX512_VNNI) vs llama.cpp AVX2 build (host: AVX512_VNNI)"
    assert decode.simd_comparison(ours, None).endswith("llama.cpp not measured")
    model = {"name": "m", "decode_tok_s": 1.0, "_ours": ours, "llamacpp_note": "llama.cpp not measured: No module"}
    out = decode.summarize([model], {"simd": ["AVX2"]}, "default")
    assert out["ours"] == ours and "_ours" not in out["models"][0]
    assert out["llamacpp"] == {"available": False, "note": "llama.cpp not measured: No module",
                               "flash_attn": {"setting": "default"}}
    ll_entry = {"name": "m", "_ours": ours, "_llamacpp": {"version": "0.3.36", **ll, "flash_attn": {}}}
    out = decode.summarize([ll_entry], {"simd": ["AVX2", "AVX512_VNNI"]}, "default")
    assert out["llamacpp"]["available"] is True and out["llamacpp"]["host_simd_not_built"] == ["AVX512_VNNI"]
    assert "_llamacpp" not in out["models"][0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    return str(write_synthetic(tmp_path_factory.mktemp("bench") / "tiny.gguf", SyntheticSpec()))


def test_run_model_without_llamacpp(tiny_model, monkeypatch):
    """Ours measured for real in its child process; the llama.cpp child failing (not installed) leaves a
    note and None figures, and the result is still one JSON object."""
    real_child = decode._child

    def child(which, *args):
        if which == "llamacpp":
            return {"error": "ModuleNotFoundError: No module named 'llama_cpp'"}
        return real_child(which, *args)

    monkeypatch.setattr(decode, "_child", child)
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0)
    assert m["prompt_tok_s"] > 0 and m["decode_tok_s"] > 0 and m["file_mb"] > 0
    assert m["kernels"] == m["_ours"]["kernels"]
    assert m["decode_ratio"] is None and m["llamacpp_flash_attn"] is None
    assert m["llamacpp_note"].startswith("llama.cpp not measured: ModuleNotFoundError")
    out = decode.summarize([m], decode.host_info(), "default")
    assert out["llamacpp"]["available"] is False and out["ours"]["flash_attn"] is False
    json.loads(json.dumps(out))


def test_rounds_alternate_and_take_medians(monkeypatch, tiny_model):
    """--rounds: ours and llama.cpp alternate; tok/s are medians, a ratio the median of the rounds'."""
    calls = []
    figures = {"ours": iter([(100, 10), (300, 30), (200, 20)]), "llamacpp": iter([(100, 5), (100, 40), (100, 10)])}

    def child(which, *args):
        calls.append(which)
        p, d = next(figures[which])
        info = {"ours": {"kernels": "avx2"}} if which == "ours" else \
            {"llamacpp": {"flash_attn": {"resolved": "enabled"}}}
        return {"prompt_tok_s": p, "decode_tok_s": d, "peak_rss_mb": 1.0, "weight_bytes": 10**9, "read_bytes": 10**9, **info}

    monkeypatch.setattr(decode, "_child", child)
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0, rounds=3)
    assert calls == ["ours", "llamacpp"] * 3
    assert m["rounds"] == 3 and m["decode_tok_s"] == 20 and m["llamacpp_decode_tok_s"] == 10
    assert m["decode_ratios"] == [2.0, 0.75, 2.0] and m["decode_ratio"] == 2.0
    assert m["prompt_ratios"] == [1.0, 3.0, 2.0] and m["prompt_ratio"] == 2.0
    assert m["decode_gb_s"] == 20.0
    assert m["tokens_match"] is None                    # these children report no tokens: not compared


@pytest.mark.parametrize("setting", ["default", "on", "off"])
def test_llamacpp_flash_attention_setting(tiny_model, setting):
    llama_cpp = pytest.importorskip("llama_cpp")
    r = decode.measure_llamacpp(tiny_model, 16, 4, 1, setting)
    assert r["prompt_tok_s"] > 0 and r["decode_tok_s"] > 0
    info = r["llamacpp"]
    assert info["simd"] == decode.parse_system_info(llama_cpp.llama_print_system_info())["simd"]
    fa = info["flash_attn"]
    assert fa["setting"] == setting
    if setting != "default":
        want = {"on": "enabled", "off": "disabled"}[setting]
        assert fa["requested"] == want and fa["resolved"] == want
    else:
        assert fa["requested"] == fa["library_default"]
        assert fa["resolved"] in ("enabled", "disabled")         # what llama.cpp's auto became
    assert llama_cpp._logger.llama_log_callback is not None      # its own logger is set back


def test_paired_takes_turns(tiny_model, monkeypatch):
    """--paired: one process, each round's prompts then chunks of PAIRED_CHUNK decode tokens in turn,
    ABBA (the round's second engine goes first in the next chunk and the next round). Our own engine sits
    in llama.cpp's seat here, so the test runs without llama-cpp-python and sees every turn."""
    turns = []

    class Second(decode._Ours):
        def run(self, toks):
            turns.append(("llamacpp", len(toks)))
            return super().run(toks)

        def info(self):
            return {"flash_attn": {"resolved": None}}

    class First(decode._Ours):
        def run(self, toks):
            turns.append(("ours", len(toks)))
            return super().run(toks)

    monkeypatch.setattr(decode, "_Ours", First)
    monkeypatch.setattr(decode, "_LlamaCpp", lambda path, n_ctx, threads, fa: Second(path, n_ctx, threads))
    gen = 2 * decode.PAIRED_CHUNK + 3
    res = decode.measure_paired(tiny_model, 16, gen, 1, rounds=2)
    timed = turns[4:]                                   # after each engine's warm-up (prompt, one token)
    runs_of = [(k, sum(1 for _ in g)) for k, g in itertools.groupby(timed, key=lambda t: t[0])]
    # round 0: the prompts (ours, llamacpp), then chunks of 8, 8, 3 tokens: ours 8, llamacpp 8 + 8 (the
    # turn order flips each chunk), ours 8 + 3, llamacpp 3; round 1 begins with llamacpp's prompt
    assert runs_of[:5] == [("ours", 1), ("llamacpp", 1), ("ours", 8), ("llamacpp", 16), ("ours", 11)]
    assert timed[1] == ("llamacpp", 16) and timed[0] == ("ours", 16)        # whole prompts
    assert len(res["runs"]) == 2 and len(res["decode_chunk_ratios"]) == 2 * 3
    for ours, ref in res["runs"]:
        assert ours["prompt_tok_s"] > 0 and ours["decode_tok_s"] > 0 and ref["decode_tok_s"] > 0
        assert ours["ours"]["kernels"] and "llamacpp" in ref


def test_paired_run_model_reports_ratios(monkeypatch, tiny_model):
    """run_model(paired=True): one "paired" child for all rounds, its rounds' figures as --rounds gives
    them, no per-engine peak RSS, the chunk ratios' quartiles."""
    calls = []

    def child(which, *args):
        calls.append((which, args[-1]))
        def pair(p, d):
            return [{"prompt_tok_s": p, "decode_tok_s": d, "weight_bytes": 10**9, "read_bytes": 10**9, "ours": {"kernels": "avx2"}},
                    {"prompt_tok_s": 100, "decode_tok_s": 10, "llamacpp": {"flash_attn": {"resolved": "enabled"}}}]
        return {"runs": [pair(100, 20), pair(300, 5)], "decode_chunk_ratios": [1.0, 2.0, 3.0], "peak_rss_mb": 123.4}
    monkeypatch.setattr(decode, "_child", child)
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0, rounds=2, paired=True)
    assert calls == [("paired", 2)]
    assert m["decode_ratios"] == [2.0, 0.5] and m["prompt_ratios"] == [1.0, 3.0]
    assert m["peak_rss_mb"] is None and m["llamacpp_peak_rss_mb"] is None
    assert m["paired"] == {"chunk": decode.PAIRED_CHUNK, "decode_chunk_ratio_quartiles": [1.5, 2.0, 2.5],
                           "peak_rss_mb": 123.4}


@needs_llamacpp                                         # before the fixture, which may download SmolLM2
def test_paired_with_llamacpp(smollm2_path):
    """SmolLM2, paired: both engines decode the same sequence and choose the same greedy tokens in every
    round (llama.cpp's own logits, not Llama.scores, which llama-cpp-python leaves at 0 without
    logits_all: its side used to feed back token 0 at every step). llama.cpp without flash attention,
    the graph ours runs (with it, a 128-token prompt's tokens part at step 1), in the AVX2 build whose
    logits ours equals bit for bit (docs/numerics.md)."""
    pytest.importorskip("llama_cpp")
    gen = 2 * decode.PAIRED_CHUNK
    res = decode.measure_paired(smollm2_path, 32, gen, 1, "off", rounds=2)
    assert len(res["runs"]) == 2 and len(res["decode_chunk_ratios"]) == 4
    for ours, ref in res["runs"]:
        assert ours["decode_tok_s"] > 0 and ref["decode_tok_s"] > 0
        assert ref["llamacpp"]["flash_attn"]["resolved"] == "disabled"
        assert len(ours["tokens"]) == gen + 1 and ours["tokens"] == ref["tokens"]
        assert len(set(ours["tokens"])) > 1                  # a real continuation, not one token repeated
    assert decode.token_check([(o["tokens"], r["tokens"]) for o, r in res["runs"]]) == \
        {"tokens_match": True, "tokens_compared": 2 * (gen + 1)}


def test_llamacpp_reads_its_own_logits(tiny_model):
    """_LlamaCpp.run's token is the argmax of llama.cpp's logits for the batch's last token: the same row a
    logits_all=True Llama writes into its scores, for the prompt and for a decode step after it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import numpy as np
    ll = decode._LlamaCpp(tiny_model, 64, 1)
    toks = decode._prompt(ll.n_vocab, 16)
    first = ll.run(toks)
    second = ll.run([first])
    ref = llama_cpp.Llama(tiny_model, n_ctx=64, n_batch=512, n_threads=1, logits_all=True, verbose=False)
    ref.eval(toks)
    assert first == int(np.argmax(ref.scores[len(toks) - 1]))
    ref.eval([first])
    assert second == int(np.argmax(ref.scores[len(toks)]))


def test_separate_rounds_check_tokens(tiny_model):
    """--rounds without --paired: the ours and llama.cpp children each report their greedy tokens and
    run_model compares them."""
    pytest.importorskip("llama_cpp")
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0, rounds=1)
    assert m["tokens_match"] is True and m["tokens_compared"] == 5, m


def test_token_check():
    assert decode.token_check([([1, 2, 3], [1, 2, 3]), ([4, 5], [4, 5])]) == \
        {"tokens_match": True, "tokens_compared": 5}
    bad = decode.token_check([([1, 2, 3], [1, 2, 3]), ([4, 5, 6, 7, 8, 9], [4, 5, 6, 0, 0, 0])])
    assert bad == {"tokens_match": False, "first_mismatch": {"round": 1, "step": 3, "from_step": 1,
                                                             "ours": [5, 6, 7, 8, 9], "llamacpp": [5, 6, 0, 0, 0]}}
    short = decode.token_check([([1, 2, 3], [1, 2])])
    assert short["tokens_match"] is False and short["first_mismatch"]["step"] == 2
    assert decode.token_check([([1], None)])["tokens_match"] is None
    assert decode.token_check([])["tokens_match"] is None


def test_run_model_reports_a_token_mismatch(monkeypatch, tiny_model, capsys):
    """A mismatch is reported (the entry and stderr), its ratios still given: not hidden, not fatal."""
    def child(which, *args):
        info = {"ours": {"kernels": "avx2"}} if which == "ours" else \
            {"llamacpp": {"flash_attn": {"resolved": "enabled"}}}
        toks = [7, 8, 9, 10, 11] if which == "ours" else [7, 8, 0, 0, 0]
        return {"prompt_tok_s": 100, "decode_tok_s": 10, "peak_rss_mb": 1.0, "weight_bytes": 10**9, "read_bytes": 10**9,
                "tokens": toks, **info}
    monkeypatch.setattr(decode, "_child", child)
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0)
    assert m["tokens_match"] is False and m["decode_ratio"] == 1.0
    assert m["first_mismatch"] == {"round": 0, "step": 2, "from_step": 0, "ours": [7, 8, 9, 10, 11],
                                   "llamacpp": [7, 8, 0, 0, 0]}
    assert m["mismatch_notes"] == [decode.mismatch_notes({"flash_attn": {"resolved": "enabled"}})[0]]
    err = capsys.readouterr().err
    assert "tiny: ours and llama.cpp chose different greedy tokens, first in round 0 at step 2" in err
    assert "--llamacpp-flash-attn off runs the graph ours runs" in err


def test_mismatch_notes():
    """Why llama.cpp's tokens can part from ours: its flash attention, a build wider than AVX2."""
    avx2 = decode.parse_system_info(AVX2_BUILD)
    assert decode.mismatch_notes({**avx2, "flash_attn": {"resolved": "disabled"}}) == []
    fa, wide = decode.mismatch_notes({**decode.parse_system_info(VNNI_BUILD), "flash_attn": {"resolved": "enabled"}})
    assert "flash attention" in fa and "AMX_INT8, not AVX2" in wide


SEGV = [sys.executable, "-X", "faulthandler", "-c", "import ctypes; ctypes.string_at(0)"]
AMX_HOST = ["avx2", "avx512f", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8"]


def test_child_killed_by_sigsegv_is_diagnosed():
    """A child that really dies by SIGSEGV: its exit and signal named; on a CPU whose flags list AMX, from
    a build with AMX_INT8 (or one that could not be read), the AMX cause and the build without it."""
    res = decode.run_child(SEGV)
    assert res == {"error": "exit -11 (SIGSEGV)", "returncode": -11, "in_llama_cpp": False}
    vnni = decode.parse_system_info(VNNI_BUILD)["simd"]
    diag = decode.crash_diagnosis(res, AMX_HOST, vnni)
    assert diag["signal"] == "SIGSEGV" and diag["host_amx_flags"] == ["amx_tile", "amx_int8", "amx_bf16"]
    assert diag["build_amx"] is True and "AMX" in diag["cause"]
    assert "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in diag["fix"] and "--no-binary :all:" in diag["fix"]
    assert "cause" in decode.crash_diagnosis(res, AMX_HOST, None)           # the build unread: still likely
    no_amx_build = decode.crash_diagnosis(res, AMX_HOST, decode.parse_system_info(AVX2_BUILD)["simd"])
    assert no_amx_build["build_amx"] is False and "cause" not in no_amx_build
    assert "cause" not in decode.crash_diagnosis(res, ["avx2", "avx512f"], vnni)
    failed = decode.run_child([sys.executable, "-c", "raise SystemExit('bad model')"])
    assert failed == {"error": "bad model", "returncode": 1}
    assert decode.crash_diagnosis(failed, AMX_HOST, vnni) is None


@pytest.mark.parametrize("paired", [False, True])
def test_run_model_explains_an_amx_crash(monkeypatch, tiny_model, capsys, paired):
    """The llama.cpp child (or the paired one) killed by SIGSEGV on an AMX host: "llamacpp_crash" in the
    entry and the fix on stderr (the old report was a bare "exit -11"). The crash is a real child's."""
    real_child, crash = decode._child, decode.run_child(SEGV)
    monkeypatch.setattr(decode, "_child", lambda which, *a: crash if which != "ours" else real_child(which, *a))
    monkeypatch.setattr(decode, "llamacpp_build_simd", lambda env=None: decode.parse_system_info(VNNI_BUILD)["simd"])
    m = decode.run_model("tiny", tiny_model, 16, 4, 1, 1.0, paired=paired, host_flags=AMX_HOST)
    assert m["llamacpp_crash"]["signal"] == "SIGSEGV" and "fix" in m["llamacpp_crash"]
    if paired:
        assert m["error"] == "exit -11 (SIGSEGV)"
    else:
        assert m["decode_tok_s"] > 0 and m["llamacpp_note"] == "llama.cpp not measured: exit -11 (SIGSEGV)"
    err = capsys.readouterr().err
    assert "died by SIGSEGV on a CPU whose flags list AMX (amx_tile amx_int8 amx_bf16)" in err
    assert "-mno-amx-tile" in err


# issue 56's profile: a call's weight bytes (a mixture's chosen experts only) and the products grouped by
# kernel and weight type, with GB/s against a read bandwidth
def test_weight_bytes_and_groups(tmp_path):
    from ggml_dist.bench.bandwidth import by_weight, weight_bytes
    from ggml_dist.core import ops
    from ggml_dist.core.context import Context
    from ggml_dist.core.types import GGMLType
    from ggml_dist.model.model import LlamaModel
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    m = LlamaModel.load(write_synthetic(tmp_path / "s.gguf", SyntheticSpec(n_layer=1, seed=1, wtype="Q4_0")))
    wq, wk = m.weights["blk.0.attn_q.weight"], m.weights["blk.0.attn_k.weight"]
    ctx = Context(1 << 20, no_alloc=True)
    x = ctx.new_tensor(GGMLType.F32, (wq.ne[0], 1))
    q, k = ops.mul_mat(ctx, wq, x), ops.mul_mat(ctx, wk, x)
    assert weight_bytes([q, k]) == (wq.nbytes + wk.nbytes, "Q4_0")
    assert weight_bytes([ops.add(ctx, x, x)]) == (0, "")
    emb = m.weights["token_embd.weight"]
    ids = ctx.new_tensor(GGMLType.I32, (3,))
    assert weight_bytes([ops.get_rows(ctx, emb, ids)]) == (3 * emb.nb[1], emb.type.name)
    rows = by_weight([("matmul", [q, k], 0.002), ("matmul", [q], 0.001), ("add", [ops.add(ctx, x, x)], 1.0)],
                     n_steps=2, read=10.0)
    assert len(rows) == 1 and rows[0]["calls_per_step"] == 2 and rows[0]["ms_per_step"] == 1.5
    gbs = (2 * wq.nbytes + wk.nbytes) / 0.0015 / 1e9
    assert rows[0]["gb_s"] == round(gbs, 2) and rows[0]["read_share"] == round(gbs / 10.0, 3)

"""llama.cpp's own server test suite (tools/server/tests/unit, from the llama.cpp vendored in the
llama-cpp-python 0.3.36 sdist) run against `ggml-dist serve`: a dev-only check of llama-server
compatibility (serve/llama_server.py). Prints one JSON object: per test file, passed / skipped /
failed, and every skip's reason.

    python benchmarks/llama_server_suite.py [--files test_completion,test_tokenize] [--keep DIR] [-k EXPR]

How it runs:
  - the suite starts `llama-server` (LLAMA_SERVER_BIN_PATH) with llama-server's flags; here that is a
    shim (written into the work directory) that translates them into `ggml-dist serve` flags and runs
    it on SmolLM2-135M-Instruct (`ggml-dist pull smollm2-135m`): the presets' models come from the
    Hugging Face hub, which this machine cannot reach, so every preset serves SmolLM2
  - flags without an equivalent are dropped (SHIM_IGNORED: threads, UI, logging, backend and download
    switches); the request defaults --temp, --seed and --n-predict are ggml-dist's too; llama-server's
    built-in template names map to files where one is known (chatml), else the server does not start
  - the suite's tests are copied unchanged into the work directory (its ../../../models/templates
    linked), and a pytest plugin (this file, loaded with -p) marks the tests in SKIPS skipped with
    their reason: assertions on the presets' models' own text or token counts, and features out of
    scope. Everything else must pass
  - only the fast tests (-m "not slow"), as llama.cpp's CI runs by default; one test at a time
Needs pytest, requests, openai, wget, filelock (the suite's requirements.txt; `pip install wget`).
Takes ~40 minutes on 2 cores: each test starts a server (~10 s).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

FILES = ["test_completion", "test_chat_completion", "test_tokenize", "test_embedding", "test_tool_call"]

MODEL_TEXT = "asserts the preset model's own text (stories260K/bert), not SmolLM2's"
MODEL_COUNT = "asserts token counts of the preset model's tokenizer (stories260K/bert), not SmolLM2's"
TEMPLATE_NAME = "a llama-server built-in template by name (--chat-template NAME); ggml-dist takes a template file"

# nodeid (without the file) or its test function's name -> why it is skipped
SKIPS: dict[str, str] = {
    # test_completion
    "test_completion.py::test_completion": MODEL_TEXT + " and prompt token counts",
    "test_completion.py::test_completion_stream": MODEL_TEXT,
    "test_completion.py::test_completion_stream_vs_non_stream": "the second request (the test's generator "
        "runs after it) finds the prompt cached and re-evaluates its last token alone, whose logits differ in "
        "the default numerics (a matmul's reduction order follows its row count), so the seeded sample "
        "differs; passes with --serve-args=--deterministic",
    "test_completion.py::test_completion_with_tokens_input": "two sequences of one prompt, one of them from "
        "the prompt cache (its last token evaluated alone), give different greedy text after ~12 tokens in the "
        "default numerics (the reduction order follows the row count); passes with --serve-args=--deterministic",
    "test_completion.py::test_completion_parallel_slots[4-6]": "6 seeded temperature-1 answers on 4 slots: "
        "the 5th and 6th reuse a slot whose cache holds another prompt's prefix and re-evaluate the rest, whose "
        "logits differ in the default numerics, and SmolLM2 gives <|im_end|> p=0.17 as the first token of "
        "'Write a very long joke.', so the draw can be an end (an empty answer where the test wants >10 "
        "characters); passes with --serve-args=--deterministic",
    "test_completion.py::test_completion_with_openai_library": MODEL_TEXT,
    "test_completion.py::test_completion_stream_with_openai_library": MODEL_TEXT,
    "test_completion.py::test_completion_response_fields[I believe the meaning of life is-32-response_fields1]":
        "expects the prompt echoed as '<s> ' + prompt (stories260K's BOS; SmolLM2 adds none)",
    "test_completion.py::test_nocache_long_input_prompt": MODEL_COUNT + " (the prompt x32 fits SmolLM2's "
                                                          "256-token slot, not stories260K's)",
    "test_completion.py::test_n_probs_post_sampling": "post_sampling_probs (the sampler chain's truncated "
                                                      "probabilities) is not implemented: refused by name",
    "test_completion.py::test_n_probs_post_backend_sampling": "backend sampling and post_sampling_probs are "
                                                              "llama.cpp features not implemented",
    "test_completion.py::test_completion_unified": "asserts llama-server's unified KV pool semantics (a shared "
                                                   "pool aborted as a whole when slots overlap); ggml-dist "
                                                   "gives each slot ctx/parallel cells",
    "test_completion.py::test_completion_prompt_cache": MODEL_COUNT + " (n_prompt = (40 + r) * 5 + 2)",
    # test_chat_completion
    "test_chat_completion.py::test_chat_completion": MODEL_TEXT + " and prompt token counts",
    "test_chat_completion.py::test_chat_completion_stream": MODEL_TEXT + " and prompt token counts",
    "test_chat_completion.py::test_chat_completion_with_openai_library": MODEL_TEXT,
    "test_chat_completion.py::test_chat_completion_cached_tokens": MODEL_COUNT + " (77 prompt tokens)",
    "test_chat_completion.py::test_chat_template": TEMPLATE_NAME + " (llama3)",
    "test_chat_completion.py::test_apply_chat_template": TEMPLATE_NAME + " (command-r)",
    "test_chat_completion.py::test_chat_template_continue_final_message_mutual_exclusion": TEMPLATE_NAME,
    "test_chat_completion.py::test_chat_template_assistant_prefill": "llama-server's assistant prefill (a last "
        "assistant message continued without being asked, its parts joined by blank lines) is not implemented: "
        "ggml-dist continues one only with continue_final_message",
    "test_chat_completion.py::test_completion_with_response_format[response_format1-10-[ -3000 ]]":
        MODEL_TEXT + " (its spacing of a JSON array)",
    "test_chat_completion.py::test_invalid_chat_completion_req[messages7]": "expects two trailing assistant "
        "messages refused (llama-server's assistant-prefill rule); ggml-dist renders what the template renders",
    "test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat": "reads the prompt from "
        "__verbose, which llama-server adds to every answer under its --verbose flag; ggml-dist adds it per "
        "request (verbose: true), and continue_final_message itself is tested in tests/serve/test_llama_server.py",
    "test_chat_completion.py::test_return_progress": "return_progress (prompt progress events) is not "
                                                     "implemented: refused",
    # test_tokenize
    "test_tokenize.py::test_tokenize_with_bos": "expects a BOS from add_special; SmolLM2's file sets "
                                                "add_bos_token false (stories260K's adds one)",
    # test_embedding
    "test_embedding.py::test_embedding_usage_single": MODEL_COUNT + " (bert's [CLS]/[SEP])",
    "test_embedding.py::test_embedding_usage_multiple": MODEL_COUNT + " (bert's [CLS]/[SEP])",
    "test_embedding.py::test_embedding_pooling_none": MODEL_COUNT + " (3 text tokens + bert's 2 specials)",
    "test_embedding.py::test_embedding_mixed_input[-False]": "an empty input embeds bert's [CLS]/[SEP]; "
                                                             "SmolLM2 adds no special token, so it has no "
                                                             "token to embed (a 400)",
    # test_tool_call: the fast tests run; the rest are marked slow (real models from the hub)
}

# skips that --serve-args=--deterministic (batch-invariant numerics) makes unnecessary
DETERMINISTIC_PASSES = {"test_completion.py::test_completion_stream_vs_non_stream",
                        "test_completion.py::test_completion_with_tokens_input",
                        "test_completion.py::test_completion_parallel_slots[4-6]"}

# llama-server flags with no ggml-dist equivalent, and how many values each takes
SHIM_IGNORED = {"--threads": 1, "--ubatch-size": 1, "--hf-repo": 1,
                "--hf-file": 1, "--model": 1, "--model-url": 1, "-fa": 1, "-ctk": 1, "-ctv": 1, "--tags": 1,
                "--reasoning-format": 1, "--reasoning": 1, "--cache-ram": 1, "--sleep-idle-seconds": 1,
                "--offline": 0, "--cont-batching": 0, "--metrics": 0, "--slots": 0, "--no-slots": 0,
                "--jinja": 0, "--no-jinja": 0, "--verbose": 0, "--swa-full": 0, "--no-ui": 0, "--embedding": 0,
                "--no-cache-idle-slots": 0, "--context-shift": 0, "--no-models-autoload": 0,
                "--reranking": 0,   # only the load-all pass starts the reranker preset (test_rerank is not run)
                "--mmproj-url": 1, "--no-mmproj": 0, "--media-path": 1}
SHIM_MAPPED = {"--port": "--port", "--host": "--host", "--ctx-size": "--ctx", "--parallel": "--parallel",
               "--batch-size": "--batch", "--alias": "--alias", "--api-key": "--api-key", "--pooling": "--pooling",
               "--chat-template-file": "--chat-template", "--temp": "--temp", "--seed": "--seed",
               "--n-predict": "--n-predict"}
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def translate(argv: list[str], model: str, templates: Path) -> list[str]:
    """llama-server's command line as `ggml-dist serve`'s (the module docstring)."""
    out = ["serve", "--model", model]
    seen: set[str] = set()
    embedding = False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in SHIM_MAPPED:
            out += [SHIM_MAPPED[a], argv[i + 1]]
            seen.add(a)
            i += 2
        elif a == "--kv-unified":
            out += ["--kv-unified", "on"]
            i += 1
        elif a == "--chat-template":
            name = argv[i + 1]
            if name != "chatml":
                raise SystemExit(f"llama-server shim: the built-in template '{name}' has no file here")
            path = templates / "chatml.jinja"
            path.write_text(CHATML)
            out += ["--chat-template", str(path)]
            i += 2
        elif a in SHIM_IGNORED:
            embedding = embedding or a == "--embedding"
            i += 1 + SHIM_IGNORED[a]
        else:
            raise SystemExit(f"llama-server shim: no ggml-dist equivalent for {a}")
    if embedding and "--pooling" not in seen:
        out += ["--pooling", "mean"]            # the presets' models' own pooling; SmolLM2's file has none
    if "--ctx-size" not in seen:
        out += ["--ctx", "4096"]
    return out


def shim_main() -> None:
    """The `llama-server` the suite starts (argv: llama-server's flags)."""
    work = Path(os.environ["GGML_DIST_SUITE_WORK"])
    args = translate(sys.argv[1:], os.environ["GGML_DIST_SUITE_MODEL"], work)
    extra = os.environ.get("GGML_DIST_SUITE_EXTRA", "").split()
    os.execv(sys.executable, [sys.executable, "-m", "ggml_dist.cli", *args, *extra])


# -- the pytest plugin (loaded in the suite's pytest run with -p llama_server_suite) ----------------------

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    deterministic = "--deterministic" in os.environ.get("GGML_DIST_SUITE_EXTRA", "")
    for item in items:
        name = item.nodeid.split("/")[-1]
        if deterministic and name in DETERMINISTIC_PASSES:
            continue
        reason = SKIPS.get(name) or SKIPS.get(name.split("[")[0])
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"ggml-dist: {reason}"))


# -- the driver ------------------------------------------------------------------------------------------

def find_suite() -> Path:
    cache = Path(os.environ.get("GGML_DIST_CACHE", Path.home() / ".cache" / "ggml_dist"))
    hits = glob.glob(str(cache / "llama-rpc" / "src" / "llama_cpp_python-*" / "vendor" / "llama.cpp"))
    if not hits:
        raise SystemExit(f"no llama.cpp source under {cache}/llama-rpc/src: run benchmarks/build_llama_rpc.sh "
                         "(it unpacks the llama-cpp-python 0.3.36 sdist there)")
    return Path(sorted(hits)[-1])


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(junit: Path) -> dict:
    out: dict[str, dict] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        f = case.get("classname", "").split(".")[-1] or case.get("file", "?")
        row = out.setdefault(f, {"passed": 0, "skipped": 0, "failed": 0, "skips": {}, "failures": []})
        name = case.get("name", "")
        skipped = case.find("skipped")
        failed = case.find("failure") if case.find("failure") is not None else case.find("error")
        if skipped is not None:
            row["skipped"] += 1
            why = skipped.get("message", "").removeprefix("ggml-dist: ")
            row["skips"][why] = row["skips"].get(why, 0) + 1
        elif failed is not None:
            row["failed"] += 1
            row["failures"].append(f"{name}: {failed.get('message', '')[:300]}")
        else:
            row["passed"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", default=",".join(FILES))
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("-k", dest="expr", help="pytest -k expression")
    ap.add_argument("--serve-args", default="", help="more `ggml-dist serve` flags for every server the suite "
                    "starts (e.g. --deterministic)")
    args = ap.parse_args()
    from ggml_dist.model.pull import pull
    model = str(pull("smollm2-135m", progress=False))
    src = find_suite()
    work = Path(args.keep or tempfile.mkdtemp(prefix="llama-suite-"))
    tests = work / "llama.cpp" / "tools" / "server" / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(src / "tools" / "server" / "tests", tests)
    models = work / "llama.cpp" / "models"
    if not models.exists():
        models.symlink_to(src / "models")
    shim = work / "llama-server"
    shim.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    "import llama_server_suite\nllama_server_suite.shim_main()\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "LLAMA_SERVER_BIN_PATH": str(shim), "GGML_DIST_SUITE_MODEL": model,
           "GGML_DIST_SUITE_WORK": str(work), "PORT": str(free_port()), "GGML_DIST_API_KEY": "",
           "GGML_DIST_SUITE_EXTRA": args.serve_args,
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    junit = work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-p", "llama_server_suite", "-p", "no:cacheprovider", "-m", "not slow",
           "-v", "--tb=line", f"--junitxml={junit}", *[f"unit/{f}.py" for f in args.files.split(",")]]
    if args.expr:
        cmd += ["-k", args.expr]
    run = subprocess.run(cmd, check=False, cwd=tests, env=env)
    result = {"suite": str(src / "tools" / "server" / "tests"), "model": model, "pytest_exit": run.returncode,
              "files": summarize(junit) if junit.exists() else {}, "work": str(work)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""The README's shell recipes run as written (issue 43).

A ```bash block of README.md is a recipe when the line before its fence is an HTML comment that marks it:

    <!-- runnable -->              this test runs it: the block as one `bash -e` script, as written, in a
                                   temporary directory (so `logits.npz` and the like land there), in CI
    <!-- runnable: KIND ... -->    KIND says who runs it and when; the words after it are for the reader:
        ci          the two top commands. CI has installed the package, so a `pip install ...` part of a
                    line is what CI did already and is left out here; the test command is what `.ci/run`
                    runs (checked here to be it, part for part); the rest of the block runs here, in CI
        cluster     tests/workers/test_job_submit.py runs it against a real `ray start --head --block`,
                    in CI (the ports it names are swapped for free ones, `--block` and a `--temp-dir` of
                    its own are added to `ray start`, the token is a file of its own: RAY_AUTH_TOKEN_PATH)
        namespaces  tests/workers/test_job_submit.py runs it on namespace hosts (ggml_dist/testbed), with
                    GGML_DIST_SLOW_TESTS=1 and where network namespaces can be made (root)
    <!-- not runnable: REASON -->  an illustration, or a recipe that needs what a test cannot have here

Every ```bash block carries one of these, so a new recipe is not left untested by accident
(test_every_shell_block_is_marked). The runs here see the test session's environment
(GGML_DIST_NO_BACKGROUND_COMPILE=1 from conftest: kernels compile in the process, none is left behind).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KINDS = {"", "ci", "cluster", "namespaces"}
SLOW = os.environ.get("GGML_DIST_SLOW_TESTS", "") in ("1", "true", "yes")
_MARK = re.compile(r"<!--\s*(not runnable|runnable)\s*(?::\s*([\w-]+))?(.*?)-->")


@dataclass(frozen=True)
class Block:
    kind: str | None        # None: not runnable; "" plain runnable; else a KIND above
    text: str               # the block's lines, as written
    line: int               # README line of its opening fence (1-based)

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, comment and blank lines dropped."""
        out, cur = [], []
        for ln in self.text.splitlines():
            s = ln.strip()
            if not cur and (not s or s.startswith("#")):
                continue
            if s.endswith("\\"):
                cur.append(s[:-1].strip())
                continue
            out.append(" ".join([*cur, s]))
            cur = []
        return out


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every ```bash block of the README with its marker (None where it has none: a test fails then)."""
    lines = (README.read_text() if text is None else text).splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```bash":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            m = _MARK.search(lines[i - 1]) if i > 0 else None
            kind: str | None = None
            if m is not None and m.group(1) == "runnable":
                kind = m.group(2) or ""
            elif m is None:
                kind = "?"                                  # unmarked
            out.append(Block(kind, "\n".join(lines[i + 1:j]), i + 1))
            i = j
        i += 1
    return out


def blocks_of(kind: str) -> list[Block]:
    return [b for b in readme_blocks() if b.kind == kind]


def run_block(script: str, cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    """A block as one bash script, stopping at its first failing command, the console scripts of this
    Python first on PATH."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return subprocess.run(["bash", "-e", "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


# every shell block of the README is marked: a recipe a test runs, or not runnable with its reason
def test_every_shell_block_is_marked():
    blocks = readme_blocks()
    assert blocks, "no ```bash block found in README.md"
    unmarked = [b.line for b in blocks if b.kind == "?"]
    assert not unmarked, (f"README.md lines {unmarked}: a ```bash block needs `<!-- runnable -->`, "
                          f"`<!-- runnable: KIND -->` or `<!-- not runnable: REASON -->` on the line before it "
                          f"(tests/test_readme.py)")
    unknown = {b.kind for b in blocks if b.kind is not None} - KINDS - {"?"}
    assert not unknown, f"unknown runnable kinds {unknown}; known: {sorted(KINDS)}"
    assert {"ci", "", "cluster", "namespaces"} <= {b.kind for b in blocks}


# the markers and the joining of continuation lines, on a README of three blocks
def test_blocks_are_parsed():
    text = ("x\n<!-- runnable -->\n```bash\n# a comment\necho a \\\n    b\n\necho c\n```\n"
            "<!-- not runnable: needs a GPU -->\n```bash\nnvidia-smi\n```\n```bash\nls\n```\n")
    a, b, c = readme_blocks(text)
    assert (a.kind, a.commands(), a.line) == ("", ["echo a b", "echo c"], 3)
    assert b.kind is None and c.kind == "?"


# the two top commands: the install-and-run line runs (its pip install is CI's own), the test line is CI's
def test_top_commands():
    (top,) = blocks_of("ci")
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    ran = []
    for cmd in top.commands():
        parts = [p.strip() for p in cmd.split("&&")]
        if any("pytest" in p for p in parts):                   # the test command: .ci/run runs it, part for part
            idx = [ci.index(p) for p in parts if p in ci]
            assert len(idx) == len(parts) and idx == sorted(idx), f"{parts} is not what .ci/run runs: {ci}"
            continue
        ran.append(" && ".join(p for p in parts if not p.startswith("pip install")))
    assert ran and all("ggml-dist" in r for r in ran)
    r = run_block("\n".join(ran), ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.strip(), "the run printed no text"
    assert "prompt:" in r.stderr and "decode:" in r.stderr


# the blocks marked plain runnable (the commands), as written
@pytest.mark.parametrize("block", blocks_of(""), ids=lambda b: f"README-line-{b.line}")
def test_runnable_block(block, tmp_path):
    r = run_block(block.text, tmp_path)
    assert r.returncode == 0, f"README line {block.line}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"


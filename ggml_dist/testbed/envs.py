"""A Python environment that has every dependency of ggml_dist but not ggml_dist itself: for a testbed
host that lacks the package, so that shipping the code to it (Ray py_modules) is tested for real."""
from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path


class VenvError(RuntimeError):
    """No venv without ggml_dist can be made here; str(e) is a one-line reason."""


_VENV_DEPS = "import ray, numpy, numba, msgpack, gguf"
_venv_cache: dict[str, str] = {}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH")}
    return env


def _system_site_dirs() -> list[str]:
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def venv_without_ggml_dist(path: str | os.PathLike) -> str:
    """The python of a venv at `path` that imports every package of this interpreter's
    site-packages except ggml_dist; built once and reused while it still fits. Raises VenvError.

    The venv has no system site packages; a .pth file in its site-packages names this
    interpreter's site-packages dirs. Such lines go on sys.path, but the .pth files inside those
    dirs (pip's `__editable__.ggml_dist-*.pth`, and any other editable install's) are not run,
    so the editable ggml_dist is not importable. Use it as HostSpec(python=...)."""
    path = Path(path).absolute()
    py = path / "bin" / "python"
    stamp = path / ".ggml_dist_free"
    site_dirs = _system_site_dirs()
    key = json.dumps({"base": os.path.realpath(sys.executable), "version": sys.version,
                      "site": site_dirs})
    if _venv_cache.get(str(path)) == key and py.exists():
        return str(py)
    if stamp.exists() and py.exists() and stamp.read_text() == key:
        _venv_cache[str(path)] = key
        return str(py)
    if path.exists() and any(path.iterdir()) and not (path / "pyvenv.cfg").exists():
        raise VenvError(f"{path} exists, is not empty and is not a venv; not clearing it")
    try:
        venv.EnvBuilder(clear=True, with_pip=False, symlinks=True).create(path)
    except Exception as e:
        raise VenvError(f"cannot create a venv at {path}: {e}") from e
    env = _clean_env()
    p = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       check=False, capture_output=True, text=True, env=env, cwd="/", timeout=60)
    if p.returncode != 0:
        raise VenvError(f"the new venv's python does not run: {p.stderr.strip()[-300:]}")
    purelib = Path(p.stdout.strip())
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "_ggml_dist_free_system_site.pth").write_text("".join(d + "\n" for d in site_dirs))

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(py), "-c", code], check=False, capture_output=True, text=True, env=env,
                              cwd="/", timeout=300)

    p = run(_VENV_DEPS)
    if p.returncode != 0:
        raise VenvError(f"the venv cannot `{_VENV_DEPS}`: {p.stderr.strip().splitlines()[-1:]}")
    p = run("import ggml_dist, sys; print(ggml_dist.__file__)")
    if p.returncode == 0:
        raise VenvError(f"ggml_dist is importable without its editable .pth ({p.stdout.strip()}): "
                        "installed non-editable?")
    if "ModuleNotFoundError" not in p.stderr:
        raise VenvError(f"`import ggml_dist` failed oddly in the venv: {p.stderr.strip()[-300:]}")
    p = subprocess.run([str(py), "-m", "ray.scripts.scripts", "--version"], check=False, capture_output=True,
                       text=True, env=env, cwd="/", timeout=120)
    if p.returncode != 0:
        raise VenvError(f"`python -m ray.scripts.scripts` does not run in the venv: "
                        f"{p.stderr.strip()[-300:]}")
    stamp.write_text(key)
    _venv_cache[str(path)] = key
    return str(py)


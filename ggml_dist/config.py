"""Run configs: a JSON or YAML mapping of `ggml-dist run` options (see configs/)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A run config that cannot be read or names unknown options."""


def load_run_config(path: str, known: set[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml/json raise several unrelated types; re-raised as ConfigError
        raise ConfigError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a run config is a mapping of option names to values")
    norm = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(norm) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown options {unknown}; known: {sorted(known)}")
    if isinstance(norm.get("layers"), list):
        norm["layers"] = ",".join(f"{a}-{b}" for a, b in norm["layers"])
    return norm

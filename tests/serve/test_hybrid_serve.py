"""A Qwen3.5-style model (Gated DeltaNet layers beside attention; model/qwen35.py) served in one process and
over two Ray stages: its slots' recurrent state cannot be cut back to a prefix, so the prompt cache goes
back to the state checkpoints the slots keep (serve/checkpoints.py; on a pipeline each stage keeps the
copies of its layers' rows) or to position 0. What a cached request answers equals what a fresh server
answers (batch-invariant numerics: the same bits whatever the ubatches), and cached_tokens says how much
was not evaluated again."""
from __future__ import annotations

import threading

import httpx
import pytest

from ggml_dist.model.synthetic_hybrid import SyntheticHybridSpec, write_hybrid
from ggml_dist.serve import ServerThread
from tests.serve.common import engine_config

P = [1] + [(7 * i + 3) % 500 + 4 for i in range(40)]      # 41 tokens
EVERY = 16


@pytest.fixture(scope="module")
def hybrid_path(tmp_path_factory):
    return str(write_hybrid(tmp_path_factory.mktemp("hybrid") / "q35.gguf", SyntheticHybridSpec(n_layer=4)))


def _server(path: str, **kw) -> ServerThread:
    return ServerThread(engine_config(path, n_ctx=1024, batch_invariant=True, n_parallel=2,
                                      checkpoint_every=EVERY, **kw)).start()


def _complete(srv: ServerThread, prompt: list[int], seed: int = 0, n: int = 8) -> tuple[list, int]:
    r = httpx.post(srv.url + "/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": n, "temperature": 1.0, "seed": seed, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    return list(zip(lp["tokens"], lp["token_logprobs"], strict=True)), cached


def _metric(srv: ServerThread, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(f"ggml_dist_{name} ")))


FORKS = [P, P, [*P[:37], 9, 10, 11], [*P[:20], 12, 13, 14, 15], [*P, 16, 17]]
# cached_tokens of each: nothing; the same prompt again, all but its last token (the checkpoint before it);
# a fork inside the prompt, the latest checkpoint within the shared 37 tokens (every 16: 32); 20 tokens
# shared, the checkpoint at 16; P continued, in the same slot (the other is empty), which now shares 20
# tokens with it: the checkpoint at 16 again
CACHED = [0, len(P) - 1, 32, 16, 16]


@pytest.fixture(scope="module")
def fresh(hybrid_path):
    """Each answer of a server that caches nothing (every prompt evaluated from position 0)."""
    srv = _server(hybrid_path, cache_prompt=False)
    try:
        out = [_complete(srv, prompt, seed=k) for k, prompt in enumerate(FORKS)]
    finally:
        srv.stop()
    assert [f[1] for f in out] == [0] * len(FORKS)
    return [f[0] for f in out]


def _forks_hit_checkpoints(srv: ServerThread, fresh: list) -> None:
    got = [_complete(srv, prompt, seed=k) for k, prompt in enumerate(FORKS)]
    assert [g[1] for g in got] == CACHED
    hits, misses = _metric(srv, "state_checkpoint_hits_total"), _metric(srv, "state_checkpoint_misses_total")
    assert hits >= 3 and _metric(srv, "state_checkpoints_taken_total") >= 4, (hits, misses)
    assert _metric(srv, "state_checkpoint_bytes") > 0
    assert [g[0] for g in got] == fresh


def test_prompt_cache_goes_back_to_checkpoints(hybrid_path, fresh):
    srv = _server(hybrid_path)
    try:
        _forks_hit_checkpoints(srv, fresh)
    finally:
        srv.stop()


def test_checkpoints_on_two_stages(local_ray, hybrid_path, fresh):
    """The same over two Ray stages: each keeps the copies of its layers' rows."""
    srv = _server(hybrid_path, n_stages=2)
    try:
        _forks_hit_checkpoints(srv, fresh)
        kept = [st.state_copy_bytes for st in srv.engine.runtime.stats()]
    finally:
        srv.stop()
    assert len(kept) == 2 and all(k > 0 for k in kept), kept       # both stages hold recurrent layers


def test_two_slots_at_once(hybrid_path):
    """Two requests decode side by side (both in one ubatch, a state row each), each as alone."""
    srv = _server(hybrid_path)
    try:
        alone = [_complete(srv, [1, 5, 6, 7, 8], seed=1)[0], _complete(srv, [1, 9, 10, 11, 12, 13], seed=2)[0]]
        srv_out: list = [None, None]

        def go(i: int, prompt: list[int]) -> None:
            srv_out[i] = _complete(srv, prompt, seed=i + 1)[0]

        ts = [threading.Thread(target=go, args=(0, [1, 5, 6, 7, 8])),
              threading.Thread(target=go, args=(1, [1, 9, 10, 11, 12, 13]))]
        for t in ts:
            t.start()
        for t in ts:
            t.join(600)
        assert srv_out == alone
    finally:
        srv.stop()

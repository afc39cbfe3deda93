"""Tensor-parallel ranks as separate processes whose ALL_GATHER goes over workers/collective.py's socket
mesh (issue 54): each rank a RankContext (model/tp_local.py) in a spawned process, all of them giving
one process's logits bit for bit.

The mesh is workers/collective.py's (MeshListener, mesh_connect), opened as a stage would: each rank
listens, learns every rank's address (a queue here), connects.
"""
from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

from ggml_dist.model.context import ContextParams, LlamaContext
from ggml_dist.model.model import LlamaModel
from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
from ggml_dist.model.ubatch import Batch
from ggml_dist.workers import collective

PROMPT = [1, 5, 9, 33, 70, 100, 7, 300, 12]
SPEC = SyntheticSpec(n_vocab=512, n_embd=256, n_layer=2, n_head=32, n_head_kv=4, n_ff=512, wtype="Q4_0",
                     embd_type="Q4_0", tied=False, seed=6)


def _greedy(ctx) -> list[np.ndarray]:
    out = [ctx.decode(Batch.from_tokens(PROMPT, all_outputs=True))]
    for i in range(4):
        out.append(ctx.decode(Batch.from_tokens([int(out[-1][-1].argmax())], pos0=len(PROMPT) + i)))
    return out


def _rank_main(path: str, rank: int, q_addr, q_all, q_out) -> None:
    """One rank's process: listen, learn every rank's address, form the mesh, decode."""
    from ggml_dist.model.tp_local import RankContext
    listener = collective.MeshListener()
    q_addr.put((rank, listener.address))
    coll = collective.mesh_connect(rank, q_all.get(), b"tp-test", listener)
    try:
        q_out.put((rank, _greedy(RankContext(LlamaModel.load(path), ContextParams(n_ctx=256), coll))))
    finally:
        coll.close()


# K = 2 and 4 rank processes over the mesh: every rank's logits are one process's
@pytest.mark.parametrize("size", [2, 4])
def test_rank_processes_equal_one_process(tmp_path, size):
    path = str(write_synthetic(tmp_path / "m.gguf", SPEC))
    want = _greedy(LlamaContext(LlamaModel.load(path), ContextParams(n_ctx=256)))
    spawn = mp.get_context("spawn")
    q_addr, q_out = spawn.Queue(), spawn.Queue()
    q_all = [spawn.Queue() for _ in range(size)]
    procs = [spawn.Process(target=_rank_main, args=(path, r, q_addr, q_all[r], q_out), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        addrs = dict(q_addr.get(timeout=300) for _ in range(size))
        for q in q_all:
            q.put([addrs[r] for r in range(size)])
        got = dict(q_out.get(timeout=300) for _ in range(size))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for r in range(size):
        assert all(np.array_equal(a, b) for a, b in zip(want, got[r])), f"rank {r}"

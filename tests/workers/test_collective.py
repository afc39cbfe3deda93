"""The mesh all-gather (workers/collective.py): K ranks as separate processes on localhost exchange parts
of unequal sizes, exactly and in rank order, round after round; a killed peer and a wrong secret give
errors that name the rank, never a hang."""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time

import numpy as np
import pytest

from ggml_dist.workers.collective import (
    INLINE_MAX,
    CollectiveError,
    MeshListener,
    mesh_connect,
)
from ggml_dist.workers.links import Link

SECRET = b"mesh-test-secret"
N_EMBD = 2048


def _part(rank: int, size: int, rnd: int, n_tokens: int) -> np.ndarray:
    # ne = (N_EMBD // size + 3 * rank, n_tokens): unequal widths, the same for every rank to recompute
    rng = np.random.default_rng((rank, rnd, n_tokens))
    return rng.standard_normal((n_tokens, N_EMBD // size + 3 * rank), dtype=np.float32)


def _rank_main(rank: int, size: int, conn, plan: list[tuple[int, int]], die_after: int | None) -> None:
    """One rank: listen, learn the addresses, connect, run `plan` ((n_tokens, n_rounds) pairs). Talks
    to the test on its own pipe (a shared queue's lock could die with a killed rank)."""
    try:
        listener = MeshListener("127.0.0.1")
        conn.send(listener.address)
        coll = mesh_connect(rank, conn.recv(), SECRET, listener, timeout_s=20)
        rnd = 0
        for n_tokens, n_rounds in plan:
            for _ in range(n_rounds):
                if die_after is not None and rnd == die_after:
                    conn.send("waiting to be killed")
                    time.sleep(60)
                got = coll.all_gather(_part(rank, size, rnd, n_tokens))
                want = [_part(j, size, rnd, n_tokens) for j in range(size)]
                assert len(got) == size and all(np.array_equal(g, w) for g, w in zip(got, want)), \
                    f"rank {rank} round {rnd}: parts differ"
                rnd += 1
        coll.close()
        conn.send(f"ok {rnd}")
    except BaseException as e:  # noqa: BLE001 -- reported to the test, which fails on it
        conn.send(f"{type(e).__name__}: {e}")


def _run_ranks(size: int, plan: list[tuple[int, int]], die: int | None = None, die_after: int = 0,
               timeout_s: float = 60.0) -> dict[int, str]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, size, pipes[r][1], plan, die_after if r == die else None))
             for r in range(size)]
    for p in procs:
        p.start()
    try:
        conns = [pipes[r][0] for r in range(size)]
        deadline = time.monotonic() + timeout_s
        addrs = [c.recv() if c.poll(max(0.1, deadline - time.monotonic())) else "none" for c in conns]
        for c in conns:
            c.send(addrs)
        results: dict[int, str] = {}
        while len(results) < size and time.monotonic() < deadline:
            for c in mp_connection.wait([c for r, c in enumerate(conns) if r not in results],
                                        timeout=max(0.1, deadline - time.monotonic())):
                rank, msg = conns.index(c), c.recv()
                if msg == "waiting to be killed":
                    procs[rank].kill()
                    procs[rank].join(10)
                    msg = "killed"
                results[rank] = msg
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_all_gather_returns_every_part_in_rank_order(size):
    # decode-sized parts (1 token, inline sends) for many rounds, then prompt-sized ones (512 tokens,
    # parts over INLINE_MAX, sent from threads while the rank reads), then 1 token again, then empty
    # parts (a rank owning none of a step's experts sends 0 rows) between decode-sized ones
    assert 512 * (N_EMBD // 4) * 4 > INLINE_MAX
    results = _run_ranks(size, [(1, 40), (512, 3), (1, 5), (0, 2), (1, 2)])
    assert results == dict.fromkeys(range(size), "ok 52")


def test_a_killed_peer_raises_naming_its_rank():
    # rank 2 of 3 is killed (SIGKILL) before round 5: the others' all_gather raises, naming rank 2
    results = _run_ranks(3, [(1, 20)], die=2, die_after=5, timeout_s=60)
    assert results[2] == "killed"
    for r in (0, 1):
        assert results[r].startswith("CollectiveError") and "rank 2" in results[r], results[r]


def _connect_in_thread(rank: int, addrs: list[str], secret: bytes, listener: MeshListener, out: dict,
                       **kw) -> threading.Thread:
    def run() -> None:
        try:
            out[rank] = mesh_connect(rank, addrs, secret, listener, **kw)
        except Exception as e:  # noqa: BLE001 -- the test asserts on it
            out[rank] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_wrong_secret_is_refused():
    # rank 1 comes with another secret: rank 0 drops it and, when no rank 1 comes, says so; rank 1's
    # first exchange finds the link closed by rank 0
    l0, l1 = MeshListener(), MeshListener()
    addrs, out = [l0.address, l1.address], {}
    threads = [_connect_in_thread(0, addrs, SECRET, l0, out, timeout_s=2),
               _connect_in_thread(1, addrs, b"not-the-secret!!", l1, out, timeout_s=2)]
    for t in threads:
        t.join(10)
    assert isinstance(out[0], CollectiveError) and "ranks [1] did not connect" in str(out[0]) \
        and "secret" in str(out[0])
    with pytest.raises(CollectiveError, match="rank 0"):
        out[1].all_gather(np.zeros(4, np.float32))
    out[1].close()


def test_a_silent_peer_times_out_when_asked_to():
    # with exchange_timeout_s a peer that never sends (a cut cable, not a closed socket) raises
    l0, l1 = MeshListener(), MeshListener()
    addrs, out = [l0.address, l1.address], {}
    threads = [_connect_in_thread(r, addrs, SECRET, lst, out, timeout_s=10, exchange_timeout_s=0.5)
               for r, lst in ((0, l0), (1, l1))]
    for t in threads:
        t.join(10)
    t0 = time.monotonic()
    with pytest.raises(CollectiveError, match="rank 1"):
        out[0].all_gather(np.zeros(4, np.float32))
    assert time.monotonic() - t0 < 30
    for c in out.values():
        c.close()


def test_a_stranger_is_dropped_and_the_mesh_still_forms():
    # a connection with a bad hello before the real rank 1 does not take rank 1's place
    l0, l1 = MeshListener(), MeshListener()
    addrs, out = [l0.address, l1.address], {}
    t0 = _connect_in_thread(0, addrs, SECRET, l0, out, timeout_s=10)
    Link.connect(l0.address, os.urandom(16), who=1).close()
    t1 = _connect_in_thread(1, addrs, SECRET, l1, out, timeout_s=10)
    t0.join(10)
    t1.join(10)
    a, b = np.arange(3, dtype=np.float32), np.ones(5, np.float32)
    res: dict = {}
    t = threading.Thread(target=lambda: res.setdefault(1, out[1].all_gather(b)))
    t.start()
    got0 = out[0].all_gather(a)
    t.join(10)
    assert np.array_equal(got0[0], a) and np.array_equal(got0[1], b)
    assert np.array_equal(res[1][0], a) and np.array_equal(res[1][1], b)
    for c in out.values():
        c.close()


def test_a_rank_dialled_before_it_listens_is_tried_again():
    # addresses known in advance (a fixed port per host): rank 1 dials rank 0 before rank 0 listens
    probe = MeshListener()
    port = int(probe.address.rpartition(":")[2])
    probe.close()
    l1, out = MeshListener(), {}
    addrs = [f"127.0.0.1:{port}", l1.address]
    t1 = _connect_in_thread(1, addrs, SECRET, l1, out, timeout_s=10)
    time.sleep(0.3)
    t0 = _connect_in_thread(0, addrs, SECRET, MeshListener("127.0.0.1", port), out, timeout_s=10)
    t0.join(15)
    t1.join(15)
    assert all(not isinstance(out[r], Exception) for r in (0, 1)), out
    for c in out.values():
        c.close()

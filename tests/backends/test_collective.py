"""backends/collective.py: the in-process group of ranks (threads) behind ALL_GATHER."""
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from ggml_dist.backends.collective import CollectiveError, ThreadGroup


def _on_ranks(colls, fn):
    with ThreadPoolExecutor(len(colls)) as pool:
        return [f.result() for f in [pool.submit(fn, c) for c in colls]]


# every rank gets every rank's part, in rank order, exchange after exchange; the parts are copies
def test_all_gather_in_rank_order():
    colls = ThreadGroup(3, timeout=30).ranks()

    def run(c):
        got = []
        for step in range(5):
            part = np.full((2, c.rank + 1), 10 * step + c.rank, np.float32)
            out = c.all_gather(part)
            part[...] = -1                       # the caller's buffer is rewritten: no rank may see it
            got.append(out)
        return got

    results = _on_ranks(colls, run)
    for got in results:
        for step, out in enumerate(got):
            assert [p.shape for p in out] == [(2, 1), (2, 2), (2, 3)]
            assert [float(p[0, 0]) for p in out] == [10 * step, 10 * step + 1, 10 * step + 2]


# a rank that leaves (close) makes the waiting ranks fail with the reason instead of waiting on
def test_close_fails_the_waiting_rank():
    c0, c1 = ThreadGroup(2, timeout=60).ranks()
    err: list[BaseException] = []

    def wait():
        try:
            c0.all_gather(np.zeros((1, 1), np.float32))
        except CollectiveError as e:
            err.append(e)

    th = threading.Thread(target=wait)
    th.start()
    while c0.group.barrier.n_waiting == 0:
        th.join(0.01)
    c1.close()
    th.join(30)
    assert len(err) == 1 and "rank 0 of 2" in str(err[0]) and "group broke" in str(err[0])


# a rank that never comes: the wait ends at the group's timeout with CollectiveError
def test_timeout():
    c0, _ = ThreadGroup(2, timeout=0.2).ranks()
    with pytest.raises(CollectiveError, match="took over"):
        c0.all_gather(np.zeros((1, 1), np.float32))

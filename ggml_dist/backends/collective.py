"""What a backend's ALL_GATHER nodes exchange through: the Collective protocol, and the group of K ranks
that run as threads of one process (ThreadGroup). workers/collective.py implements the same protocol
over sockets between processes; a kernel sees only the protocol.

    rank, size          this rank's index in its group, and the group's size
    all_gather(part)    every rank's part in rank order (this rank's included); blocks until all have
                        given theirs. A part is a C-contiguous f32 array of the same ndim on every rank;
                        ALL_GATHER's is (n_tokens, n_part), a ggml (n_part, n_tokens) tensor as numpy sees it
    close()             leave the group: a rank waiting in all_gather then fails instead of waiting on
"""
from __future__ import annotations

import threading
from typing import Protocol

import numpy as np


class CollectiveError(RuntimeError):
    """A rank of the group left, failed or did not answer in time: the exchange cannot complete."""


class Collective(Protocol):
    rank: int
    size: int

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]: ...
    def close(self) -> None: ...


class ThreadGroup:
    """The shared state of K ranks that are threads of one process: a slot per rank and one barrier.
    An exchange is two barrier phases: every rank puts its part in its slot, then reads them all, and
    nobody writes the next exchange's part before every rank has read (the second wait)."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, not {size}")
        self.size = size
        self.timeout = timeout        # a rank that stopped (an error on its thread) fails the others here
        self.slots: list[np.ndarray | None] = [None] * size
        self.barrier = threading.Barrier(size)

    def ranks(self) -> list[ThreadCollective]:
        return [ThreadCollective(self, r) for r in range(self.size)]


class ThreadCollective:
    """Rank `rank` of a ThreadGroup (the Collective protocol)."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group = group
        self.rank = rank
        self.size = group.size

    def all_gather(self, part: np.ndarray) -> list[np.ndarray]:
        g = self.group
        g.slots[self.rank] = part.copy()        # the caller's array is its buffer: it is rewritten later
        self._wait("put its part")
        out = [p for p in g.slots if p is not None]
        self._wait("read the parts")
        assert len(out) == self.size, f"rank {self.rank}: {len(out)} parts of {self.size} after the barrier"
        return out

    def _wait(self, what: str) -> None:
        try:
            self.group.barrier.wait(self.group.timeout)
        except threading.BrokenBarrierError:
            raise CollectiveError(f"all_gather: rank {self.rank} of {self.size} waited for every rank to "
                                  f"{what}, and the group broke (a rank left, failed, or took over "
                                  f"{self.group.timeout:.0f} s)") from None

    def close(self) -> None:
        self.group.barrier.abort()

"""workers/compiled.py on a real local Ray: a chain of stage calls runs as compiled-graph executions with
the plain calls' results, several in flight and read in any order; a call that breaks the chain falls
back to plain calls without losing the calls not executed yet; a dead actor's result is a StageLostError."""
from __future__ import annotations

import numpy as np
import pytest

from ggml_dist.model.recovery import StageLostError
from ggml_dist.workers.actor import _ray_call, _stage_error
from ggml_dist.workers.compiled import CompiledChain
from ggml_dist.workers.health import StageWatch

ray = pytest.importorskip("ray")


class Adder:
    """A stage whose result is its input bytes plus (byte-wise) its upstream result, as bytes (as
    StageActor's), and which counts its calls (so a test sees that a call ran once)."""

    def __init__(self) -> None:
        self.n = 0

    def compute(self, pid, desc, inputs, incarnation, *ups):
        self.n += 1
        out = np.frombuffer(inputs, np.uint8).copy()       # messages come as bytes or arrays
        for u in ups:
            out = out + np.frombuffer(u, np.uint8)
        return out.tobytes()

    def compute_chained(self, args, up=None):
        pid, desc, inputs, incarnation = args
        return self.compute(pid, desc, inputs, incarnation, *(() if up is None else (up,)))

    def calls(self):
        return self.n


@pytest.fixture
def chain(local_ray):
    actors = [ray.remote(num_cpus=0)(Adder).remote() for _ in range(3)]
    watch = StageWatch(lambda k: f"stage {k}")
    c = CompiledChain(3, lambda: actors, lambda k: _ray_call(actors[k], k, (k, k + 1), watch, lambda: None),
                      watch, lambda k: None, lambda e: _stage_error(e, "a stage"))
    yield c, actors
    c.reset()
    for a in actors:
        ray.kill(a)


def _step(c, values):
    """One step over the three stages: stage k adds values[k]; the last stage's handle."""
    h = None
    for k, v in enumerate(values):
        h = c.call(k).submit("p", None, bytearray([v] * 4), *(() if h is None else (h,)))
    return h


def test_chain_executes_in_flight_and_reads_in_any_order(chain):
    c, actors = chain
    handles = [_step(c, [i, 10, 100]) for i in range(6)]     # six executions out, none read yet
    assert c.n_executions == 6 and c.enabled
    assert c.get([handles[4]])[0].tolist() == [114] * 4        # reads 0..4 in order, keeps them
    assert [c.get([h])[0][0] for h in handles] == [110 + i for i in range(6)]
    assert ray.get([a.calls.remote() for a in actors]) == [6, 6, 6]


def test_more_steps_than_the_graph_holds(chain):
    from ggml_dist.workers.compiled import MAX_INFLIGHT
    c, _ = chain
    handles = [_step(c, [i % 50, 1, 2]) for i in range(MAX_INFLIGHT * 2 + 3)]
    assert [int(c.get([h])[0][0]) for h in handles] == [i % 50 + 3 for i in range(len(handles))]


def test_a_call_that_breaks_the_chain_falls_back_losing_nothing(chain, capfd):
    c, actors = chain
    done = _step(c, [1, 2, 3])                                  # executed, compiled
    h0 = c.call(0).submit("p", None, bytearray([5] * 4))
    h1 = c.call(1).submit("p", None, bytearray([6] * 4), h0)    # a chain in progress ...
    stray = c.call(2).submit("p", None, bytearray([7] * 4))     # ... and a call with no upstream
    assert not c.enabled and "plain Ray calls" in capfd.readouterr().err
    assert c.get([done])[0][0] == 6 and c.get([stray])[0][0] == 7
    h2 = c.call(2).submit("p", None, bytearray([1] * 4), h1)    # the flushed chain goes on plainly
    assert c.get([h2])[0][0] == 12
    assert c.get([_step(c, [1, 1, 1])])[0][0] == 3
    assert ray.get([a.calls.remote() for a in actors]) == [3, 3, 4]


def test_only_the_last_stage_result_reaches_the_driver(chain):
    c, _ = chain
    h0 = c.call(0).submit("p", None, bytearray([1] * 4))
    h1 = c.call(1).submit("p", None, bytearray([1] * 4), h0)
    last = c.call(2).submit("p", None, bytearray([1] * 4), h1)
    with pytest.raises(RuntimeError, match="stayed on the stages"):
        c.get([h0])
    c.wait([h0])                                               # waiting on it is fine: the step ran
    assert c.get([last])[0][0] == 3


def _until_dead(actor, timeout: float = 30.0) -> None:
    import time
    from ray.exceptions import RayActorError
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get(actor.calls.remote(), timeout=timeout)
        except RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("the killed actor still answers")


def test_a_dead_actor_is_a_lost_stage(chain):
    c, actors = chain
    assert c.get([_step(c, [1, 1, 1])])[0][0] == 3
    ray.kill(actors[1])
    _until_dead(actors[1])                  # ray.kill returns before the actor is gone
    h = _step(c, [1, 1, 1])
    with pytest.raises(StageLostError):
        c.get([h])


# auto: the compiled graph only where every stage's threads and the driver have cores of their own
# (its readers spin); on a local Ray, stages x threads + 1 against the cores this process may use
@pytest.mark.parametrize("stages,threads,cores,fits", [(1, 1, 2, True), (2, 1, 2, False), (2, 1, 3, True),
                                                       (2, 2, 4, False), (2, 2, 5, True)])
def test_compiled_fits_a_local_ray(monkeypatch, stages, threads, cores, fits):
    from ggml_dist.workers import cluster
    from ggml_dist.workers.placement import Placement, StagePlan
    monkeypatch.setattr(cluster.os, "sched_getaffinity", lambda pid: set(range(cores)))
    placement = Placement([StagePlan(k, (k, k + 1), 0, 0, 0, None) for k in range(stages)])
    assert cluster.compiled_fits(placement, threads, on_nodes=False) is fits

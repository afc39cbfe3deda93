"""One reading of what the runtime already measures, for the live view (serve/live.py): no bookkeeping of
its own, only what the engine, its metrics and the stages keep anyway.

    probe(engine, since) -> Reading     the lanes (one per pipeline stage, one for this process, one per
                                        replica), the micro-batches in flight, the slots and queue, the
                                        metrics' counters, the recovery's figures
    computing(lane, lo, hi)             a stage's share of [lo, hi] in compute, from its timeline
    queued(up, down, lo, hi)            micro-batches waiting before a stage, on average over [lo, hi],
                                        from the two stages' timelines (workers/timeline.py's `queued`)

A reading holds counters (seconds of compute, tokens, recoveries); live.py turns two readings into
rates. probe blocks (a pipeline's stages answer a Ray call, 1 s at most each), so it runs off the event
loop, and only while someone looks.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .engine import Engine, ServingEngine

CallSpan = tuple[float, float, float, float, str]     # a stage's call: start, compute start, compute end, end


@dataclass(frozen=True)
class Lane:
    """One lane of the view: a pipeline stage, this process, or a replica. busy_s None: it did not answer."""
    name: str
    node: str = ""
    layers: tuple[int, int] | None = None
    device: str = ""
    planned: dict[str, int] = field(default_factory=dict)   # bytes by kind (weights, kv, compute, process)
    rss_bytes: int | None = None
    busy_s: float | None = None          # compute seconds since it started
    cpu_s: float | None = None           # its process's CPU seconds
    calls: int = 0
    incarnation: str = ""                # a replaced stage's process has another
    timeline: Sequence[CallSpan] = ()    # its calls that ended since the previous reading


@dataclass(frozen=True)
class Counts:
    """The server's own counters and figures at a reading (the engine's and its metrics')."""
    slots: int
    running: int
    queue: int
    generated: int                       # tokens generated since the server started
    prompt_tokens: int
    ttft_sum: float                      # the TTFT histogram's sum and count
    ttft_n: int
    recovering: bool
    recoveries: int
    replayed_tokens: int
    recovery_s: tuple[float, ...] = ()   # each recovery's wall time


@dataclass(frozen=True)
class Reading:
    t: float                             # wall clock
    mode: str                            # "pipeline", "one process", "replicas", "loading"
    lanes: list[Lane]
    in_flight: int                       # micro-batches submitted and not collected
    depth: int                           # how many the engine keeps in flight at most
    counts: Counts


def _counts(engine: ServingEngine) -> Counts:
    m = engine.metrics
    with m.lock:
        generated, prompt, ttft_sum, ttft_n = m.generated_tokens, m.prompt_tokens, m.ttft.total, m.ttft.n
    st = engine.status() if engine.ready.is_set() else {}
    ctx = engine.ctx if isinstance(engine, Engine) else None
    return Counts(engine.cfg.n_parallel, engine.n_running(), engine.queue_length(), generated, prompt, ttft_sum,
                  ttft_n, bool(st.get("recovering", 0)), int(st.get("recoveries", 0)),
                  int(st.get("replayed_tokens", 0)), tuple(ctx.recovery.recovery_s) if ctx is not None else ())


def probe(engine: ServingEngine, since: float) -> Reading:
    """What the engine measures now; a pipeline's stage timelines from `since` (wall clock) on."""
    t, counts = time.time(), _counts(engine)
    if not isinstance(engine, Engine):          # replica processes: what each reports of itself
        busy = engine.stage_busy() if engine.ready.is_set() and not engine.load_error else []
        return Reading(t, "replicas", [Lane(f"replica {k}", busy_s=b) for k, b in enumerate(busy)], 0, 1, counts)
    rt, steps = engine.runtime, engine.steps
    if rt is None or steps is None or engine.ctx is None:     # still loading
        return Reading(t, "loading", [], 0, 1, counts)
    in_flight = len(steps.in_flight)
    if not rt.distributed:
        planned = {"weights": rt.model.weight_bytes(), "kv": engine.ctx.kv.nbytes}
        lane = Lane("this process", os.uname().nodename, (0, rt.model.hp.n_layer), "CPU", planned,
                    _own_rss(), steps.busy_s, time.process_time())
        return Reading(t, "one process", [lane], in_flight, rt.depth, counts)
    placement = rt.placement
    assert placement is not None, "a pipeline has a placement"
    infos = {i.stage: i for i in rt.stage_infos()}
    lanes = []
    for k, s in enumerate(rt.poll_stats(since, timeout_s=1.0)):
        sp, info = placement.stages[k], infos.get(k)
        planned = {"weights": sp.weight_bytes, "kv": sp.kv_bytes, "compute": sp.compute_bytes,
                   "process": sp.overhead_bytes}
        lane = Lane(f"stage {k}", info.node if info else "", sp.layers, info.device.name if info else "", planned)
        if s is not None:
            lane = replace(lane, rss_bytes=s.rss_bytes, busy_s=s.compute_s, cpu_s=s.cpu_s, calls=s.n_calls,
                           incarnation=s.incarnation, timeline=s.timeline)
        lanes.append(lane)
    return Reading(t, "pipeline", lanes, in_flight, rt.depth, counts)


def queued(up: Lane, down: Lane, lo: float, hi: float) -> float:
    """Micro-batches waiting before stage `down` (stage up's next), on average over [lo, hi]. Call i of
    one stage and call i of the next are one micro-batch (workers/timeline.py); a timeline holds a
    stage's last calls, so its first is call calls - len(timeline). A micro-batch waits from the end of
    its call upstream until downstream has finished the one before it (not its transfer after that)."""
    if up.busy_s is None or down.busy_s is None or hi <= lo:
        return 0.0
    first_up, first_down = up.calls - len(up.timeline), down.calls - len(down.timeline)
    total = 0.0
    for j, e in enumerate(up.timeline):
        i = first_up + j - first_down                  # its index in down's timeline
        if not 0 <= i < len(down.timeline) or down.timeline[i][0] < e[3]:
            continue                                   # not in down's window, or not one micro-batch
        sent, started = e[3], down.timeline[i][0]
        free = max(sent, min(started, down.timeline[i - 1][3])) if i else sent
        total += max(0.0, min(free, hi) - max(sent, lo))
    return total / (hi - lo)


def computing(lane: Lane, lo: float, hi: float) -> float:
    """The share of [lo, hi] the stage spent in compute, from its timeline: a call counts where it ran,
    not all at once when it ends (one call of a restarted stage, compiling its kernels, ran 35 s)."""
    if hi <= lo:
        return 0.0
    return sum(max(0.0, min(e[2], hi) - max(e[1], lo)) for e in lane.timeline) / (hi - lo)


def _own_rss() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None

"""The stage actors' timelines as one Chrome/Perfetto trace (`Pipeline.write_trace`, `--trace`).

    trace_events(timelines, names) -> traceEvents

A timeline holds, per call a stage ran, its wall times (start, compute start, compute end, end, plan
label): a track per stage gets an `inputs` slice (plan lookup, decoding the driver's and upstream
messages into the graph's inputs), the compute slice and an `outputs` slice (encoding the exports).
Every micro-batch calls every stage once, in order, so call i of stage k and call i of stage k+1 are one
micro-batch: a track per hop between them shows, from stage k's end to stage k+1's start, `queued`
while stage k+1 was still busy with the micro-batch before, then `transfer` (Ray handing the result
over, and the call's dispatch); a flow arrow joins the two compute slices. Times are wall clocks,
comparable across processes of one host (across hosts, as close as their clocks).
"""
from __future__ import annotations

from collections.abc import Sequence

Entry = Sequence            # (start, compute start, compute end, end, label)


def _slice(name: str, cat: str, tid: int, lo: float, hi: float, t0: float, **args: object) -> dict:
    ev = {"name": name, "ph": "X", "pid": 1, "tid": tid, "cat": cat, "ts": round((lo - t0) * 1e6, 1),
          "dur": round((hi - lo) * 1e6, 1)}
    if args:
        ev["args"] = args
    return ev


def trace_events(timelines: Sequence[Sequence[Entry]], names: list[str]) -> list[dict]:
    n = len(timelines)
    t0 = min((e[0] for tl in timelines for e in tl), default=0.0)
    events: list[dict] = []
    for k, tl in enumerate(timelines):
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": k, "args": {"name": names[k]}})
        for i, (a, b, c, d, label) in enumerate(tl):
            events += [_slice("inputs", "inputs", k, a, b, t0), _slice(f"mb{i} plan {label}", "compute", k, b, c, t0),
                       _slice("outputs", "outputs", k, c, d, t0)]
    for k in range(n - 1):
        tid = n + k
        events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                       "args": {"name": f"stage{k} -> stage{k + 1}"}})
        up, down = timelines[k], timelines[k + 1]
        for i in range(min(len(up), len(down))):
            sent, started = up[i][3], down[i][0]
            if started < sent:                   # not one micro-batch (a restarted stage's timeline)
                continue
            free = max(sent, min(started, down[i - 1][3])) if i else sent
            if free > sent:
                events.append(_slice("queued", "queue", tid, sent, free, t0, micro_batch=i))
            events.append(_slice("transfer", "transfer", tid, free, started, t0, micro_batch=i))
            flow = {"name": f"mb{i}", "cat": "flow", "id": k * 1_000_000 + i, "pid": 1}
            for ph, tid_, e in (("s", k, up[i]), ("f", k + 1, down[i])):   # inside each compute slice
                mid = (e[1] + e[2]) / 2
                events.append({**flow, "ph": ph, "bp": "e", "tid": tid_, "ts": round((mid - t0) * 1e6, 1)})
    return events

"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

Counters and histograms are updated from the engine thread and the event loop; one lock covers them,
since every update is a few additions and a scrape is rare.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

PREFIX = "ggml_dist_"

# seconds; TTFT on a CPU pipeline ranges from tens of ms to tens of seconds
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)     # [len(buckets) + 1], the last is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.total += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip((*[repr(b) for b in self.buckets], "+Inf"), self.counts):
            cum += c
            out.append(f'{name}_bucket{{le="{le}"}} {cum}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """What /metrics reports; gauges (queue, KV, stages) are read from the engine at scrape time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}      # (endpoint, outcome) -> count
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0
        self.generated_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def count_request(self, endpoint: str, outcome: str) -> None:
        with self.lock:
            key = (endpoint, outcome)
            self.requests[key] = self.requests.get(key, 0) + 1

    def add_prompt(self, n: int, cached: int = 0) -> None:
        with self.lock:
            self.prompt_tokens += n
            self.prompt_tokens_cached += cached

    def add_token(self, ttft: float | None, itl: float | None) -> None:
        with self.lock:
            self.generated_tokens += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if itl is not None:
                self.itl.observe(itl)

    def render(self, gauges: dict[str, tuple[str, float]],
               stage_busy: list[float]) -> str:
        """gauges: name -> (help, value); stage_busy: seconds of compute per pipeline stage."""
        p = PREFIX
        out: list[str] = []

        def head(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {p}{name} {help_}")
            out.append(f"# TYPE {p}{name} {kind}")

        with self.lock:
            head("requests_total", "counter", "HTTP generation requests by endpoint and outcome")
            for (ep, oc), n in sorted(self.requests.items()):
                out.append(f'{p}requests_total{{endpoint="{ep}",outcome="{oc}"}} {n}')
            head("prompt_tokens_total", "counter", "prompt tokens admitted")
            out.append(f"{p}prompt_tokens_total {self.prompt_tokens}")
            head("prompt_tokens_cached_total", "counter", "prompt tokens a slot's cache held (not evaluated)")
            out.append(f"{p}prompt_tokens_cached_total {self.prompt_tokens_cached}")
            head("generated_tokens_total", "counter", "tokens generated")
            out.append(f"{p}generated_tokens_total {self.generated_tokens}")
            head("time_to_first_token_seconds", "histogram", "request arrival to first generated token")
            out += [p + s for s in self.ttft.lines("time_to_first_token_seconds")]
            head("inter_token_latency_seconds", "histogram", "time between consecutive tokens of a request")
            out += [p + s for s in self.itl.lines("inter_token_latency_seconds")]
        for name, (help_, v) in gauges.items():
            head(name, "gauge", help_)
            out.append(f"{p}{name} {v:g}")
        head("stage_busy_seconds_total", "counter", "compute time of each pipeline stage")
        for k, s in enumerate(stage_busy):
            out.append(f'{p}stage_busy_seconds_total{{stage="{k}"}} {s:.6f}')
        return "\n".join(out) + "\n"

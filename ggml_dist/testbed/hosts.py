"""A testbed host as data: its Ray resources, CPU and memory budget, link, interpreter and what it sees
(HostSpec), the environment every process of a cluster starts with, and the head's health-check settings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cgroups import DEFAULT_PERIOD_US

DEFAULT_OBJECT_STORE_BYTES = 80 * 2**20      # Ray's minimum is 75 MiB

# The base environment of every process a cluster starts (a cluster's or host's env overrides it).
DEFAULT_ENV: dict[str, str] = {
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray 2.60 turns token auth on when ~/.ray/auth_token exists; these clusters are private
    # (a bridge only this machine sees), so it is off unless a test asks for it.
    "RAY_AUTH_MODE": "disabled",
    # a driver shows every worker's lines, not "[repeated 2x across cluster]"
    "RAY_DEDUP_LOGS": "0",
}


@dataclass
class HostSpec:
    """One host: its `ray start` resources and what it sees.

    python: the interpreter that runs this host's `ray start` (and so its Ray workers);
        None = sys.executable. E.g. venv_without_ggml_dist(...) for a host lacking ggml_dist.
    hide_dirs: directories this host's processes see as empty (a private tmpfs over each,
        in a mount namespace of its own; the rest of the machine keeps seeing the files).
    env: extra environment for this host's processes (a value of None removes the variable).
    dashboard: head only: start the dashboard on the head's IP.
    cpu: the host's CPU in cores (a CFS quota of cpu x cpu_period_us per period); None: no limit, its
        use still accounted. memory_limit_bytes: its cgroup memory limit (None: none; the Ray
        `memory` resource is memory_bytes, a scheduling figure that nothing enforces by itself).
    link_rate: its link's rate each way (tc units: "1gbit"); link_delay_ms: a fixed delay each way
        (netem's where the kernel has it, else the userspace delay line of testbed/delay.py; `shaping`
        says which).
    cpus: pin the host to these CPUs (a cpuset); None: the cluster pins a host with a CPU limit of at most
        one core to the least loaded CPU where it fits (pin_cpus).
    """
    num_cpus: int = 1
    memory_bytes: int | None = None
    cpu: float | None = None
    cpu_period_us: int = DEFAULT_PERIOD_US
    memory_limit_bytes: int | None = None
    link_rate: str | None = None
    link_delay_ms: float | None = None
    cpus: tuple[int, ...] | None = None
    python: str | None = None
    hide_dirs: list[str] = field(default_factory=list)
    env: dict[str, str | None] = field(default_factory=dict)
    dashboard: bool = False
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    resources: dict[str, float] | None = None
    extra_args: list[str] = field(default_factory=list)


def health_check_config(period_ms: int = 1000, timeout_ms: int = 1000, failure_threshold: int = 3,
                        initial_delay_ms: int | None = None) -> dict[str, int]:
    """A head `system_config` under which the GCS declares an unreachable node dead within about
    period_ms * failure_threshold + timeout_ms (Ray's default is 3000 ms x 5 + 10000 ms)."""
    cfg = {"health_check_period_ms": period_ms, "health_check_timeout_ms": timeout_ms,
           "health_check_failure_threshold": failure_threshold}
    if initial_delay_ms is not None:
        cfg["health_check_initial_delay_ms"] = initial_delay_ms
    return cfg

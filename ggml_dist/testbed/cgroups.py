"""A host's own CPU and memory: one control group per emulated host (cgroup v1, or v2 where unified).

Every machine here has the same 2 cores, so a "host" of the testbed gets a CPU of its own as a CFS
bandwidth quota: `cores` of CPU time per period. The period is short (5 ms by default): a host that idles
for a while cannot bank that time and then run a burst at full speed, which a 100 ms period allows (a
host idle half the time would run at 1.0 core while active, and a sequential split of work over two
hosts would gain for free). Its memory is limited where the memory controller exists.

    g = HostGroup.create("gd1234-h1", cores=0.6, memory_bytes=2**30)
    argv = g.wrap(["ray", "start", "--block", ...])   # joins the groups, then execs: every child stays in
    g.cpu_usage_s(); g.throttling(); g.memory_peak_bytes()
    g.remove()                                          # once its processes are gone

The kernel checks a running task against its quota at its scheduler tick (4 ms at HZ=250, as here), so
a task that computes without sleeping overruns the quota by up to a tick and repays the debt while it
waits: a host that alternates 5 ms of work with 5 ms of waiting ran at ~1.0 core under a 0.6 quota, one
that never waits at ~0.4 (a 5 ms period). That flatters every pipelined host against a busy single one.
So each limited group runs a ticker (`tick_us`, 500 us by default): a thread per CPU, inside the group,
that wakes every tick_us; each wakeup makes the scheduler account the group's running task, so it is
throttled within tick_us of its quota. Measured here (0.6 core, 5 ms period): a busy loop 0.50-0.57 of a
core, 4.5 ms of work every 10 ms at 0.60-0.67, 18 ms every 36 ms at 0.54; the ticker itself costs ~8% of
a core in this VM (timer wakeups are VM exits), charged to the host, and reported (`ticker_cpu_s`).

Where the groups go: under this process's own group of each controller (read from /proc/self/cgroup),
so a testbed inside a memory-limited sandbox stays inside that limit. v1 mounts each controller at
/sys/fs/cgroup/<controller> (cpu and cpuacct may be separate hierarchies, as on these machines, or
co-mounted as cpu,cpuacct); v2 is one tree at /sys/fs/cgroup with cpu.max, memory.max, cpu.stat.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
DEFAULT_PERIOD_US = 5000            # 5 ms: a quota of 0.6 core is 3 ms of every 5
DEFAULT_SHARES = 8192               # v1 cpu.shares (1024 default): a host gets its quota under outside load
DEFAULT_TICK_US = 500               # the ticker's wakeup interval (0: none)

# One thread per CPU this process may use (the host's, when it is pinned to some), each pinned to its CPU,
# waking every argv[1] us: a wakeup on the CPU where the group's task runs makes the scheduler account that
# task's runtime (see the module doc).
TICKER = """
import os, sys, threading, time
iv = int(sys.argv[1]) / 1e6
def tick(cpu):
    os.sched_setaffinity(0, {cpu})
    while True:
        time.sleep(iv)
for c in sorted(os.sched_getaffinity(0)):
    threading.Thread(target=tick, args=(c,), daemon=True).start()
threading.Event().wait()
"""


class CgroupError(RuntimeError):
    """A group could not be made, joined or removed; the message names the file and the errno."""


@dataclass(frozen=True)
class Throttling:
    """cpu.stat's bandwidth counters: periods with the group runnable, periods it hit the quota, and
    the time its tasks waited for the next period."""
    nr_periods: int
    nr_throttled: int
    throttled_s: float

    def __sub__(self, o: Throttling) -> Throttling:
        return Throttling(self.nr_periods - o.nr_periods, self.nr_throttled - o.nr_throttled,
                          self.throttled_s - o.throttled_s)

    def to_dict(self) -> dict[str, float]:
        return {"nr_periods": self.nr_periods, "nr_throttled": self.nr_throttled,
                "throttled_s": round(self.throttled_s, 4)}


def _own_paths() -> dict[str, str]:
    """controller -> this process's group path in its hierarchy ("" key: the v2 tree)."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


@functools.cache
def layout() -> tuple[str, dict[str, Path]]:
    """("v1", {"cpu": dir, "cpuacct": dir, "memory": dir, "cpuset": dir}) or ("v2", {"": dir}): where a new
    group's parent is for each controller (missing controllers left out). Raises CgroupError without one."""
    own = _own_paths()
    v1 = {}
    for ctrl in ("cpu", "cpuacct", "memory", "cpuset"):
        for mount in (ROOT / ctrl, ROOT / "cpu,cpuacct"):
            if (mount / "cgroup.procs").exists() and (ctrl != "cpuacct" or (mount / "cpuacct.usage").exists()):
                v1[ctrl] = mount / own.get(ctrl, "/").lstrip("/")
                break
    if "cpu" in v1:
        return "v1", v1
    if (ROOT / "cgroup.controllers").exists() and "cpu" in (ROOT / "cgroup.controllers").read_text().split():
        return "v2", {"": ROOT / own.get("", "/").lstrip("/")}
    raise CgroupError("no cgroup cpu controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in "
                      "/sys/fs/cgroup/cgroup.controllers (v2)")


def cgroups_available() -> str | None:
    """None if this process can make host groups with a CPU quota, else a one-line reason (for skip)."""
    if os.geteuid() != 0:
        return "cgroups need root (euid is not 0)"
    try:
        kind, parents = layout()
    except (CgroupError, OSError) as e:
        return str(e)
    probe = f"gdprobe{os.getpid():x}"
    made = []
    try:
        for parent in parents.values():
            (parent / probe).mkdir()
            made.append(parent / probe)
        quota = made[0] / ("cpu.cfs_quota_us" if kind == "v1" else "cpu.max")
        quota.write_text("1000\n" if kind == "v1" else "1000 5000\n")
        return None
    except OSError as e:
        return f"cannot make a cgroup with a CPU quota under {list(map(str, parents.values()))}: {e}"
    finally:
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value.strip()!r} to {path}: {e}") from e


@dataclass
class HostGroup:
    """One host's groups, one per controller; `cores` None: no CPU limit (accounted only)."""
    name: str
    kind: str                                   # "v1" or "v2"
    dirs: dict[str, Path] = field(default_factory=dict)    # controller ("" in v2) -> the group's dir
    cores: float | None = None
    period_us: int = DEFAULT_PERIOD_US
    memory_bytes: int | None = None
    cpus: tuple[int, ...] | None = None         # pinned to these CPUs (a cpuset), or None: any
    ticker: subprocess.Popen | None = None

    @classmethod
    def create(cls, name: str, cores: float | None = None, period_us: int = DEFAULT_PERIOD_US,
               memory_bytes: int | None = None, shares: int = DEFAULT_SHARES,
               tick_us: int = DEFAULT_TICK_US, cpus: tuple[int, ...] | None = None) -> HostGroup:
        """The groups, limited; with a CPU limit and tick_us > 0, its ticker started inside them. cpus: pin
        the host to these CPUs (its ticker then needs a thread on those only)."""
        if cores is not None and not 0.01 <= cores <= len(cpus or os.sched_getaffinity(0)):
            raise ValueError(f"cores must be in 0.01..{len(cpus or os.sched_getaffinity(0))}, not {cores}")
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"the CFS period must be 1000..1000000 us, not {period_us}")
        kind, parents = layout()
        if cpus is not None and kind == "v1" and "cpuset" not in parents:
            raise CgroupError("pinning a host to CPUs needs the cpuset controller")
        g = cls(name, kind, {}, cores, period_us, memory_bytes, cpus)
        try:
            for ctrl, parent in parents.items():
                if ctrl == "cpuset" and cpus is None:         # an unset v1 cpuset takes no task
                    continue
                d = parent / name
                d.mkdir()
                g.dirs[ctrl] = d
            g._limit(shares)
            if cores is not None and tick_us > 0:
                g.ticker = subprocess.Popen(g.wrap([sys.executable, "-c", TICKER, str(tick_us)]),
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            g.remove()
            raise
        return g

    def _limit(self, shares: int) -> None:
        quota = -1 if self.cores is None else max(1000, round(self.cores * self.period_us))
        if self.cpus is not None:
            d = self.dirs["cpuset" if self.kind == "v1" else ""]
            _write(d / "cpuset.cpus", ",".join(map(str, self.cpus)) + "\n")
            if self.kind == "v1":
                _write(d / "cpuset.mems", (d.parent / "cpuset.mems").read_text())
        if self.kind == "v1":
            cpu = self.dirs["cpu"]
            _write(cpu / "cpu.cfs_period_us", f"{self.period_us}\n")
            _write(cpu / "cpu.cfs_quota_us", f"{quota}\n")
            _write(cpu / "cpu.shares", f"{shares}\n")
            if self.memory_bytes is not None:
                if "memory" not in self.dirs:
                    raise CgroupError("a memory limit was asked for, but there is no memory controller")
                mem = self.dirs["memory"]
                _write(mem / "memory.limit_in_bytes", f"{self.memory_bytes}\n")
                with contextlib.suppress(CgroupError):     # no swap accounting on some kernels
                    _write(mem / "memory.memsw.limit_in_bytes", f"{self.memory_bytes}\n")
        else:
            d = self.dirs[""]
            _write(d / "cpu.max", f"{'max' if quota < 0 else quota} {self.period_us}\n")
            _write(d / "cpu.weight", f"{max(1, min(10000, shares * 100 // 1024))}\n")
            if self.memory_bytes is not None:
                _write(d / "memory.max", f"{self.memory_bytes}\n")
                with contextlib.suppress(CgroupError):
                    _write(d / "memory.swap.max", "0\n")

    # -- joining ----------------------------------------------------------------------------------
    def procs_files(self) -> list[Path]:
        return [d / "cgroup.procs" for d in self.dirs.values()]

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run in these groups: a shell that writes its own pid into each group's cgroup.procs,
        then execs argv, so the process and everything it ever forks are the host's from the start."""
        joins = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in self.procs_files())
        return ["sh", "-c", f'{joins} && exec "$@"', "sh", *argv]

    def add(self, pid: int) -> None:
        for p in self.procs_files():
            _write(p, f"{pid}\n")

    def pids(self, ticker: bool = False) -> set[int]:
        """The processes in the groups (without the group's own ticker unless asked)."""
        out: set[int] = set()
        for p in self.procs_files():
            with contextlib.suppress(OSError):
                out |= {int(x) for x in p.read_text().split()}
        if not ticker and self.ticker is not None:
            out.discard(self.ticker.pid)
        return out

    def ticker_cpu_s(self) -> float:
        """CPU seconds the ticker has used (its threads', from /proc)."""
        if self.ticker is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.ticker.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # -- accounting -------------------------------------------------------------------------------
    def cpu_usage_s(self) -> float:
        """CPU time of every task the group ever had, in seconds (cpuacct.usage; v2 cpu.stat usage_usec)."""
        if self.kind == "v1":
            d = self.dirs.get("cpuacct")
            if d is None:
                return float("nan")
            return int((d / "cpuacct.usage").read_text()) / 1e9
        return self._v2_stat()["usage_usec"] / 1e6

    def throttling(self) -> Throttling:
        st = self._v2_stat() if self.kind == "v2" else _kv((self.dirs["cpu"] / "cpu.stat").read_text())
        ns = st.get("throttled_time")                 # v1: ns; v2: throttled_usec
        s = ns / 1e9 if ns is not None else st.get("throttled_usec", 0) / 1e6
        return Throttling(st.get("nr_periods", 0), st.get("nr_throttled", 0), s)

    def memory_peak_bytes(self) -> int | None:
        if self.kind == "v1":
            d = self.dirs.get("memory")
            return None if d is None else int((d / "memory.max_usage_in_bytes").read_text())
        p = self.dirs[""] / "memory.peak"
        return int(p.read_text()) if p.exists() else None

    def reset_memory_peak(self) -> None:
        """Start memory_peak_bytes over from the current usage (v1: write max_usage_in_bytes; v2: write
        memory.peak, where the kernel allows it)."""
        d = self.dirs.get("memory" if self.kind == "v1" else "")
        if d is not None:
            with contextlib.suppress(OSError):
                (d / ("memory.max_usage_in_bytes" if self.kind == "v1" else "memory.peak")).write_text("0\n")

    def memory_oom_kills(self) -> int | None:
        """How many of the group's processes the OOM killer ended at its limit (v1 memory.oom_control,
        v2 memory.events)."""
        if self.kind == "v1":
            d = self.dirs.get("memory")
            return None if d is None else _kv((d / "memory.oom_control").read_text()).get("oom_kill", 0)
        return _kv((self.dirs[""] / "memory.events").read_text()).get("oom_kill", 0)

    def _v2_stat(self) -> dict[str, int]:
        return _kv((self.dirs[""] / "cpu.stat").read_text())

    def snapshot(self) -> dict[str, float | int | None]:
        t = self.throttling()
        return {"cpu_s": self.cpu_usage_s(), "ticker_cpu_s": self.ticker_cpu_s(), **t.to_dict(),
                "memory_peak_bytes": self.memory_peak_bytes(), "oom_kills": self.memory_oom_kills()}

    # -- removal ----------------------------------------------------------------------------------
    def remove(self, timeout_s: float = 5.0) -> list[int]:
        """Once the group's processes are gone (ended by their owner, by pid), end its ticker and rmdir
        each group; returns the pids still inside after timeout_s (the groups are left then)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.pids()) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            return sorted(left)
        if self.ticker is not None:
            self.ticker.kill()
            self.ticker.wait()
            self.ticker = None
        for d in list(self.dirs.values()):
            for _ in range(50):                      # a just-killed task leaves the group a moment later
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != 16:                # EBUSY
                        raise CgroupError(f"cannot remove {d}: {e}") from e
                    time.sleep(0.02)
            else:
                raise CgroupError(f"cannot remove {d}: still busy")
        self.dirs.clear()
        return []


def _kv(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        with contextlib.suppress(ValueError):
            out[k] = int(v)
    return out

"""A streaming `ggml-dist run` whose stage-1 host loses its link mid-generation: a real fault to recover
from (tests/workers/test_multihost.py, benchmarks/namespace_cluster.py).
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# the cluster these read is a testbed.cluster.NamespaceCluster (typed Any here: cluster.py imports this module)
NamespaceCluster = Any


@dataclass
class CutRun:
    returncode: int
    text: str                     # what the run streamed on stdout
    log: str                      # its stderr
    victim: int | None            # the host whose link was cut
    cut_to_end_s: float | None    # from the cut to the run's exit
    recoveries: int               # from the run's closing line
    detect_s: float | None        # from the cut to the run's detection of the loss (its detected_at)
    restore_s: float | None       # the restart and the replay of the KV log
    first_token_s: float | None   # from detection to the first token after it


def run_with_link_cut(c: NamespaceCluster, argv: Sequence[str], after_chars: int,
                      timeout: float = 900.0) -> CutRun:
    """Run `argv` (a `ggml-dist run` without --json, so text streams) in the head's namespace; once
    `after_chars` characters have streamed, cut the link of the host that holds stage 1 (read from the
    plan table the run prints on stderr before it loads); restore it when the run ends."""
    import re
    import threading
    p = c.popen_in(0, list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err: list[str] = []
    assert p.stdout is not None and p.stderr is not None
    stderr = p.stderr
    reader = threading.Thread(target=lambda: err.extend(ln.decode() for ln in stderr), daemon=True)
    reader.start()
    text, cut_at, cut_wall, victim = b"", None, None, None
    try:
        while b := os.read(p.stdout.fileno(), 64):
            text += b
            if cut_at is None and len(text) >= after_chars:
                row = next(ln for ln in err if re.match(r"\s+1 ", ln))
                victim = c.ips.index(row.split()[1])
                c.link_down(victim)
                cut_at, cut_wall = time.perf_counter(), time.time()
        p.wait(timeout=timeout)
        reader.join(10)
    finally:
        if victim is not None:
            c.link_up(victim)
    log = "".join(err)
    m = re.search(r"recoveries (\d+): detected after \S+ s \(at ([\d.]+)\), restored in ([\d.]+) s, first token "
                  r"([\d.]+) s", log)
    detect = float(m.group(2)) - cut_wall if m and cut_wall is not None else None
    return CutRun(p.returncode, text.decode(), log, victim, time.perf_counter() - cut_at if cut_at else None,
                  int(m.group(1)) if m else 0, None if detect is None else round(detect, 3),
                  float(m.group(3)) if m else None, float(m.group(4)) if m else None)

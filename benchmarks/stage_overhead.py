"""The fixed memory of a stage actor's process: what placement adds to every stage (STAGE_OVERHEAD_BYTES).

Starts a local Ray, runs a 2-stage pipeline of a small synthetic model (weights, KV and compute buffer
under 2 MiB a stage) through a prompt and a few decode steps, so every kernel the stage needs has been
loaded, then reads each stage process's /proc/PID/smaps_rollup. The overhead is its private anonymous
memory less what the stage reports for weights, KV and compute; shared library pages (file-backed,
shared by every process of a node) are reported but not counted. Prints one JSON object.

    python benchmarks/stage_overhead.py [--wtype Q4_0] [--stages 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        key, _, rest = line.partition(":")
        if rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wtype", default="Q4_0")
    ap.add_argument("--stages", type=int, default=2)
    a = ap.parse_args(argv)
    import ray

    from ggml_dist.model.context import ContextParams
    from ggml_dist.model.generate import generate
    from ggml_dist.model.synthetic import SyntheticSpec, write_synthetic
    from ggml_dist.workers.cluster import Pipeline
    from ggml_dist.workers.local_ray import connect
    from ggml_dist.workers.placement import STAGE_OVERHEAD_BYTES
    connect(num_cpus=max(2, a.stages))
    with tempfile.TemporaryDirectory() as d:
        path = write_synthetic(Path(d) / "m.gguf", SyntheticSpec(wtype=a.wtype, n_layer=2 * a.stages, seed=3))
        pl = Pipeline.launch(str(path), a.stages, ContextParams(n_ctx=256))
        try:
            generate(pl.ctx, pl.model.tokenizer, list(range(1, 33)), 8)
            stages = []
            for actor in pl.actors:
                info = ray.get(actor.info.remote())
                sm = _smaps(info["pid"])
                own = info["weight_bytes"] + info["kv_bytes"] + info["compute_bytes"]
                stages.append({"stage": info["stage"], "anonymous_bytes": sm.get("Anonymous", 0),
                               "rss_bytes": sm.get("Rss", 0), "shared_clean_bytes": sm.get("Shared_Clean", 0),
                               "weights_kv_compute_bytes": own,
                               "overhead_bytes": sm.get("Anonymous", 0) - own})
        finally:
            pl.shutdown()
            ray.shutdown()
    print(json.dumps({"bench": "stage_overhead", "wtype": a.wtype, "python": platform.python_version(),
                      "ray": ray.__version__, "stages": stages,
                      "max_overhead_mib": round(max(s["overhead_bytes"] for s in stages) / 2**20, 1),
                      "planned_overhead_mib": STAGE_OVERHEAD_BYTES / 2**20}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A model bigger than any node, on a Ray cluster of network-namespace hosts built on this machine.

A head (no CPUs, the dashboard) and --workers worker nodes of --node-mib MiB (Ray `memory`) and 1 CPU
each, every one at its own IP on a bridge (ggml_dist/testbed; needs root). Then, as a user would:

    1. ggml-dist plan --address HEAD --stages auto --ctx C --json                (in the head's namespace)
    2. ray job submit --address http://HEAD:8265 -- ggml-dist run --stages auto ... --temp 0 --json
    3. the same run, streaming, with the link of the host holding stage 1 cut after a few tokens

and compares 2 and 3 with the single-process greedy tokens. Prints one JSON object.

    python benchmarks/namespace_cluster.py [--model PATH] [--workers 4] [--node-mib 320] [--ctx 512]
        [--ubatch 512] [-n 32]      (default model: the 1.1B TinyLlama-shape Q4_0 of bench decode)
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ggml_dist.testbed.cluster import HostSpec, NamespaceCluster, run_with_link_cut
from ggml_dist.testbed.netns import netns_available

PROMPT = "The capital of France is"


def _single(model: str, a: argparse.Namespace) -> list[int]:
    r = subprocess.run(["ggml-dist", "run", "--model", model, "--ctx", str(a.ctx), "--ubatch", str(a.ubatch),
                        "--prompt", PROMPT, "-n", str(a.n), "--temp", "0", "--json"],
                       capture_output=True, text=True, check=True)
    return json.loads(r.stdout)["tokens"]


def _cut_run(c: NamespaceCluster, model: str, a: argparse.Namespace) -> dict:
    r = run_with_link_cut(c, ["ggml-dist", "run", "--address", c.gcs_address, "--model", model, "--stages", "auto",
                              "--ctx", str(a.ctx), "--ubatch", str(a.ubatch), "--prompt", PROMPT, "-n", str(a.n),
                              "--temp", "0"], after_chars=12)
    return {"returncode": r.returncode, "text": r.text, "victim_ip": c.ips[r.victim] if r.victim else None,
            "recoveries": r.recoveries, "detect_s": r.detect_s, "restore_s": r.restore_s,
            "first_token_s": r.first_token_s, "cut_to_end_s": r.cut_to_end_s,
            "log_tail": r.log[-1500:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--node-mib", type=int, default=320)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("-n", type=int, default=32)
    a = ap.parse_args(argv)
    reason = netns_available()
    if reason:
        print(json.dumps({"skipped": reason}))
        return 0
    if a.model is None:
        from ggml_dist.model.synthetic import TINYLLAMA_Q4_0, cached_synthetic
        a.model = str(cached_synthetic(TINYLLAMA_Q4_0))
    want = _single(a.model, a)
    hosts = [HostSpec(num_cpus=0, dashboard=True)] + [HostSpec(num_cpus=1, memory_bytes=a.node_mib * 2**20)
                                                      for _ in range(a.workers)]
    out: dict = {"model": a.model, "workers": a.workers, "node_mib": a.node_mib, "ctx": a.ctx, "ubatch": a.ubatch}
    with NamespaceCluster(hosts) as c:
        r = c.run_in(0, ["ggml-dist", "plan", "--address", c.gcs_address, "--model", a.model, "--stages", "auto",
                         "--ctx", str(a.ctx), "--ubatch", str(a.ubatch), "--json"], capture_output=True, text=True)
        if r.returncode != 0:
            out["plan_error"] = r.stderr.strip().splitlines()[-1]
            print(json.dumps(out))
            return 1
        out["plan"] = json.loads(r.stdout)["stages"]
        ray_cli = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
        t0 = time.perf_counter()
        r = subprocess.run([ray_cli, "job", "submit", "--address", c.dashboard_url, "--", "ggml-dist", "run",
                            "--model", a.model, "--stages", "auto", "--ctx", str(a.ctx), "--ubatch", str(a.ubatch),
                            "--prompt", PROMPT, "-n", str(a.n), "--temp", "0", "--json"],
                           capture_output=True, text=True, env=c.env_for(0, driver=False), cwd=str(c.workdir))
        job = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith('{"prompt_tokens"')))
        out["job"] = {"wall_s": round(time.perf_counter() - t0, 1), "tokens_equal": job["tokens"] == want,
                      "timings": job["timings"], "stage_nodes": [s["node_ip"] for s in job["plan"]]}
        cut = _cut_run(c, a.model, a)
        cut["text_equal"] = cut.pop("text").strip() == _detok(a.model, want).strip()
        out["link_cut"] = cut
    print(json.dumps(out))
    return 0


def _detok(model: str, ids: list[int]) -> str:
    from ggml_dist.model.gguf import load_gguf
    from ggml_dist.model.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(load_gguf(model))
    return b"".join(tok.token_to_piece(i) for i in ids).decode("utf-8", "replace")


if __name__ == "__main__":
    sys.exit(main())

"""Write (once) a synthetic Q4_0 model of a known shape and print its path: the TinyLlama-shaped 1.1B the CPU
benchmarks use (default), or LLaMA-2-7B's shape (--shape llama2-7b, ~3.6 GiB) for a model bigger than a
testbed host.

The file is cached under $GGML_DIST_CACHE (else ~/.cache/ggml_dist/models) and is a pure function of the
spec, so a cached file is reused as is. Peak RSS of the writing process goes to stderr: GGUFWriter keeps
every quantized tensor in memory until write_tensors_to_file, so the peak is about the file size (~600 MB)
plus one tensor's float32/float64 values.

    python -m benchmarks.make_synthetic [--shape tinyllama|llama2-7b] [--force]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time

from ggml_dist.model.synthetic import SHAPES, cached_synthetic


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    ap.add_argument("--force", action="store_true", help="rewrite even if the file exists")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = cached_synthetic(SHAPES[args.shape], force=args.force)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"{path.stat().st_size / 1e6:.0f} MB ready in {time.perf_counter() - t0:.0f} s, "
          f"peak RSS {rss_mb:.0f} MB", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

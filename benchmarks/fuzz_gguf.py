"""GGUF loader fuzzer (see ggml_dist/bench/fuzz_gguf.py): `python benchmarks/fuzz_gguf.py --cases 10000 --json`."""
import sys

from ggml_dist.bench.fuzz_gguf import main

if __name__ == "__main__":
    sys.exit(main())

"""Fault study (see ggml_dist/bench/faults.py); same as `ggml-dist bench faults`."""
import sys

from ggml_dist.bench.faults import main

if __name__ == "__main__":
    sys.exit(main())

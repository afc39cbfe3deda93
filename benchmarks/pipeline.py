"""Pipeline study (see ggml_dist/bench/pipeline.py); same as `ggml-dist bench pipeline`."""
import sys

from ggml_dist.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main())

"""Graph-allocator benchmark (see ggml_dist/bench/alloc.py); same as `ggml-dist bench alloc`."""
import sys

from ggml_dist.bench.alloc import main

if __name__ == "__main__":
    sys.exit(main())

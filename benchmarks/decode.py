"""CPU speed next to llama.cpp (see ggml_dist/bench/decode.py); same as `ggml-dist bench decode`."""
import sys

from ggml_dist.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())

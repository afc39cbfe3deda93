"""keep_freed_host_memory: a step's large temporaries come back from the heap, not from fresh pages."""
import resource
import sys

import numpy as np
import pytest

from ggml_dist.backends.cpu.backend import keep_freed_host_memory

N_VOCAB = 49152


def _step_temporaries() -> None:
    """What a decode step of 8 sequences allocates and frees: the logits copied out of the compute
    buffer, their rows, larger scratch."""
    logits = np.ones(8 * N_VOCAB, np.float32)
    rows = [logits[i * N_VOCAB:(i + 1) * N_VOCAB].copy() for i in range(8)]
    scratch = np.ones(3 * logits.size, np.float32)
    del logits, rows, scratch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_step_temporaries_are_reused_without_page_faults():
    keep_freed_host_memory()
    _step_temporaries()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(50):
        _step_temporaries()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # glibc's defaults unmap or trim these on free: ~88000 faults in all, measured
    assert faults < 1000, f"{faults} page faults for 50 steps' temporaries"

"""backends/cpu/compile_progress.py: the count of kernels compiled against those expected, and the estimate."""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import event

from ggml_dist.backends.cpu.compile_progress import CompileStatus, CompileTracker, kernel_name


def _compile_one(tracker: CompileTracker):
    """A real numba compile (a kernel of this test's own, new each call) seen by the tracker."""
    @njit(cache=False)
    def tiny(x):
        return x * 2.0 + 1.0
    event.register("numba:compile", tracker)
    try:
        tiny(np.float64(1.0))
    finally:
        event.unregister("numba:compile", tracker)
    return kernel_name(tiny)


# a compile's kernels count against the expected ones; the estimate is what is left of them at this pace
def test_counts_and_estimate():
    name = f"{__name__.rsplit('.', 1)[-1]}._compile_one.<locals>.tiny"
    tr = CompileTracker([(name, 1.0), ("fkernels._attention_serial", 20.0)])
    assert _compile_one(tr) == name
    st = tr.status()
    assert st.n_done == 1 and st.n_expected == 2 and st.current == ""
    assert st.eta_s is not None and 10.0 < st.eta_s < 40.0          # 20 s measured, at a pace held near 1
    assert "1 of 2 kernels done" in st.text() and "s left" in st.text()
    tr.reset([])
    assert tr.status().n_done == 0 and tr.status().eta_s is None       # no manifest: no estimate


# without expected kernels: the count alone, no estimate
def test_no_manifest():
    tr = CompileTracker()
    _compile_one(tr)
    st = tr.status()
    assert st.n_expected is None and st.eta_s is None and st.text().startswith("1 kernels done")
    assert CompileStatus(**st.to_json()).n_done == 1

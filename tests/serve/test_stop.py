"""StopMatcher: text that could still become a stop string is held back, never emitted past a stop."""
from __future__ import annotations

from ggml_dist.serve.stop import StopMatcher


def _run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out, hit = [], False
    for p in pieces:
        text, hit = m.push(p)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    return "".join(out), hit, out


# a stop string split over pieces ends the text before it
def test_stop_across_pieces():
    text, hit, out = _run(["END"], ["ab", "cE", "N", "Dxyz"])
    assert (text, hit) == ("abc", True)
    assert out[:3] == ["ab", "c", ""]           # "E" and "EN" were held back


# a held-back prefix that does not complete is emitted with the next piece
def test_partial_released():
    text, hit, out = _run(["END"], ["aE", "Nx", "y"])
    assert (text, hit) == ("aENxy", False)
    assert out == ["a", "ENx", "y", ""]


# the earliest of several stop strings wins; no stops streams everything at once
def test_earliest_stop_and_no_stops():
    assert _run(["zz", "b"], ["aab", "zz"])[:2] == ("aa", True)
    assert _run([], ["a", "b"])[2] == ["a", "b", ""]


# a stop string inside one piece
def test_stop_inside_piece():
    assert _run(["\n\n"], ["hello\n\nworld"])[:2] == ("hello", True)

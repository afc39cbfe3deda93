"""Stop strings over streamed text: emit only what can no longer turn into a stop string.

Text that ends in a prefix of some stop string is held back until the next piece decides it: either the
stop string completes (the text before it is emitted and generation ends) or it cannot (the held text
goes out). llama.cpp's server does the same (find_partial_stop_string).
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.text = ""          # everything generated so far
        self.n_sent = 0         # characters of text already emitted

    def push(self, piece: str) -> tuple[str, bool]:
        """Add a piece; returns (text to emit now, whether a stop string was hit)."""
        self.text += piece
        if not self.stops:
            return self._emit(len(self.text)), False
        # a stop string may straddle what was sent: search from the longest possible overlap
        start = max(0, self.n_sent - max(len(s) for s in self.stops) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            # a stop string never starts inside sent text: that text would have been held back
            return self._emit(max(cut, self.n_sent)), True
        return self._emit(len(self.text) - self._partial_len()), False

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _partial_len(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.n_sent)
        out = self.text[self.n_sent:upto]
        self.n_sent = upto
        return out

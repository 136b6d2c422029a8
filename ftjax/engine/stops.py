"""Stop strings, matched as tokens arrive.

A stop string can span tokens, so matching works on text. Re-decoding everything
generated so far at every token would cost O(n) per token (O(n^2) per request); here
each token's new text comes from a stream decoder and is searched together with the
last (longest stop - 1) characters before it, which is all a match that ends in the new
text can reach back to. Cost per token: O(piece + longest stop) x number of stops, both
bounded at the door (`check_stops`).
"""

from __future__ import annotations

from typing import Sequence

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str] | None, name: str = "stop") -> list[str]:
    """The stop strings of a request, validated: at most MAX_STOPS non-empty strings of at
    most MAX_STOP_CHARS characters each (ValueError naming `name` otherwise)."""
    out = list(stops or [])
    if len(out) > MAX_STOPS:
        raise ValueError(f"{name}: at most {MAX_STOPS} stop strings, got {len(out)}")
    for i, s in enumerate(out):
        if not isinstance(s, str) or not s:
            raise ValueError(f"{name}[{i}]: stop strings must be non-empty strings, got {s!r}")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"{name}[{i}]: stop strings are at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return out


class StopMatcher:
    """`push(token) -> the stop string that the text now contains, or None`."""

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.stops = list(stops)
        self.decoder = tokenizer.stream_decoder()
        self.reach = max(map(len, self.stops), default=1) - 1  # characters a match can start before the new text
        self.tail = ""

    def push(self, token: int) -> str | None:
        piece = self.decoder.push(token)
        if not piece or not self.stops:
            return None
        window = self.tail + piece
        self.tail = window[len(window) - self.reach:] if self.reach else ""
        hits = [(window.find(s), s) for s in self.stops if s in window]
        return min(hits)[1] if hits else None

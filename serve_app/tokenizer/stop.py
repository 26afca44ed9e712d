"""Stop strings over a stream of text deltas, with vLLM's output semantics.

The output ends right before the first stop string (right after it with
``include_stop_str_in_output``), even when the stop string spans several deltas. Text that could
still be the start of a stop string is held back, so a streaming client never sees text that
later turns out to be part of a stop string.

Which stop string wins: the occurrence that *ends* first in the text; among occurrences ending at
the same place, the one that starts first (the longest). This is "the first stop string the
stream completes", which is what an engine stopping at the exact step can implement, and it makes
the result independent of how the text is split into deltas. It equals "earliest occurrence"
unless one stop string contains another strictly inside it (stop=["abcd", "c"] on "abcd" -> "c").
A stop string that is a prefix of another wins over it (["ab", "abc"] on "abc" -> "ab").
"""

from __future__ import annotations


class StopMatcher:
    """Feeds text deltas through a set of stop strings; see the module docstring for the rules."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        # Empty strings would match everywhere; duplicates change nothing.
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._include = include_stop_str_in_output
        self._pending = ""  # held-back text: a proper prefix of some stop string, never a match
        self.matched: str | None = None

    def push(self, delta: str) -> tuple[str, str | None]:
        """Returns (text safe to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", self.matched
        if not self._stops:
            return delta, None
        buf = self._pending + delta
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in self._stops:
            # The pending text holds no complete match, so any match ends inside the new delta;
            # find() gives this string's earliest start, hence also its earliest end.
            start = buf.find(s)
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is not None:
            end, start, self.matched = best
            self._pending = ""
            return buf[: end if self._include else start], self.matched
        hold = self._partial_suffix_len(buf)
        self._pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        """Releases held-back text at the end of generation (nothing after a match)."""
        if self.matched is not None:
            return ""
        out, self._pending = self._pending, ""
        return out

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        longest = min(len(buf), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self._stops):
                return k
        return 0


def apply_stop(
    text: str, stop: list[str], include_stop_str_in_output: bool = False
) -> tuple[str, str | None]:
    """Non-streaming use: the whole output text cut at its stop string, and that string."""
    matcher = StopMatcher(stop, include_stop_str_in_output)
    out, matched = matcher.push(text)
    return out + matcher.flush(), matched

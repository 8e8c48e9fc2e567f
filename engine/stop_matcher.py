"""Stop strings matched on decoded text, never leaking a partial match.

Pure Python (no mlx) so it is unit- and property-testable on its own.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed decoded text; get back what is safe to emit and whether a stop hit.

    Text that could be the beginning of a stop string is held back until it is
    either completed (stop: the held text is dropped along with everything after)
    or disproved (released on a later feed or by ``flush``).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended generation

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        first, stop = self._first_match(buffer)
        if first >= 0:
            self.stopped = True
            self.matched = stop
            self._held = ""
            return buffer[:first]
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held text at the end of generation (no stop can complete now)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str | None]:
        """Start of the match that *completes* first (generation halts the moment
        any stop string is complete); on a tie, the longest one. Deciding by end
        position makes the result independent of how the text was chunked."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            pos = buffer.find(stop)
            if pos >= 0 and (best is None or (pos + len(stop), pos) < best[:2]):
                best = (pos + len(stop), pos, stop)
        return (-1, None) if best is None else (best[1], best[2])

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best

"""StopChecker: stop strings over streamed text, never emitting part of a stop string.

The output ends just before the first occurrence of any stop string (the stop string itself is
not returned, unless `include`: then just after it, vLLM's include_stop_str_in_output).
While streaming, the last ``max(len(stop)) - 1`` characters are held back, since
they could be the start of a stop string that the next token completes; they are released when
more text proves otherwise, or at the end of the request (:meth:`flush`).
"""
from __future__ import annotations


class StopChecker:
    """Per-choice state. ``push`` new text, emit what it returns; stop when ``stopped``."""

    def __init__(self, stop: list[str] | tuple[str, ...] = (), include: bool = False):
        self._stops = tuple(s for s in stop if s)
        self._include = include
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""                       # received, not yet emitted (at most _hold chars)
        self.stopped = False
        self.matched: str | None = None          # the stop string that ended the output

    def push(self, text: str) -> str:
        """Feed new text; return the text that is safe to emit now."""
        if self.stopped or not text:
            return ""
        buffer = self._pending + text
        hit = self._first_stop(buffer)
        if hit is not None:
            self.stopped = True
            self._pending = ""
            at, stop = hit
            self.matched = stop
            return buffer[:at + len(stop)] if self._include else buffer[:at]
        keep = min(self._hold, len(buffer))
        self._pending = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    @property
    def watching(self) -> bool:
        """Whether there are stop strings to find."""
        return bool(self._stops)

    def flush(self) -> str:
        """The request ended without a stop string: release what was held back."""
        text, self._pending = self._pending, ""
        return "" if self.stopped else text

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """(where, which) of the stop string that occurs first (at one place, the longest)."""
        # NOTE: only the held-back tail plus the new text is searched; every stop string that
        # started earlier was either found earlier or cannot fit, so each step costs O(new text).
        hits = [(i, -len(s), s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if not hits:
            return None
        at, _, stop = min(hits)
        return at, stop

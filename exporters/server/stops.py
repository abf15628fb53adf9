"""Stop strings (the ``stop`` field): text is held back while it could still become one, and cut where one starts."""

from __future__ import annotations


class StopText:
    """Generated text in pieces, as a client may see it: never a character of a stop string."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated
        self.shown = 0  # characters of ``text`` released
        self.stopped = False

    def push(self, piece: str) -> str:
        """The text that can be released after ``piece``; once a stop string appears, nothing more."""
        if self.stopped:
            return ""
        self.text += piece
        found = [i for i in (self.text.find(s, max(0, self.shown - len(s))) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            return self._release(min(found))
        return self._release(len(self.text) - self._held())

    def flush(self) -> str:
        """What was held back, once generation ended without a stop string."""
        return "" if self.stopped else self._release(len(self.text))

    def _held(self) -> int:
        """The longest end of the text that begins a stop string."""
        return max((n for s in self.stops for n in range(min(len(s) - 1, len(self.text)), 0, -1)
                    if self.text.endswith(s[:n])), default=0)

    def _release(self, end: int) -> str:
        piece, self.shown = self.text[self.shown:max(end, self.shown)], max(end, self.shown)
        return piece

    @property
    def released(self) -> str:
        return self.text[:self.shown]

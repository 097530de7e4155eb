"""Stop sequences on streamed text: hold back what may begin one, cut at the first match."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopText"]


class StopText:
    """Text as generated, and the part of it a client may see so far.

    ``push`` returns the new text that is certainly not part of a stop
    sequence; once one appears, ``hit`` is set and nothing more is released.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.longest = max((len(s) for s in self.stops), default=0)
        self.generated = ""
        self.sent = 0
        self.hit = False

    @property
    def text(self) -> str:
        """The answer: everything before the first stop sequence."""
        return self.generated[: self.sent] if self.hit else self.generated

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self.generated += piece
        if not self.stops:
            return self._release(len(self.generated))
        start = max(0, self.sent - self.longest)
        found = [i for s in self.stops if (i := self.generated.find(s, start)) >= 0]
        if found:
            out = self._release(min(found))
            self.hit = True
            return out
        return self._release(len(self.generated) - self._held_back())

    @property
    def matched(self) -> str | None:
        """The stop sequence that ended the answer (None: none did)."""
        if not self.hit:
            return None
        return next((s for s in self.stops if self.generated.startswith(s, self.sent)), None)

    def flush(self) -> str:
        """The rest of the text when generation ended without a stop sequence."""
        return "" if self.hit else self._release(len(self.generated))

    def _held_back(self) -> int:
        """The longest tail of the text that begins a stop sequence."""
        text = self.generated
        for n in range(min(self.longest - 1, len(text) - self.sent), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _release(self, end: int) -> str:
        out = self.generated[self.sent : end]
        self.sent = max(self.sent, end)
        return out

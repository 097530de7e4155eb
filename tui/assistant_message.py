"""An assistant message: Markdown that grows token by token while the model answers."""

from __future__ import annotations

from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

__all__ = ["AssistantMessage"]


class AssistantMessage(Markdown):
    """Streamed pieces are appended in the background; ``finish`` settles the text."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text
        self.pieces = 0  # streamed pieces received (tests check that an answer streamed)
        self._stream: MarkdownStream | None = None
        self._finished = False

    def append_piece(self, piece: str) -> None:
        """Add one streamed piece (called through ``App.call_from_thread``)."""
        self.pieces += 1
        self.text += piece
        self.call_next(self._write, piece)

    async def _write(self, piece: str) -> None:
        if self._finished:
            return
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        await self._stream.write(piece)

    async def finish(self, text: str) -> None:
        """Stop streaming; show exactly ``text`` (pieces after a stop are not streamed)."""
        self._finished = True
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.text = text
        await self.update(text or "*(no answer)*")

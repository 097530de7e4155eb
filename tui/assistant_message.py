"""An assistant message: Markdown that grows token by token while the model answers.

A reasoning model's thinking (between ``<think>`` and ``</think>``; an answer
that closes the marker without opening it began inside it) goes to a collapsed
"thinking" part above the answer, not into it.
"""

from __future__ import annotations

from textual.widget import Widget
from textual.widgets import Collapsible, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from localkv.chat.formats import ReasoningSplit, split_reasoning

__all__ = ["AssistantMessage"]


class AssistantMessage(Markdown):
    """Streamed pieces are appended in the background; ``finish`` settles the text."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text
        self.pieces = 0  # streamed pieces received (tests check that an answer streamed)
        self._stream: MarkdownStream | None = None
        self._finished = False
        self._split = ReasoningSplit()
        self.thinking: Static | None = None  # inside the collapsed part, once there is one
        self.reasoning = ""

    def append_piece(self, piece: str) -> None:
        """Add one streamed piece (called through ``App.call_from_thread``)."""
        self.pieces += 1
        self.text += piece
        for kind, part in self._split.push(piece):
            if kind == "reasoning":
                self._think(self.reasoning + part)
            else:
                self.call_next(self._write, part)

    def _think(self, reasoning: str) -> None:
        self.reasoning = reasoning
        if self.thinking is None:
            self.thinking = Static(reasoning, classes="thinking-text")
            part = Collapsible(self.thinking, title="thinking", collapsed=True)
            parent = self.parent
            if isinstance(parent, Widget):
                parent.mount(part, before=self)
        else:
            self.thinking.update(reasoning)

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
        reasoning, answer = split_reasoning(
            text, thinking="</think>" in text and "<think>" not in text
        )
        if reasoning:
            self._think(reasoning)
        await self.update(answer or "*(no answer)*")

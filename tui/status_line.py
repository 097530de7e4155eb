"""One line under the conversation: what the last action cost and what the cache did."""

from __future__ import annotations

from textual.content import Content
from textual.widgets import Static

__all__ = ["StatusLine"]


class StatusLine(Static):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.text = ""

    def show(self, text: str, kind: str = "info") -> None:
        """``kind`` is ``info``, ``busy`` or ``error`` (a CSS class)."""
        self.text = text
        self.set_classes(kind)
        self.update(Content(text))

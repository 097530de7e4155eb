"""The conversation: user and assistant messages, documents and notes, newest last."""

from __future__ import annotations

from textual.containers import VerticalScroll
from textual.content import Content
from textual.widgets import Markdown, Static

from localkv.chat.controller import Entry

from .assistant_message import AssistantMessage

__all__ = ["ConversationView"]


class ConversationView(VerticalScroll):
    """Scrolls to the newest message while the user has not scrolled up."""

    def on_mount(self) -> None:
        self.anchor()

    def add_user(self, text: str) -> Static:
        widget = Static(Content(text), classes="message user")
        self.mount(widget)
        return widget

    def add_assistant(self, text: str = "") -> AssistantMessage:
        widget = AssistantMessage(text)
        self.mount(widget)
        return widget

    def add_note(self, text: str, kind: str = "info") -> Static:
        """A line from the app, not the model: ``info``, ``error`` or ``document``."""
        widget = Static(Content(text), classes=f"note {kind}")
        self.mount(widget)
        return widget

    def add_markdown_note(self, markdown: str) -> Markdown:
        widget = Markdown(markdown, classes="note info")
        self.mount(widget)
        return widget

    async def show(self, transcript: tuple[Entry, ...]) -> None:
        """Replace everything with ``transcript``."""
        await self.remove_children()
        for entry in transcript:
            if entry.role == "assistant":
                self.add_assistant(entry.text)
            elif entry.role == "user":
                self.add_user(entry.text)
            elif entry.role == "document":
                self.add_note(f"attached {entry.text}", "document")
            else:
                self.add_note(f"system prompt: {entry.text}", "system")

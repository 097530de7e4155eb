"""Saved conversations: Enter reopens one (its prefix restored from the cache), d deletes.

Each row names the model the conversation was made with (it resumes only with
that model); damaged rows are left out and named below the table.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.content import Content
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from localkv.chat.controller import ChatController
from localkv.chat.formats import ago
from localkv.history.store import ConversationInfo
from localkv.runtime.reports import printable

__all__ = ["HistoryScreen"]


class HistoryScreen(Screen[str | None]):
    """Dismissed with the id of the conversation to open, or None."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "back", "Back"),
        Binding("enter", "open", "Open", priority=True),
        Binding("d,delete", "delete", "Delete"),
    ]

    def __init__(self, controller: ChatController) -> None:
        super().__init__()
        self.controller = controller
        self.conversations: list[ConversationInfo] = []

    def compose(self) -> ComposeResult:
        yield Label("Conversations", classes="heading")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="conversations")
        yield Static(id="history-note")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns("title", "model", "messages", "tokens", "updated")
        self._reload()

    def _reload(self) -> None:
        # a quick indexed SQLite read: no need for a worker
        self.conversations, skipped = self.controller.conversations()
        table = self.query_one(DataTable)
        table.clear()
        for conv in self.conversations:
            table.add_row(
                Text(printable(conv.title)),
                Text(printable(conv.model.file) if conv.model is not None else "—"),
                str(conv.messages),
                f"{conv.tokens:,}",
                ago(conv.updated),
                key=conv.id,
            )
        note = "" if self.conversations else "No saved conversations yet."
        if skipped:
            lines = [*([note] if note else []), *(printable(row.line()) for row in skipped)]
            note = "\n".join(lines)
        if self.controller.history is None:
            note = f"Conversations are not saved: {self.controller.history_error}"
        self.query_one("#history-note", Static).update(Content(note))

    def _selected(self) -> ConversationInfo | None:
        row = self.query_one(DataTable).cursor_row
        return self.conversations[row] if 0 <= row < len(self.conversations) else None

    def action_open(self) -> None:
        conv = self._selected()
        if conv is not None:
            self.dismiss(conv.id)

    def action_back(self) -> None:
        self.dismiss(None)

    def action_delete(self) -> None:
        conv = self._selected()
        if conv is not None:
            self.controller.delete_conversation(conv.id)
            self._reload()

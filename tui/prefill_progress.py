"""A progress bar for prefilling a document or a resumed conversation (Esc cancels)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Label, ProgressBar

__all__ = ["PrefillProgress"]


class PrefillProgress(Horizontal):
    """Hidden until ``begin``; ``advance`` is called through ``App.call_from_thread``."""

    def compose(self) -> ComposeResult:
        yield Label(id="prefill-label")
        yield ProgressBar(show_eta=False, id="prefill-bar")

    def begin(self, label: str) -> None:
        """Show the bar, moving, with no percentage until a total is known (a restore
        from the cache reports none: ``--%`` would read as a fault)."""
        self.query_one("#prefill-label", Label).update(Content(f"{label} (Esc cancels) "))
        self.query_one(ProgressBar).update(total=None, progress=0)
        self._percentage(False)
        self.display = True

    def advance(self, done: int, total: int) -> None:
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
        self._percentage(True)

    def _percentage(self, shown: bool) -> None:
        for status in self.query_one(ProgressBar).query("#percentage"):
            status.display = shown

    def end(self) -> None:
        self.display = False

"""The cache screen: this namespace's snapshots of the running model, with pin, unpin
and delete (``d`` twice: the first asks)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.content import Content
from textual.message import Message
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Label, Static

from localkv.chat.controller import ChatController
from localkv.chat.formats import ago, human_bytes
from localkv.runtime.info import SnapshotInfo
from localkv.runtime.reports import printable

__all__ = ["CacheScreen"]

log = logging.getLogger(__name__)

# frees: what deleting the row frees (blocks no other snapshot needs); size: its whole chain
_COLUMNS = ("label", "tokens", "frees", "size", "hits", "last used", "pinned")


class CacheScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("p", "toggle_pin", "Pin/unpin"),
        Binding("d,delete", "delete", "Delete"),
        Binding("r", "refresh", "Refresh"),
    ]

    @dataclass
    class SnapshotsLoaded(Message):
        snapshots: list[SnapshotInfo]
        note: str | None = None
        others: int = 0  # snapshots of other models, not listed

    @dataclass
    class ActionFailed(Message):
        error: str

    def __init__(self, controller: ChatController) -> None:
        super().__init__()
        self.controller = controller
        self.snapshots: list[SnapshotInfo] = []
        self._armed: str | None = None  # the snapshot the next ``d`` deletes

    def compose(self) -> ComposeResult:
        yield Label("Cache snapshots of this model", classes="heading")
        yield Static(Content(f"cache: {self.controller.cache_status}"), id="cache-status")
        yield DataTable(cursor_type="row", zebra_stripes=True, id="snapshots")
        yield Static(id="cache-note")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(DataTable).add_columns(*_COLUMNS)
        self.action_refresh()

    def action_refresh(self) -> None:
        self._load(self.controller, None)

    @work(thread=True, exclusive=True, exit_on_error=False, group="cache")
    def _load(self, controller: ChatController, note: str | None) -> None:
        try:
            self.post_message(_loaded(self, controller, note))
        except Exception as exc:
            log.warning("listing snapshots failed", exc_info=True)
            self.post_message(self.ActionFailed(str(exc)))

    def on_cache_screen_snapshots_loaded(self, message: SnapshotsLoaded) -> None:
        self.snapshots, self._armed = message.snapshots, None
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        for snap in self.snapshots:
            table.add_row(
                Text(printable(snap.label)),
                f"{snap.tokens:,}",
                human_bytes(snap.frees_bytes),
                human_bytes(snap.bytes_on_disk),
                str(snap.hits),
                ago(snap.last_used),
                "pinned" if snap.pinned else "",
                key=snap.id,
            )
        if self.snapshots:
            table.move_cursor(row=min(row, len(self.snapshots) - 1))
        empty = "No snapshots yet: /attach a document to cache it. " if not self.snapshots else ""
        others = message.others
        hidden = (
            f"{others} snapshot{'s' * (others != 1)} of other models not listed "
            "(`localkv cache ls` lists them). "
            if others
            else ""
        )
        model = self.snapshots[0].model if self.snapshots else ""
        heading = f"Cache snapshots of {printable(model)}" if model else "Cache snapshots"
        self.query_one(".heading", Label).update(Content(heading))
        note = Content(empty + hidden + (message.note or ""))
        self.query_one("#cache-note", Static).update(note)

    def on_cache_screen_action_failed(self, message: ActionFailed) -> None:
        self.query_one("#cache-note", Static).update(Content(message.error))
        self.notify(message.error, severity="error")

    def _selected(self) -> SnapshotInfo | None:
        row = self.query_one(DataTable).cursor_row
        return self.snapshots[row] if 0 <= row < len(self.snapshots) else None

    def action_toggle_pin(self) -> None:
        snap = self._selected()
        if snap is not None:
            self._pin(self.controller, snap, not snap.pinned)

    @work(thread=True, exclusive=True, exit_on_error=False, group="cache")
    def _pin(self, controller: ChatController, snap: SnapshotInfo, pinned: bool) -> None:
        try:
            controller.set_pinned(snap.id, pinned)
            note = f"{'pinned' if pinned else 'unpinned'} {printable(snap.label)}"
            self.post_message(_loaded(self, controller, note))
        except Exception as exc:
            self.post_message(self.ActionFailed(str(exc)))

    def action_delete(self) -> None:
        snap = self._selected()
        if snap is None:
            return
        if self._armed != snap.id:  # the first press asks
            self._armed = snap.id
            ask = f"delete {printable(snap.label)}? press d again to delete it"
            self.query_one("#cache-note", Static).update(Content(ask))
            return
        self._armed = None
        self._delete(self.controller, snap)

    def on_data_table_row_highlighted(self) -> None:
        self._armed = None  # another row: ask again

    @work(thread=True, exclusive=True, exit_on_error=False, group="cache")
    def _delete(self, controller: ChatController, snap: SnapshotInfo) -> None:
        try:
            freed = controller.remove_snapshot(snap.id)
            note = f"deleted {printable(snap.label)}, freed {human_bytes(freed)}"
            self.post_message(_loaded(self, controller, note))
        except Exception as exc:
            self.post_message(self.ActionFailed(str(exc)))


def _loaded(
    screen: CacheScreen, controller: ChatController, note: str | None
) -> CacheScreen.SnapshotsLoaded:
    """The running model's snapshots, and how many of other models are not listed."""
    rows = controller.snapshots()
    return screen.SnapshotsLoaded(rows, note, controller.other_models_snapshots())

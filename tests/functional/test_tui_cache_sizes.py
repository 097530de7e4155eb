"""The chat app's cache screen (F2): each row says what deleting it frees, and it does."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from localkv.tui.app import build_app
from localkv.tui.cache_screen import CacheScreen
from support.tinymodels import TinyModels, tiny_config
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from localkv.chat.formats import human_bytes
from localkv.model.sampling import SamplingParams
from localkv.prompt.request import read_document
from localkv.runtime import Runtime


def test_the_cache_screen_shows_what_deleting_a_row_frees(
    tiny_models: TinyModels, tmp_path: Path, long_text: str
) -> None:
    head, tail = tmp_path / "head.txt", tmp_path / "tail.txt"
    head.write_text(long_text[:4000], encoding="utf-8")
    tail.write_text(long_text[4000:6000], encoding="utf-8")
    config, home = tiny_config(tiny_models.base), tmp_path / "home"
    with Runtime(config, cache_dir=home) as runtime:  # two chains sharing head's blocks
        assert runtime.prefill([read_document(head)]).snapshot
        assert runtime.prefill([read_document(head), read_document(tail)]).snapshot
        stored = runtime.cache.store.usage().stored_bytes if runtime.cache else 0
    runtime = Runtime(config, cache_dir=home)
    app = build_app(runtime, params=SamplingParams(temperature=0, max_tokens=8))
    freed: list[int] = []

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press("f2")
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        await _until(pilot, lambda: len(screen.snapshots) == 2)
        rows = {s.label: s for s in screen.snapshots}
        shorter = rows["head.txt"]
        assert sum(s.bytes_on_disk for s in rows.values()) > stored  # shared blocks twice
        assert 0 < shorter.frees_bytes < shorter.bytes_on_disk
        table = screen.query_one(DataTable)
        cells = [str(c) for c in table.get_row(shorter.id)]
        assert cells[2:4] == [human_bytes(shorter.frees_bytes), human_bytes(shorter.bytes_on_disk)]
        table.move_cursor(row=screen.snapshots.index(shorter))
        await pilot.press("d", "d")
        await _until(pilot, lambda: len(screen.snapshots) == 1)
        note = str(screen.query_one("#cache-note", Static).render())
        assert f"freed {human_bytes(shorter.frees_bytes)}" in note, note
        freed.append(shorter.frees_bytes)

    async def main() -> None:
        async with app.run_test(size=(100, 24)) as pilot:
            await pilot.pause()
            await scenario(pilot)
            await pilot.app.workers.wait_for_complete()
        app.close_controller()

    asyncio.run(main())
    with Runtime(config, cache_dir=home) as after:
        assert after.cache is not None
        assert [stored - after.cache.store.usage().stored_bytes] == freed


async def _until(pilot: Pilot[None], condition: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not callable(condition) or not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s")
        await pilot.pause(0.05)

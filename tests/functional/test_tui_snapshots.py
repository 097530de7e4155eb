"""What the chat app looks like at 80x24: the main screen, the cache screen, an error.

Rendered with pytest-textual-snapshot on the tiny model; nothing on these screens
depends on timing or on the CPU (the cache screen's rows are fixed values, the
data path behind them is tested in test_tui.py). Update with ``--snapshot-update``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from localkv.tui.app import LocalKVApp, build_app
from localkv.tui.conversation_view import ConversationView
from localkv.tui.prompt_input import PromptInput
from support.tinymodels import TinyModels, tiny_config
from textual.pilot import Pilot

from localkv.model.sampling import SamplingParams
from localkv.runtime import Runtime
from localkv.runtime.info import SnapshotInfo

SnapCompare = Callable[..., bool]
PARAMS = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture()
def app(tiny_models: TinyModels, tmp_path: Path) -> Iterator[LocalKVApp]:
    # flash attention named, not "auto": the panel shows the setting, whatever auto means
    config = tiny_config(tiny_models.base, flash_attn="off")
    runtime = Runtime(config, cache_dir=tmp_path / "home")
    chat_app = build_app(runtime, params=PARAMS, system="Answer from the notes.")
    yield chat_app
    chat_app.close_controller()
    runtime.close()


async def _type(pilot: Pilot[None], text: str) -> None:
    await pilot.pause()
    prompt = pilot.app.screen.query_one(PromptInput)
    prompt.cursor_blink = False  # a blinking cursor is a coin toss in a screenshot
    prompt.load_text(text)
    await pilot.pause()


def test_main_screen(app: LocalKVApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        # fixed messages (the tiny model's answers are noise): the pixels of a turn
        view = pilot.app.screen.query_one(ConversationView)
        view.add_note("attached notes.txt · 2,431 tokens", "document")
        view.add_user("What is due on Friday?")
        view.add_assistant("The **report** is due on Friday:\n\n- draft by Wednesday\n- review")
        await _type(pilot, "And after that?")

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_cache_screen(
    app: LocalKVApp, snap_compare: SnapCompare, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = time.time()
    rows = [
        SnapshotInfo(
            id="a1",
            label="notes.txt",
            model="",
            this_model=True,
            tokens=2431,
            frees_bytes=1_228_800,
            bytes_on_disk=3_311_616,
            hits=4,
            last_used=now - 7200,
            pinned=True,
            pinned_until=None,
        ),
        SnapshotInfo(
            id="b2",
            label="handbook.md, faq.md",
            model="",
            this_model=True,
            tokens=12_044,
            frees_bytes=14_300_000,
            bytes_on_disk=16_400_000,
            hits=0,
            last_used=now - 3 * 86400,
            pinned=False,
            pinned_until=None,
        ),
    ]
    assert app.controller is not None
    monkeypatch.setattr(app.controller, "snapshots", lambda: rows)

    async def run_before(pilot: Pilot[None]) -> None:
        await pilot.pause()
        await pilot.press("f2")
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)


def test_an_error_on_screen(app: LocalKVApp, snap_compare: SnapCompare) -> None:
    async def run_before(pilot: Pilot[None]) -> None:
        await _type(pilot, "/attach missing-notes.txt")
        await pilot.press("enter")
        await pilot.app.workers.wait_for_complete()
        await pilot.pause()

    assert snap_compare(app, terminal_size=(80, 24), run_before=run_before)

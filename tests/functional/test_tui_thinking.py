"""A reasoning model's thinking shows as a collapsed part above its answer, not in it."""

from __future__ import annotations

import asyncio

from localkv.tui.assistant_message import AssistantMessage
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Collapsible


class _One(App[None]):
    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield AssistantMessage()


def test_thinking_goes_to_a_collapsed_part_and_the_answer_keeps_the_rest() -> None:
    asyncio.run(_thinking())


def test_an_answer_without_thinking_has_no_thinking_part() -> None:
    asyncio.run(_no_thinking())


async def _thinking() -> None:
    app = _One()
    async with app.run_test() as pilot:
        reply = app.query_one(AssistantMessage)
        text = "<think>\nParis is in France.\n</think>\n\nParis."
        for i in range(0, len(text), 3):
            reply.append_piece(text[i : i + 3])
        await pilot.pause()
        await reply.finish(text)
        await pilot.pause()
        (part,) = app.query(Collapsible)
        assert part.collapsed and part.title == "thinking"
        assert reply.reasoning == "\nParis is in France.\n"
        assert reply.source == "Paris."


async def _no_thinking() -> None:
    app = _One()
    async with app.run_test() as pilot:
        reply = app.query_one(AssistantMessage)
        reply.append_piece("Just 2 < 3.")
        await reply.finish("Just 2 < 3.")
        await pilot.pause()
        assert not app.query(Collapsible) and reply.source == "Just 2 < 3."

"""The chat app on the tiny model, driven through ``run_test`` and checked by its messages.

Each test builds the app with ``build_app`` (the factory ``localkv chat`` uses) on a
real llama.cpp runtime with a temporary cache, types into it, and waits for the
domain messages the chat screen posts (``AnswerFinished``, ``DocumentAttached``, ...).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from localkv.tui.app import LocalKVApp, build_app
from localkv.tui.assistant_message import AssistantMessage
from localkv.tui.cache_screen import CacheScreen
from localkv.tui.chat_screen import ChatScreen
from localkv.tui.context_full_screen import ContextFullScreen
from localkv.tui.context_panel import ContextPanel
from localkv.tui.history_screen import HistoryScreen
from localkv.tui.load_error_screen import LoadErrorScreen
from localkv.tui.path_suggester import PathSuggester
from localkv.tui.prefill_progress import PrefillProgress
from localkv.tui.prompt_input import PromptInput
from localkv.tui.status_line import StatusLine
from support.tinymodels import TinyModels, tiny_config
from textual import events
from textual.message import Message
from textual.pilot import Pilot
from textual.widgets import Label, ProgressBar, Static

from localkv.chat.controller import ChatController
from localkv.chat.formats import turn_line
from localkv.history.store import ConversationStore
from localkv.model.sampling import SamplingParams
from localkv.prompt.request import read_document
from localkv.runtime import Runtime

M = TypeVar("M", bound=Message)
SHORT = SamplingParams(temperature=0, max_tokens=24)
LONG = SamplingParams(temperature=0, max_tokens=1500)
SIZE = (80, 24)


class Seen:
    """Messages seen by the app's message hook (a bubbling message is seen once)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def hook(self, message: Message) -> None:
        if not any(m is message for m in self.messages):
            self.messages.append(message)

    def of(self, kind: type[M]) -> list[M]:
        return [m for m in self.messages if isinstance(m, kind)]


async def wait_for(
    pilot: Pilot[None], condition: Callable[[], object], timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s")
        await pilot.pause(0.05)


async def submit(pilot: Pilot[None], text: str) -> None:
    """Put ``text`` in the message box and press Enter."""
    pilot.app.screen.query_one(PromptInput).load_text(text)
    await pilot.press("enter")


def status(app: LocalKVApp) -> str:
    return app.screen.query_one(StatusLine).text


@pytest.fixture()
def open_runtime(tiny_models: TinyModels, tmp_path: Path) -> Iterator[Callable[..., Runtime]]:
    """Opens runtimes on the tiny model with the test's cache; closes them afterwards."""
    opened: list[Runtime] = []

    def opener(**overrides: object) -> Runtime:
        cache = overrides.pop("cache_dir", tmp_path / "home")
        runtime = Runtime(tiny_config(tiny_models.base, **overrides), cache_dir=cache)  # type: ignore[arg-type]
        opened.append(runtime)
        return runtime

    yield opener
    for runtime in opened:
        runtime.close()


@pytest.fixture()
def history(tmp_path: Path) -> Iterator[ConversationStore]:
    with ConversationStore.open(tmp_path / "home") as store:
        yield store


def run(app: LocalKVApp, seen: Seen, scenario: Callable[[Pilot[None]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with app.run_test(size=SIZE, message_hook=seen.hook) as pilot:
            await pilot.pause()
            await scenario(pilot)
            await pilot.app.workers.wait_for_complete()
        app.close_controller()

    asyncio.run(main())


@pytest.fixture()
def document(tmp_path: Path, long_text: str) -> Path:
    path = tmp_path / "notes.txt"
    path.write_text(long_text[:2500], encoding="utf-8")
    return path


# --------------------------------------------------------------------------- answers
def test_send_streams_an_answer_and_reports_the_turn(
    open_runtime: Callable[..., Runtime], history: ConversationStore
) -> None:
    app = build_app(open_runtime(), params=SHORT, history=history)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await pilot.press(*"Hello there")
        await pilot.press("enter")
        prompt = app.screen.query_one(PromptInput)
        assert prompt.text == ""  # sent, the box is empty and ready
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))
        await pilot.pause(0.1)
        finished = seen.of(ChatScreen.AnswerFinished)[0]
        report = finished.answered.report
        reply = app.screen.query_one(AssistantMessage)
        assert reply is finished.reply
        assert report.generated > 1
        assert reply.pieces > 1  # streamed piece by piece, not all at once
        assert reply.text == report.text
        assert "Hello there" in app.screen.query(".user").first().content.plain
        line = status(app)
        assert line == turn_line(report)
        assert "TTFT" in line and "tok/s" in line
        # a fresh chat's first turn: the cache had only template tokens, no word of it
        assert "cache miss" not in line and "restored" not in line
        panel = app.screen.query_one(ContextPanel)
        assert panel.context_info.used == finished.answered.context.used > 0
        assert prompt.has_focus

    run(app, seen, scenario)
    latest = history.latest()
    assert latest is not None and latest.title == "Hello there" and latest.messages == 2


def test_escape_stops_the_answer_and_keeps_what_was_produced(
    open_runtime: Callable[..., Runtime],
) -> None:
    app = build_app(open_runtime(), params=LONG)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, "Tell me a long story")
        reply = app.screen.query_one(AssistantMessage)
        await wait_for(pilot, lambda: reply.pieces >= 5)
        # the input is not blocked while the model works: keys arrive as from a
        # terminal (pilot.press would wait for the streaming app to go idle)
        for key in "next":
            app.post_message(events.Key(key, key))
        await pilot.pause(0.3)
        assert app.screen.query_one(PromptInput).text == "next"
        assert not seen.of(ChatScreen.AnswerFinished)
        await pilot.press("escape")
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))
        report = seen.of(ChatScreen.AnswerFinished)[0].answered.report
        assert report.stopped
        assert 5 <= report.generated < LONG.max_tokens
        await pilot.pause(0.1)
        assert reply.text == report.text and report.text
        assert "stopped" in status(app)

    run(app, seen, scenario)


# ------------------------------------------------------------------------- documents
def test_attach_prefills_then_the_second_attach_restores_it(
    open_runtime: Callable[..., Runtime], document: Path
) -> None:
    app = build_app(open_runtime(), params=SHORT, system="Answer from the notes.")
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, f"/attach {document}")
        await wait_for(pilot, lambda: seen.of(ChatScreen.DocumentAttached))
        first = seen.of(ChatScreen.DocumentAttached)[0].attached
        assert first.name == "notes.txt" and first.tokens > 300
        assert first.sync.cache is not None and not first.sync.cache.hit
        assert first.sync.prefilled > 300
        panel = app.screen.query_one(ContextPanel)
        assert panel.context_info.documents == (("notes.txt", first.tokens),)
        await wait_for(pilot, lambda: not app.screen.query_one(PrefillProgress).display)
        bar = app.screen.query_one("#prefill-bar", ProgressBar)
        assert bar.total == bar.progress == first.sync.prefilled  # it advanced to the end

        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: seen.of(ChatScreen.ConversationOpened))
        assert panel.context_info.documents == ()
        await submit(pilot, f"/attach {document}")
        await wait_for(pilot, lambda: len(seen.of(ChatScreen.DocumentAttached)) == 2)
        second = seen.of(ChatScreen.DocumentAttached)[1].attached
        cache = second.sync.cache
        assert cache is not None and cache.hit and cache.verified
        assert cache.reused == second.context.used
        assert second.sync.prefilled == 0
        assert "restored" in status(app) and "(verified)" in status(app)

    run(app, seen, scenario)


def test_doc_option_attaches_at_start_and_the_cache_screen_pins_and_deletes(
    open_runtime: Callable[..., Runtime], document: Path
) -> None:
    app = build_app(open_runtime(), params=SHORT, documents=[str(document)])
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: seen.of(ChatScreen.DocumentAttached))
        await pilot.press("f2")
        await wait_for(pilot, lambda: seen.of(CacheScreen.SnapshotsLoaded))
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        assert [(s.label, s.pinned) for s in screen.snapshots] == [("notes.txt", False)]
        assert screen.snapshots[0].tokens > 300 and screen.snapshots[0].bytes_on_disk > 0
        await pilot.press("p")
        await wait_for(pilot, lambda: len(seen.of(CacheScreen.SnapshotsLoaded)) == 2)
        assert screen.snapshots[0].pinned
        await pilot.press("d")  # asks first
        await pilot.pause(0.2)
        assert "press d again" in str(screen.query_one("#cache-note", Static).render())
        assert len(seen.of(CacheScreen.SnapshotsLoaded)) == 2 and screen.snapshots
        await pilot.press("d")
        await wait_for(pilot, lambda: len(seen.of(CacheScreen.SnapshotsLoaded)) == 3)
        assert screen.snapshots == []
        await pilot.press("escape")
        assert isinstance(app.screen, ChatScreen)

    run(app, seen, scenario)


def test_the_cache_screen_lists_the_running_models_snapshots_and_counts_the_others(
    open_runtime: Callable[..., Runtime], document: Path, tiny_models: TinyModels, tmp_path: Path
) -> None:
    with Runtime(tiny_config(tiny_models.other_weights), cache_dir=tmp_path / "home") as other:
        assert other.prefill([read_document(document)]).snapshot
    app = build_app(open_runtime(), params=SHORT, documents=[str(document)])
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: seen.of(ChatScreen.DocumentAttached))
        await pilot.press("f2")
        await wait_for(pilot, lambda: seen.of(CacheScreen.SnapshotsLoaded))
        screen = app.screen
        assert isinstance(screen, CacheScreen)
        assert [(s.label, s.model) for s in screen.snapshots] == [("notes.txt", "tiny-base")]
        assert seen.of(CacheScreen.SnapshotsLoaded)[-1].others == 1
        note = str(screen.query_one("#cache-note", Static).render())
        assert "1 snapshot of other models not listed" in note
        assert "tiny-base" in str(screen.query_one(".heading", Label).render())

    run(app, seen, scenario)


def test_a_cancelled_prefill_leaves_the_conversation_as_it_was(
    open_runtime: Callable[..., Runtime], document: Path
) -> None:
    controller = ChatController(open_runtime(), None, system="Answer from the notes.")
    before = controller.context()
    calls: list[tuple[int, int]] = []
    attached = controller.attach(str(document), lambda *p: calls.append(p), lambda: bool(calls))
    assert attached.sync.cancelled and len(calls) == 1
    assert calls[0][0] < calls[0][1]  # stopped part way
    assert attached.context == before and attached.tokens == 0
    again = controller.attach(str(document), lambda *p: None, lambda: False)
    assert not again.sync.cancelled and again.context.documents == (("notes.txt", again.tokens),)


def test_path_completion_for_attach(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "nested").mkdir()
    suggester = PathSuggester()

    async def main() -> None:
        assert await suggester.get_suggestion(f"/attach {tmp_path}/no") == (
            f"/attach {tmp_path}/notes.txt"
        )
        assert await suggester.get_suggestion(f"/attach {tmp_path}/ne") == (
            f"/attach {tmp_path}/nested/"
        )
        assert await suggester.get_suggestion(f"/attach {tmp_path}/zz") is None
        assert await suggester.get_suggestion("hello /attach") is None

    asyncio.run(main())


def test_tab_keeps_the_focus_in_the_message_box(
    open_runtime: Callable[..., Runtime], tmp_path: Path
) -> None:
    (tmp_path / "notes.txt").write_text("x")
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        prompt = app.screen.query_one(PromptInput)
        assert prompt.has_focus
        prompt.load_text("a message")
        for key in ("tab", "shift+tab", "tab"):
            await pilot.press(key)
            assert prompt.has_focus and prompt.text == "a message"
        prompt.load_text(f"/attach {tmp_path}/no")
        prompt.move_cursor(prompt.document.end)
        prompt.update_suggestion()
        await wait_for(pilot, lambda: prompt.suggestion)
        await pilot.press("tab")  # completes, and stays
        assert prompt.has_focus and prompt.text == f"/attach {tmp_path}/notes.txt"

    run(app, seen, scenario)


# ---------------------------------------------------------------------- conversations
def test_resume_in_a_new_app_restores_the_conversation_verified(
    open_runtime: Callable[..., Runtime], history: ConversationStore
) -> None:
    first = build_app(open_runtime(), params=SHORT, history=history, system="Be brief.")
    seen = Seen()

    async def ask(pilot: Pilot[None]) -> None:
        await submit(pilot, "What is a prefix cache?")
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))

    run(first, seen, ask)
    answer = seen.of(ChatScreen.AnswerFinished)[0].answered.report.text

    second = build_app(open_runtime(), params=SHORT, history=history, resume=True)
    seen_again = Seen()

    async def resume(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: seen_again.of(ChatScreen.ConversationOpened))
        opened = seen_again.of(ChatScreen.ConversationOpened)[0].opened
        assert opened is not None and opened.sync is not None
        cache = opened.sync.cache
        assert cache is not None and cache.hit and cache.verified
        assert cache.reused == opened.context.used
        line = status(second)
        assert line.startswith("resumed “What is a prefix cache?”")
        assert "restored" in line and "(verified)" in line
        await pilot.pause(0.1)
        replies = second.screen.query(AssistantMessage)
        assert [r.text for r in replies] == [answer]
        assert second.screen.query_one(ContextPanel).context_info.system == "Be brief."

    run(second, seen_again, resume)


def test_the_side_panel_names_the_model_by_its_file_stem(
    open_runtime: Callable[..., Runtime], tiny_models: TinyModels
) -> None:
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        shown = app.screen.query_one("#model-info", Static).render()
        name = str(shown).splitlines()[0]
        assert name == tiny_models.base.stem  # as `localkv models` and the server name it

    run(app, seen, scenario)


def test_a_conversation_longer_than_the_context_names_the_ctx_to_resume_it(
    open_runtime: Callable[..., Runtime], history: ConversationStore
) -> None:
    first = build_app(open_runtime(n_ctx=1024), params=SHORT, history=history)
    seen = Seen()
    question = "Tell me everything about the fox and the dog and the long road home. " * 25

    async def ask(pilot: Pilot[None]) -> None:
        await submit(pilot, question.strip())
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))

    run(first, seen, ask)
    second = build_app(open_runtime(n_ctx=256), params=SHORT, history=history, resume=True)
    seen_again = Seen()

    async def resume(pilot: Pilot[None]) -> None:
        await wait_for(pilot, lambda: seen_again.of(ChatScreen.OpenFailed))
        await pilot.pause(0.1)
        assert isinstance(second.screen, ChatScreen)  # no "context is full" question
        notes = [n.content.plain for n in second.screen.query(".note.error")]
        assert len(notes) == 1 and notes[0].endswith("resume with --ctx 1024"), notes
        assert "context of 256 tokens" in notes[0]

    run(second, seen_again, resume)


def test_history_screen_reopens_an_earlier_conversation(
    open_runtime: Callable[..., Runtime], history: ConversationStore
) -> None:
    app = build_app(open_runtime(), params=SHORT, history=history)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, "First question")
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))
        await submit(pilot, "/new")
        await wait_for(pilot, lambda: seen.of(ChatScreen.ConversationOpened))
        assert not app.screen.query(AssistantMessage)
        await pilot.press("f3")
        assert isinstance(app.screen, HistoryScreen)
        assert [c.title for c in app.screen.conversations] == ["First question"]
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(seen.of(ChatScreen.ConversationOpened)) == 2)
        assert isinstance(app.screen, ChatScreen)
        assert status(app).startswith("resumed “First question”")
        await pilot.pause(0.1)
        assert len(app.screen.query(AssistantMessage)) == 1

    run(app, seen, scenario)


def test_commands_help_system_and_unknown(open_runtime: Callable[..., Runtime]) -> None:
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, "/help")
        await pilot.pause()
        assert app.screen.query("Markdown.note")
        await submit(pilot, "/system You are terse.")
        await wait_for(pilot, lambda: seen.of(ChatScreen.ConversationOpened))
        panel = app.screen.query_one(ContextPanel)
        assert panel.context_info.system == "You are terse."
        await submit(pilot, "/frobnicate")
        await pilot.pause()
        notes = [n.content.plain for n in app.screen.query(".note.error")]
        assert any("unknown command /frobnicate" in n for n in notes)

    run(app, seen, scenario)


# ---------------------------------------------------------------------------- errors
def test_a_bad_path_is_an_error_on_screen(open_runtime: Callable[..., Runtime]) -> None:
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, "/attach /no/such/notes.txt")
        await wait_for(pilot, lambda: seen.of(ChatScreen.AttachFailed))
        await pilot.pause()
        failed = seen.of(ChatScreen.AttachFailed)[0]
        assert "no such file" in failed.error and not failed.context_full
        notes = [n.content.plain for n in app.screen.query(".note.error")]
        assert notes == [failed.error]
        assert status(app) == "could not attach notes.txt"  # the error is shown once
        assert app.screen.query_one(StatusLine).has_class("error")
        assert isinstance(app.screen, ChatScreen) and app.is_running

    run(app, seen, scenario)


def test_a_full_context_offers_a_new_conversation(open_runtime: Callable[..., Runtime]) -> None:
    app = build_app(open_runtime(n_ctx=256), params=SHORT)
    seen = Seen()
    question = ("Please summarise " + "the whole long story of the fox and the dog " * 30).strip()

    async def scenario(pilot: Pilot[None]) -> None:
        await submit(pilot, question)
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFailed))
        await pilot.pause()
        failed = seen.of(ChatScreen.AnswerFailed)[0]
        assert failed.context_full and "do not fit in the context of 256" in failed.error
        assert isinstance(app.screen, ContextFullScreen)
        await pilot.press("y")
        await wait_for(pilot, lambda: seen.of(ChatScreen.ConversationOpened))
        assert isinstance(app.screen, ChatScreen)
        assert app.screen.query_one(PromptInput).text == question  # put back to edit
        assert not app.screen.query(AssistantMessage)

    run(app, seen, scenario)


def test_cache_unavailable_the_chat_continues_uncached(
    open_runtime: Callable[..., Runtime], tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    runtime = open_runtime(cache_dir=not_a_dir)
    assert runtime.cache is None and runtime.cache_error
    app = build_app(runtime, params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        notes = [n.content.plain for n in app.screen.query(".note.error")]
        assert any("continues without the cache" in n for n in notes)
        await submit(pilot, "Hello")
        await wait_for(pilot, lambda: seen.of(ChatScreen.AnswerFinished))
        assert "cache miss: cache unavailable" in status(app)

    run(app, seen, scenario)


def test_a_model_that_fails_to_load_is_shown_not_raised() -> None:
    app = build_app(None, load_error="llama.cpp could not load /tmp/x.gguf")
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        screen = app.screen
        assert isinstance(screen, LoadErrorScreen)
        shown = screen.query_one("#load-error").content.plain  # type: ignore[attr-defined]
        assert shown == "llama.cpp could not load /tmp/x.gguf"
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running

    run(app, seen, scenario)


def test_tab_at_once_completes_the_path_before_its_suggestion_came(
    open_runtime: Callable[..., Runtime], document: Path
) -> None:
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        box = app.screen.query_one(PromptInput)
        box.load_text(f"/attach {document.parent}/note")
        box.move_cursor(box.document.end)
        box.suggestion = ""  # as if the suggestion's worker had not answered yet
        await pilot.press("tab")
        assert box.text == f"/attach {document}"

    run(app, seen, scenario)


def test_the_prefill_bar_shows_no_percentage_before_it_has_a_total(
    open_runtime: Callable[..., Runtime],
) -> None:
    app = build_app(open_runtime(), params=SHORT)
    seen = Seen()

    async def scenario(pilot: Pilot[None]) -> None:
        progress = app.screen.query_one(PrefillProgress)
        progress.begin("restoring the conversation")  # a restore reports no total
        await pilot.pause()
        percentage = progress.query_one("#percentage")
        assert not percentage.display
        progress.advance(256, 1024)
        await pilot.pause()
        assert percentage.display and "25%" in str(percentage.render())
        progress.end()

    run(app, seen, scenario)


@pytest.mark.default_model
def test_a_model_without_a_chat_template_is_said_inside_the_app(
    gemma3_path: Path, tmp_path: Path
) -> None:
    with Runtime(tiny_config(gemma3_path, n_ctx=512), cache_dir=tmp_path / "home") as runtime:
        app = build_app(runtime, params=SHORT)
        seen = Seen()

        async def scenario(pilot: Pilot[None]) -> None:
            await pilot.pause()
            notes = [n.content.plain for n in app.screen.query(".note")]
            assert any("no chat template" in n and "'gemma'" in n for n in notes), notes

        run(app, seen, scenario)

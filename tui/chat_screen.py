"""The chat screen: the conversation, the side panel, the status line, the message box.

Everything the model does runs in thread workers that call the ``ChatController``
and report back with the messages below; the widgets only show values.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Static
from textual.worker import get_current_worker

from localkv import ContextFullError, DocumentError, SamplingParams, TextError
from localkv.chat.commands import HELP, Command, message_text, parse_command
from localkv.chat.controller import Answered, Attached, ChatController, ModelMismatch, Opened
from localkv.chat.formats import finish_line, sync_line, turn_line
from localkv.runtime.callbacks import CancelFn, ProgressFn, TextFn
from localkv.runtime.reports import printable

from .assistant_message import AssistantMessage
from .cache_screen import CacheScreen
from .context_full_screen import ContextFullScreen
from .context_panel import ContextPanel
from .conversation_view import ConversationView
from .history_screen import HistoryScreen
from .path_suggester import PathSuggester
from .prefill_progress import PrefillProgress
from .prompt_input import PromptInput
from .status_line import StatusLine

__all__ = ["ChatScreen"]

log = logging.getLogger(__name__)

_MODEL_GROUPS = ("answer", "attach", "open")


def _cancelled() -> CancelFn:
    """The current worker's cancel flag, for the engine's ``cancel`` callables."""
    worker = get_current_worker()
    return lambda: worker.is_cancelled


class ChatScreen(Screen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new", "New"),
        Binding("f1", "help", "Help"),
        Binding("f2", "cache", "Cache"),
        Binding("f3", "history", "History"),
        Binding("f4", "toggle_panel", "Panel"),
    ]

    @dataclass
    class AnswerFinished(Message):
        reply: AssistantMessage
        answered: Answered

    @dataclass(kw_only=True)
    class AnswerFailed(Message):
        reply: AssistantMessage
        question: Static
        prompt: str
        error: str
        context_full: bool

    @dataclass
    class DocumentAttached(Message):
        attached: Attached

    @dataclass
    class AttachFailed(Message):
        path: str
        error: str
        context_full: bool

    @dataclass
    class ConversationOpened(Message):
        opened: Opened | None  # None: there was no saved conversation to resume
        resumed: bool

    @dataclass
    class OpenFailed(Message):
        """The conversation stays as it was; ``error`` says why (the ``--ctx`` it needs)."""

        error: str

    @dataclass
    class PrefillEnded(Message):
        """A worker that showed the prefill bar is done."""

    def __init__(
        self,
        controller: ChatController,
        params: SamplingParams,
        *,
        system: str | None = None,
        documents: Sequence[str] = (),
        resume: bool = False,
    ) -> None:
        super().__init__()
        self.controller = controller
        self.params = params
        self.system = system
        self._pending_documents = list(documents)
        self._resume = resume
        self._prefills = 0
        self._history_error_shown: str | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield ConversationView(id="conversation")
            yield ContextPanel(self.controller.model, self.controller.context(), id="context")
        yield PrefillProgress(id="prefill")
        yield StatusLine(id="status")
        yield PromptInput(suggester=PathSuggester(), id="prompt")
        yield Footer(compact=True)

    @property
    def conversation(self) -> ConversationView:
        return self.query_one(ConversationView)

    @property
    def status(self) -> StatusLine:
        return self.query_one(StatusLine)

    def on_mount(self) -> None:
        self.query_one(PrefillProgress).end()
        self.query_one(PromptInput).focus()
        cache = self.controller.runtime.cache_error
        if cache and cache != "cache disabled":
            self.conversation.add_note(f"{cache}. The chat continues without the cache.", "error")
        self._note_history_error()
        self.status.show("Type a message; Enter sends. /help lists the commands.")
        if self._resume:
            self._begin_prefill("restoring the last conversation")
            self._open(self.controller, None, self._progress())
        else:
            self._attach_pending()

    # ------------------------------------------------------------ the input
    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        command = parse_command(message.text)
        if command is None:
            self._ask(message_text(message.text))
        else:
            self._run_command(command)

    def _run_command(self, command: Command) -> None:
        match command.name:
            case "attach" if command.arg:
                self._attach_paths([command.arg])
            case "attach":
                self.conversation.add_note("usage: /attach PATH", "error")
            case "new":
                self.action_new()
            case "system" if command.arg:
                self.system = command.arg
                self.action_new()
            case "system":
                self.conversation.add_note(f"system prompt: {self.system or '(none)'}")
            case "history":
                self.action_history()
            case "cache":
                self.action_cache()
            case "help":
                self.action_help()
            case "quit":
                self.app.exit()
            case _:
                self.conversation.add_note(
                    f"unknown command /{command.name}; /help lists the commands", "error"
                )

    # -------------------------------------------------------------- answers
    def _ask(self, text: str) -> None:
        question = self.conversation.add_user(text)
        reply = self.conversation.add_assistant()
        self.status.show("answering… (Esc stops)", "busy")
        app = self.app

        def emit(piece: str) -> None:
            app.call_from_thread(reply.append_piece, piece)

        self._answer(self.controller, text, self.params, emit, reply, question=question)

    @work(thread=True, exclusive=True, exit_on_error=False, group="answer")
    def _answer(
        self,
        controller: ChatController,
        text: str,
        params: SamplingParams,
        emit: TextFn,
        reply: AssistantMessage,
        *,
        question: Static,
    ) -> None:
        cancel = _cancelled()

        def on_text(piece: str) -> None:
            if not cancel():  # the final text arrives with AnswerFinished
                emit(piece)

        try:
            answered = controller.send(text, params, on_text, cancel)
        except ContextFullError as exc:
            self.post_message(
                self.AnswerFailed(
                    reply=reply, question=question, prompt=text, error=str(exc), context_full=True
                )
            )
        except Exception as exc:
            log.warning("answering failed", exc_info=True)
            self.post_message(
                self.AnswerFailed(
                    reply=reply, question=question, prompt=text, error=str(exc), context_full=False
                )
            )
        else:
            self.post_message(self.AnswerFinished(reply, answered))

    async def on_chat_screen_answer_finished(self, message: AnswerFinished) -> None:
        report = message.answered.report
        if message.reply.is_attached:
            await message.reply.finish(report.text)
        self.status.show(turn_line(report))
        if report.finish_reason == "context":  # kept in the conversation, not only the status
            reason = finish_line(report.finish_reason, report.n_ctx) or ""
            self.conversation.add_note(reason, "error")
        self.query_one(ContextPanel).show_context(message.answered.context)
        self._note_history_error()

    def _note_history_error(self) -> None:
        for notice in self.controller.notices():
            self.conversation.add_note(notice, "error")
        error = self.controller.history_error
        if error and error != self._history_error_shown:
            self._history_error_shown = error
            self.conversation.add_note(f"conversations are not saved: {error}", "error")

    async def on_chat_screen_answer_failed(self, message: AnswerFailed) -> None:
        await message.reply.remove()
        await message.question.remove()
        self.conversation.add_note(message.error, "error")
        self._note_history_error()
        self.status.show(message.error, "error")
        prompt = self.query_one(PromptInput)
        if not prompt.text:
            prompt.load_text(message.prompt)
        if message.context_full:
            self.app.push_screen(ContextFullScreen(message.error), self._after_context_full)

    def _after_context_full(self, start_new: bool | None) -> None:
        if start_new:
            self.action_new()

    # ------------------------------------------------------------ documents
    def _attach_pending(self) -> None:
        paths, self._pending_documents = self._pending_documents, []
        if paths:
            self._attach_paths(paths)

    def _attach_paths(self, paths: list[str]) -> None:
        self._begin_prefill(f"prefilling {', '.join(paths)}")
        self._attach_documents(self.controller, paths, self._progress())

    @work(thread=True, exit_on_error=False, group="attach")
    def _attach_documents(
        self, controller: ChatController, paths: list[str], progress: ProgressFn
    ) -> None:
        cancel = _cancelled()
        for path in paths:
            try:
                attached = controller.attach(path, progress, cancel)
            except (DocumentError, ContextFullError) as exc:
                full = isinstance(exc, ContextFullError)
                self.post_message(self.AttachFailed(path, str(exc), full))
            except Exception as exc:
                log.warning("attaching %s failed", path, exc_info=True)
                self.post_message(self.AttachFailed(path, str(exc), False))
            else:
                self.post_message(self.DocumentAttached(attached))
        self.post_message(self.PrefillEnded())

    def on_chat_screen_document_attached(self, message: DocumentAttached) -> None:
        attached = message.attached
        line, name = sync_line(attached.sync), printable(attached.name)
        if attached.sync.cancelled:
            self.conversation.add_note(f"not attached: {name} ({line})", "error")
        else:
            self.conversation.add_note(f"attached {name} · {attached.tokens:,} tokens", "document")
            if attached.reuse:
                self.conversation.add_note(attached.reuse)
        self.status.show(f"{name}: {line}")
        self.query_one(ContextPanel).show_context(attached.context)
        self._note_history_error()

    def on_chat_screen_attach_failed(self, message: AttachFailed) -> None:
        self.conversation.add_note(message.error, "error")  # the status line names it only
        name = printable(message.path.rstrip("/").rsplit("/", 1)[-1])
        self.status.show(f"could not attach {name}", "error")
        if message.context_full:
            self.app.push_screen(ContextFullScreen(message.error), self._after_context_full)

    # --------------------------------------------------------- conversations
    @work(thread=True, exclusive=True, exit_on_error=False, group="open")
    def _open(
        self, controller: ChatController, conversation_id: str | None, progress: ProgressFn
    ) -> None:
        try:
            opened = controller.open(conversation_id, progress, _cancelled())
        except (ContextFullError, ModelMismatch) as exc:
            self.post_message(self.OpenFailed(str(exc)))
        except Exception as exc:
            log.warning("opening a conversation failed", exc_info=True)
            self.post_message(self.OpenFailed(str(exc)))
        else:
            self.post_message(self.ConversationOpened(opened, True))
        self.post_message(self.PrefillEnded())

    @work(thread=True, exclusive=True, exit_on_error=False, group="open")
    def _new(self, controller: ChatController, system: str | None) -> None:
        try:
            opened = controller.new(system)
        except TextError as exc:  # a system prompt with a NUL: the conversation stays
            self.app.call_from_thread(self.conversation.add_note, f"not changed: {exc}", "error")
            return
        self.post_message(self.ConversationOpened(opened, False))

    async def on_chat_screen_conversation_opened(self, message: ConversationOpened) -> None:
        opened = message.opened
        if opened is None:
            self.status.show("no saved conversation yet: this is a new one")
        else:
            await self.conversation.show(opened.transcript)
            self.query_one(ContextPanel).show_context(opened.context)
            if opened.sync is None:
                self.status.show("new conversation")
            else:
                made = f" · made with {opened.model}" if opened.model else ""
                title = printable(opened.title)
                self.status.show(f"resumed “{title}” · {sync_line(opened.sync)}{made}")
        self._note_history_error()
        self._attach_pending()

    def on_chat_screen_open_failed(self, message: OpenFailed) -> None:
        """Said once, in the conversation; the current conversation goes on (nothing is full)."""
        self._note_history_error()
        self.conversation.add_note(f"could not reopen the conversation: {message.error}", "error")
        self.status.show("could not reopen the conversation", "error")
        self._attach_pending()

    # ------------------------------------------------------------- prefills
    def _begin_prefill(self, label: str) -> None:
        self._prefills += 1
        self.query_one(PrefillProgress).begin(label)

    def _progress(self) -> ProgressFn:
        bar = self.query_one(PrefillProgress)
        app = self.app
        return lambda done, total: app.call_from_thread(bar.advance, done, total)

    def on_chat_screen_prefill_ended(self, message: PrefillEnded) -> None:
        self._prefills = max(0, self._prefills - 1)
        if not self._prefills:
            self.query_one(PrefillProgress).end()

    # --------------------------------------------------------------- actions
    def action_stop(self) -> None:
        stopped = [w for group in _MODEL_GROUPS for w in self.workers.cancel_group(self, group)]
        if stopped:
            self.status.show("stopping…", "busy")

    def action_new(self) -> None:
        for group in ("answer", "attach"):
            self.workers.cancel_group(self, group)
        self._new(self.controller, self.system)

    def action_help(self) -> None:
        self.conversation.add_markdown_note(HELP)

    def action_cache(self) -> None:
        self.app.push_screen(CacheScreen(self.controller))

    def action_history(self) -> None:
        self.app.push_screen(HistoryScreen(self.controller), self._after_history)

    def _after_history(self, conversation_id: str | None) -> None:
        if conversation_id is not None:
            for group in ("answer", "attach"):
                self.workers.cancel_group(self, group)
            self._begin_prefill("restoring the conversation")
            self._open(self.controller, conversation_id, self._progress())

    def action_toggle_panel(self) -> None:
        panel = self.query_one(ContextPanel)
        panel.display = not panel.display

"""What the chat app asks of the engine: one conversation, saved after every change.

The history is written through ``localkv.chat.saving``: the user's message
before its answer, the answer after it, forks when another chat wrote the
same conversation. What happened there reaches the faces as ``notices()``.

The methods that touch the model are called from worker threads and take one
lock, so a new request waits for the previous one (a cancel makes that short).
They return values (frozen dataclasses); the app never reads engine state itself.
No Textual here.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

from localkv.chat.saving import HistoryKeeper, ModelMismatch, check_model, model_of
from localkv.history.store import ConversationInfo, ConversationStore, Skipped, title_of
from localkv.model.sampling import SamplingParams
from localkv.model.session import ContextFullError
from localkv.prompt.renderbudget import TemplateRenderError
from localkv.prompt.request import Document, byte_limit, check_text, read_document
from localkv.runtime import Runtime
from localkv.runtime.callbacks import CancelFn, ProgressFn, TextFn
from localkv.runtime.chatsession import ChatSession, ChatState, SyncReport, TurnReport, is_trivial
from localkv.runtime.info import SnapshotInfo

__all__ = [
    "Answered",
    "Attached",
    "ChatController",
    "ContextInfo",
    "Entry",
    "ModelMismatch",
    "NoHistory",
    "Opened",
    "TooLongToResume",
    "check_resume",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextInfo:
    """What the context panel shows about the conversation."""

    system: str | None
    documents: tuple[tuple[str, int], ...]
    used: int
    total: int
    title: str
    cache: str  # "on · namespace default", or why it is off


@dataclass(frozen=True, slots=True)
class Entry:
    """One item of a transcript: role is system, user, assistant or document."""

    role: str
    text: str


@dataclass(frozen=True, slots=True)
class Answered:
    report: TurnReport
    context: ContextInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Attached:
    name: str
    tokens: int
    sync: SyncReport
    context: ContextInfo
    # why the document's cached state serves only this conversation (attached after
    # its turns), or None when it was attached first and is reusable everywhere
    reuse: str | None = None


def conversation_label(state: ChatState) -> str | None:
    """A conversation's snapshot label, its title, once it has a turn (None before:
    its documents alone are the snapshot ``Runtime.prefill`` named after them)."""
    if not any(m.role == "assistant" for m in state.messages):
        return None
    return title_of(state)


def mid_conversation_note(before: int) -> str:
    """Why a document attached after a conversation's turns is reused by it alone."""
    return (
        f"attached mid-conversation, the document is cached after this conversation's "
        f"{before:,} tokens, so only this conversation reuses it; attached first in a "
        "fresh chat (/new) it is reusable everywhere"
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Opened:
    title: str
    transcript: tuple[Entry, ...]
    sync: SyncReport | None  # None: nothing to restore (a fresh conversation)
    context: ContextInfo
    model: str | None = None  # the model file it was made with, when it was recorded


class NoHistory(RuntimeError):
    """Conversations are not saved (the store could not be opened)."""


_CTX_STEP = 1024  # a suggested --ctx is a multiple of this


class TooLongToResume(ContextFullError):
    """A saved conversation longer than this context; ``ctx``: the ``--ctx`` that holds it
    (the one it was made in, when the history recorded it)."""

    def __init__(self, info: ConversationInfo, needed: int, n_ctx: int) -> None:
        made_in = info.n_ctx if info.n_ctx is not None and info.n_ctx >= needed else None
        self.ctx = made_in or (needed // _CTX_STEP + 1) * _CTX_STEP
        ValueError.__init__(
            self,
            f"“{info.title}” holds {needed:,} tokens, more than the context of {n_ctx:,} "
            f"tokens: resume with --ctx {self.ctx}",
        )
        self.needed, self.n_ctx = needed, n_ctx


def _resumed(runtime: Runtime, history: ConversationStore, info: ConversationInfo) -> ChatSession:
    """The saved conversation as a session on ``runtime``, its KV untouched: its unanswered
    message kept with an empty answer. Raises ``ModelMismatch`` and ``TooLongToResume``."""
    check_model(info, model_of(runtime))
    chat = ChatSession(runtime, history.load(info.id), snapshot_label=conversation_label)
    if info.pending is not None:
        chat.add_unanswered(info.pending)
    if chat.n_tokens > chat.n_ctx:
        raise TooLongToResume(info, chat.n_tokens, chat.n_ctx)
    return chat


def check_resume(runtime: Runtime, history: ConversationStore) -> None:
    """Raise what resuming the latest conversation on ``runtime`` would, before anything
    opens: ``ModelMismatch``, ``TooLongToResume`` (and ``MalformedConversation``)."""
    found, _ = history.scan()
    if found:
        _resumed(runtime, history, found[0])


class ChatController:
    """One conversation on a runtime, with its saved history."""

    def __init__(
        self,
        runtime: Runtime,
        history: ConversationStore | None,
        *,
        system: str | None = None,
        history_error: str | None = None,
    ) -> None:
        self.runtime = runtime
        self.history = history
        self.keeper = HistoryKeeper(
            history, model_of(runtime), history_error, n_ctx=runtime.session.n_ctx
        )
        self.model = runtime.model_info()
        self.chat = ChatSession(
            runtime, ChatState(system=system), snapshot_label=conversation_label
        )
        self._documents: list[Document] = []  # this conversation's, while it has no turns
        self._lock = threading.Lock()

    def close(self) -> None:
        """Wait for the request in progress to end (the app cancels it on exit).

        The runtime and the history belong to whoever opened them.
        """
        with self._lock:
            pass

    # ------------------------------------------------------------ information
    @property
    def history_error(self) -> str | None:
        """Why conversations are not being saved right now, or None."""
        return self.keeper.error

    @property
    def conversation_id(self) -> str | None:
        return self.keeper.id

    def notices(self) -> list[str]:
        """What happened to the saved history since the last call, for the faces to show."""
        return self.keeper.notices()

    def template_notice(self) -> str | None:
        """What the log said of a model without a usable chat template (None: it has one)."""
        choice = self.runtime.template.choice
        if choice.source != "architecture":
            return None
        return (
            f"the model has no chat template it can use: the {choice.name!r} format is used "
            "(override with --chat-template)"
        )

    @property
    def cache_status(self) -> str:
        if self.runtime.cache is not None:
            return f"on · namespace {self.runtime.namespace}"
        return self.runtime.cache_error or "off"

    def context(self) -> ContextInfo:
        """Call with the lock held, or before any worker runs."""
        state = self.chat.state
        return ContextInfo(
            system=state.system,
            documents=tuple(state.documents),
            used=len(state.tokens),
            total=self.chat.n_ctx,
            title=title_of(state),
            cache=self.cache_status,
        )

    def transcript(self) -> tuple[Entry, ...]:
        """The conversation as the screen shows it (documents by name, not text)."""
        state = self.chat.state
        docs = iter(state.documents)
        entries: list[Entry] = []
        for i, message in enumerate(state.messages):
            answered = i + 1 < len(state.messages) and state.messages[i + 1].role == "assistant"
            if message.role == "user" and not answered:
                name, tokens = next(docs, ("document", 0))
                entries.append(Entry("document", f"{name} · {tokens:,} tokens"))
            else:
                entries.append(Entry(message.role, message.content))
        return tuple(entries)

    # ------------------------------------------------------------ the model
    def send(
        self, text: str, params: SamplingParams, on_text: TextFn, cancel: CancelFn
    ) -> Answered:
        """Answer ``text`` (streaming to ``on_text``); raises ``ContextFullError``,
        ``TextError`` for text no prompt can hold (a NUL, bytes that were not UTF-8), and
        ``TemplateRenderError`` where the chat template fails on the conversation."""
        check_text(text, "the message")
        with self._lock:
            self.keeper.question(self.chat.state, text)  # kept even if this process dies
            try:
                report = self.chat.send(text, params, on_text, cancel)
            except (ContextFullError, TemplateRenderError):
                self.keeper.answered(self.chat.state)  # refused: nothing is pending
                raise
            self.keeper.answered(self.chat.state)
            return Answered(report, self.context())

    def attach(
        self, path: str, progress: ProgressFn | None = None, cancel: CancelFn | None = None
    ) -> Attached:
        """Read and prefill a document (restored when cached); raises ``DocumentError``."""
        limit = byte_limit(self.runtime.session.n_ctx)
        return self.attach_document(read_document(path, max_bytes=limit), progress, cancel)

    def attach_document(
        self,
        document: Document,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> Attached:
        """Prefill a document read already (restored when cached), named by its file name.

        Raises ``ContextFullError`` when it does not fit; a cancelled prefill leaves
        the conversation as it was.
        """
        document = dataclasses.replace(document, name=Path(document.name).name or document.name)
        with self._lock:
            self.runtime.wait_for_saves()  # a prefix saved a moment ago can be restored
            state = self.chat.state
            before = len(state.tokens)
            if self._documents_only():
                # [system][documents] is what `localkv prefill` caches: saved as a
                # named snapshot (listed on the cache screen), then joined in.
                done = self.runtime.prefill(
                    [*self._documents, document],
                    system=state.system,
                    progress=progress,
                    cancel=cancel,
                )
                cache_on = self.runtime.cache is not None
                trivial = cache_on and is_trivial(done.cache, self.chat.block_size)
                sync = SyncReport(
                    cache=done.cache,
                    prefilled=done.prefilled,
                    prefill_s=done.seconds,
                    cancelled=done.cancelled,
                    trivial=trivial,
                )
                if not done.cancelled:
                    self.chat.attach(document)  # the sequence already holds it
                reuse = None
            else:
                sync = self.chat.attach(document, progress, cancel)
                reuse = mid_conversation_note(before)
            if not sync.cancelled:
                self._documents.append(document)
                self.keeper.answered(self.chat.state)
            tokens = len(state.tokens) - before
            return Attached(
                name=document.name, tokens=tokens, sync=sync, context=self.context(), reuse=reuse
            )

    def _documents_only(self) -> bool:
        state = self.chat.state
        plain = [m for m in state.messages if m.role != "system"]
        return len(plain) == len(state.documents) == len(self._documents)

    def new(self, system: str | None) -> Opened:
        """Start a fresh conversation (the current one stays saved); ``TextError`` as ``send``."""
        if system is not None:
            check_text(system, "the system prompt")
        with self._lock:
            self.chat.reset(system)
            self.keeper.started(None)
            self._documents = []
            return Opened(
                title=title_of(self.chat.state),
                transcript=self.transcript(),
                sync=None,
                context=self.context(),
            )

    def open(
        self,
        conversation_id: str | None,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> Opened | None:
        """Reopen a saved conversation (None: the latest) and restore its prefix.

        Returns None when there is no saved conversation; raises ``TooLongToResume``
        when it does not fit this context (the current conversation stays),
        ``ModelMismatch``, and ``NoHistory`` without a history store.
        """
        if self.history is None:
            raise NoHistory(self.history_error or "conversations are not saved")
        with self._lock:
            if conversation_id is None:
                found, skipped = self.history.scan()
                for row in skipped:
                    self.keeper.note(row.line())
                info = found[0] if found else None
            else:
                info = self.history.info(conversation_id)
            if info is None:
                return None
            chat = _resumed(self.runtime, self.history, info)
            self.runtime.wait_for_saves()
            if info.pending is not None:
                self.keeper.note(
                    f"the last message, “{title_of(ChatState(), info.pending)}”, was never "
                    "answered (the chat was stopped): it is kept, with an empty answer"
                )
            sync = chat.sync(progress, cancel)  # checks that it fits before touching the KV
            self.chat, self._documents = chat, []
            self.keeper.started(info)
            model = info.model.describe() if info.model is not None else None
            return Opened(
                title=info.title,
                transcript=self.transcript(),
                sync=sync,
                context=self.context(),
                model=model,
            )

    # ----------------------------------------------------------------- cache
    def snapshots(self) -> list[SnapshotInfo]:
        """The namespace's snapshots of the running model (the only ones a chat can
        restore), the conversations' among them, once saves are done."""
        self.runtime.wait_for_saves()
        return [snap for snap in self.runtime.snapshots() if snap.this_model]

    def other_models_snapshots(self) -> int:
        """How many of the namespace's snapshots are of other models (``cache ls`` lists them)."""
        return sum(1 for snap in self.runtime.snapshots() if not snap.this_model)

    def set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        self.runtime.set_pinned(snapshot_id, pinned)

    def remove_snapshot(self, snapshot_id: str) -> int:
        with self._lock:  # it waits for pending saves, which turns also start
            return self.runtime.remove_snapshot(snapshot_id)

    # --------------------------------------------------------------- history
    def conversations(self) -> tuple[list[ConversationInfo], list[Skipped]]:
        """The saved conversations that read back, and the damaged ones left out."""
        return ([], []) if self.history is None else self.history.scan()

    def delete_conversation(self, conversation_id: str) -> None:
        if self.history is None:
            raise NoHistory(self.history_error or "conversations are not saved")
        if conversation_id == self.conversation_id:
            self.keeper.started(None)  # the next turn saves it as a new one
        self.history.delete(conversation_id)

"""A cached chat on a runtime: turns, attached documents, resume from the cache.

The conversation is kept as messages *and* as the exact token ids in the KV
sequence (generated tokens as sampled, never re-tokenized), with the token
counts where segments end and the spans of generated tokens. Those define the
conversation's canonical batch schedule (``localkv.model.schedule``): prompt
segments are batched by the block grid, each generated token is a batch of
its own, as it was when it was sampled. The live sequence, a resumed one and
an uncached recomputation are therefore the same bits. After every turn the
new blocks are saved in the background; reopening the conversation later
restores its prefix from the cache (verified) instead of recomputing it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localkv.model.sampling import SamplingParams
from localkv.model.schedule import shared_end
from localkv.model.session import (
    CancelFn,
    ContextFullError,
    FinishReason,
    PrefillCancelled,
    ProgressFn,
)
from localkv.prompt.conversation import Streamed, stream_answer
from localkv.prompt.renderbudget import TemplateRenderError
from localkv.prompt.request import Document
from localkv.prompt.template import Message
from localkv.runtime.callbacks import TextFn
from localkv.runtime.chatsnapshot import ConversationSnapshot
from localkv.runtime.reports import CacheReport
from localkv.runtime.runtime import Runtime

__all__ = ["ChatSession", "ChatState", "SyncReport", "TurnReport"]

LabelFn = Callable[["ChatState"], str | None]


@dataclass(kw_only=True)
class ChatState:
    """Everything needed to resume a conversation exactly."""

    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    documents: list[tuple[str, int]] = field(default_factory=list)  # (name, tokens)
    # (start, end) of each answer's tokens as sampled: each was decoded alone
    generated: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncReport:
    """Bringing the KV sequence in line with the conversation: restore, then prefill."""

    cache: CacheReport | None  # None when the sequence already held the prefix
    prefilled: int
    prefill_s: float
    cancelled: bool = False
    # the cache had nothing worth a word: less than a block (the template's first
    # tokens) restored or in common; the faces say neither a hit nor a miss
    trivial: bool = False
    # tokens the sequence held before the prefill: kept from the live context or restored
    reused: int = 0


def is_trivial(cache: CacheReport | None, block_size: int) -> bool:
    """A lookup that restored, and shared, less than one block: only template tokens."""
    return cache is not None and cache.reused < block_size and cache.common < block_size


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnReport:
    """One answer and what it cost (``localkv.chat.formats.turn_line`` shows it)."""

    text: str
    generated: int
    sync: SyncReport
    ttft_s: float
    tokens_per_s: float
    stopped: bool  # cancelled before the end of the answer
    finish_reason: FinishReason = "stop"  # see ``Streamed.finish_reason``
    n_ctx: int = 0  # the context's size, for "the context is full (4,096 tokens)"


class ChatSession:
    """One conversation on a ``Runtime``. Not thread-safe: one call at a time."""

    def __init__(
        self,
        runtime: Runtime,
        state: ChatState | None = None,
        *,
        snapshot_label: LabelFn | None = None,
    ) -> None:
        """``snapshot_label``: name each saved prefix as a snapshot with the label it
        gives (None: not named; ``localkv.runtime.chatsnapshot``; the chat controller
        labels a conversation with its title once it has a turn)."""
        self.runtime = runtime
        self.state = state or ChatState()
        self.snapshot_label = snapshot_label
        self.snapshot = ConversationSnapshot(runtime, resumed=bool(self.state.tokens))
        if not self.state.tokens:
            self.reset(self.state.system)

    # ------------------------------------------------------------- structure
    @property
    def n_ctx(self) -> int:
        return self.runtime.session.n_ctx

    @property
    def block_size(self) -> int:
        return self.runtime.session.config.block_size

    @property
    def n_tokens(self) -> int:
        return len(self.state.tokens)

    def reset(self, system: str | None) -> None:
        """Start over (optionally with a new system prompt)."""
        template = self.runtime.template
        self.state = ChatState(system=system)
        self.snapshot = ConversationSnapshot(self.runtime)  # the last one's saves keep theirs
        self.state.tokens = template.start_tokens()
        if system:
            self._add(Message("system", system))
        self.runtime.session.reset()

    def _add(self, message: Message) -> int:
        new, inner = self.runtime.template.message_parts(self.state.messages, message)
        self.state.messages.append(message)
        start = len(self.state.tokens)
        self.state.boundaries.extend(start + end for end in inner)
        self.state.tokens.extend(new)
        self.state.boundaries.append(len(self.state.tokens))
        return len(new)

    def _drop_last(self, n_messages: int, n_tokens: int) -> None:
        del self.state.messages[n_messages:]
        del self.state.tokens[n_tokens:]
        self.state.boundaries = [b for b in self.state.boundaries if b <= n_tokens]
        self.state.generated = [
            (a, min(b, n_tokens)) for a, b in self.state.generated if a < n_tokens
        ]
        if self.runtime.session.n_tokens > n_tokens:
            self.runtime.session.truncate(n_tokens)

    # ------------------------------------------------------------------ sync
    def schedule(self) -> list[int]:
        """The conversation's canonical batch ends (see the module docstring)."""
        return self.runtime.session.schedule(
            len(self.state.tokens), self.state.boundaries, self.state.generated
        )

    def _live_is_exact(self, ends: list[int]) -> bool:
        """The live sequence holds a prefix of the conversation, computed in its batches."""
        session = self.runtime.session
        n = session.n_tokens
        if n == 0 or session.tokens != self.state.tokens[:n]:
            return False
        return shared_end(session.batch_ends, ends, n) == n

    def sync(
        self,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
        *,
        quiet: bool = False,
    ) -> SyncReport:
        """Make the KV sequence hold the conversation's tokens (restore, then prefill).

        ``quiet`` (a turn, an attach): a lookup that found less than a block is
        ``trivial`` (see ``is_trivial``) while the cache is on; a resume reports
        what it restored, however short.
        """
        session = self.runtime.session
        tokens = self.state.tokens
        if len(tokens) > session.n_ctx:
            raise ContextFullError(len(tokens), session.n_ctx)
        ends = self.schedule()
        report: CacheReport | None = None
        if not self._live_is_exact(ends):
            _, report = self.runtime.restore(tokens, ends)
        start = session.n_tokens
        t0 = time.perf_counter()
        cancelled = False
        if start < len(tokens):
            try:
                session.prefill(tokens[start:], ends=ends, progress=progress, cancel=cancel)
            except PrefillCancelled:
                cancelled = True
        elapsed = time.perf_counter() - t0
        self.runtime.note_prefill(elapsed, session.n_tokens - start)  # one rate for every writer
        cached = self.runtime.cache is not None
        return SyncReport(
            cache=report,
            prefilled=session.n_tokens - start,
            prefill_s=elapsed,
            cancelled=cancelled,
            trivial=quiet and cached and is_trivial(report, self.block_size),
            reused=start,
        )

    def save(self) -> None:
        """Save the conversation's prefix in the background (and name it, see ``__init__``)."""
        title = self.snapshot_label(self.state) if self.snapshot_label else None
        if title is None:
            self.runtime.save_prefix(self.state.boundaries)
            return
        n_tokens = self.state.boundaries[-1]
        snapshot = self.snapshot  # this conversation's, even once ``reset`` has run
        self.runtime.save_prefix(
            self.state.boundaries, lambda saved: snapshot.name(saved, title, n_tokens)
        )

    # -------------------------------------------------------------- documents
    def attach(
        self,
        document: Document,
        progress: ProgressFn | None = None,
        cancel: CancelFn | None = None,
    ) -> SyncReport:
        """Add a document to the conversation and prefill it (restored if cached)."""
        n_messages, n_tokens = len(self.state.messages), len(self.state.tokens)
        added = self._add(Message("user", document.text))
        if len(self.state.tokens) >= self.n_ctx:
            self._drop_last(n_messages, n_tokens)
            raise ContextFullError(n_tokens + added, self.n_ctx)
        report = self.sync(progress, cancel, quiet=True)
        if report.cancelled:
            self._drop_last(n_messages, n_tokens)
            return report
        self.state.documents.append((document.name, added))
        self.save()
        return report

    # ------------------------------------------------------------------ turns
    def send(
        self,
        text: str,
        params: SamplingParams,
        on_text: TextFn | None = None,
        cancel: CancelFn | None = None,
    ) -> TurnReport:
        """Add the user's message, answer it (streaming), keep both in the conversation.

        If ``cancel()`` turns true the answer stops and what was produced is kept.
        A full context raises ``ContextFullError`` and leaves the conversation as it was;
        so does a chat template that fails on it (``TemplateRenderError``).
        """
        template = self.runtime.template
        n_messages, n_tokens = len(self.state.messages), len(self.state.tokens)
        self._add(Message("user", text))
        try:
            opener = template.assistant_start_tokens(self.state.messages)
        except TemplateRenderError:  # the template fails on this conversation
            self._drop_last(n_messages, n_tokens)
            raise
        self.state.tokens.extend(opener)
        self.state.boundaries[-1] = len(self.state.tokens)
        if len(self.state.tokens) + 1 > self.n_ctx:
            needed = len(self.state.tokens) + 1
            self._drop_last(n_messages, n_tokens)
            raise ContextFullError(needed, self.n_ctx)
        t0 = time.perf_counter()
        with self.runtime.work.held():  # the restore's bookkeeping waits for the answer
            sync = self.sync(quiet=True)
            answer = stream_answer(self.runtime.session, params, t0, on_text, cancel)
        stopped = cancel is not None and cancel()
        try:
            self._close_turn(answer)
        except TemplateRenderError:  # the template fails on the answered conversation
            self._drop_last(n_messages, n_tokens)
            raise
        return TurnReport(
            text=answer.text,
            generated=len(answer.ids),
            sync=sync,
            ttft_s=answer.ttft_s,
            tokens_per_s=answer.tokens_per_s,
            stopped=stopped,
            finish_reason=answer.finish_reason,
            n_ctx=self.n_ctx,
        )

    def add_unanswered(self, text: str) -> None:
        """Add a user message whose answer never came (the chat was killed), answered empty.

        Only the conversation changes; ``sync`` brings the KV sequence in line.
        """
        template = self.runtime.template
        self._add(Message("user", text))
        self.state.tokens.extend(template.assistant_start_tokens(self.state.messages))
        self.state.boundaries[-1] = len(self.state.tokens)
        history = list(self.state.messages)
        self.state.messages.append(Message("assistant", ""))
        self.state.tokens.extend(template.assistant_end_tokens(history, ""))
        self.state.boundaries.append(len(self.state.tokens))  # as a turn that got no token

    def _close_turn(self, stream: Streamed) -> None:
        history = list(self.state.messages)
        session = self.runtime.session
        start = len(self.state.tokens)
        if session.n_tokens > start:  # the answer's tokens each decoded alone, as sampled
            self.state.generated.append((start, session.n_tokens))
        self.state.tokens.extend(stream.ids)
        self.state.messages.append(Message("assistant", stream.text))
        closing = self.runtime.template.assistant_end_tokens(history, stream.text)
        self.state.tokens.extend(closing)
        room = self.n_ctx - len(self.state.tokens)
        if room < 0:  # the closing tokens do not fit: keep the answer, drop the excess
            del self.state.tokens[self.n_ctx :]
        self.state.boundaries.append(len(self.state.tokens))
        pending = self.state.tokens[session.n_tokens :]
        if pending:
            session.prefill(pending, ends=self.schedule())
        self.save()

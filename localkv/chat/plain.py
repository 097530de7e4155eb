"""Line-mode chat for terminals, ssh sessions and pipes (``localkv chat --plain``).

The other face of the chat app: the same ``ChatController`` (attach, resume,
save after every change), the same slash commands (``localkv.chat.commands``)
and the same cache reports (``localkv.chat.formats``); only the drawing differs.
Answers and what a command lists go to ``stdout``; notes in brackets (the
status line with TTFT, tokens/s and what the cache did, errors) go to ``stderr``.

Ctrl-C during an answer stops it and keeps what was produced; SIGTERM and
SIGHUP do the same, then end the chat (exit 143 and 129) once the turn is
saved; while waiting for input they end it at once (everything is saved).
"""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import sys
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import TextIO

from localkv.chat.commands import PLAIN_HELP, PLAIN_INTRO, Command, message_text, parse_command
from localkv.chat.controller import ChatController, ModelMismatch
from localkv.chat.formats import (
    ago,
    counted,
    human_bytes,
    id_width,
    sync_line,
    sync_summary,
    turn_line,
)
from localkv.history.store import ConversationStore, MalformedConversation
from localkv.model.sampling import SamplingParams
from localkv.model.session import ContextFullError
from localkv.prompt.renderbudget import TemplateRenderError
from localkv.prompt.request import (
    Document,
    DocumentError,
    TextError,
    byte_limit,
    check_text,
    read_document,
)
from localkv.runtime import Runtime
from localkv.runtime.reports import printable

__all__ = ["run_plain_chat"]


def run_plain_chat(  # noqa: PLR0913 - to take a value type
    runtime: Runtime,
    params: SamplingParams,
    *,
    system: str | None = None,
    documents: Sequence[Document] = (),
    history: ConversationStore | None = None,
    history_error: str | None = None,
    resume: bool = False,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Read lines, answer each; returns an exit code (streams default to ``sys``'s).

    ``resume`` reopens the latest saved conversation (1: it could not be, with
    the reason on ``stderr``), then ``documents`` are attached; the caller owns
    ``runtime`` and ``history``.
    """
    controller = ChatController(runtime, history, system=system, history_error=history_error)
    chat = _PlainChat(
        controller,
        params,
        system,
        stdin or _lenient(sys.stdin),
        stdout or sys.stdout,
        stderr=stderr or sys.stderr,
    )
    try:
        with chat.signals():
            chat.note_history_error()
            if resume and not chat.resume():
                return 1
            for document in documents:
                chat.attach(document)
            return chat.loop()
    except _Ended as ended:
        return 128 + ended.signum
    finally:
        controller.close()


def _lenient(stdin: TextIO) -> TextIO:
    """Standard input that reads bytes which are not UTF-8 instead of failing on them.

    They arrive as lone surrogates (``surrogateescape``), so a path after
    ``/attach`` keeps its bytes, and a message holding them is refused with a
    note (``check_text``) while the chat goes on.
    """
    reconfigure = getattr(stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")
    return stdin


class _Ended(Exception):
    """SIGTERM or SIGHUP while the chat waited for input."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class _PlainChat:
    """Draws the controller's answers and reports as lines."""

    def __init__(
        self,
        controller: ChatController,
        params: SamplingParams,
        system: str | None,
        stdin: TextIO,
        stdout: TextIO,
        *,
        stderr: TextIO,
    ) -> None:
        self.controller = controller
        self.params = params
        self.system = system
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._history_error_shown: str | None = None
        self._signal = 0  # a stop signal that came during an answer (0: none)
        self._waiting = False  # reading input: a stop signal ends the chat at once

    # --------------------------------------------------------------- signals
    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """Ctrl-C, SIGTERM and SIGHUP stop an answer (kept); see the module docstring."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self._waiting:
                if signum == signal.SIGINT:
                    raise KeyboardInterrupt
                raise _Ended(signum)
            self._signal = signum

        wanted = [signal.SIGINT, *_ENDING]
        try:
            previous = {sig: signal.signal(sig, handler) for sig in wanted}
        except ValueError:  # not the main thread: no signal handling
            yield
            return
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    def _stopped(self) -> bool:
        return bool(self._signal)

    def _ending(self) -> int | None:
        """The exit code when a stop signal ends the chat; a Ctrl-C is consumed."""
        if self._signal in _ENDING:
            return 128 + self._signal
        self._signal = 0
        return None

    def _readline(self) -> str:
        self._waiting = True
        try:
            if self._signal in _ENDING:  # it came before we waited
                raise _Ended(self._signal)
            return self.stdin.readline()
        finally:
            self._waiting = False

    # ---------------------------------------------------------------- output
    def note(self, text: str) -> None:
        print(f"[{text}]", file=self.stderr, flush=True)

    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.stdout, flush=True)

    def note_history_error(self) -> None:
        """Say what happened to the history; that conversations are not saved, once per reason."""
        for notice in self.controller.notices():
            self.note(notice)
        error = self.controller.history_error
        if error and error != self._history_error_shown:
            self._history_error_shown = error
            self.note(f"conversations are not saved: {error}")

    # ------------------------------------------------------------- the loop
    def loop(self) -> int:
        """Answer line after line until end of input or ``/quit``."""
        interactive = self.stdin.isatty()
        if interactive:
            self.say(PLAIN_INTRO)
        while True:
            if interactive:
                self.say("> ", end="")
            line = self._readline()
            if not line:
                return 0
            if not line.strip():
                continue
            command = parse_command(line)
            if command is None:
                self.ask(message_text(line))
            elif command.name == "quit":
                return 0
            else:
                self.run_command(command)
            code = self._ending()
            if code is not None:
                return code

    def run_command(self, command: Command) -> None:
        """The same commands as the chat app's; /history and /cache list instead of a screen."""
        match command.name:
            case "attach" if command.arg:
                try:
                    limit = byte_limit(self.controller.runtime.session.n_ctx)
                    self.attach(read_document(command.arg, max_bytes=limit))
                except DocumentError as exc:
                    self.note(str(exc))
            case "attach":
                self.note("usage: /attach PATH")
            case "new":
                self.new()
            case "system" if command.arg:
                try:
                    self.system = check_text(command.arg, "the system prompt")
                except TextError as exc:
                    self.note(f"not changed: {exc}")
                    return
                self.new()
            case "system":
                self.note(f"system prompt: {self.system or '(none)'}")
            case "history":
                self.list_history()
            case "cache":
                self.list_cache()
            case "help":
                self.say(PLAIN_HELP)
            case _:
                self.note(f"unknown command /{command.name}; /help lists the commands")

    # ---------------------------------------------------------- the controller
    def ask(self, text: str) -> None:
        try:
            answered = self.controller.send(
                text, self.params, lambda piece: self.say(piece, end=""), self._stopped
            )
        except ContextFullError as exc:
            self.note(f"context full: {exc}. Type /new to start over.")
            self.note_history_error()
            return
        except TextError as exc:
            self.note(f"not sent: {exc}")
            return
        except TemplateRenderError as exc:  # the conversation stays as it was
            self.note(f"not answered: {exc}. Type /new to start over.")
            return
        self.say()
        self.note(turn_line(answered.report))
        self.note_history_error()

    def attach(self, document: Document) -> None:
        try:
            attached = self.controller.attach_document(document, cancel=self._stopped)
        except ContextFullError as exc:
            self.note(f"context full: {exc}")
            return
        except TemplateRenderError as exc:
            self.note(f"not attached: {exc}")
            return
        self.note(f"attached {printable(attached.name)}: {sync_summary(attached.sync)}")
        if attached.reuse:
            self.note(attached.reuse)
        self.note_history_error()

    def new(self) -> None:
        self.controller.new(self.system)
        self.note("new conversation")

    def resume(self) -> bool:
        """Reopen the latest saved conversation, restored from the cache; False: it cannot be
        (another model, a larger ``--ctx``: the note names it)."""
        if self.controller.history is None:
            error = self.controller.history_error or "conversations are not saved"
            self.note(f"cannot resume: the saved conversations cannot be read: {error}")
            return False
        try:
            opened = self.controller.open(None, cancel=self._stopped)
        except (
            ContextFullError,
            ModelMismatch,
            MalformedConversation,
            sqlite3.Error,
            OSError,
        ) as exc:
            self.note_history_error()
            self.note(f"cannot resume: {exc}")
            return False
        self.note_history_error()
        if opened is None:
            self.note("no saved conversation to resume: this is a new one")
        elif opened.sync is not None:
            made = f" · made with {opened.model}" if opened.model else ""
            self.note(f"resumed “{printable(opened.title)}”: {sync_line(opened.sync)}{made}")
        return True

    # ------------------------------------------------------------- listings
    def list_history(self) -> None:
        if self.controller.history is None:
            self.note(f"conversations are not saved: {self.controller.history_error or 'off'}")
            return
        rows, skipped = self.controller.conversations()
        if not rows:
            self.say("No saved conversations yet.")
        for conv in rows:
            model = f" · {conv.model.file}" if conv.model is not None else ""
            counts = f"{counted(conv.messages, 'message')} · {counted(conv.tokens, 'token')}"
            if conv.pending is not None:
                counts += " (last message unanswered)"
            line = f"{conv.id} · {conv.title} · {counts}"
            self.say(printable(f"{line}{model}") + f" · {ago(conv.updated)}")
        for row in skipped:
            self.note(printable(row.line()))

    def list_cache(self) -> None:
        if self.controller.runtime.cache is None:
            self.note(f"the cache is off: {self.controller.cache_status}")
            return
        rows = self.controller.snapshots()
        if not rows:
            self.say("No cache snapshots yet.")
        width = id_width(snap.id for snap in self.controller.runtime.snapshots())
        for snap in rows:
            pinned = " · pinned" if snap.pinned else ""
            self.say(  # the id first, as `localkv cache ls` shows it: pin, rm take it
                f"{snap.id[:width]}  {printable(snap.label)} · {printable(snap.model)} · "
                f"{snap.tokens:,} tokens · "
                f"{human_bytes(snap.bytes_on_disk)} · {counted(snap.hits, 'hit')} · "
                f"used {ago(snap.last_used)}{pinned}"
            )
        others = self.controller.other_models_snapshots()
        if others:
            self.note(
                f"{counted(others, 'snapshot')} of other models not listed "
                "(`localkv cache ls` lists them)"
            )

"""Line-mode chat for terminals, ssh sessions and pipes (``localkv chat --plain``).

The other face of the chat app: the same ``ChatController`` (attach, resume,
save after every change), the same slash commands (``localkv.chat.commands``)
and the same cache reports (``localkv.chat.formats``); only the drawing differs.
Answers and what a command lists go to ``stdout``; notes in brackets (the
status line with TTFT, tokens/s and what the cache did, errors) go to ``stderr``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from localkv.chat.commands import PLAIN_HELP, PLAIN_INTRO, Command, message_text, parse_command
from localkv.chat.controller import ChatController
from localkv.chat.formats import ago, human_bytes, sync_line, sync_summary, turn_line
from localkv.chat.history import ConversationStore
from localkv.model.sampling import SamplingParams
from localkv.model.session import ContextFullError
from localkv.prompt.request import Document, DocumentError, byte_limit, read_document
from localkv.runtime import Runtime

__all__ = ["run_plain_chat"]


def run_plain_chat(
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

    ``resume`` reopens the latest saved conversation, then ``documents`` are
    attached; the caller owns ``runtime`` and ``history``.
    """
    controller = ChatController(runtime, history, system=system, history_error=history_error)
    chat = _PlainChat(
        controller,
        params,
        system,
        stdin or sys.stdin,
        stdout or sys.stdout,
        stderr or sys.stderr,
    )
    try:
        chat.note_history_error()
        if resume:
            chat.resume()
        for document in documents:
            chat.attach(document)
        return chat.loop()
    finally:
        controller.close()


class _PlainChat:
    """Draws the controller's answers and reports as lines."""

    def __init__(
        self,
        controller: ChatController,
        params: SamplingParams,
        system: str | None,
        stdin: TextIO,
        stdout: TextIO,
        stderr: TextIO,
    ) -> None:
        self.controller = controller
        self.params = params
        self.system = system
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self._history_error_shown: str | None = None

    # ---------------------------------------------------------------- output
    def note(self, text: str) -> None:
        print(f"[{text}]", file=self.stderr, flush=True)

    def say(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.stdout, flush=True)

    def note_history_error(self) -> None:
        """Say once that conversations are not saved, each time the reason changes."""
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
            line = self.stdin.readline()
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
                self.system = command.arg
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
                text, self.params, lambda piece: self.say(piece, end=""), lambda: False
            )
        except ContextFullError as exc:
            self.note(f"context full: {exc}. Type /new to start over.")
            return
        self.say()
        self.note(turn_line(answered.report))
        self.note_history_error()

    def attach(self, document: Document) -> None:
        try:
            attached = self.controller.attach_document(document)
        except ContextFullError as exc:
            self.note(f"context full: {exc}")
            return
        self.note(f"attached {attached.name}: {sync_summary(attached.sync)}")
        self.note_history_error()

    def new(self) -> None:
        self.controller.new(self.system)
        self.note("new conversation")

    def resume(self) -> None:
        """Reopen the latest saved conversation, restored from the cache."""
        history = self.controller.history
        latest = history.latest() if history is not None else None
        if latest is None:
            return
        try:
            opened = self.controller.open(latest.id)
        except ContextFullError as exc:
            self.note(f"cannot resume “{latest.title}”: {exc}")
            return
        if opened is not None and opened.sync is not None:
            self.note(f"resumed “{opened.title}”: {sync_line(opened.sync)}")

    # ------------------------------------------------------------- listings
    def list_history(self) -> None:
        if self.controller.history is None:
            self.note(f"conversations are not saved: {self.controller.history_error or 'off'}")
            return
        rows = self.controller.conversations()
        if not rows:
            self.say("No saved conversations yet.")
        for conv in rows:
            self.say(
                f"{conv.title} · {conv.messages} messages · {conv.tokens:,} tokens · "
                f"{ago(conv.updated)}"
            )

    def list_cache(self) -> None:
        if self.controller.runtime.cache is None:
            self.note(f"the cache is off: {self.controller.cache_status}")
            return
        rows = self.controller.snapshots()
        if not rows:
            self.say("No cache snapshots yet.")
        for snap in rows:
            pinned = " · pinned" if snap.pinned else ""
            self.say(
                f"{snap.label} · {snap.tokens:,} tokens · {human_bytes(snap.bytes_on_disk)} · "
                f"{snap.hits} hits · used {ago(snap.last_used)}{pinned}"
            )

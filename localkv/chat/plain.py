"""Line-mode chat for terminals, ssh sessions and pipes (``localkv chat --plain``).

The same cached ``ChatSession`` as the chat app: answers stream to ``stdout``,
the status line (TTFT, tokens/s, what the cache did) goes to ``stderr``, and
conversations are saved to the history when one is given.
"""

from __future__ import annotations

import logging
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from localkv.chat.history import ConversationStore
from localkv.chat.session import ChatSession, ChatState
from localkv.model.sampling import SamplingParams
from localkv.model.session import ContextFullError
from localkv.prompt.request import Document, DocumentError, read_document
from localkv.runtime import Runtime

__all__ = ["run_plain_chat"]

log = logging.getLogger(__name__)

_HELP = "Type a message and press Enter. Commands: /attach PATH, /new, /system TEXT, /help, /quit."


def run_plain_chat(
    runtime: Runtime,
    params: SamplingParams,
    *,
    system: str | None = None,
    documents: Sequence[Document] = (),
    history: ConversationStore | None = None,
    resume: bool = False,
    stdin: TextIO | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Read lines, answer each; returns an exit code (streams default to ``sys``'s)."""
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    chat = ChatSession(runtime, ChatState(system=system))
    conversation_id: str | None = None

    def note(text: str) -> None:
        print(f"[{text}]", file=stderr, flush=True)

    def save() -> None:
        nonlocal conversation_id
        if history is not None:
            try:
                conversation_id = history.save(chat.state, conversation_id)
            except (sqlite3.Error, OSError) as exc:
                note(f"conversation not saved: {exc}")

    def attach(document: Document) -> None:
        runtime.wait_for_saves()  # what was saved a moment ago can be restored
        try:
            report = chat.attach(document)
        except ContextFullError as exc:
            note(f"context full: {exc}")
            return
        hit = report.cache is not None and report.cache.hit
        how = "restored from the cache" if hit else f"prefilled {report.prefilled:,} tokens"
        note(f"attached {Path(document.name).name}: {how}")
        save()

    if resume and history is not None and (latest := history.latest()) is not None:
        try:
            resumed = ChatSession(runtime, history.load(latest.id))
            report = resumed.sync()
        except ContextFullError as exc:
            note(f"cannot resume “{latest.title}”: {exc}")
        else:
            chat, conversation_id = resumed, latest.id
            hit = report.cache is not None and report.cache.hit
            reused = report.cache.reused if report.cache is not None and hit else 0
            note(
                f"resumed “{latest.title}”: restored {reused:,} tokens, "
                f"prefilled {report.prefilled:,}"
            )
    for document in documents:
        attach(document)
    interactive = stdin.isatty()
    if interactive:
        print(_HELP, file=stdout)
    while True:
        if interactive:
            print("> ", end="", file=stdout, flush=True)
        line = stdin.readline()
        if not line:
            return 0
        text = line.strip()
        command, _, arg = text.partition(" ")
        if not text:
            continue
        if command in ("/quit", "/exit"):
            return 0
        if command == "/help":
            print(_HELP, file=stdout)
        elif command in ("/new", "/system"):
            if command == "/system" and arg.strip():
                system = arg.strip()
            chat.reset(system)
            conversation_id = None
            note("new conversation")
        elif command == "/attach":
            try:
                attach(read_document(arg.strip()))
            except DocumentError as exc:
                note(str(exc))
        else:
            try:
                turn = chat.send(
                    text, params, lambda piece: print(piece, end="", file=stdout, flush=True)
                )
            except ContextFullError as exc:
                note(f"context full: {exc}. Type /new to start over.")
                continue
            print(file=stdout, flush=True)
            note(turn.status_line())
            save()

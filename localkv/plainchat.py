"""Line-mode chat for terminals, ssh sessions and pipes (``localkv chat --plain``)."""

from __future__ import annotations

import sys
from typing import TextIO

from localkv.conversation import Conversation, reply
from localkv.prompt import ChatTemplate, Message
from localkv.sampling import SamplingParams
from localkv.session import ContextFullError, ModelSession

__all__ = ["run_plain_chat"]

_HELP = "Type a message and press Enter. Commands: /new (fresh conversation), /quit."


def run_plain_chat(
    session: ModelSession,
    params: SamplingParams,
    *,
    system: str | None = None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    """Read lines, answer each; returns an exit code."""
    template = ChatTemplate(session)
    conv = Conversation()
    conv.start(template, system)
    session.reset()
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
        if not text:
            continue
        if text in ("/quit", "/exit"):
            return 0
        if text == "/new":
            conv.start(template, system)
            session.reset()
            print("(new conversation)", file=stdout)
            continue
        try:
            conv.add(template, Message("user", text))
            session.prefill(conv.tokens[session.n_tokens :], block_size=256)
            for piece in reply(session, template, conv, params):
                print(piece, end="", file=stdout, flush=True)
            print(file=stdout, flush=True)
        except ContextFullError as exc:
            print(f"\n[context full: {exc}. Type /new to start over.]", file=stdout)
            conv.messages.pop()
            del conv.tokens[session.n_tokens :]

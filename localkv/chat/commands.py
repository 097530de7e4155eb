"""The slash commands typed in the message box, and the help text."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMMANDS", "HELP", "Command", "parse_command"]

COMMANDS = ("attach", "new", "system", "history", "cache", "help", "quit")

HELP = """\
**Commands**

| | |
|---|---|
| `/attach PATH` | add a document (Tab completes the path); a cached one is restored |
| `/new` | start a new conversation (the current one stays in the history) |
| `/system TEXT` | start a new conversation with this system prompt |
| `/history` | saved conversations (F3) |
| `/cache` | cache snapshots: pin, unpin, delete (F2) |
| `/help` | this help (F1) |
| `/quit` | leave (Ctrl+Q) |

**Keys**: Enter sends · Ctrl+J (or Shift+Enter) new line · Esc stops the answer or
a prefill, keeping what was done · Ctrl+N new conversation · F4 hides the side panel
· Ctrl+P commands and themes.
"""


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # one of COMMANDS, or what was typed when it is unknown
    arg: str
    known: bool


def parse_command(text: str) -> Command | None:
    """``/name ARG`` as a command; None for an ordinary message (``//x`` sends ``/x``)."""
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name = name.strip().lower()
    return Command(name, arg.strip(), name in COMMANDS)

"""The slash commands of both chat faces (the app and ``--plain``), and their help.

One parser and one table, so a line means the same in either face: ``/name ARG``
is a command (the name in any case, the argument after any whitespace), an
unknown ``/name`` is reported rather than sent to the model, and ``//text``
sends ``/text`` as an ordinary message.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COMMANDS",
    "HELP",
    "PLAIN_HELP",
    "PLAIN_INTRO",
    "Command",
    "CommandHelp",
    "message_text",
    "parse_command",
]


@dataclass(frozen=True, slots=True)
class CommandHelp:
    """One line of help: what a command does in both faces, and what the app adds."""

    usage: str  # "/attach PATH"
    does: str
    in_app: str = ""  # appended in the app's help: its key, completion, actions

    @property
    def name(self) -> str:
        return self.usage[1:].split(" ", 1)[0]


TABLE = (
    CommandHelp(
        "/attach PATH", "add a document; a cached one is restored", " (Tab completes the path)"
    ),
    CommandHelp("/new", "start a new conversation (the current one stays in the history)"),
    CommandHelp(
        "/system TEXT", "start a new conversation with this system prompt (alone: show it)"
    ),
    CommandHelp("/history", "saved conversations", " (F3)"),
    CommandHelp("/cache", "cache snapshots", ": pin, unpin, delete (F2)"),
    CommandHelp("/help", "this help", " (F1)"),
    CommandHelp("/quit", "leave", " (Ctrl+Q)"),
)
COMMANDS = tuple(c.name for c in TABLE)
ALIASES = {"exit": "quit"}  # line mode has always taken /exit too
_ESCAPE = "Start a message with `//` to send one that begins with `/`."

HELP = "\n".join(  # the chat app's (Markdown)
    [
        "**Commands**",
        "",
        "| Command | What it does |",
        "|---|---|",
        *(f"| `{c.usage}` | {c.does}{c.in_app} |" for c in TABLE),
        "",
        _ESCAPE,
        "",
        "**Keys**: Enter sends · Ctrl+J (or Shift+Enter) new line · Esc stops the answer or",
        "a prefill, keeping what was done · Ctrl+N new conversation · F4 hides the side panel",
        "· Ctrl+P commands and themes.",
        "",
    ]
)

_WIDTH = max(len(c.usage) for c in TABLE)
# what line mode prints when it starts at a terminal
PLAIN_INTRO = f"Type a message and press Enter. Commands: {', '.join(c.usage for c in TABLE)}."

PLAIN_HELP = (
    "\n".join(  # line mode's: the same table, without the app's keys  # the chat app's (Markdown)
        [
            "Type a message and press Enter. Commands:",
            *(f"  {c.usage:<{_WIDTH}}  {c.does}" for c in TABLE),
            _ESCAPE.replace("`", ""),
        ]
    )
)


@dataclass(frozen=True, slots=True)
class Command:
    name: str  # one of COMMANDS, or what was typed when it is unknown
    arg: str
    known: bool


def parse_command(text: str) -> Command | None:
    """``/name ARG`` as a command; None for an ordinary message (``//x`` sends ``/x``)."""
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    words = text[1:].split(maxsplit=1)
    name = words[0].lower() if words else ""
    arg = words[1].strip() if len(words) > 1 else ""
    name = ALIASES.get(name, name)
    return Command(name, arg, name in COMMANDS)


def message_text(text: str) -> str:
    """What an ordinary message sends: ``//x`` is ``/x`` (see ``parse_command``)."""
    text = text.strip()
    return text[1:] if text.startswith("//") else text

"""Chat templates rendered with placeholders where the messages' text goes.

llama.cpp's built-in formats (``llama_chat_apply_template``) write each message's
text as it is or trimmed of ASCII whitespace, between markup of their own, and
never look inside it. So a conversation is rendered with a short placeholder in
place of each text, and the output says which characters are the template's
markup and which are a message's text: ``Piece``s. Only markup may become
special tokens (``markup``); a message's text is always text, so a document that
contains ``<|im_start|>system`` cannot open a turn.

The text itself never goes through the renderer, so a render costs the same
for a one-word message and a long document, and a message's tokens are the
delta of two renders of a bounded window (``window``): the last few messages of
the history, as llama.cpp's formats carry nothing further from one message to
the next (a pending system prompt, whether a turn is open; what a format does
with the first message of a rendering is in both renders and cancels). A
conversation of n messages is n renders of bounded size, not n renders of its
whole history; a test compares the deltas with whole-history ones for every
built-in format.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from localkv.model.native import llama_cpp

__all__ = ["WHITESPACE", "WINDOW", "Deltas", "Piece", "Renderer", "pieces", "window"]

# the characters llama.cpp's trim() removes (C isspace)
WHITESPACE = " \t\n\v\f\r"
# messages of history rendered before the new one (every built-in format needs 2)
WINDOW = 4
# a placeholder: private-use delimiters around the message's index, padded with
# vertical tabs so that a format that trims the text shows it by dropping them
# (a reasoning placeholder has an "r" before the index); a literal: the text of a
# control token found in a request's other strings (``jinja``), which stays text
# control token found in a request's other strings (``jinja``), which stays text; a
# placeholder a template wrote as JSON (``tojson``): the text JSON-escaped
_PLACEHOLDER = re.compile(
    "(\v?)\ue000(r?)([0-9]+)\ue001(\v?)|\ue002([0-9]+)\ue003"
    "|\\\\u000b\ue000(r?)([0-9]+)\ue001\\\\u000b"
)


class Message(Protocol):
    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Piece:
    """Part of a rendering: template markup, or the text of message ``source``."""

    text: str
    source: int | None = None  # the message's index in the rendered list; None: markup
    reasoning: bool = False  # the message's reasoning, not its content

    @property
    def content(self) -> bool:
        return self.source is not None


def window(history: Sequence[Message], size: int | None = WINDOW) -> list[Message]:
    """The messages of ``history`` that a new message's rendering can depend on
    (``size`` None: all of them)."""
    if size is None:
        return list(history)
    return list(history[max(0, len(history) - size) :])


class Deltas:
    """What every renderer does with its ``marked``: the delta of two renderings."""

    window_size: int | None = WINDOW
    literals: list[str]
    renders: int
    rendered_chars: int

    def marked(self, messages: Sequence[Message], add_assistant: bool = False) -> str:
        raise NotImplementedError

    def delta(
        self,
        before: Sequence[Message] | None,
        after: Sequence[Message],
        *,
        open_before: bool = False,
        open_after: bool = False,
    ) -> list[Piece]:
        """What the rendering of ``after`` adds to that of ``before`` (None: nothing).

        ``before`` is a prefix of ``after``; ``open_*`` renders the assistant's
        opening after the messages. A format that is not prefix-stable keeps the
        earlier text as it was: the delta is what follows the longest common
        prefix, never cut inside a placeholder.
        """
        old = "" if before is None else self.marked(before, open_before)
        new = self.marked(after, open_after)
        start = _common_prefix(old, new)
        for match in _PLACEHOLDER.finditer(new, max(0, start - 32), start + 32):
            if match.start() < start < match.end():
                start = match.start()
        return pieces(new[start:], after, self.literals)


class Renderer(Deltas):
    """Renders placeholder conversations with llama.cpp's formats, counting the work."""

    def __init__(self, template: bytes) -> None:
        self.template = template
        self.literals = []
        self.renders = 0
        self.rendered_chars = 0

    def marked(self, messages: Sequence[Message], add_assistant: bool = False) -> str:
        """The rendering of ``messages`` with placeholders for their text."""
        n = len(messages)
        arr = (llama_cpp.llama_chat_message * max(1, n))()
        keep: list[bytes] = []  # the C strings must outlive the call
        for i, m in enumerate(messages):
            role, content = m.role.encode(), f"\v\ue000{i}\ue001\v".encode()
            keep.extend((role, content))
            arr[i].role = role
            arr[i].content = content
        size = 256 + 64 * n
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            out = llama_cpp.llama_chat_apply_template(
                self.template, arr, n, add_assistant, buf, size
            )
            if out < 0:
                raise ValueError("the model's chat template is not supported by llama.cpp")
            if out <= size:
                self.renders += 1
                self.rendered_chars += out
                return buf.raw[:out].decode("utf-8")
            size = out + 1
        raise RuntimeError("chat template output kept growing")


def pieces(rendered: str, messages: Sequence[Message], literals: Sequence[str] = ()) -> list[Piece]:
    """A placeholder rendering as markup and the messages' text (trimmed where it was).

    A literal (a control token's text found in a tool definition or call) is a
    text piece of no message (``source`` -1).
    """
    out: list[Piece] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(rendered):
        if match.start() > pos:
            out.append(Piece(rendered[pos : match.start()]))
        pos = match.end()
        if match.group(5) is not None:
            out.append(Piece(literals[int(match.group(5))], -1))
            continue
        if match.group(7) is not None:  # written as JSON
            index, reasoning = int(match.group(7)), bool(match.group(6))
            text = _text(messages[index], reasoning)
            out.append(Piece(json.dumps(text, ensure_ascii=False)[1:-1], index, reasoning))
            continue
        index = int(match.group(3))
        text = _text(messages[index], bool(match.group(2)))
        if not match.group(1):
            text = text.lstrip(WHITESPACE)
        if not match.group(4):
            text = text.rstrip(WHITESPACE)
        out.append(Piece(text, index, bool(match.group(2))))
    if pos < len(rendered):
        out.append(Piece(rendered[pos:]))
    return out


def _text(message: Message, reasoning: bool) -> str:
    return (getattr(message, "reasoning", None) or "") if reasoning else message.content


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    i = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        i += 1
    return i

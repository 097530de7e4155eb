"""Documents and requests: segments in, one token list with segment boundaries out."""

from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localkv.prompt.conversation import Conversation
from localkv.prompt.template import ChatTemplate, Message

__all__ = ["Document", "DocumentError", "Request", "build_request", "read_document"]

log = logging.getLogger(__name__)

ENCODING_POLICY = (
    "Documents are read as UTF-8 (a byte-order mark is dropped); a file that is not "
    "valid UTF-8 is read as Latin-1, with a warning. Files with NUL bytes are binary "
    "and refused."
)


class DocumentError(ValueError):
    """A document cannot be used (missing, unreadable, binary, empty)."""


@dataclass(frozen=True, slots=True)
class Document:
    text: str
    name: str
    sha256: str
    path: Path | None = None
    encoding: str = "utf-8"

    @classmethod
    def from_text(cls, text: str, name: str = "<text>") -> Document:
        if not text.strip():
            raise DocumentError(f"{name}: the document is empty")
        return cls(text, name, hashlib.sha256(text.encode("utf-8")).hexdigest())


def read_document(source: str | Path) -> Document:
    """Read a document file (``-`` is standard input) under ``ENCODING_POLICY``."""
    if str(source) == "-":
        data = sys.stdin.buffer.read()
        name, path = "<stdin>", None
    else:
        path = Path(source).expanduser()
        name = str(source)
        if not path.exists():
            raise DocumentError(f"{name}: no such file")
        if path.is_dir():
            raise DocumentError(f"{name}: is a directory, not a document")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DocumentError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    if b"\0" in data[:65536]:
        raise DocumentError(f"{name}: looks binary (NUL bytes); give a text file")
    encoding = "utf-8"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        encoding = "latin-1"
        text = data.decode("latin-1")
        log.info("%s is not valid UTF-8: read as Latin-1", name)
    if not text.strip():
        raise DocumentError(f"{name}: the document is empty")
    return Document(text, name, hashlib.sha256(data).hexdigest(), path, encoding)


@dataclass(frozen=True, slots=True)
class Request:
    """The model input: tokens, and the token counts where segments end."""

    tokens: list[int]
    boundaries: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


def build_request(
    template: ChatTemplate,
    *,
    system: str | None,
    documents: Sequence[Document] = (),
    question: str | None = None,
) -> Request:
    """``[system][document]...[question][assistant opener]`` as tokens, segment by segment.

    Each document is a user turn holding the document's text alone, so the same
    document after the same system prompt always gives the same tokens.
    """
    conv = Conversation()
    conv.start(template, system)
    boundaries = [len(conv.tokens)] if conv.tokens else []
    for doc in documents:
        conv.add(template, Message("user", doc.text))
        boundaries.append(len(conv.tokens))
    if question is not None:
        conv.add(template, Message("user", question))
        conv.tokens.extend(template.assistant_start_tokens(conv.messages))
        boundaries.append(len(conv.tokens))
    return Request(conv.tokens, boundaries, conv.messages)

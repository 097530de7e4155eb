"""Documents and requests: segments in, one token list with segment boundaries out."""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
import re
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from localkv.prompt.conversation import Conversation
from localkv.prompt.template import ChatTemplate, Message

__all__ = [
    "ENCODING_POLICY",
    "MAX_BYTES_PER_TOKEN",
    "Document",
    "DocumentError",
    "Request",
    "TextError",
    "build_request",
    "byte_limit",
    "check_text",
    "path_text",
    "read_document",
]

log = logging.getLogger(__name__)

ENCODING_POLICY = (
    "Documents are read as UTF-8 (a byte-order mark is dropped); a file with a UTF-16 "
    "byte-order mark is read as UTF-16; a file that is not valid UTF-8 is read as "
    "Latin-1, with a warning. Files with a NUL byte anywhere are binary and refused. "
    "Only regular files are read (not FIFOs, sockets or devices)."
)
# A context of n tokens never holds more text than this many bytes per token; the
# CLI caps what it reads by it, so a huge file fails at once instead of filling memory.
MAX_BYTES_PER_TOKEN = 64
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def byte_limit(n_ctx: int) -> int:
    """The most bytes of text worth reading for a context of ``n_ctx`` tokens."""
    return n_ctx * MAX_BYTES_PER_TOKEN


class TextError(ValueError):
    """Text that cannot become a prompt: a NUL character, or not valid UTF-8."""


class DocumentError(ValueError):
    """A document cannot be used (missing, unreadable, binary, empty)."""


# What llama.cpp's tokenizer cannot take whole: it reads C strings, so a NUL ends
# the text there, and a lone surrogate (an undecodable byte kept by Python's
# surrogateescape, or one from JSON) has no UTF-8 form.
_NOT_TEXT = re.compile(r"[\x00\ud800-\udfff]")


def check_text(text: str, what: str) -> str:
    """``text`` unchanged, or ``TextError`` naming ``what`` and the first character
    that cannot be a prompt (see ``_NOT_TEXT``): never a silently cut prompt."""
    found = _NOT_TEXT.search(text)
    if found is None:
        return text
    char, at = found.group(), f"at character {found.start() + 1:,}"
    if char == "\0":
        raise TextError(f"{what} holds a NUL character ({at}); give text")
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8, kept by surrogateescape
        raise TextError(f"{what} is not valid UTF-8 (byte 0x{code - 0xDC00:02x} {at})")
    raise TextError(f"{what} holds a lone surrogate U+{code:04X} ({at}); give text")


def path_text(path: str | os.PathLike[str]) -> str:
    """A path as text: bytes that are not UTF-8 become U+FFFD.

    A path is bytes; what names it in the index, the history, JSON and on the
    terminal is text, which cannot hold the lone surrogates Python reads such
    bytes as. The path itself still opens the file.
    """
    return os.fsencode(path).decode("utf-8", "replace")


@dataclass(frozen=True, slots=True, kw_only=True)
class Document:
    text: str
    name: str
    sha256: str
    path: Path | None = None
    encoding: str = "utf-8"

    @classmethod
    def from_text(cls, text: str, name: str = "<text>") -> Document:
        try:
            check_text(text, name)
        except TextError as exc:
            raise DocumentError(str(exc)) from None
        if not text.strip():
            raise DocumentError(f"{name}: the document is empty")
        return cls(text=text, name=name, sha256=hashlib.sha256(text.encode("utf-8")).hexdigest())


def read_document(source: str | Path, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """Read a document file (``-`` is standard input) under ``ENCODING_POLICY``."""
    if str(source) == "-":
        data = sys.stdin.buffer.read(max_bytes + 1)
        name, path = "<stdin>", None
    else:
        path = Path(source).expanduser()
        name = path_text(source)
        data = _read_regular_file(path, name, max_bytes)
    if len(data) > max_bytes:
        raise DocumentError(_too_large(name, max_bytes))
    text, encoding = _decode(data, name)
    if not text.strip():
        raise DocumentError(f"{name}: the document is empty")
    return Document(
        text=text, name=name, sha256=hashlib.sha256(data).hexdigest(), path=path, encoding=encoding
    )


def _too_large(name: str, max_bytes: int) -> str:
    return (
        f"{name}: larger than {max_bytes / 1e6:.1f} MB, more text than the context can hold "
        "(raise --ctx, or split the document)"
    )


def _read_regular_file(path: Path, name: str, max_bytes: int) -> bytes:
    """At most ``max_bytes + 1`` bytes of a regular file, never blocking on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise DocumentError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{name}: is a directory, not a document") from None
    except OSError as exc:
        raise DocumentError(f"{name}: cannot read it ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise DocumentError(f"{name}: is a directory, not a document")
        if not stat.S_ISREG(st.st_mode):
            raise DocumentError(f"{name}: not a regular file (a FIFO, socket or device)")
        if st.st_size > max_bytes:
            raise DocumentError(_too_large(name, max_bytes))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read(max_bytes + 1)
        except OSError as exc:
            raise DocumentError(f"{name}: cannot read it ({exc.strerror or exc})") from None


def _decode(data: bytes, name: str) -> tuple[str, str]:
    """The text and the encoding it was read in (see ``ENCODING_POLICY``)."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            text = data.decode("utf-16")
        except UnicodeDecodeError:
            raise DocumentError(f"{name}: has a UTF-16 byte-order mark but is not UTF-16") from None
        if "\0" in text:
            raise DocumentError(f"{name}: looks binary (a NUL character); give a text file")
        return text, "utf-16"
    if (at := data.find(b"\0")) >= 0:
        raise DocumentError(
            f"{name}: looks binary (a NUL byte at byte {at + 1:,}); give a text file"
        )
    try:
        return data.decode("utf-8-sig"), "utf-8"
    except UnicodeDecodeError:
        log.info("%s is not valid UTF-8: read as Latin-1", name)
        return data.decode("latin-1"), "latin-1"


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
        boundaries.extend(conv.add(template, Message("user", doc.text)))
        boundaries.append(len(conv.tokens))
    if question is not None:
        boundaries.extend(conv.add(template, Message("user", question)))
        conv.tokens.extend(template.assistant_start_tokens(conv.messages))
        boundaries.append(len(conv.tokens))
    return Request(conv.tokens, boundaries, conv.messages)

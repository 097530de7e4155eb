"""Snapshots for the prefixes the server saves, so ``cache ls`` and ``GET /v1/localkv/cache``
list them and they can be pinned and removed like any other.

Each request's prefix (its prompt and answer, a conversation so far) is saved in
the background; once written, its chain is named ``server: <first words>``, the
first words of the request's first message (or prompt). A conversation that goes
on replaces its earlier snapshot (same label, its tokens the start of the new
chain) as the chat's do, keeping its pin and hits (``chat.snapshots``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from localkv.cache.save import SaveResult
from localkv.chat.snapshots import ConversationSnapshot
from localkv.prompt.request import Document, DocumentError
from localkv.prompt.template import Message
from localkv.reports import printable
from localkv.server.errors import bad_request

__all__ = ["prefill_body", "prefix_label", "snapshot_namer"]

_WORDS = 6
_MAX_CHARS = 48


def prefix_label(first: str | Sequence[int] | Sequence[Message]) -> str:
    """``server: You answer questions about the…``: the first words of what the prefix
    starts with (a message's text, a prompt; ``token ids`` for a prompt of ids)."""
    if isinstance(first, str):
        text = first
    elif first and isinstance(first[0], Message):
        text = next((m.content for m in first if isinstance(m, Message) and m.content), "")
    else:
        text = "token ids" if first else ""
    words = text.split()
    head = printable(" ".join(words[:_WORDS]))[:_MAX_CHARS]
    more = len(words) > _WORDS or len(head) == _MAX_CHARS
    return f"server: {head}{'…' if more else ''}" if head else "server: (empty)"


def snapshot_namer(
    snapshot: ConversationSnapshot, label: str, n_tokens: int
) -> Callable[[SaveResult], None]:
    """What the save runs once the prefix is written: name it ``label``."""
    return lambda saved: snapshot.name(saved, label, n_tokens)


def prefill_body(body: dict[str, Any]) -> tuple[str | None, list[Document], str | None, bool]:
    """``POST /v1/localkv/prefill``'s system prompt, documents, label and pin (a 400
    naming the field for a bad one)."""
    system = _optional_str(body, "system")
    documents = _documents(body.get("documents", []))
    if not documents and not system:
        raise bad_request("give 'documents', a 'system' prompt, or both", "documents")
    label = _optional_str(body, "label")
    pin = body.get("pin", False)
    if not isinstance(pin, bool):
        raise bad_request("'pin' must be true or false", "pin")
    return system, documents, label, pin


def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return value


def _documents(raw: object) -> list[Document]:
    if not isinstance(raw, list):
        raise bad_request("'documents' must be an array", "documents")
    docs = []
    for i, item in enumerate(raw):
        where = f"documents[{i}]"
        if isinstance(item, str):
            text, name = item, None
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            text, name = item["text"], item.get("name")
            if name is not None and not isinstance(name, str):
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
        else:
            raise bad_request("each document is a string or {'name', 'text'}", where)
        try:
            docs.append(Document.from_text(text, name or f"document {i + 1}"))
        except DocumentError as exc:
            raise bad_request(str(exc), where) from None
    return docs

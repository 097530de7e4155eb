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

from localkv.cache.save import SaveResult
from localkv.chat.snapshots import ConversationSnapshot
from localkv.prompt.template import Message
from localkv.reports import printable

__all__ = ["prefix_label", "snapshot_namer"]

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

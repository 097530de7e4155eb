"""Rows of ``conversations.db`` as values: encoding a conversation, and decoding one safely.

A row is read back only when every field is what the writer wrote: messages a
JSON list of ``[role, content]``, tokens a whole number of little-endian int32
ids that matches ``n_tokens``, boundaries, documents and generated spans inside
the tokens. Anything else raises ``MalformedConversation`` with the reason, and
the store skips that row (reporting it) instead of failing the chat.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from localkv.prompt.template import Message
from localkv.runtime.chatsession import ChatState

__all__ = [
    "INFO_COLUMNS",
    "INFO_WIDTH",
    "STATE_COLUMNS",
    "ConversationInfo",
    "ConversationModel",
    "MalformedConversation",
    "Part",
    "Skipped",
    "decode_info",
    "decode_state",
    "encode_state",
    "info_or_placeholder",
    "message_texts",
    "parts_of",
    "title_of",
]

_TITLE_CHARS = 60
_ROLES = frozenset({"system", "user", "assistant"})

INFO_COLUMNS = (
    "id, title, n_messages, n_tokens, created, updated, model, model_sha256, identity, "
    "revision, pending, forked_from, n_ctx"
)
INFO_WIDTH = len(INFO_COLUMNS.split(","))  # a row's info columns, before its state's
STATE_COLUMNS = "system, messages, tokens, boundaries, documents, generated"


class MalformedConversation(ValueError):
    """A stored conversation that cannot be read back as it was written."""

    def __init__(self, id: str, reason: str) -> None:
        super().__init__(f"saved conversation {id} is damaged: {reason}")
        self.id = id
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ConversationModel:
    """The model a conversation was made with: its tokens mean something only there."""

    file: str  # the GGUF file's name
    sha256: str | None = None  # its content hash (known when the cache is on)
    identity: str | None = None  # the cache identity digest

    def differs(self, other: ConversationModel) -> bool:
        """Another model: other content when both hashes are known, else another file."""
        if self.sha256 and other.sha256:
            return self.sha256 != other.sha256
        return self.file != other.file

    def describe(self) -> str:
        return f"{self.file} (sha256 {self.sha256[:12]}…)" if self.sha256 else self.file


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationInfo:
    """One saved conversation, as a list shows it."""

    id: str
    title: str
    messages: int  # the unanswered one (``pending``) included
    tokens: int  # in the saved KV sequence: not the unanswered message's
    created: float
    updated: float
    model: ConversationModel | None = None  # None: saved before models were recorded
    revision: int = 0  # bumped by every write: a changed one means another writer
    pending: str | None = None  # the user's message whose answer never came
    forked_from: str | None = None
    n_ctx: int | None = None  # the context it was made in (None: not recorded)


@dataclass(frozen=True, slots=True)
class Skipped:
    """A row left out of a listing, and why."""

    id: str
    reason: str

    def line(self) -> str:
        return f"skipped the damaged saved conversation {self.id}: {self.reason}"


def title_of(state: ChatState, pending: str | None = None) -> str:
    """The first question asked (a user message answered by the assistant), shortened.

    Attached documents are user messages too, but never directly answered; a
    conversation whose first question is still unanswered is named by it.
    """
    for message, following in itertools.pairwise(state.messages):
        if message.role == "user" and following.role == "assistant":
            return _short(message.content)
    if pending:
        return _short(pending)
    if state.documents:
        return ", ".join(name for name, _ in state.documents)
    return "(new conversation)"


def _short(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _TITLE_CHARS else line[: _TITLE_CHARS - 1] + "…"


def encode_state(state: ChatState) -> dict[str, object]:
    """The columns that hold ``state`` exactly."""
    return {
        "system": state.system,
        "messages": json.dumps([[m.role, m.content] for m in state.messages]),
        "tokens": np.asarray(state.tokens, dtype="<i4").tobytes(),
        "boundaries": json.dumps(state.boundaries),
        "documents": json.dumps([[name, n] for name, n in state.documents]),
        "generated": json.dumps([[a, b] for a, b in state.generated]),
        "n_messages": len(state.messages),
        "n_tokens": len(state.tokens),
    }


def decode_info(row: Sequence[Any]) -> ConversationInfo:
    """``INFO_COLUMNS`` of one row; raises ``MalformedConversation``."""
    id = str(row[0])
    title, n_messages, n_tokens, created, updated = row[1:6]
    model, sha, identity, revision, pending, forked_from, n_ctx = row[6:INFO_WIDTH]
    _want(id, isinstance(title, str), "the title is not text")
    for name, value in (("n_messages", n_messages), ("n_tokens", n_tokens)):
        _want(id, _is_int(value) and value >= 0, f"{name} is not a count")
    for name, value in (("created", created), ("updated", updated)):
        _want(id, isinstance(value, int | float) and not isinstance(value, bool), f"no {name}")
    _want(id, pending is None or isinstance(pending, str), "the pending message is not text")
    return ConversationInfo(
        id=id,
        title=title,
        messages=n_messages + (pending is not None),
        tokens=n_tokens,
        created=float(created),
        updated=float(updated),
        model=ConversationModel(model, sha, identity) if isinstance(model, str) else None,
        revision=revision if _is_int(revision) else 0,
        pending=pending,
        forked_from=forked_from if isinstance(forked_from, str) else None,
        n_ctx=n_ctx if _is_int(n_ctx) and n_ctx > 0 else None,
    )


def decode_state(id: str, row: Sequence[Any], n_tokens: int | None = None) -> ChatState:
    """``STATE_COLUMNS`` of a row as the state saved; raises ``MalformedConversation``."""
    system, messages, tokens, boundaries, documents, generated = row
    _want(id, system is None or isinstance(system, str), "the system prompt is not text")
    _want(id, isinstance(tokens, bytes), "the tokens are not a blob")
    _want(id, len(tokens) % 4 == 0, f"a tokens blob of {len(tokens)} bytes is not int32 ids")
    ids = [int(t) for t in np.frombuffer(tokens, dtype="<i4")]
    _want(id, n_tokens is None or n_tokens == len(ids), f"{len(ids)} tokens, not {n_tokens}")
    _want(id, all(t >= 0 for t in ids), "a negative token id")
    pairs = _json_list(id, "messages", messages)
    _want(id, all(_is_message(m) for m in pairs), "a message is not [role, text]")
    ends = _json_list(id, "boundaries", boundaries)
    _want(id, all(_is_int(b) and 0 <= b <= len(ids) for b in ends), "a boundary is outside")
    docs = _json_list(id, "documents", documents)
    _want(id, all(_is_document(d) for d in docs), "a document is not [name, tokens]")
    spans = _json_list(id, "generated", generated)
    _want(id, all(_is_span(s, len(ids)) for s in spans), "a generated span is outside")
    return ChatState(
        system=system,
        messages=[Message(role, content) for role, content in pairs],
        tokens=ids,
        boundaries=[int(b) for b in ends],
        documents=[(str(name), int(n)) for name, n in docs],
        generated=[(int(a), int(b)) for a, b in spans],
    )


def message_texts(column: object) -> list[object]:
    """The messages' texts, or the raw column when it is not the JSON it should be."""
    try:
        return [content for _, content in json.loads(column)]  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return [column if isinstance(column, str) else str(column)]


def info_or_placeholder(row: Sequence[Any]) -> ConversationInfo:
    """``decode_info``, or for a damaged row its id and the reason as the title."""
    try:
        return decode_info(row)
    except MalformedConversation as exc:
        return ConversationInfo(
            id=str(row[0]),
            title=f"(damaged: {exc.reason})",
            messages=0,
            tokens=0,
            created=0.0,
            updated=0.0,
        )


class Part(NamedTuple):
    """One message as the transcript shows it."""

    kind: str  # system, user, assistant or document
    name: str
    text: str


def parts_of(state: ChatState) -> Iterator[Part]:
    """Each message as the transcript shows it.

    A user message the assistant did not answer is an attached document (named
    by the next entry of ``state.documents``).
    """
    docs = iter(state.documents)
    messages = state.messages
    for i, message in enumerate(messages):
        answered = i + 1 < len(messages) and messages[i + 1].role == "assistant"
        if message.role == "user" and not answered:
            yield Part("document", next(docs, ("document", 0))[0], message.content)
        else:
            yield Part(message.role, message.role, message.content)


def _want(id: str, ok: bool, reason: str) -> None:
    if not ok:
        raise MalformedConversation(id, reason)


def _json_list(id: str, name: str, text: object) -> list[Any]:
    try:
        value = json.loads(text) if isinstance(text, str | bytes) else None
    except ValueError:
        value = None
    _want(id, isinstance(value, list), f"{name} are not a JSON list")
    return value  # type: ignore[return-value]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_message(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and value[0] in _ROLES
        and isinstance(value[1], str)
    )


def _is_document(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and _is_int(value[1])
    )


def _is_span(value: object, n: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 2
        and all(_is_int(v) for v in value)
        and 0 <= value[0] <= value[1] <= n
    )

"""Saved conversations: ``conversations.db`` next to the cache (sqlite-utils, WAL).

A conversation is stored exactly as ``ChatState`` holds it — messages, the
token ids in the KV sequence (generated tokens as sampled), segment
boundaries and attached documents — so reopening it rebuilds the same tokens
and its prefix is restored from the cache instead of recomputed. The schema is
built by migrations recorded in ``_migrations``, applied when the store opens.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sqlite_utils

from localkv.chat.session import ChatState
from localkv.prompt.template import Message
from localkv.storage.index.migrations import Migrations
from localkv.storage.paths import create_private_file, default_root, ensure_private_dir
from localkv.storage.removal.forget import DocumentRuns

__all__ = [
    "HISTORY_FILE",
    "MIGRATIONS",
    "ConversationInfo",
    "ConversationNotFound",
    "ConversationStore",
    "migrate",
    "title_of",
]

log = logging.getLogger(__name__)

HISTORY_FILE = "conversations.db"
_TITLE_CHARS = 60

migration = Migrations()  # the conversation database's schema
MIGRATIONS = migration.functions


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the migrations not yet named in ``_migrations``; return their names."""
    return migration.apply(db)


@migration
def m001_conversations(db: sqlite_utils.Database) -> None:
    db.table("conversations").create(
        {
            "id": str,
            "title": str,
            "system": str,
            "messages": str,  # JSON [[role, content], ...]
            "tokens": bytes,  # little-endian int32 token ids
            "boundaries": str,  # JSON [int, ...]
            "documents": str,  # JSON [[name, tokens], ...]
            "n_messages": int,
            "n_tokens": int,
            "created": float,
            "updated": float,
        },
        pk="id",
        not_null={
            "title",
            "messages",
            "tokens",
            "boundaries",
            "documents",
            "n_messages",
            "n_tokens",
            "created",
            "updated",
        },
    )
    db.table("conversations").create_index(["updated"])


@migration
def m002_generated_spans(db: sqlite_utils.Database) -> None:
    """The spans of generated tokens (each decoded alone): part of the batch schedule."""
    db.table("conversations").add_column("generated", str, not_null_default="[]")


class ConversationNotFound(KeyError):
    """No saved conversation has this id."""


@dataclass(frozen=True, slots=True)
class ConversationInfo:
    """One saved conversation, as a list shows it."""

    id: str
    title: str
    messages: int
    tokens: int
    created: float
    updated: float


def title_of(state: ChatState) -> str:
    """The first question asked (a user message answered by the assistant), shortened.

    Attached documents are user messages too, but never directly answered.
    """
    msgs = state.messages
    for message, following in itertools.pairwise(msgs):
        if message.role == "user" and following.role == "assistant":
            line = " ".join(message.content.split())
            return line if len(line) <= _TITLE_CHARS else line[: _TITLE_CHARS - 1] + "…"
    if state.documents:
        return ", ".join(name for name, _ in state.documents)
    return "(new conversation)"


def _encode_tokens(tokens: list[int]) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


def _decode_tokens(data: bytes) -> list[int]:
    return [int(t) for t in np.frombuffer(data, dtype="<i4")]


def _prepare_file(path: Path) -> None:
    """Create the database file 0600 before SQLite does (its -wal/-shm copy the mode)."""
    with contextlib.suppress(FileExistsError):
        os.close(create_private_file(path))
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"refusing conversation history {path}: not a regular file")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o600)


class ConversationStore:
    """Saved conversations; safe to share between threads (one lock, one connection)."""

    def __init__(self, path: Path | None) -> None:
        """``path=None`` keeps everything in memory (for tests)."""
        if path is None:
            conn = sqlite3.connect(":memory:", check_same_thread=False)
        else:
            conn = sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
        self.path = path
        self._lock = threading.Lock()
        self._closed = False
        self.db = sqlite_utils.Database(conn)
        self.db.execute("PRAGMA busy_timeout = 30000")
        if path is not None:
            self.db.execute("PRAGMA journal_mode = WAL")
        migrate(self.db)

    @classmethod
    def open(cls, root: Path | str | None = None) -> ConversationStore:
        """Open ``conversations.db`` in the cache root (``root``, ``$LOCALKV_HOME``, default)."""
        directory = default_root(root)
        ensure_private_dir(directory)
        path = directory / HISTORY_FILE
        _prepare_file(path)
        return cls(path)

    def close(self) -> None:
        """Close the connection (safe to call twice)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite_utils.Database]:
        with self._lock:
            if self._closed:
                raise RuntimeError("the conversation store is closed")
            yield self.db

    # ----------------------------------------------------------------- writes
    def save(self, state: ChatState, id: str | None = None, *, title: str | None = None) -> str:
        """Insert (``id=None``) or replace a conversation; returns its id."""
        now = time.time()
        row: dict[str, object] = {
            "title": title or title_of(state),
            "system": state.system,
            "messages": json.dumps([[m.role, m.content] for m in state.messages]),
            "tokens": _encode_tokens(state.tokens),
            "boundaries": json.dumps(state.boundaries),
            "documents": json.dumps([[name, n] for name, n in state.documents]),
            "generated": json.dumps([[a, b] for a, b in state.generated]),
            "n_messages": len(state.messages),
            "n_tokens": len(state.tokens),
            "updated": now,
        }
        with self._db() as db, db.atomic():
            table = db.table("conversations")
            if id is not None and table.count_where("id = ?", [id]):
                table.update(id, row)
                return id
            new_id = id or secrets.token_hex(8)
            table.insert({"id": new_id, "created": now, **row})
            return new_id

    def delete(self, id: str) -> bool:
        """Forget a conversation; False if there was none with this id."""
        with self._db() as db, db.atomic():
            cursor = db.execute("DELETE FROM conversations WHERE id = ?", [id])
            return cursor.rowcount > 0

    # ------------------------------------------------------------------ reads
    def list(self, limit: int | None = None) -> list[ConversationInfo]:
        """Saved conversations, most recently updated first."""
        sql = (
            "SELECT id, title, n_messages, n_tokens, created, updated FROM conversations "
            "ORDER BY updated DESC, rowid DESC"
        )
        params: list[object] = []
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        with self._db() as db:
            rows = db.execute(sql, params).fetchall()
        return [ConversationInfo(*row) for row in rows]

    def latest(self) -> ConversationInfo | None:
        """The most recently updated conversation, or None when there is none."""
        found = self.list(limit=1)
        return found[0] if found else None

    def info(self, id: str) -> ConversationInfo:
        with self._db() as db:
            row = db.execute(
                "SELECT id, title, n_messages, n_tokens, created, updated FROM conversations "
                "WHERE id = ?",
                [id],
            ).fetchone()
        if row is None:
            raise ConversationNotFound(id)
        return ConversationInfo(*row)

    def load(self, id: str) -> ChatState:
        """The saved state, exactly as it was saved."""
        with self._db() as db:
            row = db.execute(
                "SELECT system, messages, tokens, boundaries, documents, generated "
                "FROM conversations WHERE id = ?",
                [id],
            ).fetchone()
        if row is None:
            raise ConversationNotFound(id)
        system, messages, tokens, boundaries, documents, generated = row
        return ChatState(
            system=system,
            messages=[Message(role, content) for role, content in json.loads(messages)],
            tokens=_decode_tokens(tokens),
            boundaries=[int(b) for b in json.loads(boundaries)],
            documents=[(str(name), int(n)) for name, n in json.loads(documents)],
            generated=[(int(a), int(b)) for a, b in json.loads(generated)],
        )

    # --------------------------------------------------------------- privacy
    def holding(self, text: str, runs: Sequence[np.ndarray] = ()) -> tuple[ConversationInfo, ...]:
        """Conversations that hold a document, most recently updated first.

        One holds it if its system prompt or a message contains the document's
        text (an attached document is a message holding the text alone), or if
        its tokens contain ``RUN_LENGTH`` consecutive tokens of one of ``runs``
        (the document tokenized by a model's vocabulary, see
        ``localkv.cache.forgetting``). ``cache forget`` must not leave it there.
        """
        needle = text.strip()
        document = DocumentRuns.of(runs)
        with self._db() as db:
            rows = db.execute("SELECT id, system, messages, tokens FROM conversations").fetchall()
        found = {
            str(id)
            for id, system, messages, tokens in rows
            if (needle and self._mentions(needle, system, messages))
            or document.holds(np.frombuffer(tokens, dtype="<i4"))
        }
        return tuple(info for info in self.list() if info.id in found)

    def forget(self, ids: Sequence[str]) -> tuple[tuple[str, ...], bool]:
        """Delete these conversations, then overwrite what their rows left behind.

        Rows are deleted with ``secure_delete`` on (their pages zeroed), then the
        file is rebuilt (VACUUM) and the WAL emptied, so no page or WAL frame
        still holds them. Returns the ids deleted, and False if another
        connection (a running ``localkv chat``) kept the WAL from being emptied.
        """
        with self._db() as db:
            if db.execute("PRAGMA secure_delete").fetchone()[0] != 1:
                db.execute("PRAGMA secure_delete = ON")
            deleted: list[str] = []
            with db.atomic():
                for id in dict.fromkeys(ids):
                    if db.execute("DELETE FROM conversations WHERE id = ?", [id]).rowcount:
                        deleted.append(id)
            try:
                db.execute("VACUUM")
            except sqlite3.OperationalError as exc:  # another connection is writing
                log.warning("could not vacuum the conversation history: %s", exc)
            row = db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        truncated = row is None or not row[0]
        if not truncated:
            log.warning("the conversation history's WAL is in use; not yet truncated")
        return tuple(deleted), truncated

    @staticmethod
    def _mentions(needle: str, system: str | None, messages: str) -> bool:
        """The system prompt or a message (JSON ``[[role, content], ...]``) holds ``needle``."""
        if system and needle in system:
            return True
        return any(needle in str(content) for _, content in json.loads(messages))

"""Saved conversations: ``conversations.db`` next to the cache (sqlite-utils, WAL).

A conversation is stored exactly as ``ChatState`` holds it — messages, the
token ids in the KV sequence (generated tokens as sampled), segment
boundaries and attached documents — so reopening it rebuilds the same tokens
and its prefix is restored from the cache instead of recomputed. The schema is
built by migrations (``localkv.history.schema``), applied when the store opens.

Nothing is lost silently. Opening checks that the file is a regular SQLite
database this process can write (a probe write, rolled back), or raises. Every
row carries a revision: ``write`` updates a conversation only at the revision
its writer read, so a second chat on the same conversation forks a new one
instead of overwriting the first one's turns. Rows that cannot be read back
(``localkv.history.rows``) are skipped and reported, never raised from a
listing.
"""

from __future__ import annotations

import contextlib
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

from localkv.history.rows import (
    INFO_COLUMNS,
    INFO_WIDTH,
    STATE_COLUMNS,
    ConversationInfo,
    ConversationModel,
    MalformedConversation,
    Skipped,
    decode_info,
    decode_state,
    encode_state,
    info_or_placeholder,
    message_texts,
    title_of,
)
from localkv.history.schema import MIGRATIONS, connect, migrate, rebuild_table
from localkv.runtime.chatsession import ChatState
from localkv.storage.paths import create_private_file, default_root, ensure_private_dir
from localkv.storage.removal.forget import DocumentRuns

__all__ = [
    "HISTORY_FILE",
    "MIGRATIONS",
    "ConversationInfo",
    "ConversationModel",
    "ConversationNotFound",
    "ConversationStore",
    "MalformedConversation",
    "Skipped",
    "Written",
    "migrate",
    "title_of",
]

log = logging.getLogger(__name__)

HISTORY_FILE = "conversations.db"


class ConversationNotFound(KeyError):
    """No saved conversation has this id."""

    def __str__(self) -> str:
        name = str(self.args[0]) if self.args else ""
        return f"no saved conversation {name or repr(name)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Written:
    """Where a write went: ``forked_from`` is set when it became a new conversation."""

    id: str
    revision: int
    forked_from: str | None = None
    reason: str | None = None  # why it forked


def _prepare_file(path: Path) -> None:
    """Create the database file 0600 before SQLite does (its -wal/-shm copy the mode).

    Anything but a regular file (a directory, a FIFO, a symlink) is refused
    before SQLite opens it: nothing blocks, nothing is followed.
    """
    with contextlib.suppress(FileExistsError):
        os.close(create_private_file(path))
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(f"refusing conversation history {path}: not a regular file")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o600)


class ConversationStore:
    """Saved conversations; safe to share between threads (one lock, one connection).

    ``repairs`` says what opening had to mend (a dropped table made again, empty).
    """

    def __init__(self, path: Path | None, *, read_only: bool = False) -> None:
        """``path=None`` keeps everything in memory (for tests). Raises ``sqlite3.Error``.

        ``read_only`` (listing, exporting): a history whose schema is current is
        opened without a write transaction, so a chat writing it in another
        process does not hold the reader up; one that needs migrating is
        opened as for writing.
        """
        conn, ready = connect(path, read_only)
        self.path = path
        self.repairs: list[str] = []
        self._lock = threading.Lock()
        self._closed = False
        self.db = sqlite_utils.Database(conn)
        try:
            self.db.execute("PRAGMA busy_timeout = 30000")
            if ready:
                return
            if path is not None:
                self.db.execute("PRAGMA journal_mode = WAL")
            with self._immediate(self.db):  # one process migrates at a time
                migrate(self.db)
                if not self.db.table("conversations").exists():
                    rebuild_table(self.db)
                    self.repairs.append("its conversations table was missing; made a new one")
                    log.warning("conversation history %s: %s", path, self.repairs[-1])
            self._check_writable()
        except BaseException:
            conn.close()
            raise

    @classmethod
    def open(cls, root: Path | str | None = None, *, read_only: bool = False) -> ConversationStore:
        """Open ``conversations.db`` in the cache root (``root``, ``$LOCALKV_HOME``, default)."""
        directory = default_root(root)
        ensure_private_dir(directory)
        path = directory / HISTORY_FILE
        _prepare_file(path)
        try:
            return cls(path, read_only=read_only)
        except sqlite3.Error as exc:  # not a database, read-only, disk full, locked
            raise OSError(f"conversation history {path}: {exc}") from exc

    @classmethod
    def open_existing(
        cls, root: Path | str | None = None, *, read_only: bool = False
    ) -> ConversationStore | None:
        """Open the history if there is one; None (creating nothing) when there is none."""
        path = default_root(root) / HISTORY_FILE
        if not os.path.lexists(path):
            return None
        return cls.open(root, read_only=read_only)

    def _check_writable(self) -> None:
        """Fail now, not after the first answer, if nothing can be written."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            self.db.execute("CREATE TABLE _write_check (x)")
        finally:
            self.db.conn.rollback()

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

    @staticmethod
    @contextlib.contextmanager
    def _immediate(db: sqlite_utils.Database) -> Iterator[None]:
        """A ``BEGIN IMMEDIATE`` transaction: a read-check-write no other process interleaves."""
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            if db.conn.in_transaction:
                db.conn.rollback()
            raise

    # ----------------------------------------------------------------- writes
    def save(self, state: ChatState, id: str | None = None, *, title: str | None = None) -> str:
        """Insert (``id=None``) or replace a conversation, whatever its revision; its id."""
        now = time.time()
        row = {**encode_state(state), "title": title or title_of(state), "updated": now}
        with self._db() as db, self._immediate(db):
            table = db.table("conversations")
            if id is not None and table.count_where("id = ?", [id]):
                db.execute("UPDATE conversations SET revision = revision + 1 WHERE id = ?", [id])
                table.update(id, row)
                return id
            new_id = id or secrets.token_hex(8)
            table.insert({"id": new_id, "created": now, "revision": 1, **row})
            return new_id

    def write(
        self,
        state: ChatState,
        id: str | None,
        revision: int,
        *,
        model: ConversationModel | None,
        pending: str | None = None,
        n_ctx: int | None = None,
    ) -> Written:
        """Save ``state`` (and the message awaiting its answer) in one transaction.

        ``n_ctx``: the context it is made in, for a resume in a smaller one to name.

        ``id`` is updated only if it is still at ``revision`` (what this writer
        last wrote or read); if another writer changed or deleted it meanwhile,
        the state becomes a new conversation, forked from ``id``. ``id=None``
        inserts a new one.
        """
        now = time.time()
        row: dict[str, object] = {
            **encode_state(state),
            "title": title_of(state, pending),
            "updated": now,
            "pending": pending,
            "model": model.file if model else None,
            "model_sha256": model.sha256 if model else None,
            "identity": model.identity if model else None,
            "n_ctx": n_ctx,
        }
        with self._db() as db, self._immediate(db):
            reason = None
            if id is not None:
                columns = ", ".join(f"{name} = ?" for name in row)
                cursor = db.execute(
                    f"UPDATE conversations SET {columns}, revision = revision + 1 "
                    "WHERE id = ? AND revision = ?",
                    [*row.values(), id, revision],
                )
                if cursor.rowcount:
                    return Written(id=id, revision=revision + 1)
                held = db.execute("SELECT 1 FROM conversations WHERE id = ?", [id]).fetchone()
                reason = "another chat saved it meanwhile" if held else "it was deleted meanwhile"
            new_id = secrets.token_hex(8)
            db.table("conversations").insert(
                {"id": new_id, "created": now, "revision": 1, "forked_from": id, **row}
            )
            return Written(id=new_id, revision=1, forked_from=id, reason=reason)

    def delete(self, id: str) -> bool:
        """Forget a conversation; False if there was none with this id."""
        with self._db() as db, self._immediate(db):
            cursor = db.execute("DELETE FROM conversations WHERE id = ?", [id])
            return cursor.rowcount > 0

    # ------------------------------------------------------------------ reads
    def scan(self) -> tuple[list[ConversationInfo], list[Skipped]]:
        """Every conversation that reads back, most recently updated first; and those that don't."""
        sql = (
            f"SELECT {INFO_COLUMNS}, {STATE_COLUMNS} FROM conversations "
            "ORDER BY updated DESC, rowid DESC"
        )
        with self._db() as db:
            rows = db.execute(sql).fetchall()
        found: list[ConversationInfo] = []
        skipped: list[Skipped] = []
        for row in rows:
            try:
                info = decode_info(row[:INFO_WIDTH])
                decode_state(info.id, row[INFO_WIDTH:], info.tokens)
            except MalformedConversation as exc:
                skipped.append(Skipped(exc.id, exc.reason))
                log.warning("%s", exc)
            else:
                found.append(info)
        return found, skipped

    def list(self, limit: int | None = None) -> list[ConversationInfo]:
        """Saved conversations that read back, most recently updated first."""
        found = self.scan()[0]
        return found if limit is None else found[:limit]

    def latest(self) -> ConversationInfo | None:
        """The most recently updated conversation that reads back, or None."""
        found = self.list(limit=1)
        return found[0] if found else None

    def info(self, id: str) -> ConversationInfo:
        """Raises ``ConversationNotFound`` or ``MalformedConversation``."""
        return decode_info(self._row(id, INFO_COLUMNS))

    def load(self, id: str) -> ChatState:
        """The saved state, exactly as it was saved (raises as ``info``)."""
        return decode_state(id, self._row(id, STATE_COLUMNS), self.info(id).tokens)

    def _row(self, id: str, columns: str) -> tuple[object, ...]:
        with self._db() as db:
            row = db.execute(f"SELECT {columns} FROM conversations WHERE id = ?", [id]).fetchone()
        if row is None:
            raise ConversationNotFound(id)
        return tuple(row)

    def resolve(self, ident: str) -> str:
        """The id of the conversation that ``ident`` names: an id, or its unique start."""
        with self._db() as db:
            ids = [
                str(row[0])
                for row in db.execute(
                    "SELECT id FROM conversations WHERE substr(id, 1, length(?)) = ?",
                    [ident, ident],
                ).fetchall()
            ]
        if ident in ids:
            return ident
        if len(ids) == 1 and ident:
            return ids[0]
        if ids and ident:
            raise ConversationNotFound(f"{ident} (ambiguous: {len(ids)} conversations start so)")
        raise ConversationNotFound(ident)

    # --------------------------------------------------------------- privacy
    def holding(self, text: str, runs: Sequence[np.ndarray] = ()) -> tuple[ConversationInfo, ...]:
        """Conversations that hold a document, most recently updated first.

        One holds it if its system prompt or a message contains the document's
        text (an attached document is a message holding the text alone), or if
        its tokens contain ``RUN_LENGTH`` consecutive tokens of one of ``runs``
        (the document tokenized by a model's vocabulary, see
        ``localkv.cache.forgetting``). ``cache forget`` must not leave it there:
        a damaged row is searched as raw text and bytes, and listed by id.
        """
        needle = text.strip()
        document = DocumentRuns.of(runs)
        with self._db() as db:
            rows = db.execute(
                f"SELECT {INFO_COLUMNS}, system, messages, tokens FROM conversations "
                "ORDER BY updated DESC, rowid DESC"
            ).fetchall()
        held: list[ConversationInfo] = []
        for row in rows:
            system, messages, tokens = row[INFO_WIDTH : INFO_WIDTH + 3]
            pending = row[10]
            texts = [system, pending, *message_texts(messages)]
            blob = tokens if isinstance(tokens, bytes) else b""
            ids = np.frombuffer(blob[: len(blob) // 4 * 4], dtype="<i4")
            if (needle and any(isinstance(t, str) and needle in t for t in texts)) or (
                document.holds(ids)
            ):
                held.append(info_or_placeholder(row[:INFO_WIDTH]))
        return tuple(held)

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

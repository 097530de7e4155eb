"""The schema of ``conversations.db``: migrations as data, applied when the store opens.

Never edit a migration that has shipped: add a new one.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import sqlite_utils

from localkv.storage.index.health import read_only_uri
from localkv.storage.index.migrations import Migrations

__all__ = ["MIGRATIONS", "connect", "migrate", "rebuild_table"]

migration = Migrations()  # the conversation database's schema
MIGRATIONS = migration.functions


def migrate(db: sqlite_utils.Database) -> list[str]:
    """Apply the migrations not yet named in ``_migrations``; return their names."""
    return migration.apply(db)


def connect(path: Path | None, read_only: bool) -> tuple[sqlite3.Connection, bool]:
    """A connection to the history (None: in memory), and whether it is ready to read.

    ``read_only``: a history whose schema is current is opened read-only, so no
    write lock another process holds, and no full disk, keeps it from being
    read (immutable when SQLite cannot make its -shm there); one that needs
    migrating, and every other, is opened for writing (not ready: migrate it).
    """
    if path is None:
        return sqlite3.connect(":memory:", check_same_thread=False), False
    if read_only:
        for uri in (read_only_uri(path), read_only_uri(path, immutable=True)):
            conn = sqlite3.connect(uri, uri=True, timeout=30.0, check_same_thread=False)
            try:
                db = sqlite_utils.Database(conn)
                ready = not migration.pending(db) and db.table("conversations").exists()
            except sqlite3.OperationalError:  # no -shm can be made: the immutable one
                conn.close()
                continue
            if ready:
                return conn, True
            conn.close()
            break
    return sqlite3.connect(str(path), timeout=30.0, check_same_thread=False), False


def rebuild_table(db: sqlite_utils.Database) -> None:
    """Make the ``conversations`` table again (empty) after something dropped it."""
    for fn in MIGRATIONS:
        fn(db)


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


@migration
def m003_models_and_revisions(db: sqlite_utils.Database) -> None:
    """The model a conversation needs, a revision per write, the unanswered message, forks.

    Rows saved before have no model (NULL): they resume with any model.
    """
    table = db.table("conversations")
    for name in ("model", "model_sha256", "identity", "pending", "forked_from"):
        table.add_column(name, str)
    table.add_column("revision", int, not_null_default=0)


@migration
def m004_context_size(db: sqlite_utils.Database) -> None:
    """The context (``--ctx``) a conversation was made in: a resume too small for it names it.

    Rows saved before have none (NULL).
    """
    db.table("conversations").add_column("n_ctx", int)

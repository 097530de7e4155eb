"""The SQLite index of blocks and snapshots (sqlite-utils, WAL, ``BEGIN IMMEDIATE``).

``BlockIndex`` owns one connection, shared by the store's threads under a
lock. It knows rows and queries, never files. Writes run inside ``write()``,
a ``BEGIN IMMEDIATE`` transaction, so two processes never interleave a
read-check-write sequence; ``busy_timeout`` makes the other one wait.

Reads go to the ``sqlite3`` connection itself; ``sqlite_utils`` (and the many
modules it imports) is imported by the first write or migration, so a cache
hit's first token does not wait for it.
"""

from __future__ import annotations

import contextlib
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from .. import faults
from ..values import BlockRow, SnapshotRow
from .health import IndexDamaged, is_damage, read_only_uri
from .migrations import MIGRATIONS, migrate
from .rows import (
    BLOCK_COLUMNS,
    PIN_HOLDS,
    SNAPSHOT_COLUMNS,
    USER_PIN_HOLDS,
    block_row,
    readable_rows,
    snapshot_row,
)

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["BlockIndex"]

_IN_CHUNK = 500
_DESCENDANTS = (
    "WITH RECURSIVE d(hash) AS (SELECT hash FROM blocks WHERE hash IN ({marks}) "
    "UNION SELECT b.hash FROM blocks b JOIN d ON b.parent = d.hash) SELECT hash FROM d"
)


def _chunks(items: Sequence[str]) -> Iterator[Sequence[str]]:
    for i in range(0, len(items), _IN_CHUNK):
        yield items[i : i + _IN_CHUNK]


def _marks(n: int) -> str:
    return ", ".join("?" * n)


class BlockIndex:
    """Rows of ``index.db``; every method takes the connection lock."""

    def __init__(self, path: Path | None, *, read_only: bool = False) -> None:
        """Open (creating and migrating) the index at ``path`` (None: in memory).

        ``read_only``: open it without writing anything (a cache directory this
        process cannot write); every write raises ``sqlite3.OperationalError``.
        A file that is not a sound SQLite index raises ``IndexDamaged``.
        """
        self.lock = threading.RLock()
        self.read_only = read_only
        self.path = path
        try:
            conn = self._connect(path)
        except sqlite3.DatabaseError as exc:
            raise IndexDamaged(path, str(exc)) if is_damage(exc) else exc from None
        self.conn = conn
        self._db: sqlite_utils.Database | None = None
        try:
            self._prepare(path)
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise IndexDamaged(path, str(exc)) if is_damage(exc) else exc from None

    def _connect(self, path: Path | None) -> sqlite3.Connection:
        if path is None:
            return sqlite3.connect(":memory:", check_same_thread=False)
        if not self.read_only:
            return sqlite3.connect(str(path), timeout=30.0, check_same_thread=False)
        conn = sqlite3.connect(read_only_uri(path), uri=True, timeout=30.0, check_same_thread=False)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:  # a WAL index whose -shm cannot be made here
            conn.close()
        uri = read_only_uri(path, immutable=True)
        return sqlite3.connect(uri, uri=True, timeout=30.0, check_same_thread=False)

    @property
    def db(self) -> sqlite_utils.Database:
        """The connection as a ``sqlite_utils.Database`` (imported on first use)."""
        if self._db is None:
            import sqlite_utils

            self._db = sqlite_utils.Database(self.conn, execute_plugins=False)  # no plugins
        return self._db

    def _prepare(self, path: Path | None) -> None:
        self.conn.execute("PRAGMA busy_timeout = 30000")
        if self.read_only:
            return  # pending migrations wait for a writer; reads of what is there work
        applied: set[str] = set()
        # deleted rows (a forgotten document's tokens) are overwritten, not left in free pages
        self.conn.execute("PRAGMA secure_delete = ON")
        if path is not None:
            self.conn.execute("PRAGMA journal_mode = WAL")
            self.conn.execute("PRAGMA synchronous = NORMAL")
        made = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = '_migrations'"
        if self.conn.execute(made).fetchone() is not None:
            applied = {r[0] for r in self.conn.execute("SELECT name FROM _migrations")}
        if any(fn.__name__ not in applied for fn in MIGRATIONS):
            with self.write():
                migrate(self.db)

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    @contextlib.contextmanager
    def write(self) -> Iterator[sqlite_utils.Database]:
        """A ``BEGIN IMMEDIATE`` transaction: committed on success, rolled back on error."""
        with self.lock:
            db = self.db
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield db
                faults.point("before_commit")
                self.conn.execute("COMMIT")
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.rollback()
                raise
            faults.point("after_commit")

    def checkpoint(self) -> bool:
        """Copy the WAL into the database and truncate it to zero bytes; False when a
        reader in another process kept the WAL from being emptied (SQLite's ``busy``)."""
        with self.lock:
            row = self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return not (row and int(row[0]))

    def vacuum(self) -> None:
        """Rebuild the database file without free pages (outside any transaction)."""
        with self.lock:
            self.conn.execute("VACUUM")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """All rows of a read query."""
        with self.lock:
            return list(self.conn.execute(sql, params).fetchall())

    # ------------------------------------------------------------------ blocks
    def has_block(self, block_hash: str) -> bool:
        return bool(self.query("SELECT 1 FROM blocks WHERE hash = ?", (block_hash,)))

    def get_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]:
        """The stored rows among ``hashes``, by hash (one indexed query per 500)."""
        found: dict[str, BlockRow] = {}
        for chunk in _chunks(list(dict.fromkeys(hashes))):
            sql = f"SELECT {BLOCK_COLUMNS} FROM blocks WHERE hash IN ({_marks(len(chunk))})"
            for r in self.query(sql, chunk):
                found.update((row.hash, row) for row in readable_rows([r]))
        return found

    def get_block(self, block_hash: str) -> BlockRow | None:
        return self.get_blocks([block_hash]).get(block_hash)

    def all_blocks(self) -> list[BlockRow]:
        """Every readable row (see ``unreadable_blocks`` for the others)."""
        rows = self.query(f"SELECT {BLOCK_COLUMNS} FROM blocks")
        return [row for r in rows for row in readable_rows([r])]

    def unreadable_blocks(self) -> list[tuple[str, str]]:
        """(hash, reason) of every row that does not decode as a block row."""
        bad: list[tuple[str, str]] = []
        for r in self.query(f"SELECT {BLOCK_COLUMNS} FROM blocks"):
            try:
                block_row(r)
            except (ValueError, TypeError) as exc:
                bad.append((str(r[0]), f"index row cannot be read: {exc}"))
        return bad

    def insert_block(self, db: sqlite_utils.Database, row: BlockRow) -> None:
        """Insert a row inside a ``write()`` transaction (ignored if the hash exists)."""
        db.execute(
            f"INSERT INTO blocks ({BLOCK_COLUMNS}, n_tokens) "
            f"VALUES ({_marks(BLOCK_COLUMNS.count(',') + 2)}) ON CONFLICT(hash) DO NOTHING",
            (
                row.hash,
                row.parent,
                row.identity,
                row.namespace,
                row.start,
                row.tokens.astype("<i4").tobytes(),
                row.tokens_sha,
                row.file,
                row.raw_bytes,
                row.stored_bytes,
                row.checksum,
                row.probe.digest,
                row.probe.top_bytes(),
                row.prefill_seconds,
                row.created,
                row.last_used,
                row.hits,
                row.ends.astype("<u4").tobytes(),
                int(row.end_state),
                row.n_tokens,
            ),
        )

    def add_block(
        self, row: BlockRow, before_insert: Callable[[], None] | None = None
    ) -> Literal["inserted", "exists", "orphan"]:
        """Insert a row unless it exists or its parent is gone (checked in the transaction).

        ``before_insert`` runs inside the transaction, just before the insert:
        the store uses it to put the block's file in place under the write lock.
        """
        with self.write() as db:
            if db.execute("SELECT 1 FROM blocks WHERE hash = ?", (row.hash,)).fetchone():
                return "exists"
            if (
                row.parent is not None
                and not db.execute("SELECT 1 FROM blocks WHERE hash = ?", (row.parent,)).fetchone()
            ):
                return "orphan"
            if before_insert is not None:
                before_insert()
            self.insert_block(db, row)
            return "inserted"

    def files_in_use(self, db: sqlite_utils.Database, files: Sequence[str]) -> set[str]:
        """Those of ``files`` that some row names (inside ``write()``)."""
        used: set[str] = set()
        for chunk in _chunks(list(files)):
            sql = f"SELECT file FROM blocks WHERE file IN ({_marks(len(chunk))})"
            used.update(str(r[0]) for r in db.execute(sql, chunk).fetchall())
        return used

    def children(
        self, parent: str | None, identity: str, namespace: str, first_token: int | None = None
    ) -> list[BlockRow]:
        cond = "parent IS NULL" if parent is None else "parent = ?"
        params: tuple[object, ...] = () if parent is None else (parent,)
        if first_token is not None:
            # tokens are int32 little-endian: compare the first 4 bytes in SQL
            cond += " AND substr(tokens, 1, 4) = ?"
            params = (*params, struct.pack("<i", first_token))
        params = (*params, identity, namespace)
        sql = (
            f"SELECT {BLOCK_COLUMNS} FROM blocks WHERE {cond} AND identity = ? "
            "AND namespace = ? ORDER BY start, hash"
        )
        return [row for r in self.query(sql, params) for row in readable_rows([r])]

    def same_first_block_elsewhere(
        self, tokens_sha: str, identity: str, namespace: str
    ) -> list[str]:
        sql = (
            "SELECT DISTINCT identity FROM blocks WHERE tokens_sha = ? AND parent IS NULL "
            "AND namespace = ? AND identity != ? ORDER BY identity"
        )
        return [str(r[0]) for r in self.query(sql, (tokens_sha, namespace, identity))]

    def chain_of(self, tip: str) -> list[BlockRow]:
        """The chain ending at ``tip``, root first (empty if ``tip`` is not stored)."""
        sql = (
            "WITH RECURSIVE c(hash, depth) AS (SELECT ?, 0 UNION ALL "
            "SELECT b.parent, c.depth + 1 FROM blocks b JOIN c ON b.hash = c.hash "
            "WHERE b.parent IS NOT NULL) "
            f"SELECT {', '.join('b.' + c for c in BLOCK_COLUMNS.split(', '))} "
            "FROM c JOIN blocks b ON b.hash = c.hash ORDER BY c.depth DESC"
        )
        return readable_rows(self.query(sql, (tip,)))

    def descendants(self, db: sqlite_utils.Database, hashes: Sequence[str]) -> set[str]:
        """``hashes`` that are stored, and every block below them."""
        found: set[str] = set()
        for chunk in _chunks(list(hashes)):
            sql = _DESCENDANTS.format(marks=_marks(len(chunk)))
            found.update(r[0] for r in db.execute(sql, chunk).fetchall())
        return found

    def delete_blocks(self, db: sqlite_utils.Database, hashes: Iterable[str]) -> list[str]:
        """Delete rows inside ``write()``; return their files. Unpinned snapshots on them go."""
        files: list[str] = []
        items = list(hashes)
        for chunk in _chunks(items):
            marks = _marks(len(chunk))
            files.extend(
                r[0] for r in db.execute(f"SELECT file FROM blocks WHERE hash IN ({marks})", chunk)
            )
            db.execute(f"DELETE FROM snapshots WHERE tip IN ({marks})", chunk)
            db.execute(f"DELETE FROM blocks WHERE hash IN ({marks})", chunk)
        return files

    def touch(self, hashes: Sequence[str], now: float) -> None:
        with self.write() as db:
            for chunk in _chunks(list(hashes)):
                marks = _marks(len(chunk))
                db.execute(
                    f"UPDATE blocks SET last_used = ?, hits = hits + 1 WHERE hash IN ({marks})",
                    (now, *chunk),
                )
                # a snapshot's hits are the restores that name it (``events.record``)
                db.execute(
                    f"UPDATE snapshots SET last_used = ? WHERE tip IN ({marks})", (now, *chunk)
                )

    # -------------------------------------------------------------- identities
    def put_identity(self, digest: str, json_text: str, now: float) -> None:
        """Store an identity's JSON once; ValueError if its digest holds other JSON.

        Read first: an identity already stored (every open after the first)
        takes no write transaction, so opening waits for no other writer.
        """
        stored = self.get_identity(digest)
        if stored == json_text:
            return
        if stored is not None:
            raise ValueError(f"identity {digest} is already stored with other JSON")
        with self.write() as db:
            found = db.execute("SELECT json FROM identities WHERE digest = ?", (digest,)).fetchone()
            if found is None:
                db.execute(
                    "INSERT INTO identities (digest, json, created) VALUES (?, ?, ?)",
                    (digest, json_text, now),
                )
            elif found[0] != json_text:
                raise ValueError(f"identity {digest} is already stored with other JSON")

    def get_identity(self, digest: str) -> str | None:
        rows = self.query("SELECT json FROM identities WHERE digest = ?", (digest,))
        return str(rows[0][0]) if rows else None

    # --------------------------------------------------------------- snapshots
    def insert_snapshot(self, db: sqlite_utils.Database, snap: SnapshotRow) -> None:
        """Insert a snapshot row inside a ``write()`` transaction."""
        db.execute(
            f"INSERT INTO snapshots ({SNAPSHOT_COLUMNS}) VALUES ({_marks(15)})",
            (
                snap.id,
                snap.tip,
                snap.label,
                snap.source_path,
                snap.source_sha256,
                snap.n_tokens,
                snap.identity,
                snap.namespace,
                snap.created,
                snap.last_used,
                snap.hits,
                int(snap.pinned),
                snap.pinned_until if snap.pinned else None,
                snap.pin_owner,
                snap.system,
            ),
        )

    def snapshots(self, namespace: str | None = None) -> list[SnapshotRow]:
        where, params = ("", ()) if namespace is None else ("WHERE namespace = ?", (namespace,))
        sql = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots {where} ORDER BY created, id"
        return [snapshot_row(r) for r in self.query(sql, params)]

    def snapshots_by_prefix(self, prefix: str) -> list[SnapshotRow]:
        escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        sql = f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE id LIKE ? ESCAPE '\\'"
        return [snapshot_row(r) for r in self.query(sql, (escaped + "%",))]

    def protected(
        self, db: sqlite_utils.Database, *, pinned_only: bool, users_only: bool = False
    ) -> set[str]:
        """Blocks in the chain of any snapshot (``pinned_only``: whose pin holds now;
        ``users_only`` too: a pin the user asked for, not a server's client)."""
        holds = USER_PIN_HOLDS if users_only else PIN_HOLDS
        where = f"WHERE {holds}" if pinned_only else ""
        sql = (
            f"WITH RECURSIVE c(hash) AS (SELECT tip FROM snapshots {where} UNION "
            "SELECT b.parent FROM blocks b JOIN c ON b.hash = c.hash "
            "WHERE b.parent IS NOT NULL) SELECT c.hash FROM c JOIN blocks b ON b.hash = c.hash"
        )
        params = (time.time(),) if pinned_only else ()
        return {r[0] for r in db.execute(sql, params).fetchall()}

"""SHA-256 of large files, computed once per (path, size, mtime, inode).

A GGUF of several gigabytes takes seconds to hash; its content hash is part
of every cache identity, so the result is remembered in a small SQLite table
keyed by what changes when the file does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable
from pathlib import Path

from .paths import ensure_private_db

__all__ = ["FileHasher", "recorded_paths", "sha256_file"]

log = logging.getLogger(__name__)

_CHUNK = 4 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class FileHasher:
    """Content hashes remembered in memory and, with ``db_path``, on disk."""

    def __init__(self, db_path: Path | None = None) -> None:
        self._memo: dict[tuple[str, int, int, int], str] = {}
        self._lock = threading.Lock()
        self._db_path = db_path
        if db_path is not None:
            db = self._connect()
            try:
                db.execute(
                    "CREATE TABLE IF NOT EXISTS file_hashes (path TEXT, size INTEGER, "
                    "mtime_ns INTEGER, inode INTEGER, sha256 TEXT NOT NULL, "
                    "PRIMARY KEY (path, size, mtime_ns, inode))"
                )
            finally:
                db.close()

    def _connect(self) -> sqlite3.Connection:
        if self._db_path is None:
            raise RuntimeError("no database")
        ensure_private_db(self._db_path)  # 0600, never a symlink
        # autocommit: each write below opens its own BEGIN IMMEDIATE
        db = sqlite3.connect(self._db_path, timeout=30, isolation_level=None)
        db.execute("PRAGMA busy_timeout = 30000")
        return db

    def sha256(self, path: Path) -> str:
        real = Path(path).resolve()
        st = os.stat(real)
        key = (str(real), st.st_size, st.st_mtime_ns, st.st_ino)
        with self._lock:
            if key in self._memo:
                return self._memo[key]
        digest = self._lookup(key)
        if digest is None:
            digest = sha256_file(real)
            self._remember(key, digest)
        with self._lock:
            self._memo[key] = digest
        return digest

    def _lookup(self, key: tuple[str, int, int, int]) -> str | None:
        if self._db_path is None:
            return None
        db = self._connect()
        try:
            row = db.execute(
                "SELECT sha256 FROM file_hashes WHERE path=? AND size=? AND mtime_ns=? AND inode=?",
                key,
            ).fetchone()
        finally:
            db.close()
        return str(row[0]) if row else None

    def _remember(self, key: tuple[str, int, int, int], digest: str) -> None:
        if self._db_path is None:
            return
        db = self._connect()
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                db.execute("DELETE FROM file_hashes WHERE path=?", (key[0],))
                db.execute("INSERT INTO file_hashes VALUES (?, ?, ?, ?, ?)", (*key, digest))
                db.execute("COMMIT")
            except BaseException:
                db.rollback()
                raise
        finally:
            db.close()


def recorded_paths(file_hashes: Path, sha256: Iterable[str]) -> list[Path]:
    """Files recorded in ``file_hashes`` (a ``FileHasher`` database, read-only) with one
    of these content hashes that still exist, in the order recorded."""
    wanted = set(sha256)
    if not wanted or not file_hashes.is_file():
        return []
    try:
        db = sqlite3.connect(f"file:{file_hashes}?mode=ro", uri=True, timeout=30)
    except sqlite3.Error as exc:
        log.warning("cannot read %s: %s", file_hashes, exc)
        return []
    try:
        rows = db.execute("SELECT path, sha256 FROM file_hashes ORDER BY rowid").fetchall()
    except sqlite3.Error as exc:
        log.warning("cannot read %s: %s", file_hashes, exc)
        return []
    finally:
        db.close()
    paths = [Path(str(p)) for p, sha in rows if sha in wanted]
    return [p for p in dict.fromkeys(paths) if p.is_file()]

"""Is ``index.db`` sound? SQLite's own check, and the error a damaged index raises.

A damaged index (garbage bytes, a damaged page) surfaces as a
``sqlite3.DatabaseError`` with SQLite's code ``SQLITE_CORRUPT`` or
``SQLITE_NOTADB``, at open or at the first query that reaches the damage.
``IndexDamaged`` is that error with one line that names the way back:
``localkv cache repair`` rebuilds the index from the block files
(``storage/repair.py``). It is a ``sqlite3.DatabaseError``, so code that
already falls back on index errors keeps doing so.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

__all__ = ["REPAIR_HINT", "IndexDamaged", "check_index", "is_damage", "read_only_uri"]

REPAIR_HINT = "run `localkv cache repair` to rebuild it from the block files"
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
_MAX_MESSAGES = 5


class IndexDamaged(sqlite3.DatabaseError):
    """The index cannot be read; ``reason`` says what SQLite found."""

    def __init__(self, path: Path | None, reason: str) -> None:
        self.path = path
        self.reason = reason
        where = f" {path}" if path is not None else ""
        super().__init__(f"the cache index{where} is damaged ({reason}); {REPAIR_HINT}")


def is_damage(exc: BaseException) -> bool:
    """True if ``exc`` is SQLite reporting a damaged or foreign database file."""
    if isinstance(exc, IndexDamaged):
        return True
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    text = str(exc)
    return "malformed" in text or "not a database" in text


def read_only_uri(path: Path, *, immutable: bool = False) -> str:
    """The SQLite URI that opens ``path`` read-only (``immutable``: not even its -shm)."""
    return f"{path.absolute().as_uri()}?mode=ro" + ("&immutable=1" if immutable else "")


def check_index(path: Path) -> str | None:
    """Why the SQLite file at ``path`` is not sound, or None (a missing file is None too).

    Runs ``PRAGMA integrity_check`` on a read-only connection (``immutable``
    where a read-only directory keeps SQLite from making the -shm), so
    checking never changes the file. An error that is not damage (the file
    is busy or cannot be opened here) is not a finding: None.
    """
    if not path.exists():
        return None
    for immutable in (False, True):
        try:
            return _integrity(read_only_uri(path, immutable=immutable))
        except sqlite3.Error as exc:
            if is_damage(exc):
                return str(exc)
    return None


def _integrity(uri: str) -> str | None:
    conn = sqlite3.connect(uri, uri=True, timeout=30.0)
    try:
        messages = [str(r[0]) for r in conn.execute("PRAGMA integrity_check").fetchall()]
    finally:
        with contextlib.suppress(sqlite3.Error):
            conn.close()
    if messages == ["ok"]:
        return None
    more = f" (+{len(messages) - _MAX_MESSAGES} more)" if len(messages) > _MAX_MESSAGES else ""
    return "integrity check: " + "; ".join(messages[:_MAX_MESSAGES]) + more

"""The privacy path: ``forget`` one document and ``scrub`` what its rows left behind.

``forget`` removes a document's snapshots, the blocks only they need (with
every block below them and every longer sibling that holds their tokens),
those blocks' quarantined copies, and then ``scrub``s the index so no SQLite
page or WAL frame still holds their rows. ``SnapshotStore.forget`` and
``SnapshotStore.scrub`` delegate here.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import numpy as np

from .files import remove_file
from .index import BlockIndex
from .paths import CacheLayout
from .removal import bytes_of, remove_files
from .values import ForgetReport

__all__ = ["forget", "scrub"]

logger = logging.getLogger(__name__)


def forget(
    index: BlockIndex, layout: CacheLayout, source_path: str | None, source_sha256: str | None
) -> ForgetReport:
    """Remove every trace of one document: its snapshots and the blocks only it needs.

    A snapshot matches if its ``source_sha256`` equals ``source_sha256`` or its
    ``source_path`` (one path, or several joined by ``"; "``) names
    ``source_path``. Its chain's blocks that no other snapshot needs go, with
    every block below them and every sibling that holds their tokens and more
    (a longer prompt saved by ``ask``), their quarantined copies, and, through
    ``scrub()``, the SQLite pages and WAL frames that held their rows.
    """
    matched = [
        s
        for s in index.snapshots()
        if (source_sha256 is not None and s.source_sha256 == source_sha256)
        or (source_path is not None and source_path in (s.source_path or "").split("; "))
    ]
    with index.write() as db:
        for snap in matched:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
        needed = index.protected(db, pinned_only=False)
        own = {r.hash for s in matched for r in index.chain_of(s.tip)} - needed
        victims = index.descendants(db, [*own, *_extensions(index, own)]) - needed
        freed = bytes_of(index, victims)
        files = index.delete_blocks(db, victims)
    remove_files(index, layout, files)
    quarantined = _remove_quarantined(layout, victims)
    busy = scrub(index)
    logger.info("forgot %d snapshot(s), %d block(s), %d bytes", len(matched), len(victims), freed)
    return ForgetReport(
        snapshots=sorted(s.id for s in matched),
        blocks=len(victims),
        bytes_freed=freed,
        quarantined_files=quarantined,
        wal_truncated=not busy,
    )


def scrub(index: BlockIndex) -> bool:
    """Overwrite what deleted rows left behind: VACUUM, then empty the WAL.

    Deleted rows are zeroed as they go (``secure_delete``); this rebuilds the
    file and truncates the WAL so no older page survives in it. Returns True
    if a reader in another process kept the WAL from being emptied.
    """
    try:
        index.vacuum()
    except sqlite3.OperationalError as exc:  # another process is writing: try later
        logger.warning("could not vacuum the index: %s", exc)
    busy, _, _ = index.checkpoint()
    if busy:
        logger.warning("the index WAL is in use by another process; not yet truncated")
    return bool(busy)


def _extensions(index: BlockIndex, hashes: set[str]) -> set[str]:
    """Blocks beside ``hashes`` (same parent and start) whose tokens begin with theirs."""
    rows = index.get_blocks(list(hashes))
    out: set[str] = set()
    for row in rows.values():
        for sib in index.children(row.parent, row.identity, row.namespace):
            n = row.n_tokens
            if (
                sib.hash not in hashes
                and sib.start == row.start
                and sib.n_tokens > n
                and np.array_equal(sib.tokens[:n], row.tokens)
            ):
                out.add(sib.hash)
    return out


def _remove_quarantined(layout: CacheLayout, hashes: set[str]) -> int:
    """Delete the quarantined copies of these blocks' files; return how many went."""
    names = {layout.block_relpath(h).rsplit("/", 1)[1] for h in hashes}
    count = 0
    for entry in os.scandir(layout.quarantine):
        if entry.name.split(".lkv", 1)[0] + ".lkv" in names:
            remove_file(Path(entry.path))
            count += 1
    return count

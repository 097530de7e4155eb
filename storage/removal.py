"""Removing blocks: ``quarantine`` a bad one, ``evict`` down to a budget, unlink files.

Deleting is row first, then file: rows go under the index's write lock, then
the files those rows named go through ``remove_files``. A crash in between
leaves an orphan file that ``gc`` removes, never a row that points at nothing
it did not check. ``SnapshotStore.quarantine`` and ``SnapshotStore.evict``
delegate here; ``snapshots.py`` and ``forget.py`` use ``remove_files`` and
``bytes_of``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Sequence

from . import budget, faults
from .files import move_to_quarantine, remove_file
from .index import BlockIndex
from .paths import CacheLayout

__all__ = ["bytes_of", "evict", "quarantine", "remove_files"]

logger = logging.getLogger(__name__)


def bytes_of(index: BlockIndex, hashes: Iterable[str]) -> int:
    """The bytes stored for these blocks (those the index still holds)."""
    rows = index.get_blocks(list(hashes))
    return sum(r.stored_bytes for r in rows.values())


def remove_files(
    index: BlockIndex,
    layout: CacheLayout,
    files: Sequence[str],
    quarantine_reason: str | None = None,
) -> None:
    """Unlink files whose rows are gone, under the write lock.

    A file that a row names again (the block was saved anew since its row
    was deleted) is left alone. With ``quarantine_reason`` files are moved
    to ``quarantine/`` instead.
    """
    if not files:
        return
    with index.write() as db:
        in_use = index.files_in_use(db, files)
        faults.point("before_unlink")
        for f in files:
            if f in in_use:
                continue
            try:
                if quarantine_reason is None:
                    remove_file(layout.resolve(f))
                else:
                    move_to_quarantine(layout, f, quarantine_reason)
            except (OSError, ValueError) as exc:
                logger.warning("could not remove %s: %s", f, exc)


def quarantine(index: BlockIndex, layout: CacheLayout, block_hash: str, reason: str) -> list[str]:
    """Drop a bad block and its descendants from the index; move its file aside.

    Returns the hashes removed. The bad block's file goes to ``quarantine/``
    with the reason; its descendants' files (fine but unreachable) are deleted.
    """
    with index.write() as db:
        gone = index.descendants(db, [block_hash])
        if block_hash not in gone:
            return []  # already removed (evicted while being read): nothing to do
        files = index.delete_blocks(db, gone - {block_hash})
        own = index.delete_blocks(db, [block_hash])
    with contextlib.suppress(ValueError):  # a malformed hash: its row named the file
        own = [layout.block_relpath(block_hash)]
    remove_files(index, layout, own, quarantine_reason=reason)
    remove_files(index, layout, files)
    logger.warning(
        "quarantined block %s (%s); dropped %d descendant(s)", block_hash, reason, len(files)
    )
    return sorted(gone)


def evict(index: BlockIndex, layout: CacheLayout, budget_bytes: int) -> int:
    """Evict unpinned leaf blocks, least valuable first, until within budget.

    Never touches a pinned snapshot's chain or the middle of a chain;
    snapshots whose tip goes are dropped. Returns the bytes freed.
    """
    with index.write() as db:
        total = int(db.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM blocks").fetchone()[0])
        if total <= budget_bytes:
            return 0
        protected = index.protected(db, pinned_only=True)
        infos = [
            budget.LeafInfo(*r)
            for r in db.execute(
                "SELECT hash, parent, stored_bytes, prefill_seconds, last_used FROM blocks"
            ).fetchall()
        ]
        victims = budget.plan_eviction(infos, protected, total - budget_bytes, time.time())
        freed = bytes_of(index, victims)
        files = index.delete_blocks(db, victims)
    remove_files(index, layout, files)
    logger.info("evicted %d block(s), %d bytes, budget %d", len(victims), freed, budget_bytes)
    return freed

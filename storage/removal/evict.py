"""Eviction: unpinned leaf blocks leave, least valuable first, until the store fits its budget.

``budget`` chooses the victims from the rows alone. This module makes the
choice and deletes the victims' rows in one write transaction, so no other
process adds a child to a leaf in between, then removes their files.
"""

from __future__ import annotations

import logging
import time

from ..index.blockindex import BlockIndex
from ..paths import CacheLayout
from . import budget
from .deletion import remove_files

__all__ = ["evict"]

logger = logging.getLogger(__name__)


def evict(index: BlockIndex, layout: CacheLayout, budget_bytes: int) -> int:
    """Evict unpinned leaf blocks, least valuable first, until within budget.

    Never touches a pinned snapshot's chain or the middle of a chain;
    snapshots whose tip goes are dropped. Returns the bytes freed on disk
    (a file reached through a symlink is not removed, so not counted).
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
        files = index.delete_blocks(db, victims)
    freed = remove_files(index, layout, files)
    logger.info("evicted %d block(s), %d bytes, budget %d", len(victims), freed, budget_bytes)
    return freed

"""Eviction: unpinned leaf blocks leave, least valuable first, until the store fits its budget.

``budget`` chooses the victims from the rows alone. This module makes the
choice and deletes the victims' rows in one write transaction, so no other
process adds a child to a leaf in between, then removes their files. The
user's pins keep their chains; the clients' pins keep theirs within the
clients' share of the budget (``budget.client_share``); the snapshots of
clients' refused or lapsed pins go first.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..index.blockindex import BlockIndex
from ..index.rows import CLIENT, CLIENT_PIN_HOLDS, PIN_HOLDS
from ..paths import CacheLayout
from . import budget
from .deletion import remove_files

__all__ = ["evict"]

if TYPE_CHECKING:
    import sqlite_utils

logger = logging.getLogger(__name__)


def evict(index: BlockIndex, layout: CacheLayout, budget_bytes: int) -> int:
    """Evict unpinned leaf blocks, least valuable first, until within budget.

    Never touches the chain of a snapshot the user pinned, nor one a client pinned
    within the clients' share, nor the middle of a chain; snapshots whose tip
    goes are dropped. Returns the bytes freed on disk (a file reached through a
    symlink is not removed, so not counted).
    """
    with index.write() as db:
        total = int(db.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM blocks").fetchone()[0])
        if total <= budget_bytes:
            return 0
        now = time.time()
        protected = index.protected(db, pinned_only=True, users_only=True)
        infos = [
            budget.LeafInfo(hash=h, parent=p, stored_bytes=n, prefill_seconds=s, last_used=u)
            for h, p, n, s, u in db.execute(
                "SELECT hash, parent, stored_bytes, prefill_seconds, last_used FROM blocks"
            ).fetchall()
        ]
        pins = db.execute(
            f"SELECT tip FROM snapshots WHERE {CLIENT_PIN_HOLDS} ORDER BY created, id", (now,)
        ).fetchall()
        share = budget.client_share(budget_bytes)
        protected |= budget.client_protected(infos, protected, [r[0] for r in pins], share)
        first = _refused(db, now)
        victims = budget.plan_eviction(infos, protected, total - budget_bytes, now, first)
        files = index.delete_blocks(db, victims)
    freed = remove_files(index, layout, files)
    logger.info("evicted %d block(s), %d bytes, budget %d", len(victims), freed, budget_bytes)
    return freed


_REFUSED = (
    "WITH RECURSIVE r(hash) AS (SELECT tip FROM snapshots WHERE {refused} UNION "
    "SELECT b.parent FROM blocks b JOIN r ON b.hash = r.hash WHERE b.parent IS NOT NULL), "
    "o(hash) AS (SELECT tip FROM snapshots WHERE NOT ({refused}) UNION "
    "SELECT b.parent FROM blocks b JOIN o ON b.hash = o.hash WHERE b.parent IS NOT NULL) "
    "SELECT hash FROM r EXCEPT SELECT hash FROM o"
)


def _refused(db: sqlite_utils.Database, now: float) -> set[str]:
    """The blocks only in the chains of snapshots whose client pin was refused or lapsed."""
    refused = f"COALESCE(pin_owner = '{CLIENT}' AND NOT ({PIN_HOLDS}), 0)"
    sql = _REFUSED.format(refused=refused)
    return {r[0] for r in db.execute(sql, (now, now)).fetchall()}

"""Quarantine: a block that failed a check leaves the index, its file kept aside.

Reading never deletes: a reader raises ``BlockCorrupt`` and its caller (a
restore, or ``verify(repair=True)``) decides to quarantine. The bad block's
file goes to ``quarantine/`` with a note of the reason, for a person to
inspect; its descendants are fine but unreachable, so their rows and files
go too.
"""

from __future__ import annotations

import contextlib
import logging

from ..index.blockindex import BlockIndex
from ..paths import CacheLayout
from .deletion import remove_files

__all__ = ["quarantine"]

logger = logging.getLogger(__name__)


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

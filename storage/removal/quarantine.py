"""Quarantine: a block that failed a check leaves the index, its file kept aside.

Reading never deletes: a reader raises ``BlockCorrupt`` and its caller (a
restore, or ``verify(repair=True)``) decides to quarantine. The bad block's
file goes to ``quarantine/`` with a note of the reason, for a person to
inspect; its descendants are fine but unreachable, so their rows and files
go too.

A damaged ``index.db`` is quarantined the same way by ``repair``
(``quarantine_index``): moved aside with its -wal and -shm and a note, never
deleted, before a new index is rebuilt from the block files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from pathlib import Path

from ..index.blockindex import BlockIndex
from ..paths import SQLITE_SIDE_FILES, CacheLayout, create_private_file, fsync_dir
from .deletion import remove_files

__all__ = ["quarantine", "quarantine_index"]

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


def quarantine_index(layout: CacheLayout, reason: str) -> Path | None:
    """Move ``index.db`` (and its -wal, -shm, -journal) into ``quarantine/`` with a note.

    Returns where the index went (None if there was none). Nothing is deleted.
    """
    if not os.path.lexists(layout.index):
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
    dest = layout.quarantine / f"index-{stamp}-{secrets.token_hex(3)}.db"
    for suffix in ("", *SQLITE_SIDE_FILES):
        src = layout.index.with_name(layout.index.name + suffix)
        if os.path.lexists(src):
            os.replace(src, dest.with_name(dest.name + suffix))
    fd = create_private_file(dest.with_name(dest.name + ".reason"))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(reason + "\n")
    fsync_dir(layout.quarantine)
    fsync_dir(layout.root)
    logger.info("quarantined the cache index as %s (%s)", dest, reason)
    return dest

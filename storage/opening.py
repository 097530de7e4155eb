"""Opening a cache root: created and private, read-only, or not there at all.

- A root this process can write is created if needed (``paths.prepare_root``:
  0700 directories, a 0600 index) and its index opened for writing.
- A root it cannot write (a read-only mount, a directory made read-only) is
  checked the same way (never a symlink, owned by this user, not writable by
  others) and its index opened read-only: restores work, nothing is saved,
  and every write raises ``sqlite3.OperationalError``. A read-only root
  without an index is an empty store.
- A root on a full disk (less free than the least ``LOCALKV_MIN_FREE``), whose
  index cannot be opened for writing (SQLite cannot create its -wal/-shm), is
  opened read-only the same way: reading needs no room.
- With ``create=False`` (the read-only commands: ``cache ls``, ``show``,
  ``stats``, ``verify``), a root that does not exist is an empty store in
  memory, and no directory is created.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
from pathlib import Path
from typing import NamedTuple

from .disk import MIN_FREE_FLOOR
from .index.blockindex import BlockIndex
from .paths import CacheDirError, CacheLayout, ensure_private_dir, prepare_root

__all__ = ["NOT_WRITABLE", "OpenedIndex", "open_index", "writable"]

logger = logging.getLogger(__name__)

NOT_WRITABLE = "this process cannot write to it"


def writable(root: Path) -> bool:
    """True if this process may create files in the existing directory ``root``."""
    return os.access(root, os.W_OK | os.X_OK)


class OpenedIndex(NamedTuple):
    """A store's root laid out and its index opened."""

    layout: CacheLayout
    block_index: BlockIndex
    read_only: str | None  # why it is read-only (None: it is not; see the module)


def open_index(root: Path, *, create: bool = True) -> OpenedIndex:
    """The layout of ``root``, its index, and why it is read-only."""
    layout = CacheLayout(root)
    if not create and not os.path.lexists(root):
        return OpenedIndex(layout, BlockIndex(None), None)
    if os.path.isdir(root) and not os.path.islink(root) and not writable(root):
        return OpenedIndex(layout, _read_only_index(layout), NOT_WRITABLE)
    layout = prepare_root(root)
    try:
        return OpenedIndex(layout, BlockIndex(layout.index), None)
    except (OSError, sqlite3.OperationalError) as exc:
        free = shutil.disk_usage(root).free
        if free >= MIN_FREE_FLOOR or not layout.index.is_file():
            raise
        logger.info("the index cannot be opened for writing (%s): opened read-only", exc)
        full = f"its disk is full ({free:,} bytes free)"
        return OpenedIndex(layout, _read_only_index(layout), full)


def _read_only_index(layout: CacheLayout) -> BlockIndex:
    ensure_private_dir(layout.root)  # exists: only checked
    try:
        st = os.lstat(layout.index)
    except FileNotFoundError:
        return BlockIndex(None)
    if not stat.S_ISREG(st.st_mode):
        raise CacheDirError(f"refusing {layout.index}: not a regular file (a symlink?)")
    return BlockIndex(layout.index, read_only=True)

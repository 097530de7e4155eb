"""Opening a cache root: created and private, read-only, or not there at all.

- A root this process can write is created if needed (``paths.prepare_root``:
  0700 directories, a 0600 index) and its index opened for writing.
- A root it cannot write (a read-only mount, a directory made read-only) is
  checked the same way (never a symlink, owned by this user, not writable by
  others) and its index opened read-only: restores work, nothing is saved,
  and every write raises ``sqlite3.OperationalError``. A read-only root
  without an index is an empty store.
- With ``create=False`` (the read-only commands: ``cache ls``, ``show``,
  ``stats``, ``verify``), a root that does not exist is an empty store in
  memory, and no directory is created.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .index.blockindex import BlockIndex
from .paths import CacheDirError, CacheLayout, ensure_private_dir, prepare_root

__all__ = ["open_index", "writable"]


def writable(root: Path) -> bool:
    """True if this process may create files in the existing directory ``root``."""
    return os.access(root, os.W_OK | os.X_OK)


def open_index(root: Path, *, create: bool = True) -> tuple[CacheLayout, BlockIndex, bool]:
    """The layout of ``root``, its index, and whether it is read-only (see the module)."""
    layout = CacheLayout(root)
    if not create and not os.path.lexists(root):
        return layout, BlockIndex(None), False
    if os.path.isdir(root) and not os.path.islink(root) and not writable(root):
        ensure_private_dir(root)  # exists: only checked
        try:
            st = os.lstat(layout.index)
        except FileNotFoundError:
            return layout, BlockIndex(None), True
        if not stat.S_ISREG(st.st_mode):
            raise CacheDirError(f"refusing {layout.index}: not a regular file (a symlink?)")
        return layout, BlockIndex(layout.index, read_only=True), True
    layout = prepare_root(root)
    return layout, BlockIndex(layout.index), False

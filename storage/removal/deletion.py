"""Deleting blocks row first, then file: the one way a block file leaves the store.

Rows go under the index's write lock, in the caller's transaction; then the
files those rows named go through ``remove_files``. A crash in between
leaves an orphan file that ``gc`` removes, never a row that points at
nothing it did not check. ``quarantine``, ``evict``, ``forget`` and the
snapshot catalogue all delete this way; the last two remove what a snapshot
alone held (``only_theirs``).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import faults
from ..disk import move_to_quarantine, remove_file
from ..index.blockindex import BlockIndex
from ..paths import CacheLayout
from ..values import BlockRow

if TYPE_CHECKING:
    import sqlite_utils

__all__ = ["bytes_of", "only_theirs", "remove_files"]

logger = logging.getLogger(__name__)


def bytes_of(index: BlockIndex, hashes: Iterable[str]) -> int:
    """The bytes stored for these blocks (those the index still holds)."""
    rows = index.get_blocks(list(hashes))
    return sum(r.stored_bytes for r in rows.values())


def only_theirs(
    index: BlockIndex, db: sqlite_utils.Database, chain: Iterable[str], needed: set[str]
) -> set[str]:
    """The blocks that go with removed chains: all they alone held, nothing ``needed`` holds.

    ``chain``: the hashes of the removed snapshots' chains; ``needed``: the chains of
    the snapshots that stay (inside ``db``'s ``write()``). Their blocks outside
    ``needed`` go, and every block beside one of those (same parent and start) whose
    tokens begin its tokens or begin with them: the shorter tips a save leaves beside
    a chain (a server request's prompt, which ends at the assistant's opening; an
    earlier turn's end) and longer unnamed ones (a prompt saved by ``ask``). Such a
    block stays when a staying block beside it begins with its tokens: it holds
    nothing the staying chains do not. Every block below those goes too.
    """
    own = [h for h in dict.fromkeys(chain) if h not in needed]
    rows = index.get_blocks(own)
    beside: set[str] = set()
    for row in rows.values():
        siblings = [
            s
            for s in index.children(row.parent, row.identity, row.namespace)
            if s.start == row.start and s.hash not in rows
        ]
        staying = [s for s in siblings if s.hash in needed]
        for sib in siblings:
            if sib.hash in needed or not (_begins(row, sib) or _begins(sib, row)):
                continue
            if not any(_begins(s, sib) for s in staying):
                beside.add(sib.hash)
    return index.descendants(db, [*own, *sorted(beside)]) - needed


def _begins(longer: BlockRow, shorter: BlockRow) -> bool:
    """Whether ``longer``'s tokens begin with all of ``shorter``'s."""
    n = shorter.n_tokens
    return longer.n_tokens >= n and bool(np.array_equal(longer.tokens[:n], shorter.tokens))


def remove_files(
    index: BlockIndex,
    layout: CacheLayout,
    files: Sequence[str],
    quarantine_reason: str | None = None,
) -> int:
    """Unlink files whose rows are gone, under the write lock; return the bytes freed.

    A file that a row names again (the block was saved anew since its row
    was deleted) is left alone. So is one whose path goes through a symlink
    (a fan-out directory replaced by a link): it is outside the cache, never
    followed, and its bytes are not counted. Only regular files count, so the
    sum is what the disk really got back. With ``quarantine_reason`` files are
    moved to ``quarantine/`` instead (nothing is freed).
    """
    if not files:
        return 0
    freed = 0
    with index.write() as db:
        in_use = index.files_in_use(db, files)
        faults.point("before_unlink")
        for f in files:
            if f in in_use:
                continue
            try:
                if quarantine_reason is None:
                    freed += _unlink_regular(layout.resolve(f))
                else:
                    move_to_quarantine(layout, f, quarantine_reason)
            except (OSError, ValueError) as exc:
                logger.warning("could not remove %s: %s", f, exc)
    return freed


def _unlink_regular(path: Path) -> int:
    """Unlink ``path``; its size if it was a regular file, else 0 (a link frees nothing)."""
    try:
        regular = stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return 0
    size = remove_file(path)
    return size if regular else 0

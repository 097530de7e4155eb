"""Reconciling the index and the files: ``gc`` makes them agree, ``verify`` rechecks them.

After a crash or a manual deletion the two can disagree three ways: temp files
left in ``tmp/``, block files no row names, rows whose file is gone. ``gc``
removes the first two: a temp file once no living writer holds its lock, any
other past a grace period (a writer in another process may be between placing
its file and its ``INSERT``); and drops the third with
their descendants: a chain without its middle is useless. An intact block
file older than the index is kept: the index was lost, and ``cache repair``
indexes it again. ``verify`` reads
every block file and recomputes every chain hash; with ``repair`` it
quarantines the bad ones.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .. import faults
from ..chain import chain_next, chain_root
from ..disk import remove_file, remove_if_abandoned
from ..index.blockindex import BlockIndex
from ..paths import CacheLayout
from ..readpool import BlockReader
from ..values import MAX_RAW_BLOCK_BYTES, BlockCorrupt, BlockRow, GcReport
from .quarantine import quarantine

__all__ = ["gc", "verify"]

logger = logging.getLogger(__name__)


def _old(path: Path, cutoff: float) -> bool:
    try:
        return os.lstat(path).st_mtime <= cutoff
    except FileNotFoundError:
        return False


def _remove_temp_files(layout: CacheLayout, cutoff: float) -> tuple[int, int]:
    """Temp files no living writer holds (a killed save's), at once; others past the
    grace period (a writer stuck that long, or a file system without ``flock``)."""
    count = freed = 0
    for entry in os.scandir(layout.tmp):
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            continue
        gone = remove_if_abandoned(path)
        if gone is None and _old(path, cutoff):
            gone = remove_file(path)
        if gone is not None:
            freed += gone
            count += 1
    return count, freed


def _rows_without_files(layout: CacheLayout, index: BlockIndex) -> tuple[int, int]:
    missing: list[str] = []
    for block_hash, relpath in index.query("SELECT hash, file FROM blocks"):
        try:
            st = os.lstat(layout.resolve(relpath))
        except (FileNotFoundError, NotADirectoryError, ValueError):
            missing.append(block_hash)
            continue
        if not stat.S_ISREG(st.st_mode):
            missing.append(block_hash)
    if not missing:
        return 0, 0
    with index.write() as db:
        gone = index.descendants(db, missing)
        files = index.delete_blocks(db, gone)
    freed = 0
    for f in files:
        faults.point("mid_gc")
        try:
            freed += remove_file(layout.resolve(f))
        except ValueError:  # a tampered row naming a path outside the root: never touched
            logger.warning("gc: dropped a row whose file %r is outside the cache", f)
    logger.warning("gc: %d row(s) had no file; dropped %d row(s)", len(missing), len(gone))
    return len(gone), freed


def _files_without_rows(layout: CacheLayout, index: BlockIndex, cutoff: float) -> tuple[int, int]:
    known = {str(r[0]) for r in index.query("SELECT file FROM blocks")}
    # An intact block file older than the index itself was not left by a save
    # into this index: the index was lost or replaced, and ``repair`` indexes
    # it again. Files written since (a save that died before its row) and
    # damaged ones go.
    born = index.query("SELECT MIN(applied_at) FROM _migrations")[0][0] or 0.0
    count = freed = kept = 0
    for fan in os.scandir(layout.blocks):
        if not fan.is_dir(follow_symlinks=False):
            if _old(Path(fan.path), cutoff):
                freed += remove_file(Path(fan.path))
                count += 1
            continue
        for entry in os.scandir(fan.path):
            relpath = f"blocks/{fan.name}/{entry.name}"
            if relpath in known and entry.is_file(follow_symlinks=False):
                continue
            path = Path(entry.path)
            if entry.is_dir(follow_symlinks=False) or not _old(path, cutoff):
                continue
            if _old(path, float(born)) and _intact(layout, relpath):
                kept += 1
                continue
            faults.point("mid_gc")
            freed += remove_file(path)
            count += 1
    if count:
        logger.warning("gc: removed %d file(s) without an index row", count)
    if kept:
        logger.warning(
            "gc: kept %d block file(s) older than the index: `localkv cache repair` indexes them",
            kept,
        )
    return count, freed


def _intact(layout: CacheLayout, relpath: str) -> bool:
    """Whether a block file carries a whole, checked index row (``repair`` can use it)."""
    from ..repair import recover_row  # imported here: repair builds on removal

    try:
        recover_row(layout, relpath, MAX_RAW_BLOCK_BYTES)
    except BlockCorrupt:
        return False
    return True


def gc(layout: CacheLayout, index: BlockIndex, grace_seconds: float) -> GcReport:
    """Remove temp files, orphan block files and rows without files."""
    cutoff = time.time() - grace_seconds
    temp, temp_bytes = _remove_temp_files(layout, cutoff)
    faults.point("mid_gc")
    missing, missing_bytes = _rows_without_files(layout, index)
    faults.point("mid_gc")
    orphans, orphan_bytes = _files_without_rows(layout, index, cutoff)
    return GcReport(
        temp_files=temp,
        orphan_files=orphans,
        missing_files=missing,
        bytes_freed=temp_bytes + missing_bytes + orphan_bytes,
    )


def verify(
    index: BlockIndex,
    layout: CacheLayout,
    reader: BlockReader,
    pool: ThreadPoolExecutor,
    repair: bool,
) -> list[tuple[str, str]]:
    """(hash, reason) of every bad block: unreadable row, wrong hash, bad file, no parent.

    Files are read on ``pool``; ``repair`` quarantines every bad block still stored.
    """
    rows = index.all_blocks()
    bad = index.unreadable_blocks()
    stored = {str(r[0]) for r in index.query("SELECT hash FROM blocks")}
    reasons = pool.map(lambda row: _check_row(reader, row), rows)
    for row, reason in zip(rows, reasons, strict=True):
        if reason is None and row.parent is not None and row.parent not in stored:
            reason = "parent block is not stored"  # unreachable: no lookup gets here
        if reason is not None:
            bad.append((row.hash, reason))
    if repair:
        for block_hash, reason in bad:
            if index.has_block(block_hash):
                quarantine(index, layout, block_hash, reason)
    return bad


def _check_row(reader: BlockReader, row: BlockRow) -> str | None:
    try:
        parent = row.parent or chain_root(row.identity, row.namespace)
        if chain_next(parent, row.tokens, row.ends) != row.hash:
            return "hash does not match parent, tokens and batch ends"
    except ValueError as exc:  # a malformed parent or identity digest in the row
        return f"index row cannot be read: {exc}"
    try:
        reader.read([row])
    except BlockCorrupt as exc:
        return exc.reason
    return None

"""The privacy path: ``forget`` one document and ``scrub`` what its rows left behind.

``forget`` removes a document's snapshots and every block that holds its
tokens, whatever wrote it (``prefill``, ``ask``, a chat's ``/attach``): a
block holds the document when its tokens contain ``RUN_LENGTH`` consecutive
tokens of one of the document's token runs (its text tokenized by each
model's vocabulary, see ``localkv.cache.forgetting``). Every block after those
goes too, with their quarantined copies; then ``scrub`` overwrites the
index so no SQLite page or WAL frame still holds their rows.
``SnapshotStore.forget`` and ``SnapshotStore.scrub`` delegate here.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..disk import remove_abandoned_temp_files, remove_file
from ..index.blockindex import BlockIndex
from ..paths import CacheLayout
from ..values import BlockRow, ForgetReport, ForgottenSnapshot, SnapshotRow
from .deletion import only_theirs, remove_files

__all__ = ["RUN_LENGTH", "DocumentRuns", "Runs", "forget", "scrub"]

logger = logging.getLogger(__name__)

RUN_LENGTH = 6  # consecutive document tokens that mark a block (or conversation) as holding it
_WIDTH = 4 * RUN_LENGTH  # a window's bytes: int32 little-endian

Runs = Sequence[np.ndarray]  # a document's tokens, one int32 array per model vocabulary


@dataclass(frozen=True, slots=True, eq=False)
class DocumentRuns:
    """The ``RUN_LENGTH``-token windows of a document's token runs, for matching.

    ``offsets`` maps each window (int32 little-endian bytes) to the offsets at
    which it occurs in its run, and ``runs`` keeps the runs, so a block can be
    told to start inside the document rather than at its beginning.
    """

    runs: tuple[np.ndarray, ...]
    offsets: dict[bytes, tuple[tuple[int, int], ...]]  # window -> ((run, offset), ...)
    firsts: np.ndarray  # every window's first token, to skip most positions cheaply

    @classmethod
    def of(cls, runs: Runs) -> DocumentRuns:
        """Index every window of ``runs`` (a run shorter than ``RUN_LENGTH`` has none)."""
        arrays = tuple(np.ascontiguousarray(r, dtype="<i4") for r in runs)
        offsets: dict[bytes, list[tuple[int, int]]] = {}
        for k, run in enumerate(arrays):
            data = run.tobytes()
            for j in range(run.shape[0] - RUN_LENGTH + 1):
                offsets.setdefault(data[4 * j : 4 * j + _WIDTH], []).append((k, j))
        firsts = np.unique(np.frombuffer(b"".join(w[:4] for w in offsets), dtype="<i4"))
        return cls(arrays, {w: tuple(o) for w, o in offsets.items()}, firsts)

    def __bool__(self) -> bool:
        return bool(self.offsets)

    def holds(self, tokens: np.ndarray) -> bool:
        """True if ``tokens`` contain ``RUN_LENGTH`` consecutive tokens of some run."""
        arr = np.ascontiguousarray(tokens, dtype="<i4")
        n = arr.shape[0] - RUN_LENGTH + 1
        if n <= 0 or not self.offsets:
            return False
        data = arr.tobytes()
        starts = np.flatnonzero(np.isin(arr[:n], self.firsts))
        return any(data[4 * int(i) : 4 * int(i) + _WIDTH] in self.offsets for i in starts)

    def starts_inside(self, row: BlockRow, parent: BlockRow | None) -> bool:
        """``row`` begins inside the document, so the document began in ``parent``.

        True when the row's first window occurs in a run at an offset ``j > 0``
        and either never at offset 0, or ``parent`` ends with the run's tokens
        before ``j`` (the document's first token aside, which its context may
        tokenize differently). A document that repeats its opening therefore
        does not take a shared block before it (a system prompt) with it.
        """
        found = self.offsets.get(np.ascontiguousarray(row.tokens[:RUN_LENGTH], "<i4").tobytes())
        inner = [(k, j) for k, j in found or () if j > 0]
        if not inner:
            return False
        if all(j > 0 for _, j in found or ()):
            return True
        tail = parent.tokens if parent is not None else np.zeros(0, np.int32)
        for k, j in inner:
            before = self.runs[k][max(1, j - tail.shape[0]) : j]
            if np.array_equal(tail[tail.shape[0] - before.shape[0] :], before):
                return True
        return False


def forget(
    index: BlockIndex,
    layout: CacheLayout,
    source_path: str | None,
    source_sha256: str | None,
    runs: Runs = (),
) -> ForgetReport:
    """Remove every trace of one document: its snapshots and every block holding it.

    Two ways find the document. A snapshot matches if its ``source_sha256``
    equals ``source_sha256`` or its ``source_path`` (one path, or several
    joined by ``"; "``) names ``source_path``; its chain's blocks that no other
    snapshot needs go, with every sibling that holds their tokens and more (a
    longer prompt saved by ``ask``) or a start of them (``deletion.only_theirs``).
    And every block, of any identity and
    namespace, whose tokens contain ``RUN_LENGTH`` consecutive tokens of one
    of ``runs`` goes, with its parent when the document began there (see
    ``DocumentRuns.starts_inside``), even if another snapshot needs it:
    privacy first. Every block below those goes, with the snapshots on them,
    their quarantined copies, and, through ``scrub()``, the SQLite pages and
    WAL frames that held their rows. Files no row names go too: every temp
    file no living writer holds (a killed save's, whatever it held), and every
    block file holding one of ``runs`` (a save killed before its row).
    """
    before = {s.id: s for s in index.snapshots()}
    matched = _matching(before.values(), source_path, source_sha256)
    document = DocumentRuns.of(runs)
    with index.write() as db:
        for snap in matched:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
        needed = index.protected(db, pinned_only=False)
        chains = [r.hash for s in matched for r in index.chain_of(s.tip)]
        victims = only_theirs(index, db, chains, needed)
        victims |= index.descendants(db, sorted(_holding(index, document)))
        removed = {s.id for s in matched} | _snapshots_on(index, victims)
        files = index.delete_blocks(db, victims)
    freed = remove_files(index, layout, files)  # only what really left the disk
    quarantined, quarantined_bytes = _remove_quarantined(layout, victims)
    unindexed, unindexed_bytes = _remove_unindexed(index, layout, document)
    freed += quarantined_bytes + unindexed_bytes
    busy = scrub(index)
    logger.info("forgot %d snapshot(s), %d block(s), %d bytes", len(removed), len(victims), freed)
    return ForgetReport(
        snapshots=sorted(removed),
        removed=_why(before, removed, {s.id for s in matched}),
        blocks=len(victims),
        bytes_freed=freed,
        quarantined_files=quarantined,
        wal_truncated=not busy,
        unindexed_files=unindexed,
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
    busy = not index.checkpoint()
    if busy:
        logger.warning("the index WAL is in use by another process; not yet truncated")
    return bool(busy)


def _matching(
    snapshots: Iterable[SnapshotRow], source_path: str | None, source_sha256: str | None
) -> list[SnapshotRow]:
    """The snapshots saved from this document, by content hash or by path."""
    return [
        s
        for s in snapshots
        if (source_sha256 is not None and s.source_sha256 == source_sha256)
        or (source_path is not None and source_path in (s.source_path or "").split("; "))
    ]


def _holding(index: BlockIndex, document: DocumentRuns) -> set[str]:
    """Blocks holding a run of the document, and the parents where it began."""
    if not document:
        return set()
    rows = index.all_blocks()
    by_hash = {r.hash: r for r in rows}
    found: set[str] = set()
    for row in rows:
        if not document.holds(row.tokens):
            continue
        found.add(row.hash)
        parent = by_hash.get(row.parent) if row.parent is not None else None
        if parent is not None and document.starts_inside(row, parent):
            found.add(parent.hash)
    return found


def _why(
    before: dict[str, SnapshotRow], removed: set[str], matched: set[str]
) -> list[ForgottenSnapshot]:
    """The removed snapshots as listed before: saved from the document (``source``), or
    on a chain a block of which holds it (``holds``)."""
    return [
        ForgottenSnapshot(
            id=ident,
            label=before[ident].label,
            pinned=before[ident].pinned,
            why="source" if ident in matched else "holds",
        )
        for ident in sorted(removed)
        if ident in before
    ]


def _snapshots_on(index: BlockIndex, hashes: set[str]) -> set[str]:
    """Ids of the snapshots whose tip is one of ``hashes`` (they go with it)."""
    return {s.id for s in index.snapshots() if s.tip in hashes}


def _remove_unindexed(
    index: BlockIndex, layout: CacheLayout, document: DocumentRuns
) -> tuple[int, int]:
    """Abandoned temp files, and block files without a row that hold the document."""
    count, freed = remove_abandoned_temp_files(layout)
    if not document:
        return count, freed
    known = {str(r[0]) for r in index.query("SELECT file FROM blocks")}
    for fan in os.scandir(layout.blocks):
        if not fan.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(fan.path):
            if f"blocks/{fan.name}/{entry.name}" in known:
                continue
            if entry.is_file(follow_symlinks=False) and _file_holds(Path(entry.path), document):
                freed += remove_file(Path(entry.path))
                count += 1
    return count, freed


def _file_holds(path: Path, document: DocumentRuns) -> bool:
    """Whether the file's bytes hold a run of the document's tokens as int32 anywhere
    (at any alignment): what its ``tokens`` tensor is, read without trusting its header."""
    chunk, tail = 16 << 20, b""
    try:
        with path.open("rb") as f:
            while data := f.read(chunk):
                window = tail + data
                for at in range(4):
                    usable = (len(window) - at) // 4 * 4
                    if document.holds(np.frombuffer(window, "<i4", usable // 4, at)):
                        return True
                tail = window[-_WIDTH:]
    except OSError:
        return False
    return False


def _remove_quarantined(layout: CacheLayout, hashes: set[str]) -> tuple[int, int]:
    """Delete the quarantined copies of these blocks' files; return how many went and
    the bytes of those that were regular files."""
    names = {layout.block_relpath(h).rsplit("/", 1)[1] for h in hashes}
    count = freed = 0
    for entry in os.scandir(layout.quarantine):
        if entry.name.split(".lkv", 1)[0] + ".lkv" in names:
            regular = entry.is_file(follow_symlinks=False)
            size = remove_file(Path(entry.path))
            freed += size if regular else 0
            count += 1
    return count, freed

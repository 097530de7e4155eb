"""``SnapshotStore``: content-addressed blocks on disk, indexed in SQLite.

The store keeps generic blocks (tokens, named token-major tensors, a probe,
string metadata) chained by hash (``chain.py``), and snapshots that name chain
tips. It never interprets tensors: the engine converts KV state to and from
blocks. Reading never deletes; a block that fails a check raises
``BlockCorrupt`` and the caller decides to ``quarantine`` it.

Deleting is row first, then file: a crash leaves an orphan file that ``gc``
removes, never a row that points at nothing it did not check.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType

import numpy as np
import sqlite_utils

from . import budget, faults, maintenance
from .blockfile import encode, index_row
from .blockread import OpenedBlock, Targets
from .chain import chain_next, chain_root
from .files import (
    check_free_space,
    link_into_place,
    move_to_quarantine,
    remove_file,
    replace_into_place,
    stage_block_file,
)
from .index import BlockIndex
from .paths import CacheLayout, default_root, prepare_root
from .reader import BlockReader
from .values import (
    Block,
    BlockCorrupt,
    BlockRow,
    ForgetReport,
    GcReport,
    Probe,
    SnapshotRow,
    StoreStats,
)

__all__ = [
    "MAX_RAW_BLOCK_BYTES",
    "Block",
    "BlockCorrupt",
    "BlockRow",
    "ForgetReport",
    "GcReport",
    "Probe",
    "SnapshotRow",
    "SnapshotStore",
    "StoreStats",
]

logger = logging.getLogger(__name__)

MAX_RAW_BLOCK_BYTES = 4 << 30
_SNAPSHOT_ID_HEX = 12
_EVENT_KINDS = frozenset({"hit", "miss"})


class SnapshotStore:
    """The on-disk prefix cache. Open with ``SnapshotStore.open(root)``; thread-safe."""

    def __init__(self, layout: CacheLayout, index: BlockIndex, workers: int | None = None) -> None:
        self.layout = layout
        self._index = index
        self._workers = workers or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._reader = BlockReader(layout, self._executor, MAX_RAW_BLOCK_BYTES)
        self._closed = False

    @classmethod
    def open(cls, root: Path | None = None) -> SnapshotStore:
        """Open (creating if needed) the store at ``root``, ``$LOCALKV_HOME`` or the default."""
        layout = prepare_root(default_root(root))
        return cls(layout, BlockIndex(layout.index))

    @property
    def root(self) -> Path:
        return self.layout.root

    def close(self) -> None:
        """Release the index connection and reader threads (safe to call twice)."""
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._index.close()

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def db(self) -> sqlite_utils.Database:
        """The index database (for inspection and tests; write through the store)."""
        return self._index.db

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="localkv-read")
        return self._pool

    # ------------------------------------------------------------- identities
    def put_identity(self, digest: str, json_text: str) -> None:
        """Record an identity's JSON under its digest (ValueError if it differs)."""
        self._index.put_identity(digest, json_text, time.time())

    def get_identity(self, digest: str) -> str | None:
        """The JSON of a stored identity, or None."""
        return self._index.get_identity(digest)

    # ----------------------------------------------------------------- blocks
    def has_block(self, block_hash: str) -> bool:
        return self._index.has_block(block_hash)

    def put_block(self, block: Block) -> bool:
        """Store a block; False (and nothing written) if it is already stored.

        The hash must be ``chain_next(parent or chain_root(identity, namespace),
        tokens)`` and the parent must be stored, under the same identity and
        namespace, ending where this block starts (ValueError otherwise).
        """
        expected = chain_next(
            block.parent or chain_root(block.identity, block.namespace), block.tokens
        )
        if block.hash != expected:
            raise ValueError(f"block hash {block.hash} is not its chain hash {expected}")
        if self.has_block(block.hash):
            return False
        self._check_parent(block)
        data = encode(block)
        relpath = self.layout.block_relpath(block.hash)
        row = index_row(block, data, relpath, time.time())
        if row.raw_bytes > MAX_RAW_BLOCK_BYTES:
            raise ValueError(f"block of {row.raw_bytes} bytes is over {MAX_RAW_BLOCK_BYTES}")
        check_free_space(self.layout.tmp, len(data))
        tmp = stage_block_file(self.layout, relpath, data)
        try:
            placed = link_into_place(self.layout, tmp, relpath)
            # A file already there is an orphan or another writer's: replace it only
            # under the write lock and only if no row (which would name it) exists.
            place = None if placed else lambda: replace_into_place(self.layout, tmp, relpath)
            outcome = self._index.add_block(row, place)
        except BaseException:
            self._discard_unindexed(relpath)
            raise
        finally:
            remove_file(tmp)
        if outcome == "orphan":
            logger.info("parent of %s was removed while saving it; not stored", block.hash)
            self._remove_files([relpath])
        return outcome == "inserted"

    def _discard_unindexed(self, relpath: str) -> None:
        """After a failed save: remove the file it placed, unless a row names it."""
        try:
            self._remove_files([relpath])
        except Exception as exc:  # the disk may still be failing: gc removes it later
            logger.warning("could not remove unsaved block file %s: %s", relpath, exc)

    def _check_parent(self, block: Block) -> None:
        if block.parent is None:
            return
        parent = self._index.get_block(block.parent)
        if parent is None:
            raise ValueError(f"parent {block.parent} of {block.hash} is not stored")
        if (parent.identity, parent.namespace, parent.end) != (
            block.identity,
            block.namespace,
            block.start,
        ):
            raise ValueError(
                f"block {block.hash} (start {block.start}) does not continue its parent "
                f"(end {parent.end}) under the same identity and namespace"
            )

    def match_chain(self, hashes: Sequence[str]) -> list[BlockRow]:
        """The longest run of stored blocks from the start of ``hashes``."""
        found = self._index.get_blocks(hashes)
        run: list[BlockRow] = []
        for h in hashes:
            row = found.get(h)
            if row is None or row.parent != (run[-1].hash if run else row.parent):
                break
            run.append(row)
        return run

    def children(
        self, parent: str | None, identity: str, namespace: str, first_token: int | None = None
    ) -> list[BlockRow]:
        """Blocks that follow ``parent`` (None: first blocks) under identity and namespace.

        With ``first_token``, only blocks starting with that token (the others
        share no prefix with the request).
        """
        return self._index.children(parent, identity, namespace, first_token)

    def same_first_block_elsewhere(
        self, tokens_sha: str, identity: str, namespace: str
    ) -> list[str]:
        """Identities (other than ``identity``) with a first block of the same tokens."""
        sql = (
            "SELECT DISTINCT identity FROM blocks WHERE tokens_sha = ? AND parent IS NULL "
            "AND namespace = ? AND identity != ? ORDER BY identity"
        )
        return [str(r[0]) for r in self._index.query(sql, (tokens_sha, namespace, identity))]

    def chain_of(self, tip: str) -> list[BlockRow]:
        """The stored chain ending at ``tip``, root first (empty if ``tip`` is not stored)."""
        return self._index.chain_of(tip)

    def read_blocks(self, rows: Sequence[BlockRow]) -> list[Block]:
        """Read and check blocks in parallel, in order (``BlockCorrupt`` names the first bad)."""
        return self._reader.read(rows)

    def open_blocks(self, rows: Sequence[BlockRow]) -> list[OpenedBlock]:
        """Open blocks' files and check their headers; ``close()`` each (see ``BlockReader``)."""
        return self._reader.open(rows)

    def fill_blocks(
        self, opened: Sequence[OpenedBlock], targets: Sequence[Targets | None]
    ) -> list[Block]:
        """Read opened blocks in parallel into their targets (see ``blockread.fill_block``)."""
        return self._reader.fill(opened, targets)

    def quarantine(self, block_hash: str, reason: str) -> list[str]:
        """Drop a bad block and its descendants from the index; move its file aside.

        Returns the hashes removed. The bad block's file goes to ``quarantine/``
        with the reason; its descendants' files (fine but unreachable) are deleted.
        """
        with self._index.write() as db:
            gone = self._index.descendants(db, [block_hash])
            if block_hash not in gone:
                return []  # already removed (evicted while being read): nothing to do
            files = self._index.delete_blocks(db, gone - {block_hash})
            own = self._index.delete_blocks(db, [block_hash])
        with contextlib.suppress(ValueError):  # a malformed hash: its row named the file
            own = [self.layout.block_relpath(block_hash)]
        self._remove_files(own, quarantine_reason=reason)
        self._remove_files(files)
        logger.warning(
            "quarantined block %s (%s); dropped %d descendant(s)", block_hash, reason, len(files)
        )
        return sorted(gone)

    def touch(self, hashes: Sequence[str]) -> None:
        """Mark blocks (and snapshots whose tip is among them) as used now."""
        if hashes:
            self._index.touch(hashes, time.time())

    # ------------------------------------------------------------- statistics
    def record_event(self, kind: str, reason: str | None, tokens: int, seconds: float) -> None:
        """Record a cache ``hit`` (tokens reused) or ``miss`` (with its reason)."""
        if kind not in _EVENT_KINDS:
            raise ValueError(f"event kind must be hit or miss, got {kind!r}")
        with self._index.write() as db:
            db.execute(
                "INSERT INTO events (kind, reason, tokens, seconds, at) VALUES (?, ?, ?, ?, ?)",
                (kind, reason, int(tokens), float(seconds), time.time()),
            )

    def stats(self) -> StoreStats:
        """Hits, misses by reason, sizes, and an estimate of prefill seconds saved."""
        return self._index.stats()

    # -------------------------------------------------------------- snapshots
    def put_snapshot(
        self,
        tip: str,
        label: str,
        source_path: str | None,
        source_sha256: str | None,
        n_tokens: int,
        identity: str,
        namespace: str,
        pinned: bool = False,
    ) -> str:
        """Name the chain ending at ``tip``; the same tip, label and namespace keep one id."""
        h = hashlib.sha256("\0".join((tip, label, namespace)).encode("utf-8")).hexdigest()
        snap_id = h[:_SNAPSHOT_ID_HEX]
        now = time.time()
        with self._index.write() as db:
            if db.execute("SELECT 1 FROM snapshots WHERE id = ?", (snap_id,)).fetchone():
                if pinned:
                    db.execute("UPDATE snapshots SET pinned = 1 WHERE id = ?", (snap_id,))
                return snap_id
            row = self._index.get_block(tip)
            if row is None:
                raise ValueError(f"snapshot tip {tip} is not stored")
            if (row.identity, row.namespace, row.end) != (identity, namespace, n_tokens):
                raise ValueError(
                    f"snapshot says {n_tokens} tokens of {identity}/{namespace!r}, tip block "
                    f"ends at {row.end} under {row.identity}/{row.namespace!r}"
                )
            self._index.insert_snapshot(
                db,
                SnapshotRow(
                    snap_id,
                    tip,
                    label,
                    source_path,
                    source_sha256,
                    n_tokens,
                    identity,
                    namespace,
                    now,
                    now,
                    0,
                    pinned,
                ),
            )
        return snap_id

    def snapshots(self, namespace: str | None = None) -> list[SnapshotRow]:
        """All snapshots (of one namespace), oldest first."""
        return self._index.snapshots(namespace)

    def get_snapshot(self, id_or_prefix: str) -> SnapshotRow:
        """The snapshot with this id or unique id prefix (KeyError otherwise)."""
        found = self._index.snapshots_by_prefix(id_or_prefix) if id_or_prefix else []
        exact = [s for s in found if s.id == id_or_prefix]
        if exact:
            return exact[0]
        if not found:
            raise KeyError(f"no snapshot {id_or_prefix!r}")
        if len(found) > 1:
            ids = ", ".join(s.id for s in found[:5])
            raise KeyError(f"snapshot prefix {id_or_prefix!r} is ambiguous: {ids}")
        return found[0]

    def pin(self, snapshot_id: str) -> None:
        """Protect a snapshot's chain from eviction."""
        self._set_pinned(snapshot_id, True)

    def unpin(self, snapshot_id: str) -> None:
        self._set_pinned(snapshot_id, False)

    def _set_pinned(self, snapshot_id: str, pinned: bool) -> None:
        snap = self.get_snapshot(snapshot_id)
        with self._index.write() as db:
            db.execute("UPDATE snapshots SET pinned = ? WHERE id = ?", (int(pinned), snap.id))

    def remove_snapshot(self, snapshot_id: str) -> int:
        """Delete a snapshot and the blocks only it needed; return the bytes freed."""
        snap = self.get_snapshot(snapshot_id)
        with self._index.write() as db:
            db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
            needed = self._index.protected(db, pinned_only=False)
            own = [r.hash for r in self._index.chain_of(snap.tip) if r.hash not in needed]
            victims = self._index.descendants(db, own) - needed
            freed = self._bytes_of(victims)
            files = self._index.delete_blocks(db, victims)
        self._remove_files(files)
        logger.info("removed snapshot %s: %d block(s), %d bytes", snap.id, len(files), freed)
        return freed

    def forget(self, source_path: str | None, source_sha256: str | None) -> ForgetReport:
        """Remove every trace of one document: its snapshots and the blocks only it needs.

        A snapshot matches if its ``source_sha256`` equals ``source_sha256`` or its
        ``source_path`` (one path, or several joined by ``"; "``) names
        ``source_path``. Its chain's blocks that no other snapshot needs go, with
        every block below them and every sibling that holds their tokens and more
        (a longer prompt saved by ``ask``), their quarantined copies, and, through
        ``scrub()``, the SQLite pages and WAL frames that held their rows.
        """
        matched = [
            s
            for s in self.snapshots()
            if (source_sha256 is not None and s.source_sha256 == source_sha256)
            or (source_path is not None and source_path in (s.source_path or "").split("; "))
        ]
        with self._index.write() as db:
            for snap in matched:
                db.execute("DELETE FROM snapshots WHERE id = ?", (snap.id,))
            needed = self._index.protected(db, pinned_only=False)
            own = {r.hash for s in matched for r in self._index.chain_of(s.tip)} - needed
            victims = self._index.descendants(db, [*own, *self._extensions(own)]) - needed
            freed = self._bytes_of(victims)
            files = self._index.delete_blocks(db, victims)
        self._remove_files(files)
        quarantined = self._remove_quarantined(victims)
        busy = self.scrub()
        logger.info(
            "forgot %d snapshot(s), %d block(s), %d bytes", len(matched), len(victims), freed
        )
        return ForgetReport(
            snapshots=sorted(s.id for s in matched),
            blocks=len(victims),
            bytes_freed=freed,
            quarantined_files=quarantined,
            wal_truncated=not busy,
        )

    def _extensions(self, hashes: set[str]) -> set[str]:
        """Blocks beside ``hashes`` (same parent and start) whose tokens begin with theirs."""
        rows = self._index.get_blocks(list(hashes))
        out: set[str] = set()
        for row in rows.values():
            for sib in self._index.children(row.parent, row.identity, row.namespace):
                n = row.n_tokens
                if (
                    sib.hash not in hashes
                    and sib.start == row.start
                    and sib.n_tokens > n
                    and np.array_equal(sib.tokens[:n], row.tokens)
                ):
                    out.add(sib.hash)
        return out

    def _remove_quarantined(self, hashes: set[str]) -> int:
        names = {self.layout.block_relpath(h).rsplit("/", 1)[1] for h in hashes}
        count = 0
        for entry in os.scandir(self.layout.quarantine):
            if entry.name.split(".lkv", 1)[0] + ".lkv" in names:
                remove_file(Path(entry.path))
                count += 1
        return count

    def scrub(self) -> bool:
        """Overwrite what deleted rows left behind: VACUUM, then empty the WAL.

        Deleted rows are zeroed as they go (``secure_delete``); this rebuilds the
        file and truncates the WAL so no older page survives in it. Returns True
        if a reader in another process kept the WAL from being emptied.
        """
        try:
            self._index.vacuum()
        except sqlite3.OperationalError as exc:  # another process is writing: try later
            logger.warning("could not vacuum the index: %s", exc)
        busy, _, _ = self._index.checkpoint()
        if busy:
            logger.warning("the index WAL is in use by another process; not yet truncated")
        return bool(busy)

    # ---------------------------------------------------------------- budget
    def evict(self, budget_bytes: int) -> int:
        """Evict unpinned leaf blocks, least valuable first, until within budget.

        Never touches a pinned snapshot's chain or the middle of a chain;
        snapshots whose tip goes are dropped. Returns the bytes freed.
        """
        with self._index.write() as db:
            total = int(
                db.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM blocks").fetchone()[0]
            )
            if total <= budget_bytes:
                return 0
            protected = self._index.protected(db, pinned_only=True)
            infos = [
                budget.LeafInfo(*r)
                for r in db.execute(
                    "SELECT hash, parent, stored_bytes, prefill_seconds, last_used FROM blocks"
                ).fetchall()
            ]
            victims = budget.plan_eviction(infos, protected, total - budget_bytes, time.time())
            freed = self._bytes_of(victims)
            files = self._index.delete_blocks(db, victims)
        self._remove_files(files)
        logger.info("evicted %d block(s), %d bytes, budget %d", len(victims), freed, budget_bytes)
        return freed

    def default_budget(self) -> int:
        """``$LOCALKV_BUDGET``, else 10% of free disk space at the root, at most 20 GiB."""
        return budget.default_budget(self.root)

    def _bytes_of(self, hashes: set[str] | list[str]) -> int:
        rows = self._index.get_blocks(list(hashes))
        return sum(r.stored_bytes for r in rows.values())

    def _remove_files(self, files: Sequence[str], quarantine_reason: str | None = None) -> None:
        """Unlink files whose rows are gone, under the write lock.

        A file that a row names again (the block was saved anew since its row
        was deleted) is left alone. With ``quarantine_reason`` files are moved
        to ``quarantine/`` instead.
        """
        if not files:
            return
        with self._index.write() as db:
            in_use = self._index.files_in_use(db, files)
            faults.point("before_unlink")
            for f in files:
                if f in in_use:
                    continue
                try:
                    if quarantine_reason is None:
                        remove_file(self.layout.resolve(f))
                    else:
                        move_to_quarantine(self.layout, f, quarantine_reason)
                except (OSError, ValueError) as exc:
                    logger.warning("could not remove %s: %s", f, exc)

    # ----------------------------------------------------------- maintenance
    def gc(self, grace_seconds: float = 3600.0) -> GcReport:
        """Remove temp files, files without rows, rows without files (and descendants).

        Files younger than ``grace_seconds`` are kept: another process may be
        between writing a block file and inserting its row.
        """
        return maintenance.gc(self.layout, self._index, grace_seconds)

    def verify(self, repair: bool = False) -> list[tuple[str, str]]:
        """Recheck every block file and chain hash; ``repair`` quarantines the bad ones."""
        rows = self._index.all_blocks()
        bad = self._index.unreadable_blocks()
        stored = {str(r[0]) for r in self._index.query("SELECT hash FROM blocks")}
        for row, reason in zip(rows, self._executor().map(self._check_row, rows), strict=True):
            if reason is None and row.parent is not None and row.parent not in stored:
                reason = "parent block is not stored"  # unreachable: no lookup gets here
            if reason is not None:
                bad.append((row.hash, reason))
        if repair:
            for block_hash, reason in bad:
                if self.has_block(block_hash):
                    self.quarantine(block_hash, reason)
        return bad

    def _check_row(self, row: BlockRow) -> str | None:
        try:
            parent = row.parent or chain_root(row.identity, row.namespace)
            if chain_next(parent, row.tokens) != row.hash:
                return "hash does not match parent and tokens"
        except ValueError as exc:  # a malformed parent or identity digest in the row
            return f"index row cannot be read: {exc}"
        try:
            self._reader.read([row])
        except BlockCorrupt as exc:
            return exc.reason
        return None

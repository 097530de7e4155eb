"""``SnapshotStore``: content-addressed blocks on disk, indexed in SQLite.

The store keeps generic blocks (tokens, named token-major tensors, a probe,
string metadata) chained by hash (``chain.py``), and snapshots that name chain
tips. It never interprets tensors: the engine converts KV state to and from
blocks. Reading never deletes; a block that fails a check raises
``BlockCorrupt`` and the caller decides to ``quarantine`` it.

Deleting is row first, then file: a crash leaves an orphan file for ``gc``. This
module holds the store's lifecycle, identities, block writes, lookups and events;
the rest it delegates, keeping each public method here: opening a root to
``opening.py``; the snapshot catalogue to ``snapshots.py``, what removing each
snapshot frees to ``space.py``; block files' bytes and
reading one in ``formats/``, many in parallel in ``readpool.py``, placing them
on disk in ``disk.py``; the SQLite index in ``index/``; every way blocks leave,
and ``verify``, in ``removal/``. ``repair.py`` rebuilds a lost index.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from .chain import chain_next, chain_root
from .disk import check_free_space, link_into_place, replace_into_place, staged_block_file
from .formats.blockcodec import encode, index_row
from .formats.readinto import OpenedBlock
from .index import events
from .index.blockindex import BlockIndex
from .opening import open_index
from .packed import PackedStates
from .paths import CacheLayout, default_root
from .readpool import BlockReader, Drops, Fills, PendingFill, Tails, Then
from .removal import budget, deletion, evict, forget, quarantine, reconcile
from .snapshots import SnapshotCatalogue
from .space import Space, space
from .values import (
    MAX_RAW_BLOCK_BYTES,
    Block,
    BlockCorrupt,
    BlockRow,
    ForgetReport,
    GcReport,
    NewSnapshot,
    Probe,
    SnapshotRow,
    StoreStats,
)

if TYPE_CHECKING:
    import sqlite_utils

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

T = TypeVar("T")
_THREAD_START_LIMIT_S = 30.0  # ``prepare``: a thread not started by then is started on use


class SnapshotStore:
    """The on-disk prefix cache. Open with ``SnapshotStore.open(root)``; thread-safe."""

    def __init__(
        self,
        layout: CacheLayout,
        index: BlockIndex,
        workers: int | None = None,
        *,
        compact: bool = False,
        read_only: str | None = None,
    ) -> None:
        self.layout = layout
        self.packed = PackedStates(layout)  # chains' states as llama.cpp loads them
        # why nothing is saved (a root this process cannot write, a full disk), or None
        self.read_only_reason = read_only
        self.read_only = read_only is not None
        self.compact = compact  # write new blocks in the compact format (``formats.planes``)
        self._index = index
        self._workers = workers or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._reader = BlockReader(layout, self._executor, MAX_RAW_BLOCK_BYTES)
        self._catalogue = SnapshotCatalogue(index, layout)
        self._closed = False

    @classmethod
    def open(
        cls, root: Path | None = None, *, compact: bool = False, create: bool = True
    ) -> SnapshotStore:
        """Open (creating if needed) the store at ``root``, ``$LOCALKV_HOME`` or the default.

        ``compact``: new blocks are written in the compact format (fewer bytes,
        a little slower to restore); both are read. ``create``: see ``opening.py``.
        """
        layout, index, read_only = open_index(default_root(root), create=create)
        return cls(layout, index, compact=compact, read_only=read_only)

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

    @property
    def readers(self) -> int:
        """How many threads read block files in parallel."""
        return self._workers

    def on_reader(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on a reader thread (a packed state's digest, read beside its load)."""
        return self._executor().submit(fn)

    def prepare(self) -> int:
        """Start every reader thread and load what a save needs, for a process that serves
        many requests: its first restore then starts no thread, and its first save imports
        nothing, while other requests run. The reader threads started."""
        pool = self._executor()
        # each job waits for all the others: one job a thread, so every thread starts
        started = threading.Barrier(self._workers, timeout=_THREAD_START_LIMIT_S)
        with contextlib.suppress(threading.BrokenBarrierError):  # some started: enough
            list(pool.map(lambda _: started.wait(), range(self._workers)))
        if not self.read_only:
            self._index.db  # noqa: B018 - loads the write path's module
        return self.readers

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
        tokens, ends)`` and the parent must be stored, under the same identity and
        namespace, ending where this block starts (ValueError otherwise).
        """
        expected = chain_next(
            block.parent or chain_root(block.identity, block.namespace), block.tokens, block.ends
        )
        if block.hash != expected:
            raise ValueError(f"block hash {block.hash} is not its chain hash {expected}")
        if self.has_block(block.hash):
            return False
        self._check_parent(block)
        data = encode(block, compact=self.compact)
        raw_bytes = len(encode(block)) if self.compact else None
        relpath = self.layout.block_relpath(block.hash)
        row = index_row(block, data, relpath, time.time(), raw_bytes)
        if row.raw_bytes > MAX_RAW_BLOCK_BYTES:
            raise ValueError(f"block of {row.raw_bytes} bytes is over {MAX_RAW_BLOCK_BYTES}")
        check_free_space(self.layout.tmp, len(data))
        with staged_block_file(self.layout, relpath, data) as tmp:
            try:
                placed = link_into_place(self.layout, tmp, relpath)
                # A file already there is an orphan or another writer's: replace it only
                # under the write lock and only if no row (which would name it) exists.
                place = None if placed else lambda: replace_into_place(self.layout, tmp, relpath)
                outcome = self._index.add_block(row, place)
            except BaseException:
                self._discard_unindexed(relpath)
                raise
        if outcome == "orphan":
            logger.info("parent of %s was removed while saving it; not stored", block.hash)
            deletion.remove_files(self._index, self.layout, [relpath])
        return outcome == "inserted"

    def _discard_unindexed(self, relpath: str) -> None:
        """After a failed save: remove the file it placed, unless a row names it."""
        try:
            deletion.remove_files(self._index, self.layout, [relpath])
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
        return self._index.same_first_block_elsewhere(tokens_sha, identity, namespace)

    def chain_of(self, tip: str) -> list[BlockRow]:
        """The stored chain ending at ``tip``, root first (empty if ``tip`` is not stored)."""
        return self._index.chain_of(tip)

    def all_blocks(self) -> list[BlockRow]:
        """Every stored block's row (one that does not decode is left out: ``verify`` names it)."""
        return self._index.all_blocks()

    def get_blocks(self, hashes: Sequence[str]) -> dict[str, BlockRow]:
        """The rows of those of ``hashes`` that are stored, by hash."""
        return self._index.get_blocks(hashes)

    def read_blocks(self, rows: Sequence[BlockRow]) -> list[Block]:
        """Read and check blocks in parallel, in order (``BlockCorrupt`` names the first bad)."""
        return self._reader.read(rows)

    def open_blocks(self, rows: Sequence[BlockRow]) -> list[OpenedBlock]:
        """Open blocks' files and check their headers; ``close()`` each (see ``BlockReader``)."""
        return self._reader.open(rows)

    def fill_blocks(
        self,
        opened: Sequence[OpenedBlock],
        targets: Fills,
        discard: Drops = None,
        tails: Tails = None,
        *,
        parallel: bool = True,
        then: Then | None = None,
    ) -> list[Block]:
        """Read opened blocks into their targets (see ``readinto.fill_block``), in parallel
        on the reader threads unless ``parallel`` is false (then on this thread); ``then``
        (``BlockReader.fill``) runs on a block's reader once it is read and checked."""
        return self._reader.fill(opened, targets, discard, tails, parallel=parallel, then=then)

    def start_fill_blocks(
        self, opened: Sequence[OpenedBlock], targets: Fills, *, then: Then | None = None
    ) -> PendingFill:
        """``fill_blocks`` on the reader threads, returning at once; ``wait()`` on the result
        for the blocks before the targets are used or reused (``BlockReader.start_fill``)."""
        return self._reader.start_fill(opened, targets, then=then)

    def quarantine(self, block_hash: str, reason: str) -> list[str]:
        """Drop a bad block and its descendants from the index; move its file aside.

        Returns the hashes removed. The bad block's file goes to ``quarantine/``
        with the reason; its descendants' files (fine but unreachable) are deleted.
        """
        gone = quarantine.quarantine(self._index, self.layout, block_hash, reason)
        self._catalogue.prune()
        self._sweep_packed()
        return gone

    def touch(self, hashes: Sequence[str]) -> None:
        """Mark blocks (and snapshots whose tip is among them) as used now."""
        if hashes:
            self._index.touch(hashes, time.time())

    # ------------------------------------------------------------- statistics
    def record_event(
        self,
        kind: str,
        reason: str | None,
        tokens: int,
        seconds: float,
        namespace: str | None = None,
        *,
        snapshot: str | None = None,
    ) -> None:
        """Record a ``hit`` (tokens reused, seconds saved, the snapshot it names) or a ``miss``."""
        event = events.Event(
            kind=kind,
            reason=reason,
            tokens=tokens,
            seconds=seconds,
            namespace=namespace,
            snapshot=snapshot,
        )
        events.record(self._index, event)

    def stats(self, namespace: str | None = None) -> StoreStats:
        """Hits, misses by reason, sizes, prefill seconds saved: of one namespace, or all."""
        return events.stats(self._index, namespace)

    def prefill_rate(self, identity: str, n_ctx: int) -> tuple[float, int] | None:
        """Timed prefill ``(seconds, tokens)`` under ``identity`` at ``n_ctx`` (``events``)."""
        return events.rate(self._index, identity, n_ctx)

    def note_prefill(self, identity: str, n_ctx: int, seconds: float, tokens: int) -> None:
        events.note_rate(self._index, identity, n_ctx, seconds, tokens)

    # -------------------------------------------------------------- snapshots
    # The catalogue lives in ``snapshots.py``, the privacy path in ``removal/forget.py``.
    def put_snapshot(
        self,
        new: NewSnapshot,
        *,
        pinned: bool = False,
        pinned_until: float | None = None,
        client_share: int | None = None,
    ) -> str:
        """Name the chain ending at ``new.tip`` (the same tip, label and namespace keep one
        id); a pin with ``pinned_until`` lapses then (seconds since the epoch); with
        ``client_share``, it is a server's client's, made only within that many bytes
        of clients' pins (``SnapshotCatalogue.put``)."""
        return self._catalogue.put(
            new, pinned=pinned, pinned_until=pinned_until, client_share=client_share
        )

    def snapshots(self, namespace: str | None = None) -> list[SnapshotRow]:
        """All snapshots (of one namespace), oldest first."""
        return self._catalogue.snapshots(namespace)

    def get_snapshot(self, id_or_prefix: str) -> SnapshotRow:
        """The snapshot with this id or unique id prefix (KeyError otherwise)."""
        return self._catalogue.get(id_or_prefix)

    def pin(self, snapshot_id: str) -> None:
        """Protect a snapshot's chain from eviction."""
        self._catalogue.set_pinned(snapshot_id, True)

    def unpin(self, snapshot_id: str) -> None:
        self._catalogue.set_pinned(snapshot_id, False)

    def remove_snapshot(self, snapshot_id: str, heir: str | None = None) -> int:
        """Delete a snapshot and the blocks only it needed (its hits go to ``heir``)."""
        freed = self._catalogue.remove(snapshot_id, heir)
        self._sweep_packed()
        return freed

    def space(self, namespace: str | None = None) -> Space:
        """What removing each snapshot (of one namespace, or all) frees now, and the stored
        bytes split into those, the shared and the rest (``space.space``)."""
        return space(self._index, namespace)

    def forget(
        self, source_path: str | None, source_sha256: str | None, runs: forget.Runs = ()
    ) -> ForgetReport:
        """Remove every trace of one document (see ``forget.forget``)."""
        report = forget.forget(self._index, self.layout, source_path, source_sha256, runs)
        self._catalogue.prune(report.snapshots)  # their manifests name the document
        self._sweep_packed()
        return report

    def scrub(self) -> bool:
        """VACUUM the index, empty its WAL; True if another process kept it (``forget.scrub``)."""
        return forget.scrub(self._index)

    # ---------------------------------------------------------------- budget
    def evict(self, budget_bytes: int) -> int:
        """Evict unpinned leaf blocks, least valuable first, to the budget; the bytes freed.

        Never a pinned snapshot's chain or a chain's middle; a snapshot whose tip goes is dropped.
        """
        freed = evict.evict(self._index, self.layout, budget_bytes)
        self._catalogue.prune()
        self._sweep_packed()
        return freed

    def default_budget(self) -> int:
        """``$LOCALKV_BUDGET``, else 10% of free disk space at the root, at most 20 GiB."""
        return budget.default_budget(next(p for p in (self.root, *self.root.parents) if p.is_dir()))

    def client_pin_fits(self, tip: str, share: int) -> bool:
        """Whether a client's pin on the chain ending at ``tip`` fits the clients' ``share``
        of the budget (``budget.client_pin_fits``), now."""
        with self._index.write() as db:
            return budget.client_pin_fits(db, tip, share)

    def usage(self, namespace: str | None = None) -> budget.Usage:
        """Bytes stored and bytes pinned snapshots keep (of one namespace, or all)."""
        return budget.usage(self._index, namespace)

    # ----------------------------------------------------------- maintenance
    def gc(self, grace_seconds: float = 3600.0) -> GcReport:
        """Remove temp files, files without rows, rows without files (and descendants).

        Files younger than ``grace_seconds`` are kept: another process may be
        between writing a block file and inserting its row.
        """
        if not self.layout.root.is_dir():  # opened with create=False
            return GcReport(temp_files=0, orphan_files=0, missing_files=0, bytes_freed=0)
        report = reconcile.gc(self.layout, self._index, grace_seconds)
        self._catalogue.prune()
        self._sweep_packed()
        return report

    def verify(self, repair: bool = False) -> list[tuple[str, str]]:
        """Recheck every block file and chain hash; ``repair`` quarantines the bad ones."""
        bad = reconcile.verify(self._index, self.layout, self._reader, self._executor(), repair)
        if repair:
            self._catalogue.prune()
            self._sweep_packed()
        return bad

    def _sweep_packed(self) -> None:
        """Remove the packed states (``packed``) of chains whose tip block is gone: what
        was forgotten, evicted or found bad is not kept in one."""
        for entry in self.packed.listing():
            if not self.has_block(entry.tip):
                self.packed.remove(entry.tip)

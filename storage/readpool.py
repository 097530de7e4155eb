"""``BlockReader``: a store's block files read in parallel, into caller buffers if asked.

Three ways in, all checked against the index rows (``formats.readinto`` does
the checking): ``read`` returns blocks with tensors of their own; ``open`` then
``fill`` lets the caller see every block's tensor specs first and give buffers
for the bytes (a restore reads K/V rows straight into llama.cpp's state
buffer this way). Failures are ``BlockCorrupt`` naming the first bad block in
the order given.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from .formats.readinto import HeaderCache, OpenedBlock, Targets, fill_block, open_block
from .paths import CacheLayout
from .values import Block, BlockCorrupt, BlockRow

__all__ = ["BlockReader", "Drops", "Fills", "PendingFill", "Tails", "Then"]

# per block, where its tensors go (``fill_block``'s ``targets``), or what makes them on the
# thread that reads the block, as its read starts (its own buffers: a per-reader area)
Fills = Sequence[Targets | Callable[[], Targets] | None]
# per block, the tensors a read checks or skips but does not keep (``fill_block``'s ``discard``)
Drops = Sequence[Collection[str]] | None
Tails = Sequence[int | None] | None  # per block, the first tail row wanted (``tail_from``)
Then = Callable[[int, Block], None]  # done with block i once read and checked (``fill``)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """One block's read (``BlockReader._fill``)."""

    i: int
    opened: OpenedBlock
    targets: Targets | Callable[[], Targets] | None
    discard: Collection[str]
    tail_from: int | None


class PendingFill:
    """Blocks being read on the reader threads (``BlockReader.start_fill``)."""

    def __init__(self, futures: list[Future[Block]]) -> None:
        self._futures = futures

    def wait(self) -> list[Block]:
        """The blocks, in order, once every read has finished; ``BlockCorrupt`` naming the
        first bad block (in order) if one failed: what the targets hold is then unusable."""
        # every read finishes before any error is raised: the caller may then close the
        # files and reuse the targets, and no read may still be writing into them
        wait(self._futures)
        return [f.result() for f in self._futures]


class BlockReader:
    """Reads one store's block files (thread-safe)."""

    def __init__(
        self, layout: CacheLayout, executor: Callable[[], ThreadPoolExecutor], max_raw_bytes: int
    ) -> None:
        self.layout = layout
        self._executor = executor
        self._max_raw_bytes = max_raw_bytes
        self._headers = HeaderCache()

    def read(self, rows: Sequence[BlockRow]) -> list[Block]:
        """Read and check blocks in parallel, in order.

        Raises ``BlockCorrupt`` naming the first bad block (in ``rows`` order).
        """
        if len(rows) <= 1:
            return [self._read_one(row) for row in rows]
        return list(self._executor().map(self._read_one, rows))

    def _read_one(self, row: BlockRow) -> Block:
        opened = self.open([row])[0]
        try:
            return self._fill(_Job(i=0, opened=opened, targets=None, discard=(), tail_from=None))
        finally:
            opened.close()

    def open(self, rows: Sequence[BlockRow]) -> list[OpenedBlock]:
        """Open blocks' files and check their headers against the index (in order).

        The caller reads them with ``fill`` and must ``close()`` each.
        Raises ``BlockCorrupt`` naming the first bad block; nothing stays open then.
        """
        opened: list[OpenedBlock] = []
        try:
            for row in rows:
                opened.append(self._open_one(row))
        except BaseException:
            for o in opened:
                o.close()
            raise
        return opened

    def _open_one(self, row: BlockRow) -> OpenedBlock:
        try:
            if row.file != self.layout.block_relpath(row.hash):
                raise BlockCorrupt(f"index points at {row.file!r}, not the block's own path")
            return open_block(self.layout, row, self._max_raw_bytes, self._headers)
        except BlockCorrupt as exc:
            raise BlockCorrupt(exc.reason, row.hash) from None
        except (ValueError, OSError, MemoryError) as exc:
            raise BlockCorrupt(f"{type(exc).__name__}: {exc}", row.hash) from None

    def fill(
        self,
        opened: Sequence[OpenedBlock],
        targets: Fills,
        discard: Drops = None,
        tails: Tails = None,
        *,
        parallel: bool = True,
        then: Then | None = None,
    ) -> list[Block]:
        """Read opened blocks in parallel (or, with ``parallel`` false, one after another on
        this thread), each one's tensors into its targets.

        See ``formats.readinto.fill_block`` (``targets``: per block, or what makes them on
        the thread that reads it; ``discard``: per block, the tensors
        read and checked but not kept; ``tails``: per block, the first tail row
        wanted). ``then(i, block)`` runs on the thread that read block ``i``, once
        it is read and checked (while its bytes are still in the CPU's cache).
        Raises ``BlockCorrupt`` naming the first bad block (in order): what the
        targets hold is then unusable.
        """
        jobs = self._jobs(opened, targets, discard, tails)
        if len(opened) <= 1 or not parallel:  # in order: the first bad block raises first
            return [self._fill(job, then=then) for job in jobs]
        return self._start(jobs, then).wait()

    def start_fill(
        self,
        opened: Sequence[OpenedBlock],
        targets: Fills,
        discard: Drops = None,
        tails: Tails = None,
        *,
        then: Then | None = None,
    ) -> PendingFill:
        """``fill`` on the reader threads, returning at once: ``wait()`` for the blocks.

        The caller must ``wait()`` before it uses or reuses the targets or closes
        the files, however it leaves (an error of its own included).
        """
        return self._start(self._jobs(opened, targets, discard, tails), then)

    def _jobs(
        self, opened: Sequence[OpenedBlock], targets: Fills, discard: Drops, tails: Tails
    ) -> list[_Job]:
        if len(opened) != len(targets):
            raise ValueError(f"{len(opened)} blocks but {len(targets)} target maps")
        drops = list(discard) if discard is not None else [()] * len(opened)
        froms = list(tails) if tails is not None else [None] * len(opened)
        if len(drops) != len(opened) or len(froms) != len(opened):
            raise ValueError(f"{len(opened)} blocks but {len(drops)} discard sets")
        return [
            _Job(i=i, opened=o, targets=t, discard=d, tail_from=f)
            for i, (o, t, d, f) in enumerate(zip(opened, targets, drops, froms, strict=True))
        ]

    def _start(
        self,
        jobs: list[_Job],
        then: Then | None,
    ) -> PendingFill:
        pool = self._executor()
        return PendingFill([pool.submit(self._fill, job, then=then) for job in jobs])

    def _fill(self, job: _Job, *, then: Then | None = None) -> Block:
        try:
            targets = job.targets() if callable(job.targets) else job.targets
            block = fill_block(job.opened, targets, job.discard, job.tail_from)
            if then is not None:
                then(job.i, block)
            return block
        except BlockCorrupt as exc:
            raise BlockCorrupt(exc.reason, job.opened.row.hash) from None
        except (OSError, MemoryError) as exc:
            raise BlockCorrupt(f"{type(exc).__name__}: {exc}", job.opened.row.hash) from None

"""Cache work that runs after the answer, on one worker thread.

Writing new blocks, evicting down to the budget, and the bookkeeping of a
restore (hit counts, statistics) never run on the path to the first token:
the runtime queues them here. Jobs run in order; a finished job's error is
logged when the next one is queued, and ``wait`` returns every result.
Bookkeeping queued inside ``held`` (a restore, until its answer has ended) is
queued when that block ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from localkv.cache.prefix import SaveResult

__all__ = ["BackgroundWork"]

log = logging.getLogger(__name__)


class BackgroundWork:
    """One worker thread for cache writes and bookkeeping; ``close()`` waits for it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localkv-save")
        self._pending: list[Future[SaveResult]] = []
        self._held: list[Callable[[], None]] | None = None  # kept back inside held()

    def submit(self, fn: Callable[[], SaveResult]) -> None:
        """Queue a save; finished jobs are dropped (their errors logged)."""
        keep = []
        for fut in self._pending:
            if not fut.done():
                keep.append(fut)
            elif fut.exception() is not None:
                log.warning("background cache work failed: %s", fut.exception())
        keep.append(self._pool.submit(fn))
        self._pending = keep

    def defer(self, fn: Callable[[], None]) -> None:
        """Queue bookkeeping that returns nothing (kept back inside ``held``)."""
        if self._held is not None:
            self._held.append(fn)
            return

        def run() -> SaveResult:
            fn()
            return SaveResult(blocks=0, new_blocks=0, new_bytes=0, tip=None)

        self.submit(run)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Keep bookkeeping back while the block runs; queue it at the end (even on error).

        The worker's Python work (the index's imports, its write) would take a
        core and the GIL from the prefill and the decode of the answer. Inside
        another ``held`` the outer one queues it.
        """
        if self._held is not None:
            yield
            return
        self._held = []
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        held, self._held = self._held, None
        for fn in held or ():
            self.defer(fn)

    def wait(self) -> list[SaveResult]:
        """Wait for every queued job; the results of those that did not fail."""
        done = []
        for fut in self._pending:
            try:
                done.append(fut.result())
            except Exception:
                log.warning("saving cache blocks failed", exc_info=True)
        self._pending.clear()
        return done

    def close(self) -> None:
        """Wait for the queued jobs and stop the thread (idempotent)."""
        self._release()
        self.wait()
        self._pool.shutdown(wait=True)

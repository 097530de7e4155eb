"""Cache work that runs after the answer, on one worker thread.

Writing new blocks, evicting down to the budget, and the bookkeeping of a
restore (hit counts, statistics) never run on the path to the first token:
the runtime queues them here. Jobs run in order; a finished job's error is
logged when the next one is queued, and ``wait`` returns every result.
Bookkeeping queued while ``hold`` is in force (a restore before its answer's
first token) is queued when the release it returns is called, or by ``close``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from localkv.cache.prefix import SaveResult

__all__ = ["BackgroundWork", "first_then"]

log = logging.getLogger(__name__)


class BackgroundWork:
    """One worker thread for cache writes and bookkeeping; ``close()`` waits for it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localkv-save")
        self._pending: list[Future[SaveResult]] = []
        self._held: list[Callable[[], None]] | None = None  # bookkeeping kept back by hold()

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
        """Queue bookkeeping that returns nothing (kept back while ``hold`` is in force)."""
        if self._held is not None:
            self._held.append(fn)
            return

        def run() -> SaveResult:
            fn()
            return SaveResult(0, 0, 0, None)

        self.submit(run)

    def hold(self) -> Callable[[], None]:
        """Keep bookkeeping back until the returned release is called (a no-op after the first).

        The worker's Python work (the index's imports, its write) would take a
        core and the GIL from the prefill and decode that lead to a first token.
        """
        if self._held is None:
            self._held = []
        return self.release

    def release(self) -> None:
        """Queue the bookkeeping ``hold`` kept back, and stop holding."""
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
        """Queue what ``hold`` kept back, wait for the queued jobs and stop the thread
        (idempotent)."""
        self.release()
        self.wait()
        self._pool.shutdown(wait=True)


def first_then(
    on_text: Callable[[str], None] | None, then: Callable[[], None]
) -> Callable[[str], None]:
    """``on_text``, calling ``then`` once, after the first piece of text has gone out."""
    called = False

    def send(piece: str) -> None:
        nonlocal called
        if on_text is not None:
            on_text(piece)
        if not called and piece:
            called = True
            then()

    return send

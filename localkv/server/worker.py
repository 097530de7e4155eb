"""The one thread that owns the model, and the bounded queue in front of it.

llama.cpp's context is not shared: every request runs on this thread, one at
a time, so an answer never depends on what else was running. The queue admits
at most ``capacity`` requests (the running one included); one more is refused
at once (``QueueFull``, a 503 with ``Retry-After``) instead of waiting for
minutes. Results and text pieces go back to the event loop through a
``Ticket``; a ticket cancelled by its client (it disconnected) stops its
generation between tokens, or is skipped if it has not started.

Stopping the server cancels every admitted request (``cancel_all``): the
running one ends at its next token, the waiting ones are skipped, the
background saves complete, and the model is freed. ``stop`` waits for that
at most ``STOP_GRACE_S`` from the moment the stop began; a thread still busy
then (inside a native call that cannot be interrupted) is left to the
process's exit, which the saved cache survives as it survives a kill.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from localkv.server.engine import Engine
from localkv.server.errors import ApiError

__all__ = ["STOP_GRACE_S", "ModelWorker", "NotReady", "QueueFull", "Ticket"]

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # from a stop's start to the model thread's end, at most

Job = Callable[[Engine, "Ticket"], Any]


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after} s")
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading (or failed to)."""


class Ticket:
    """One submitted request: its events arrive on the event loop's ``events`` queue.

    Events are ``("started", None)`` when the request fits and its work begins,
    ``("text", piece)`` and ``("reasoning", piece)``, then ``("done", result)`` or
    ``("error", exception)``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, job: Job) -> None:
        self.loop = loop
        self.job = job
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._finished = False
        self.result: Any = None  # what the job returned (None: it failed or never ran)
        self._callbacks: list[Callable[[Any], None]] = []
        self.arrived = time.perf_counter()  # the request's arrival (the route sets it earlier)

    def when_done(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(result)`` once the job has ended (now, if it has)."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback(self.result)

    def _finish(self, result: Any) -> None:
        with self._lock:
            self._finished, self.result = True, result
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(result)

    # the client side (event loop)
    def cancel(self) -> None:
        self._cancel.set()

    # the worker side
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def started(self) -> None:
        self._put("started", None)

    def text(self, piece: str) -> None:
        if piece:
            self._put("text", piece)

    def reasoning(self, piece: str) -> None:
        if piece:
            self._put("reasoning", piece)

    def _put(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class ModelWorker:
    """Opens the engine on its own thread, then runs submitted jobs in order."""

    def __init__(
        self,
        open_engine: Callable[[], Engine],
        capacity: int,
        on_failure: Callable[[BaseException], None] | None = None,
        grace_s: float = STOP_GRACE_S,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the queue needs room for at least one request, got {capacity}")
        self.capacity = capacity
        self.state = "loading"  # -> "ready" -> "stopped", or "failed"
        self.error: str | None = None
        self.engine: Engine | None = None
        self._open_engine = open_engine
        self._on_failure = on_failure
        self._jobs: queue.Queue[Ticket | None] = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0
        self._recent_s = 1.0  # a moving average of request durations, for Retry-After
        self._tickets: set[Ticket] = set()  # admitted and not finished
        self.grace_s = grace_s
        self._stop_by: float | None = None  # monotonic time by which the thread must end
        self._thread = threading.Thread(target=self._run, name="localkv-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel_all(self) -> float:
        """Cancel every admitted request, refuse new ones, start the stop's grace period.

        The running request ends at its next token, the waiting ones are skipped.
        Returns the monotonic time the grace period ends (thread-safe).
        """
        with self._lock:
            tickets = list(self._tickets)
            if self._stop_by is None:
                self._stop_by = time.monotonic() + self.grace_s
            stop_by = self._stop_by
        for ticket in tickets:
            ticket.cancel()
        if tickets:
            log.info("stopping: cancelled %d admitted request(s)", len(tickets))
        return stop_by

    def stop(self) -> bool:
        """Cancel the admitted requests, let the background saves complete, free the model.

        Waits until the grace period that began with the first ``cancel_all`` ends;
        False (and a logged error) if the model thread is still busy then.
        """
        stop_by = self.cancel_all()
        self._jobs.put(None)
        if not self._thread.is_alive():
            return True
        self._thread.join(max(0.0, stop_by - time.monotonic()))
        if self._thread.is_alive():
            log.error("the model thread did not stop within %g s; leaving it", self.grace_s)
            return False
        return True

    def alive(self) -> bool:
        """Whether the model thread is still running (loading, serving or stopping)."""
        return self._thread.is_alive()

    def status(self) -> dict[str, object]:
        with self._lock:
            return {
                "state": self.state,
                "running": self._running,
                "waiting": self._admitted - self._running,
                "capacity": self.capacity,
            }

    def submit(self, loop: asyncio.AbstractEventLoop, job: Job) -> Ticket:
        if self.state != "ready":
            raise NotReady(self.error or "the model is loading")
        with self._lock:
            if self._stop_by is not None:
                raise NotReady("the server is stopping")
            if self._admitted >= self.capacity:
                raise QueueFull(self._retry_after())
            self._admitted += 1
            ticket = Ticket(loop, job)
            self._tickets.add(ticket)
        self._jobs.put(ticket)
        return ticket

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._recent_s * self._admitted))

    # ----------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            self.engine = self._open_engine()
        except BaseException as exc:
            self.state, self.error = "failed", str(exc)
            log.error("the model could not be loaded: %s", exc)
            if self._on_failure is not None:
                self._on_failure(exc)
            return
        self.state = "ready"
        log.info("model ready: %s", self.engine.model_id)
        try:
            while (ticket := self._jobs.get()) is not None:
                self._one(self.engine, ticket)
        finally:
            self.state = "stopped"
            self.engine.runtime.close()  # waits for the background saves

    def _one(self, engine: Engine, ticket: Ticket) -> None:
        with self._lock:
            self._running = 1
        t0 = time.perf_counter()
        result = None
        try:
            if ticket.cancelled():
                ticket._put("error", asyncio.CancelledError())
            else:
                with engine.runtime.work.held():  # a restore's bookkeeping waits for the answer
                    result = ticket.job(engine, ticket)
                ticket._put("done", result)
        except ApiError as exc:  # the request's own fault: its answer says why
            log.debug("request refused: %s %s", exc.status, exc.message)
            ticket._put("error", exc)
        except Exception as exc:
            log.debug("request failed", exc_info=True)
            ticket._put("error", exc)
        finally:
            ticket._finish(result)
            elapsed = time.perf_counter() - t0
            with self._lock:
                self._running = 0
                self._admitted -= 1
                self._tickets.discard(ticket)
                self._recent_s = 0.7 * self._recent_s + 0.3 * elapsed

"""The one thread that owns the model, and the bounded queue in front of it.

llama.cpp's context is not shared: every request runs on this thread, one at
a time, so an answer never depends on what else was running. Requests sent
together (an agent's title request beside its turn, its subagents) wait their
turn, in order of arrival, up to two bounds: at most ``capacity`` requests are
admitted at once (the running one included), and a request waits at most
``wait_s`` for its turn. Past either it is refused (``QueueFull``, a 503 with
``Retry-After``): one more at once, a waiting one when its time runs out.
Results and text pieces go back to the event loop through a ``Ticket``; a
ticket cancelled by its client (it disconnected) stops its generation between
tokens, or, still waiting, leaves the queue at once and never runs.

Stopping the server cancels every admitted request (``cancel_all``): the
running one ends at its next token, the waiting ones leave the queue, the
background saves complete, and the model is freed. ``stop`` waits for that
at most ``STOP_GRACE_S`` from the moment the stop began; a thread still busy
then (inside a native call that cannot be interrupted) is left to the
process's exit, which the saved cache survives as it survives a kill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from localkv.server.engine import Engine
from localkv.server.errors import ApiError

__all__ = ["QUEUE_WAIT_S", "STOP_GRACE_S", "ModelWorker", "NotReady", "QueueFull", "Ticket"]

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # from a stop's start to the model thread's end, at most
QUEUE_WAIT_S = 600.0  # the longest a request waits for its turn (as long as SDKs wait)

Job = Callable[[Engine, "Ticket"], Any]


class QueueFull(ApiError):
    """A request the queue has no room or no more time for: 503 with ``Retry-After``."""

    def __init__(self, retry_after: int, reason: str = "the queue is full") -> None:
        super().__init__(
            503,
            f"{reason}; retry after {retry_after} s",
            code="queue_full",
            headers={"Retry-After": str(retry_after)},
        )
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading (or failed to)."""


class Ticket:
    """One submitted request: its events arrive on the event loop's ``events`` queue.

    Events are ``("started", None)`` when the request fits and its work begins,
    ``("text", piece)`` and ``("reasoning", piece)``, then ``("done", result)`` or
    ``("error", exception)``: a ``CancelledError`` for a request cancelled before its
    turn, a ``QueueFull`` for one whose wait ran out.
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
        self.queued = False  # waiting for its turn (the worker's lock guards it)
        self.on_cancel: Callable[[Ticket], None] | None = None  # the worker's, while queued
        self.timer: asyncio.TimerHandle | None = None  # the end of its wait

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
        """Stop the request: between tokens if it runs, at once if it waits (any thread)."""
        self._cancel.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

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
    """Opens the engine on its own thread, then runs submitted jobs in order.

    ``capacity`` requests are admitted at once, the running one included; a
    waiting one is refused after ``wait_s`` (None: it waits as long as it takes).
    """

    def __init__(
        self,
        open_engine: Callable[[], Engine],
        capacity: int,
        on_failure: Callable[[BaseException], None] | None = None,
        grace_s: float = STOP_GRACE_S,
        wait_s: float | None = QUEUE_WAIT_S,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"the queue needs room for at least one request, got {capacity}")
        if wait_s is not None and wait_s <= 0:
            raise ValueError(f"a request must be allowed to wait for its turn, got {wait_s} s")
        self.capacity = capacity
        self.wait_s = wait_s
        self.state = "loading"  # -> "ready" -> "stopped", or "failed"
        self.error: str | None = None
        self.engine: Engine | None = None
        self._open_engine = open_engine
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._turn = threading.Condition(self._lock)  # a request is waiting, or the stop
        self._waiting: deque[Ticket] = deque()  # in order of arrival
        self._closed = False
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

        The running request ends at its next token, the waiting ones leave the queue.
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
        with self._turn:
            self._closed = True
            self._turn.notify()
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
        """Queue ``job``; called on ``loop``'s thread, which gets the ticket's events."""
        if self.state != "ready":
            raise NotReady(self.error or "the model is loading")
        with self._turn:
            if self._stop_by is not None:
                raise NotReady("the server is stopping")
            if self._admitted >= self.capacity:
                busy = f"the server is busy: {self._admitted} requests are running or waiting"
                raise QueueFull(self._retry_after(), busy)
            self._admitted += 1
            ticket = Ticket(loop, job)
            ticket.queued, ticket.on_cancel = True, self._withdraw
            if self.wait_s is not None:
                ticket.timer = loop.call_later(self.wait_s, self._expire, ticket)
            self._tickets.add(ticket)
            self._waiting.append(ticket)
            self._turn.notify()
        return ticket

    def _retry_after(self) -> int:
        return max(1, math.ceil(self._recent_s * self._admitted))

    # ------------------------------------------------- leaving before the turn
    def _withdraw(self, ticket: Ticket) -> None:
        """A waiting request cancelled (its client left, the server stops): it never runs."""
        if self._leave(ticket) is not None:
            self._drop(ticket, asyncio.CancelledError())

    def _expire(self, ticket: Ticket) -> None:
        """A request still waiting when its time is up: refused (on the event loop)."""
        retry_after = self._leave(ticket)
        if retry_after is not None:
            log.info("a request waited %g s for its turn: refused with 503", self.wait_s)
            reason = f"the request waited {self.wait_s:g} s for its turn"
            self._drop(ticket, QueueFull(retry_after, reason))

    def _leave(self, ticket: Ticket) -> int | None:
        """Take a waiting ticket out of the queue: the Retry-After then, None if not waiting."""
        with self._lock:
            if not ticket.queued:
                return None
            ticket.queued = False
            self._waiting.remove(ticket)
            self._tickets.discard(ticket)
            self._admitted -= 1
            return self._retry_after()

    def _drop(self, ticket: Ticket, error: BaseException) -> None:
        _disarm(ticket)
        ticket._put("error", error)
        ticket._finish(None)

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
            while (ticket := self._next()) is not None:
                self._one(self.engine, ticket)
        finally:
            self.state = "stopped"
            self.engine.runtime.close()  # waits for the background saves

    def _next(self) -> Ticket | None:
        """The first waiting ticket, now running; None once stopped with none left."""
        with self._turn:
            while not self._waiting and not self._closed:
                self._turn.wait()
            if not self._waiting:
                return None
            ticket = self._waiting.popleft()
            ticket.queued = False
            self._running = 1
        _disarm(ticket)
        return ticket

    def _one(self, engine: Engine, ticket: Ticket) -> None:
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


def _disarm(ticket: Ticket) -> None:
    """Cancel the end of the ticket's wait (from any thread)."""
    timer, ticket.timer = ticket.timer, None
    if timer is not None:
        with contextlib.suppress(RuntimeError):  # a closed loop: the timer went with it
            ticket.loop.call_soon_threadsafe(timer.cancel)

"""uvicorn as ``localkv serve`` runs it: h11 with a deadline for each request's head.

uvicorn (0.54, pinned) closes an idle keep-alive connection after
``timeout_keep_alive`` seconds, but it has no deadline for a request whose
headers arrive slowly: a client that sends a byte a minute holds its
connection, and enough such clients hold every file descriptor. Here a
connection that has not sent a complete request head within
``HEADER_TIMEOUT_S`` of opening, or of its previous response, is closed. The
body has its own deadline (``gate.read_body``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from localkv.server.worker import STOP_GRACE_S

__all__ = ["HEADER_TIMEOUT_S", "HeadDeadlineProtocol", "server_config"]

log = logging.getLogger("localkv.server")

HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5.0


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the cycle before the head awaited

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._waiting_after:
            self._disarm()  # a complete head arrived: its request runs

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()
        # the next head is awaited, unless a pipelined request has started already
        if not self.transport.is_closing() and self.cycle is finished:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after = self.cycle
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info(
                "closed a connection that sent no complete request head within %g s",
                self.header_timeout_s,
            )
            self.transport.close()


def server_config(
    app: Any,
    *,
    host: str,
    port: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    grace_s: float = STOP_GRACE_S,
) -> uvicorn.Config:
    """The uvicorn configuration of ``localkv serve`` (no access log: ``gate`` logs).

    A shutdown waits at most ``grace_s`` for the open requests, then cancels them.
    """
    protocol = type(
        "HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"header_timeout_s": header_timeout_s}
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        http=protocol,
        timeout_keep_alive=int(KEEP_ALIVE_S),
        timeout_graceful_shutdown=grace_s,  # type: ignore[arg-type]  # any number waits
    )

"""What every request passes: who may call (``boundary``), the API key, the body's
limits, and its one log line.

Whatever a handler raises ends here as an OpenAI-shaped error: an ``ApiError``
as itself, anything else as a JSON 500 (logged with its traceback, since it is
a bug), never Starlette's plain-text page.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from localkv.server.boundary import Boundary
from localkv.server.errors import ApiError, error_response
from localkv.server.limits import disconnected

__all__ = ["Gate", "read_body"]

log = logging.getLogger("localkv.server")

# a body over the limit but under this is read and dropped, so that a client still
# writing it gets the 413 rather than a reset connection
DRAIN_LIMIT = 256 * 2**20
OPEN_PATHS = ("/health",)  # answered without a key: it says nothing but "ready"


class Gate:
    """ASGI middleware: refuse a request the boundary refuses (403, 415) or with a
    missing or wrong key (401), before its body is read; log one line per request.

    The line: method, path, status, prompt/cached/generated tokens, time to
    first token and total time (the handlers leave the counts in
    ``scope["state"]["ticket"]``).
    """

    def __init__(self, app: ASGIApp, api_key: str | None, boundary: Boundary) -> None:
        self.app = app
        self.api_key = api_key
        self.boundary = boundary

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            self._check_boundary(scope)
            if self.api_key is not None and scope["path"] not in OPEN_PATHS:
                _check_key(scope, self.api_key)
            await self.app(scope, receive, logged_send)
        except ApiError as exc:
            if not status[0]:  # else the response is under way: nothing more can be said
                await error_response(exc, scope["path"])(scope, receive, logged_send)
        except Exception as exc:
            log.error("%s %s failed: %s", scope["method"], scope["path"], exc, exc_info=exc)
            if not status[0]:
                error = ApiError(
                    500, f"internal error: {type(exc).__name__}", code="internal_error"
                )
                await error_response(error, scope["path"])(scope, receive, logged_send)
        finally:
            _log_line(scope, status[0], time.perf_counter() - t0)

    def _check_boundary(self, scope: Scope) -> None:
        try:
            self.boundary.check(scope["method"], dict(scope["headers"]))
        except ApiError as exc:
            log.warning("refused %s %s: %s", scope["method"], scope["path"], exc.message)
            raise


def _check_key(scope: Scope, api_key: str) -> None:
    """``Authorization: Bearer KEY``, or ``x-api-key: KEY`` (as Anthropic's clients send it)."""
    headers = dict(scope["headers"])
    header = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, given = header.partition(" ")
    if b"x-api-key" in headers:
        scheme, given = "bearer", headers[b"x-api-key"].decode("latin-1")
    elif not header:
        raise ApiError(
            401,
            "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
            code="missing_api_key",
        )
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    ):
        raise ApiError(401, "incorrect API key", code="invalid_api_key")


def _log_line(scope: Scope, status: int, seconds: float) -> None:
    """Log the request now, or, when its generation is still stopping, once it has."""
    ticket: Any = scope.get("state", {}).get("ticket")
    method, path = scope["method"], scope["path"]

    def line(outcome: Any) -> None:
        tokens = ttft = ""
        if outcome is not None:
            tokens = (
                f" prompt={outcome.prompt_tokens} cached={outcome.cached_tokens}"
                f" generated={outcome.generated} ({outcome.source}"
                f"{', cancelled' if outcome.finish_reason == 'cancelled' else ''})"
            )
            ttft = f" ttft={outcome.ttft_s * 1000:.0f}ms"
        total = seconds * 1000
        log.info("%s %s %s%s%s total=%.0fms", method, path, status or "-", tokens, ttft, total)

    if ticket is None:
        line(None)
    else:
        ticket.when_done(line)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with a 413 past ``limit`` bytes (before reading it all).

    The whole body must arrive within ``timeout_s`` (408 after that: a client
    that trickles its body does not hold the connection); a client that goes
    away before the end gets nothing (499 in the log line), not a traceback.
    """
    try:
        return await asyncio.wait_for(_read(request, limit), timeout_s)
    except TimeoutError:
        raise ApiError(
            408,
            f"the request body did not arrive within {timeout_s:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise disconnected() from None


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    too_large = ApiError(
        413,
        f"the request body is larger than the limit of {limit:,} bytes",
        code="request_too_large",
    )
    declared_size = int(declared) if declared is not None and declared.isdigit() else 0
    if declared_size > DRAIN_LIMIT:
        raise too_large  # not worth reading: the connection closes after the answer
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > DRAIN_LIMIT:
            raise too_large
        if size <= limit:
            chunks.append(chunk)
    if size > limit:  # read to the end (and dropped), so the client gets the answer
        raise too_large
    return b"".join(chunks)

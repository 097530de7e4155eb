"""The Anthropic routes, on the OpenAI routes' worker, queue and helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localkv.server.anthropic.replies import PING, Message, event
from localkv.server.anthropic.translate import messages_request
from localkv.server.engine import Outcome
from localkv.server.errors import ApiError, anthropic_error
from localkv.server.worker import Ticket

if TYPE_CHECKING:
    from localkv.server.app import Routes

__all__ = ["AnthropicRoutes"]


class AnthropicRoutes:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

    Any model name is the loaded model, as on the OpenAI routes; the answer names
    the model the request named. ``anthropic-version`` and ``anthropic-beta`` are
    accepted, not required.
    """

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def all(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()  # before its body is read
        routes = self.routes
        parsed = messages_request(await routes._body(request))
        routes._engine()  # a 503 while the model loads
        chat, message = parsed.request, Message(parsed.model)
        ticket = routes._submit(lambda engine, t: engine.chat(chat, t))
        ticket.arrived = request.state.arrived
        request.state.ticket = ticket  # its outcome goes into the log line
        if not parsed.stream:
            outcome: Outcome = await routes._result(request, ticket)
            return JSONResponse(message.whole(outcome))
        await routes._next(request, ticket, until="started")  # a 413 comes before the stream
        events = _events(ticket, message, routes.settings.keepalive_s)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the prompt tokens of the same request to ``/v1/messages``
        (its ``input_tokens``, ``cache_read_input_tokens`` and ``cache_creation_input_tokens``
        together)."""
        parsed = messages_request(await self.routes._body(request), counting=True)
        chat = parsed.request
        n = await self.routes._run(request, lambda engine, t: engine.count(chat, t))
        return JSONResponse({"input_tokens": n})


async def _events(ticket: Ticket, message: Message, keepalive_s: float) -> AsyncIterator[str]:
    try:
        yield message.start()
        while True:
            try:
                kind, value = await asyncio.wait_for(ticket.events.get(), keepalive_s)
            except TimeoutError:
                yield PING
                continue
            if kind == "text":
                yield message.piece("text", value)
            elif kind == "reasoning":
                yield message.piece("thinking", value)
            elif kind == "done":
                yield message.end(value)
                break
            elif kind == "error":
                yield event("error", _stream_error(value))
                break
    finally:
        ticket.cancel()  # a client that went away stops its generation


def _stream_error(exc: BaseException) -> dict[str, object]:
    if isinstance(exc, ApiError):
        error = exc
    elif isinstance(exc, asyncio.CancelledError):
        error = ApiError(499, "the request was cancelled")
    else:
        error = ApiError(500, f"internal error: {exc}")
    return {"error": anthropic_error(error)[1]["error"]}

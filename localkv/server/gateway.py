"""The one way a request reaches the model: submit, then answer whole or stream.

Every protocol hands the gateway a neutral request (``server.requests``) and an
``Encoder`` of its own shapes; the gateway submits the work to the model's
queue (``worker``), waits for it while watching the client, and answers with
the encoder: a whole body, or a stream that opens once the work has started
(so a prompt too long for the context is still a plain 413), sends each piece
as it comes, a keep-alive while nothing does, and the encoder's closing or
failure at the end. A client that leaves cancels its work, waiting or running.
A chat request is made canonical first (``canonical``): its system messages
before the first answer joined into the system prompt, whatever the protocol,
then the client cache-busters its rules take out (none with
``keep_client_headers``; the system messages are placed all the same).
Errors before a stream opens are ``ApiError``s, which the app shapes per
protocol (``errors``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from localkv.server.canonical import RULES, Canonical
from localkv.server.errors import ApiError, as_api_error
from localkv.server.fields import decode_body
from localkv.server.gate import read_body
from localkv.server.requests import ChatRequest, CompletionRequest, ModelFacts, Outcome
from localkv.server.worker import ModelWorker, NotReady, Ticket

if TYPE_CHECKING:
    from localkv.server.engine import Engine

__all__ = ["Encoder", "Gateway", "ServerSettings"]

DISCONNECT_POLL_S = 0.25

Work = ChatRequest | CompletionRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerSettings:
    api_key: str | None = None
    queue: int = 4  # requests admitted at once, the running one included
    max_body: int = 16 * 2**20
    keepalive_s: float = 10.0
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    allowed_hosts: tuple[str, ...] = ()  # names besides loopback names and addresses
    allowed_origins: tuple[str, ...] = ()  # web pages that may call the server
    keep_client_headers: bool = False  # no ``canonical`` rule (system messages still placed)


class Encoder(Protocol):
    """A protocol's shapes of an answer."""

    media_type: ClassVar[str]  # of a stream

    def whole(self, outcome: Outcome) -> dict[str, Any]: ...
    def opening(self) -> str: ...
    def keepalive(self) -> str: ...  # what a stream sends while the model is busy ("": nothing)
    def piece(self, kind: str, text: str) -> str: ...  # kind: "text" or "reasoning"
    def closing(self, outcome: Outcome) -> str: ...
    def failure(self, error: ApiError) -> str: ...


class Gateway:
    """The model's queue as the protocols use it."""

    def __init__(self, settings: ServerSettings, worker: ModelWorker) -> None:
        self.settings = settings
        self.worker = worker
        self.canonical = Canonical(() if settings.keep_client_headers else RULES)

    # ---------------------------------------------------------------- input
    async def body(self, request: Request) -> dict[str, Any]:
        """The request's JSON object, read within the size and time limits. The request's
        arrival is taken before its body is read (the time a client waits starts then)."""
        if not hasattr(request.state, "arrived"):
            request.state.arrived = time.perf_counter()
        settings = self.settings
        return decode_body(await read_body(request, settings.max_body, settings.body_timeout_s))

    def engine(self) -> Engine:
        """The engine, or a 503 while the model loads (or failed to)."""
        if self.worker.engine is None or self.worker.state != "ready":
            raise ApiError(
                503, self.worker.error or "the model is loading", headers={"Retry-After": "1"}
            )
        return self.worker.engine

    def facts(self) -> ModelFacts:
        return self.engine().facts

    # --------------------------------------------------------------- answers
    async def answer(self, request: Request, work: Work, encoder: Encoder) -> Response:
        """Run ``work`` and answer it whole or as a stream, in ``encoder``'s shapes."""
        self.engine()  # a 503 while the model loads, before anything is queued
        if isinstance(work, ChatRequest):
            work = self.canonical(work)
        ticket = self._submit(_job(work))
        ticket.arrived = getattr(request.state, "arrived", ticket.arrived)
        request.state.ticket = ticket  # its outcome goes into the log line
        if not work.stream:
            outcome: Outcome = await self._next(request, ticket, until="done")
            return JSONResponse(encoder.whole(outcome))
        await self._next(request, ticket, until="started")
        return StreamingResponse(
            self._stream(ticket, encoder),
            media_type=encoder.media_type,
            headers={"Cache-Control": "no-cache"},
        )

    async def count(self, request: Request, work: ChatRequest) -> int:
        """The prompt tokens ``work`` would run (nothing is computed)."""
        work = self.canonical(work)
        return int(await self.run(request, lambda engine, ticket: engine.count(work, ticket)))

    async def run(self, request: Request, job: Callable[[Engine, Ticket], Any]) -> Any:
        """Run ``job`` on the model's thread, in its turn, and return what it returned."""
        return await self._next(request, self._submit(job), until="done")

    async def _stream(self, ticket: Ticket, encoder: Encoder) -> AsyncIterator[str]:
        keepalive_s = self.settings.keepalive_s
        try:
            yield encoder.opening()
            while True:
                try:
                    kind, value = await asyncio.wait_for(ticket.events.get(), keepalive_s)
                except TimeoutError:
                    beat = encoder.keepalive()
                    if beat:
                        yield beat
                    continue
                if kind in ("text", "reasoning"):
                    yield encoder.piece(kind, value)
                elif kind == "done":
                    yield encoder.closing(value)
                    break
                elif kind == "error":
                    yield encoder.failure(as_api_error(value))
                    break
        finally:
            ticket.cancel()  # a client that went away stops its work

    # --------------------------------------------------------------- the queue
    def _submit(self, job: Callable[[Engine, Ticket], Any]) -> Ticket:
        try:  # a full queue is a QueueFull, a 503 with Retry-After
            return self.worker.submit(asyncio.get_running_loop(), job)
        except NotReady as exc:
            raise ApiError(503, str(exc), code="loading", headers={"Retry-After": "1"}) from None

    async def _next(self, request: Request, ticket: Ticket, *, until: str) -> Any:
        """Wait for the ticket's ``until`` event (text before it is dropped: not streaming).

        A client that disconnects meanwhile cancels the ticket.
        """
        try:
            while True:
                try:
                    kind, value = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
                except TimeoutError:
                    if await request.is_disconnected():
                        ticket.cancel()
                        raise ApiError(499, "the client disconnected") from None
                    continue
                if kind == "error":
                    raise as_api_error(value)
                if kind == until:
                    return value
        except BaseException:
            ticket.cancel()
            raise


def _job(work: Work) -> Callable[[Engine, Ticket], Outcome]:
    if isinstance(work, ChatRequest):
        return lambda engine, ticket: engine.chat(work, ticket)
    return lambda engine, ticket: engine.complete(work, ticket)

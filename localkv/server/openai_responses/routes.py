"""``POST /v1/responses`` on the OpenAI routes' worker, queue and helpers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localkv.server.engine import Engine, Outcome
from localkv.server.errors import as_api_error
from localkv.server.openai_responses.replies import Answer, Events
from localkv.server.openai_responses.translate import chat_request
from localkv.server.responses import KEEP_ALIVE
from localkv.server.worker import Ticket

if TYPE_CHECKING:
    from localkv.server.app import Routes

__all__ = ["ResponsesRoutes"]

log = logging.getLogger(__name__)


@dataclass
class Reasoned:
    """The answer's reasoning tokens, counted on the worker thread after the answer."""

    tokens: int = 0


class ResponsesRoutes:
    """``POST /v1/responses``: any model name is the loaded model, as on the other routes."""

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def all(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()  # before its body is read
        routes = self.routes
        body = await routes._body(request)
        parsed = chat_request(body)
        answer = Answer.new(routes._engine().model_id, body, parsed)
        reasoned = Reasoned()

        def job(engine: Engine, ticket: Ticket) -> Outcome:
            outcome = engine.chat(parsed, ticket)
            if outcome.reasoning:  # the reasoning's text, tokenized: at most what was sampled
                tokens = engine.runtime.template.text_tokens(outcome.reasoning)
                reasoned.tokens = min(len(tokens), outcome.generated)
            return outcome

        ticket = routes._submit(job)
        ticket.arrived = request.state.arrived
        request.state.ticket = ticket  # its outcome goes into the log line
        if not parsed.stream:
            outcome: Outcome = await routes._result(request, ticket)
            return JSONResponse(answer.body(outcome, reasoned.tokens))
        await routes._next(request, ticket, until="started")  # a 413 comes before the stream
        events = self._events(ticket, Events(answer), reasoned)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _events(
        self, ticket: Ticket, events: Events, reasoned: Reasoned
    ) -> AsyncIterator[str]:
        keepalive_s = self.routes.settings.keepalive_s
        try:
            for line in events.start():
                yield line
            while True:
                try:
                    kind, value = await asyncio.wait_for(ticket.events.get(), keepalive_s)
                except TimeoutError:
                    yield KEEP_ALIVE
                    continue
                if kind in ("text", "reasoning"):
                    for line in events.piece(kind, value):
                        yield line
                elif kind == "done":
                    for line in events.finish(value, reasoned.tokens):
                        yield line
                    break
                elif kind == "error":
                    yield events.error(as_api_error(value))
                    break
        finally:
            ticket.cancel()  # a client that went away stops its generation

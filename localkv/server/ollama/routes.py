"""The Ollama routes, on the OpenAI routes' worker, queue and helpers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import localkv
from localkv.server.engine import Engine, Outcome
from localkv.server.errors import ApiError
from localkv.server.ollama.replies import Answer, model_card, ndjson, show
from localkv.server.ollama.translate import chat_request, generate_request, is_stream
from localkv.server.openai import ChatRequest
from localkv.server.worker import Ticket

if TYPE_CHECKING:
    from localkv.server.app import Routes

__all__ = ["OllamaRoutes"]

NDJSON = "application/x-ndjson"


class OllamaRoutes:
    """``/api/version``, ``tags``, ``show``, ``ps``, ``chat`` and ``generate``.

    Any model name is the loaded model, as on the OpenAI routes.
    """

    def __init__(self, routes: Routes) -> None:
        self.routes = routes

    def all(self) -> list[Route]:
        return [
            Route("/api/version", self.version),
            Route("/api/tags", self.tags),
            Route("/api/ps", self.ps),
            Route("/api/show", self.show, methods=["POST"]),
            Route("/api/chat", self.chat, methods=["POST"]),
            Route("/api/generate", self.generate, methods=["POST"]),
        ]

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": localkv.__version__})

    async def tags(self, request: Request) -> Response:
        return JSONResponse({"models": [model_card(self.routes._engine())]})

    async def ps(self, request: Request) -> Response:
        card = model_card(self.routes._engine())
        card.update(expires_at="9999-12-31T23:59:59Z", size_vram=0)  # loaded while serving
        return JSONResponse({"models": [card]})

    async def show(self, request: Request) -> Response:
        await self.routes._body(request)  # any model name: the loaded one
        return JSONResponse(show(self.routes._engine()))

    async def chat(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()
        body = await self.routes._body(request)
        stream = is_stream(body)
        answer = Answer(self._model(body), chat=True)
        if body.get("messages") == []:  # Ollama's way to load a model: it is loaded
            return self._loaded(answer)
        parsed = chat_request(body)
        return await self._generate(request, answer, stream, lambda e, t: e.chat(parsed, t))

    async def generate(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()
        body = await self.routes._body(request)
        stream = is_stream(body)
        answer = Answer(self._model(body), chat=False)
        if body.get("prompt") in (None, ""):  # Ollama's way to load a model: it is loaded
            return self._loaded(answer)
        parsed = generate_request(body)
        if isinstance(parsed, ChatRequest):
            chat = parsed
            return await self._generate(request, answer, stream, lambda e, t: e.chat(chat, t))
        raw = parsed
        return await self._generate(request, answer, stream, lambda e, t: e.complete(raw, t))

    def _loaded(self, answer: Answer) -> Response:
        self.routes._engine()  # a 503 while the model loads
        return JSONResponse({**answer.piece(), "done": True, "done_reason": "load"})

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self.routes._engine().model_id

    async def _generate(
        self,
        request: Request,
        answer: Answer,
        stream: bool,
        job: Callable[[Engine, Ticket], Outcome],
    ) -> Response:
        routes = self.routes
        ticket = routes._submit(job)
        ticket.arrived = request.state.arrived
        request.state.ticket = ticket
        if not stream:
            outcome: Outcome = await routes._result(request, ticket)
            return JSONResponse(answer.final(outcome, whole=True))
        await routes._next(request, ticket, until="started")  # a 413 comes before the stream
        return StreamingResponse(_lines(ticket, answer), media_type=NDJSON)


async def _lines(ticket: Ticket, answer: Answer) -> AsyncIterator[str]:
    try:
        while True:
            kind, value = await ticket.events.get()
            if kind == "text":
                yield ndjson(answer.piece(value))
            elif kind == "reasoning":
                yield ndjson(answer.piece("", thinking=value))
            elif kind == "done":
                yield ndjson(answer.final(value, whole=False))
                break
            elif kind == "error":
                error = value if isinstance(value, ApiError) else None
                message = error.message if error else f"internal error: {value}"
                if isinstance(value, asyncio.CancelledError):
                    message = "the request was cancelled"
                yield ndjson({"error": message})
                break
    finally:
        ticket.cancel()

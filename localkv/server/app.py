"""The routes of the OpenAI-compatible server (Starlette), on one ``ModelWorker``.

``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``, ``POST /v1/localkv/prefill``, ``GET /v1/localkv/cache``.
Streaming is Server-Sent Events ending in ``data: [DONE]``; keep-alives are
comment lines. Every error is OpenAI-shaped JSON (``errors``). The Ollama API
(``/api/...``) is ``server.ollama``, Anthropic's Messages API (``/v1/messages``)
``server.anthropic``, both on the same worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localkv.server.anthropic import AnthropicRoutes
from localkv.server.boundary import Boundary
from localkv.server.engine import Engine, Outcome
from localkv.server.errors import ApiError, as_api_error, error_response
from localkv.server.gate import Gate, read_body
from localkv.server.ollama import OllamaRoutes
from localkv.server.openai import decode_body, parse_chat, parse_completion
from localkv.server.openai_responses import ResponsesRoutes
from localkv.server.responses import DONE, KEEP_ALIVE, Reply
from localkv.server.worker import ModelWorker, NotReady, QueueFull, Ticket

__all__ = ["ServerSettings", "create_app"]

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True, slots=True)
class ServerSettings:
    api_key: str | None = None
    queue: int = 4  # requests admitted at once, the running one included
    max_body: int = 16 * 2**20
    keepalive_s: float = 10.0
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    allowed_hosts: tuple[str, ...] = ()  # names besides loopback names and addresses
    allowed_origins: tuple[str, ...] = ()  # web pages that may call the server


def create_app(settings: ServerSettings, worker: ModelWorker) -> Starlette:
    """The ASGI app; its lifespan starts the worker (loading the model) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:  # uvicorn has finished the open requests by now
            await asyncio.to_thread(worker.stop)

    routes = Routes(settings, worker)
    app = Starlette(
        routes=[
            Route("/health", routes.health),
            Route("/v1/models", routes.models),
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/localkv/prefill", routes.prefill, methods=["POST"]),
            Route("/v1/localkv/cache", routes.cache),
            *OllamaRoutes(routes).all(),
            *ResponsesRoutes(routes).all(),
            *AnthropicRoutes(routes).all(),
        ],
        exception_handlers={HTTPException: _http_error, ApiError: _api_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )
    boundary = Boundary.of(
        hosts=settings.allowed_hosts,
        origins=settings.allowed_origins,
        keyed=settings.api_key is not None,
    )
    app.add_middleware(Gate, api_key=settings.api_key, boundary=boundary)
    if boundary.origins:  # outside the gate: a preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(boundary.origins),
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            max_age=600,
        )
    return app


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = "not_found" if exc.status_code == 404 else None
    return error_response(
        ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code),
        request.url.path,
    )


async def _api_error(request: Request, exc: ApiError) -> Response:
    return error_response(exc, request.url.path)


class Routes:
    def __init__(self, settings: ServerSettings, worker: ModelWorker) -> None:
        self.settings = settings
        self.worker = worker

    # ---------------------------------------------------------- information
    async def health(self, request: Request) -> Response:
        status = self.worker.status()
        code = {"ready": 200, "loading": 503, "failed": 500}.get(str(status["state"]), 503)
        body: dict[str, object] = {
            "status": "ok" if code == 200 else status["state"],
            "queue": status,
        }
        if self.worker.error:
            body["error"] = self.worker.error
        headers = {"Retry-After": "1"} if code == 503 else None
        return JSONResponse(body, status_code=code, headers=headers)

    async def models(self, request: Request) -> Response:
        engine = self._engine()
        info = {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "localkv"}
        return JSONResponse({"object": "list", "data": [info]})

    async def cache(self, request: Request) -> Response:
        snapshots = await self._run(request, lambda engine, ticket: engine.snapshots())
        return JSONResponse({"object": "list", "data": snapshots})

    async def prefill(self, request: Request) -> Response:
        """What ``localkv prefill --json`` prints; a save the disk refused (full, an I/O
        error) is a 507 saying so, as the command's exit 1 is."""
        body = await self._body(request)
        report = await self._run(request, lambda engine, ticket: engine.prefill(body))
        if report.get("not_saved") and not report.get("cancelled"):
            held = f"the cache holds {report['kept']:,} of its {report['tokens']:,} tokens"
            message = f"not saved: {report['not_saved']}; {held}, no snapshot"
            raise ApiError(507, message, code="not_saved")
        return JSONResponse(report)

    # ---------------------------------------------------------- generation
    async def chat(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()  # before its body is read
        parsed = parse_chat(await self._body(request))
        reply = Reply.new(True, self._engine().model_id, parsed.include_usage)
        return await self._generate(request, reply, parsed.stream, lambda e, t: e.chat(parsed, t))

    async def completions(self, request: Request) -> Response:
        request.state.arrived = time.perf_counter()
        parsed = parse_completion(await self._body(request))
        reply = Reply.new(False, self._engine().model_id, parsed.include_usage)
        return await self._generate(
            request, reply, parsed.stream, lambda e, t: e.complete(parsed, t)
        )

    async def _generate(
        self, request: Request, reply: Reply, stream: bool, job: Callable[[Engine, Ticket], Outcome]
    ) -> Response:
        ticket = self._submit(job)
        ticket.arrived = request.state.arrived
        request.state.ticket = ticket  # its outcome goes into the log line
        if not stream:
            outcome: Outcome = await self._result(request, ticket)
            return JSONResponse(reply.body(outcome))
        # the response starts once the request fits and its work begins, so a
        # request that is too long still gets its 413
        await self._next(request, ticket, until="started")
        events = self._events(request, ticket, reply)
        return StreamingResponse(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def _events(self, request: Request, ticket: Ticket, reply: Reply) -> AsyncIterator[str]:
        try:
            yield reply.chunk(None, role=True)
            while True:
                try:
                    kind, value = await asyncio.wait_for(
                        ticket.events.get(), self.settings.keepalive_s
                    )
                except TimeoutError:
                    yield KEEP_ALIVE
                    continue
                if kind == "text":
                    yield reply.chunk(value)
                elif kind == "reasoning":
                    yield reply.chunk(None, reasoning=value)
                elif kind == "done":
                    for chunk in reply.tool_call_chunks(value):
                        yield chunk
                    yield reply.finish_chunk(value)
                    if reply.include_usage:
                        yield reply.usage_chunk(value)
                    break
                elif kind == "error":
                    yield reply.error_chunk(as_api_error(value).body())
                    break
            yield DONE
        finally:
            ticket.cancel()  # a client that went away stops its generation

    # --------------------------------------------------------------- helpers
    async def _body(self, request: Request) -> dict[str, Any]:
        settings = self.settings
        return decode_body(await read_body(request, settings.max_body, settings.body_timeout_s))

    def _engine(self) -> Engine:
        if self.worker.engine is None or self.worker.state != "ready":
            raise ApiError(
                503, self.worker.error or "the model is loading", headers={"Retry-After": "1"}
            )
        return self.worker.engine

    def _submit(self, job: Callable[[Engine, Ticket], Any]) -> Ticket:
        try:
            return self.worker.submit(asyncio.get_running_loop(), job)
        except QueueFull as exc:
            raise ApiError(
                503, str(exc), code="queue_full", headers={"Retry-After": str(exc.retry_after)}
            ) from None
        except NotReady as exc:
            raise ApiError(503, str(exc), code="loading", headers={"Retry-After": "1"}) from None

    async def _run(self, request: Request, job: Callable[[Engine, Ticket], Any]) -> Any:
        return await self._result(request, self._submit(job))

    async def _result(self, request: Request, ticket: Ticket) -> Any:
        return await self._next(request, ticket, until="done")

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

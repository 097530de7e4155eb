"""The server's assembly (Starlette): every protocol's routes on one gateway, behind the gate.

The protocols (``protocols/``: OpenAI, Responses, Anthropic, Ollama, localkv's
own) share one ``Gateway`` on one ``ModelWorker``; the ``Gate`` checks every
request first (``boundary``, the API key); errors are shaped per protocol
(``errors``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response

from localkv.server.boundary import Boundary
from localkv.server.errors import ApiError, error_response
from localkv.server.gate import Gate
from localkv.server.gateway import Gateway, ServerSettings
from localkv.server.protocols.anthropic import AnthropicRoutes
from localkv.server.protocols.localkv import LocalkvRoutes
from localkv.server.protocols.ollama import OllamaRoutes
from localkv.server.protocols.openai import OpenAIRoutes
from localkv.server.protocols.responses import ResponsesRoutes
from localkv.server.worker import ModelWorker

__all__ = ["ServerSettings", "create_app"]


def create_app(settings: ServerSettings, worker: ModelWorker) -> Starlette:
    """The ASGI app; its lifespan starts the worker (loading the model) and stops it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        worker.start()
        # anyio loads its event loop's backend on first use: now, not in the first
        # streamed answer, where it would take the interpreter from the model's thread
        async with anyio.create_task_group():
            pass
        try:
            yield
        finally:  # uvicorn has finished the open requests by now
            await asyncio.to_thread(worker.stop)

    gateway = Gateway(settings, worker)
    protocols = (LocalkvRoutes, OpenAIRoutes, ResponsesRoutes, AnthropicRoutes, OllamaRoutes)
    app = Starlette(
        routes=[route for protocol in protocols for route in protocol(gateway).all()],
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

"""The Ollama routes on the gateway."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import localkv
from localkv.server.gateway import Gateway
from localkv.server.protocols.ollama.replies import Answer, model_card, show
from localkv.server.protocols.ollama.translate import chat_request, generate_request, is_stream

__all__ = ["OllamaRoutes"]


class OllamaRoutes:
    """``/api/version``, ``tags``, ``show``, ``ps``, ``chat`` and ``generate``.

    Any model name is the loaded model, as on the OpenAI routes.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

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
        return JSONResponse({"models": [model_card(self.gateway.facts())]})

    async def ps(self, request: Request) -> Response:
        card = model_card(self.gateway.facts())
        card.update(expires_at="9999-12-31T23:59:59Z", size_vram=0)  # loaded while serving
        return JSONResponse({"models": [card]})

    async def show(self, request: Request) -> Response:
        await self.gateway.body(request)  # any model name: the loaded one
        return JSONResponse(show(self.gateway.facts()))

    async def chat(self, request: Request) -> Response:
        body = await self.gateway.body(request)
        stream = is_stream(body)
        answer = Answer(self._model(body), chat=True)
        if body.get("messages") == []:  # Ollama's way to load a model: it is loaded
            return self._loaded(answer)
        parsed = replace(chat_request(body), stream=stream)
        return await self.gateway.answer(request, parsed, answer)

    async def generate(self, request: Request) -> Response:
        body = await self.gateway.body(request)
        stream = is_stream(body)
        answer = Answer(self._model(body), chat=False)
        if body.get("prompt") in (None, ""):  # Ollama's way to load a model: it is loaded
            return self._loaded(answer)
        parsed = replace(generate_request(body), stream=stream)
        return await self.gateway.answer(request, parsed, answer)

    def _loaded(self, answer: Answer) -> Response:
        self.gateway.facts()  # a 503 while the model loads
        return JSONResponse({**answer.part(), "done": True, "done_reason": "load"})

    def _model(self, body: dict[str, Any]) -> str:
        model = body.get("model")
        return model if isinstance(model, str) and model else self.gateway.facts().model_id

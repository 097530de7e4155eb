"""``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localkv.server.gateway import Gateway
from localkv.server.protocols.openai.parse import parse_chat, parse_completion
from localkv.server.protocols.openai.replies import Reply

__all__ = ["OpenAIRoutes"]


class OpenAIRoutes:
    """Any model name is the loaded model; the answer names the loaded model."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def all(self) -> list[Route]:
        return [
            Route("/v1/models", self.models),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]

    async def models(self, request: Request) -> Response:
        model = self.gateway.facts().model_id
        info = {"id": model, "object": "model", "created": 0, "owned_by": "localkv"}
        return JSONResponse({"object": "list", "data": [info]})

    async def chat(self, request: Request) -> Response:
        parsed = parse_chat(await self.gateway.body(request))
        reply = Reply.new(True, self.gateway.facts().model_id, parsed.include_usage)
        return await self.gateway.answer(request, parsed, reply)

    async def completions(self, request: Request) -> Response:
        parsed = parse_completion(await self.gateway.body(request))
        reply = Reply.new(False, self.gateway.facts().model_id, parsed.include_usage)
        return await self.gateway.answer(request, parsed, reply)

"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on the gateway."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localkv.server.gateway import Gateway
from localkv.server.protocols.anthropic.replies import Message
from localkv.server.protocols.anthropic.translate import messages_request

__all__ = ["AnthropicRoutes"]


class AnthropicRoutes:
    """Any model name is the loaded model, as on the OpenAI routes; the answer names the
    model the request named. ``anthropic-version`` and ``anthropic-beta`` are accepted,
    not required.
    """

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def all(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
        ]

    async def messages(self, request: Request) -> Response:
        parsed = messages_request(await self.gateway.body(request))
        asked = parsed.request.sampling.max_tokens
        encoder = Message(model=parsed.model, asked=asked)
        return await self.gateway.answer(request, parsed.request, encoder)

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the prompt tokens of the same request to ``/v1/messages``
        (its ``input_tokens``, ``cache_read_input_tokens`` and ``cache_creation_input_tokens``
        together)."""
        parsed = messages_request(await self.gateway.body(request), counting=True)
        return JSONResponse({"input_tokens": await self.gateway.count(request, parsed.request)})

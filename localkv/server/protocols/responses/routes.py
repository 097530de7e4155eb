"""``POST /v1/responses`` on the gateway."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from localkv.server.gateway import Gateway
from localkv.server.protocols.responses.replies import Answer, Encoder
from localkv.server.protocols.responses.translate import chat_request

__all__ = ["ResponsesRoutes"]


class ResponsesRoutes:
    """Any model name is the loaded model, as on the other routes."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def all(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        body = await self.gateway.body(request)
        parsed = chat_request(body)
        answer = Answer.new(self.gateway.facts().model_id, body, parsed)
        return await self.gateway.answer(request, parsed.request, Encoder(answer))

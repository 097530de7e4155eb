"""localkv's own routes: ``GET /health``, ``POST /v1/localkv/prefill`` (pre-warm the
cache, as ``localkv prefill --json``) and ``GET /v1/localkv/cache`` (its snapshots)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from localkv.server.errors import ApiError
from localkv.server.gateway import Gateway

__all__ = ["LocalkvRoutes"]


class LocalkvRoutes:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def all(self) -> list[Route]:
        return [
            Route("/health", self.health),
            Route("/v1/localkv/prefill", self.prefill, methods=["POST"]),
            Route("/v1/localkv/cache", self.cache),
        ]

    async def health(self, request: Request) -> Response:
        worker = self.gateway.worker
        status = worker.status()
        code = {"ready": 200, "loading": 503, "failed": 500}.get(str(status["state"]), 503)
        body: dict[str, object] = {
            "status": "ok" if code == 200 else status["state"],
            "queue": status,
        }
        if worker.error:
            body["error"] = worker.error
        headers = {"Retry-After": "1"} if code == 503 else None
        return JSONResponse(body, status_code=code, headers=headers)

    async def cache(self, request: Request) -> Response:
        snapshots = await self.gateway.run(request, lambda engine, ticket: engine.snapshots())
        return JSONResponse({"object": "list", "data": snapshots})

    async def prefill(self, request: Request) -> Response:
        """What ``localkv prefill --json`` prints; a save the disk refused (full, an I/O
        error) is a 507 saying so, as the command's exit 1 is."""
        body = await self.gateway.body(request)
        report = await self.gateway.run(request, lambda engine, ticket: engine.prefill(body))
        if report.get("not_saved") and not report.get("cancelled"):
            held = f"the cache holds {report['kept']:,} of its {report['tokens']:,} tokens"
            message = f"not saved: {report['not_saved']}; {held}, no snapshot"
            raise ApiError(507, message, code="not_saved")
        return JSONResponse(report)

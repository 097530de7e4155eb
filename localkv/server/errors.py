"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Under ``/api/`` (the Ollama API) they are Ollama's: ``{"error": "message"}``;
under ``/v1/messages`` (the Anthropic API) Anthropic's: ``{"type": "error",
"error": {"type", "message"}}``, a full queue there being 529 ``overloaded_error``
and a prompt too long for the context (a 413) said in Anthropic's words, an
``invalid_request_error`` ``prompt is too long: N tokens > M maximum``, which
Claude Code reads to compact its conversation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from starlette.responses import JSONResponse

from localkv.prompt.renderbudget import TemplateRenderError

__all__ = ["RAISE_CTX", "ApiError", "anthropic_error", "bad_request", "error_response"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    507: "server_error",
}

_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"
# what a prompt too long for the context is told, after its numbers
RAISE_CTX = "the server's --ctx: start it with a larger --ctx, or shorten the prompt"


class ApiError(Exception):
    """An error a client gets as JSON with ``status``; ``headers`` go with it."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
        too_long: tuple[int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        # a prompt too long for the context: its tokens (or the fewest it has), the most
        # a prompt may have
        self.too_long = too_long

    def body(self) -> dict[str, object]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def anthropic_error(error: ApiError) -> tuple[int, dict[str, object]]:
    """The status and body of ``error`` in Anthropic's shape."""
    status = 529 if error.code == "queue_full" else error.status
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.too_long is not None:
        tokens, most = error.too_long
        kind = "invalid_request_error"
        # these words alone: Claude Code compacts its conversation on them
        message = f"prompt is too long: {max(tokens, most + 1)} tokens > {most} maximum"
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    """The error as JSON: OpenAI's shape, Ollama's ``{"error": message}`` under ``/api/``,
    Anthropic's under ``/v1/messages``."""
    status, body = error.status, error.body()
    if path.startswith("/api/"):
        body = {"error": error.message}
    elif path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        status, body = anthropic_error(error)
    return JSONResponse(body, status_code=status, headers=error.headers)


def as_api_error(exc: BaseException) -> ApiError:
    """What a request's failure tells its client: its own ApiError, a 499, a 500 naming
    the model's chat template that failed on it (one log line: the template is at
    fault, not the server), or a logged 500."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, asyncio.CancelledError):
        return ApiError(499, "the request was cancelled")
    if isinstance(exc, TemplateRenderError):
        logging.getLogger("localkv.server").warning("%s", exc)
        return ApiError(500, str(exc), code="template_error")
    logging.getLogger("localkv.server").error("request failed: %s", exc, exc_info=exc)
    return ApiError(500, f"internal error: {exc}")

"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Under ``/api/`` (the Ollama API) they are Ollama's: ``{"error": "message"}``.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.responses import JSONResponse

__all__ = ["ApiError", "bad_request", "error_response"]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

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


def error_response(error: ApiError, path: str = "") -> JSONResponse:
    """The error as JSON: OpenAI's shape, or Ollama's ``{"error": message}`` under ``/api/``."""
    body = {"error": error.message} if path.startswith("/api/") else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)

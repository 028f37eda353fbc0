"""Error bodies, in the shape of the dialect a client speaks.

OpenAI (the default, and llama-server's): {"error": {"message", "type", "code", "param"}}.
Anthropic Messages: {"type": "error", "error": {"type", "message"}}.
Ollama: {"error": "message"}.

A handler raises ApiError; the middleware renders it in the dialect of the
request's path (`dialect_of`), so a refusal before any handler ran (a wrong
key, a wrong Content-Type) reads the same as one from the handler. A stream
that fails after its headers went out writes `ApiError.body(dialect)` itself.
"""

from __future__ import annotations

import math
from typing import Literal

from aiohttp import web

Dialect = Literal["openai", "anthropic", "ollama"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          415: "invalid_request_error", 503: "service_unavailable_error"}
# Anthropic's error types (docs.anthropic.com/en/api/errors); 503 is its "overloaded_error".
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error",
                    501: "api_error", 503: "overloaded_error"}


def dialect_of(path: str) -> Dialect:
    """Whose error shape a path answers in."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after
        # More fields of the OpenAI error object, over the ones above: llama-server's type and counts of a prompt
        # its slot cannot hold (daemon/http/core/run.py failure_error).
        self.details: dict[str, int | str] = {}

    def body(self, dialect: Dialect = "openai") -> dict:
        if dialect == "anthropic":
            return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(self.status, "api_error"),
                                               "message": self.message}}
        if dialect == "ollama":
            return {"error": self.message}
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"), "code": self.code,
                          "param": self.param, **self.details}}

    def response(self, dialect: Dialect = "openai") -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response(self.body(dialect), status=self.status, headers=headers)

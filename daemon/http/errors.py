"""OpenAI-style error bodies: {"error": {"message", "type", "code", "param"}}."""

from __future__ import annotations

import math

from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          415: "invalid_request_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "code": self.code, "param": self.param}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return web.json_response(self.body(), status=self.status, headers=headers)

"""The aiohttp application: composition only. Handlers live in openai_api
and admin_api; the controller and settings are reached through AppKeys."""

from __future__ import annotations

import hmac

from aiohttp import web

from config import Settings
from daemon.controller import Controller
from daemon.errors import ApiError
from daemon.metrics import Metrics

CONTROLLER = web.AppKey("controller", Controller)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", Metrics)
LOG = web.AppKey("log", object)

ADMIN_PATHS = frozenset({"/sleep", "/wake"})


def _bearer(request: web.Request) -> str:
    header = request.headers.get("Authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("X-Api-Key", "")


def _check_key(request: web.Request, key, what: str) -> None:
    if key is None:
        return
    given = _bearer(request).encode()
    if not hmac.compare_digest(given, key.get_secret_value().encode()):
        raise ApiError(401, f"missing or wrong {what} (send 'Authorization: Bearer <key>')", "invalid_api_key")


@web.middleware
async def errors_and_access(request: web.Request, handler):
    settings = request.app[SETTINGS]
    try:
        if request.path.startswith("/v1/"):
            _check_key(request, settings.api_key, "API key")
        elif request.path in ADMIN_PATHS:
            _check_key(request, settings.admin_key, "admin key")
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPRequestEntityTooLarge:
        return ApiError(413, f"request body is larger than {settings.max_body_bytes} bytes (max_body_bytes)",
                        "request_too_large").response()
    except web.HTTPException as exc:
        if exc.status >= 400 and exc.content_type != "application/json":
            return ApiError(exc.status, exc.reason or "error", None).response()
        raise


def build_app(controller: Controller, settings: Settings, metrics: Metrics, log) -> web.Application:
    from daemon import admin_api, openai_api

    app = web.Application(middlewares=[errors_and_access], client_max_size=settings.max_body_bytes)
    app[CONTROLLER] = controller
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[LOG] = log
    openai_api.add_routes(app)
    admin_api.add_routes(app)
    return app

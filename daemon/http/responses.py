"""OpenAI Responses (/v1/responses): not built yet (issue 17/18); its routes are added here."""

from __future__ import annotations

from aiohttp import web


def add_routes(app: web.Application) -> None:
    pass

"""GET /tools and POST /tools: llama-server's built-in tools and MCP servers, and its /cors-proxy refusal.

Off (403 "this feature is disabled", llama-server's answer) unless the
operator enabled tools or MCP servers. The model is never involved: a call
neither wakes a sleeping model nor takes a slot. The answers are
llama-server's: the tool's JSON object, 200 even when it holds "error" (the
model reads it); a stream is server-sent events of {"chunk"} then {"done"}.
"""

from __future__ import annotations

import json

import msgspec
from aiohttp import web

from daemon.host_tools.registry import HostTools, ToolCallError
from daemon.http.errors import ApiError

HOST_TOOLS = web.AppKey("host_tools", HostTools)


def _disabled() -> ApiError:
    error = ApiError(403, "this feature is disabled", "feature_disabled")
    error.details["type"] = "feature_disabled"
    return error


def _tools(request: web.Request) -> HostTools:
    tools = request.app.get(HOST_TOOLS)
    if tools is None or not tools.enabled:
        raise _disabled()
    return tools


async def list_tools(request: web.Request) -> web.Response:
    return web.json_response(_tools(request).listing())


async def call_tool(request: web.Request) -> web.StreamResponse:
    tools = _tools(request)
    try:
        body = msgspec.json.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", "invalid_request") from None
    headers = {name.lower(): value for name, value in request.headers.items()}
    try:
        name, params, stream = tools.prepare(body, headers)
        if not stream:
            return web.json_response(await tools.call(name, params))
    except ToolCallError as exc:
        raise ApiError(exc.status, str(exc), exc.code) from None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    # A client that goes away cancels this handler: the generator's cleanup kills the command's process group.
    async for message in tools.stream(name, params):
        await response.write(f"data: {json.dumps(message, ensure_ascii=False)}\n\n".encode())
    await response.write_eof()
    return response


async def cors_proxy(request: web.Request) -> web.Response:
    """llama-server's web UI fetches MCP servers through it; Dormouse has no web UI and fetches no URL for a
    client (an open proxy from the daemon's network): refused as llama-server refuses it when off."""
    raise _disabled()


def add_routes(app: web.Application) -> None:
    app.router.add_get("/tools", list_tools)
    app.router.add_post("/tools", call_tool)
    app.router.add_get("/cors-proxy", cors_proxy)
    app.router.add_post("/cors-proxy", cors_proxy)

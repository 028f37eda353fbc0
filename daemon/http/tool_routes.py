"""GET /tools and POST /tools: llama-server's built-in tools and MCP servers; and its web UI's /cors-proxy.

Off (403 "this feature is disabled", llama-server's answer) unless the
operator enabled tools or MCP servers. The model is never involved: a call
neither wakes a sleeping model nor takes a slot. The answers are
llama-server's: the tool's JSON object, 200 even when it holds "error" (the
model reads it); a stream is server-sent events of {"chunk"} then {"done"}.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from daemon.host_tools.registry import HostTools, ToolCallError
from daemon.http.errors import ApiError
from daemon.http.keys import SETTINGS

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
    try:
        name, params, stream = tools.prepare(body, request.headers)
        if not stream:
            answer = await tools.call(name, params)
            with tools.holding(len(answer)):
                response = web.StreamResponse(headers={"Content-Type": "application/json; charset=utf-8"})
                response.content_length = len(answer)
                await response.prepare(request)
                await response.write(answer)
                await response.write_eof()
            return response
    except ToolCallError as exc:
        raise ApiError(exc.status, str(exc), exc.code) from None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    # A client that goes away cancels this handler: the generator's cleanup kills the command's process group.
    async for message in tools.stream(name, params):
        await response.write(f"data: {json.dumps(message, ensure_ascii=False)}\n\n".encode())
    await response.write_eof()
    return response


PROXY_HEADER = "x-llama-server-proxy-header-"
PROXY_MAX_RUNNING = 32
PROXY_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)  # llama-server's 10 minutes
PROXY_KEPT_HEADERS = ("Content-Type", "Content-Encoding", "Cache-Control", "Mcp-Session-Id")
# The connection's own headers are this hop's: a client's would desynchronise the pooled upstream connections.
HOP_BY_HOP = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade", "te",
                        "trailer", "expect", "proxy-authorization", "proxy-authenticate", "proxy-connection"})


class ProxyState:
    """The proxy's client session (opened on first use, closed with the app) and its count of requests under way."""

    def __init__(self) -> None:
        self.session: aiohttp.ClientSession | None = None
        self.running = 0

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


PROXY = web.AppKey("cors_proxy", ProxyState)


def _target(request: web.Request) -> URL:
    raw = request.query.get("url", "")
    try:
        url = URL(raw)
    except ValueError:
        url = None
    if url is None or not url.is_absolute() or not url.host:
        raise ApiError(400, "invalid target URL: give ?url=http(s)://host/path", "invalid_request", param="url")
    if url.scheme not in ("http", "https"):
        raise ApiError(400, f"unsupported URL scheme in target URL: {url.scheme[:20]}", "invalid_request", param="url")
    if url.user or url.password:
        raise ApiError(400, "authentication in target URL is not supported", "invalid_request", param="url")
    return url


async def cors_proxy(request: web.Request) -> web.StreamResponse:
    """llama-server's web UI proxy: the request goes to ?url= with only the headers the client named
    (x-llama-server-proxy-header-NAME: its cookies, keys and Authorization stay here), the answer comes back
    as it streams (an MCP server's SSE). Off (the default): 403, as llama-server's."""
    if not request.app[SETTINGS].cors_proxy:
        raise _disabled()
    url = _target(request)
    state = request.app[PROXY]
    if request.headers.get("Sec-Fetch-Mode") == "navigate":
        # a page the browser would show on the daemon's origin, where its script could call /tools
        raise ApiError(403, "the CORS proxy answers fetches, not page loads", "navigation_refused")
    if state.running >= PROXY_MAX_RUNNING:
        raise ApiError(503, f"{PROXY_MAX_RUNNING} proxied requests are under way: try again later", "busy",
                       retry_after=1)
    headers = {name[len(PROXY_HEADER):]: value for name, value in request.headers.items()
               if name.lower().startswith(PROXY_HEADER) and len(name) > len(PROXY_HEADER)
               and name[len(PROXY_HEADER):].lower() not in HOP_BY_HOP}
    if state.session is None:
        # no cookie jar: one client's upstream cookies must not ride along on the next client's requests
        state.session = aiohttp.ClientSession(timeout=PROXY_TIMEOUT, auto_decompress=False,
                                              cookie_jar=aiohttp.DummyCookieJar(),
                                              skip_auto_headers=("User-Agent", "Accept-Encoding"))
    state.running += 1
    response: web.StreamResponse | None = None
    try:
        body = await request.read() if request.method == "POST" else None
        async with state.session.request(request.method, url, headers=headers, data=body) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                name: upstream.headers[name] for name in PROXY_KEPT_HEADERS if name in upstream.headers})
            # what comes back is another site's: never a page or a script of the daemon's origin
            response.headers["Content-Security-Policy"] = "sandbox"
            response.headers["X-Content-Type-Options"] = "nosniff"
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        if response is not None and response.prepared:  # its status went out: end the answer where it broke
            if request.transport is not None:
                request.transport.close()
            return response
        raise ApiError(502, f"the proxied request failed: {str(exc)[:300] or type(exc).__name__}",
                       "bad_gateway") from None
    finally:
        state.running -= 1


async def _proxy_session(app: web.Application):
    app[PROXY] = ProxyState()
    yield
    await app[PROXY].close()


def add_routes(app: web.Application) -> None:
    app.router.add_get("/tools", list_tools)
    app.router.add_post("/tools", call_tool)
    app.router.add_get("/cors-proxy", cors_proxy)
    app.router.add_post("/cors-proxy", cors_proxy)
    app.cleanup_ctx.append(_proxy_session)

"""Vertex AI's prediction route: {"instances": [...]} in, {"predictions": [...]} out.

A Vertex AI custom container is sent every request as a POST to one route (AIP_PREDICT_ROUTE,
settings.predict_route; config/vertex_ai.py reads the variables). Each instance names the request it is
with "@requestFormat": a camelCase name of a route ("chatCompletions" for /v1/chat/completions,
"completion" for /completion, "embeddings", "rerank"...) or the route's path itself; the rest of the
instance is that route's body. llama-server answers the same way (its GCP compat), and so do its clients.

Each instance is sent to this daemon again as the HTTP request it names, over the socket the prediction
came in on, with the prediction's key and Host: so it is checked, queued, logged and answered exactly as
that request would be (an instance cannot reach a route its key does not open), and the route decides
nothing it would not decide for a direct call. Instances run a few at a time (CONCURRENT_INSTANCES: a
prediction alone never fills the queue) and never stream. Each answer goes into `predictions` in the
instance's place, its bytes as they came (nothing parsed twice), errors included, as llama-server
does; an instance that could not be run at all is an error in its place, the others go on. The
prediction itself is a 200 unless its own body is wrong. A client that goes away cancels the
prediction, which closes the instances' connections and so cancels them. The answers are written in
order as they are ready, and together may hold at most MAX_PREDICTION_BYTES.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, AsyncIterator

import aiohttp
import msgspec
from aiohttp import web

from daemon.http.errors import ApiError
from daemon.http.keys import SETTINGS

MAX_INSTANCES = 128  # llama-server's bound
CONCURRENT_INSTANCES = 8  # at once per prediction; the rest wait their turn
# The answers one prediction may hold (they wait for the ones before them to be written): 128 instances
# of per-token embeddings could otherwise hold gigabytes. Past it, an instance's answer is an error.
MAX_PREDICTION_BYTES = 128 * 2**20
PREDICT_SESSION = web.AppKey("predict_session", aiohttp.ClientSession)
ROUTES_BY_FORMAT = web.AppKey("predict_routes_by_format", dict)
# Forwarded to the instance's request: who calls (the key) and how they named this daemon (the Host check).
FORWARDED = ("Authorization", "X-Api-Key", "Host", "X-Dormouse-Max-Wait")


class RouteTaken(ValueError):
    """predict_route or predict_health_route names a route Dormouse already serves."""


def format_name(path: str) -> str:
    """A route's camelCase name, as llama-server derives it: /v1/chat/completions -> chatCompletions,
    /apply-template -> applyTemplate."""
    path = path.removeprefix("/v1").lstrip("/")
    words = re.split(r"[/_-]", path)
    return words[0] + "".join(word[:1].upper() + word[1:] for word in words[1:])


def routes_by_format(app: web.Application, predict_route: str) -> dict[str, str]:
    """Each POST route's camelCase name and path -> its path (the first route of a name wins, as in
    llama-server). Routes with path parameters and the prediction route itself are not dispatched to."""
    out: dict[str, str] = {}
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path")
        if route.method != "POST" or path is None or path == predict_route:
            continue  # dynamic resources have a formatter, not a path
        out.setdefault(format_name(path), path)
        out.setdefault(path, path)
    return out


def _error(message: str, status: int = 400) -> bytes:
    return msgspec.json.encode(ApiError(status, message, "invalid_value").body())


class _Budget:
    """The bytes a prediction's answers may still take."""

    def __init__(self, limit: int) -> None:
        self.left = limit


async def _run_instance(request: web.Request, base: str, instance: Any, turn: asyncio.Semaphore,
                        budget: _Budget) -> bytes:
    """The instance's answer as JSON bytes, spliced into the predictions as they are (never parsed again)."""
    if not isinstance(instance, dict):
        return _error("each instance must be a JSON object")
    request_format = instance.get("@requestFormat")
    if not isinstance(request_format, str):
        return _error("each instance must include a string @requestFormat")
    path = request.app[ROUTES_BY_FORMAT].get(request_format)
    if path is None:
        return _error(f"no route for @requestFormat {request_format[:80]!r}: a route's camelCase name "
                      "(chatCompletions, completion, embeddings...) or its path")
    payload = {key: value for key, value in instance.items() if key != "@requestFormat"}
    if "stream" in payload or path.startswith("/api/"):  # Ollama's routes stream unless told not to
        payload["stream"] = False  # a prediction is one JSON answer
    headers = {name: request.headers[name] for name in FORWARDED if name in request.headers}
    headers["Content-Type"] = "application/json"
    try:
        async with turn, request.app[PREDICT_SESSION].post(base + path, data=msgspec.json.encode(payload),
                                                           headers=headers) as answer:
            chunks = []
            async for chunk in answer.content.iter_any():
                budget.left -= len(chunk)
                if budget.left < 0:  # closing the connection cancels the instance's request
                    return msgspec.json.encode(ApiError(
                        413, f"the prediction's answers are over {MAX_PREDICTION_BYTES >> 20} MiB together: this "
                             "instance's answer is left out; send fewer or smaller instances",
                        "prediction_too_large").body())
                chunks.append(chunk)
            raw = b"".join(chunks)
            if answer.content_type == "application/json" and raw:
                return raw
            return msgspec.json.encode(raw.decode("utf-8", errors="replace") if raw else None)
    except Exception as exc:  # this instance's failure (a broken connection, the session closing), not the others'
        return msgspec.json.encode(ApiError(502, f"the instance could not be run: {type(exc).__name__}",
                                            "instance_failed").body())


def _base_url(request: web.Request) -> str:
    """This daemon, at the socket the prediction reached (an accepted socket's address is never a wildcard)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        raise ApiError(501, "the prediction route is served on TCP sockets only", "not_supported")
    host = str(sockname[0])
    if ":" in host:  # IPv6, its zone kept for a link-local address (%25 in a URL)
        return f"http://[{host.replace('%', '%25')}]:{sockname[1]}"
    return f"http://{host}:{sockname[1]}"


async def predict(request: web.Request) -> web.StreamResponse:
    try:
        data = json.loads(await request.read())
    except (ValueError, RecursionError):
        raise ApiError(400, "request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object", "invalid_json")
    instances = data.get("instances")
    if not isinstance(instances, list):
        raise ApiError(400, "request body must include an array field named instances", "invalid_value", "instances")
    if len(instances) > MAX_INSTANCES:
        raise ApiError(400, f"instances: at most {MAX_INSTANCES} in one prediction, got {len(instances)}",
                       "invalid_value", "instances")
    base = _base_url(request)
    # A few at a time: a prediction of 128 instances must not fill the queue (max_queued) alone.
    turn, budget = asyncio.Semaphore(CONCURRENT_INSTANCES), _Budget(MAX_PREDICTION_BYTES)
    tasks = [asyncio.ensure_future(_run_instance(request, base, instance, turn, budget)) for instance in instances]
    try:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"predictions":[')
        for i, task in enumerate(tasks):  # in order, each as soon as it and those before it are done
            answer = await task
            await response.write(b"," + answer if i else answer)
            tasks[i] = None  # its bytes go with it
        await response.write(b"]}")
        await response.write_eof()
        return response
    finally:
        for task in tasks:
            if task is not None:
                task.cancel()  # the client went away: the instances still running go too


async def _session(app: web.Application) -> AsyncIterator[None]:
    # No total timeout: an instance takes as long as its answer (the prediction's client bounds it).
    # No connection limit across predictions (each runs CONCURRENT_INSTANCES at once): a shared pool of 100
    # would let a few slow predictions hold every other client's instances in its wait.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                     connector=aiohttp.TCPConnector(limit=0), auto_decompress=True) as session:
        app[PREDICT_SESSION] = session
        yield


HEALTH_PATHS = ("/health", "/v1/health")  # already /health: a health route naming one adds nothing


def _route_taken(app: web.Application, path: str) -> bool:
    """Whether Dormouse serves `path` already, by any method, a route with a parameter (/slots/{id}) too:
    the keys a route needs go by its path."""
    for resource in app.router.resources():
        info = resource.get_info()
        pattern = info.get("pattern")
        if info.get("path") == path or (pattern is not None and pattern.fullmatch(path)):
            return True
    return False


def add_routes(app: web.Application) -> None:
    """After every other route: the formats are the routes there are."""
    settings = app[SETTINGS]
    health_route = settings.predict_health_route
    if health_route and health_route not in HEALTH_PATHS:
        if _route_taken(app, health_route):
            raise RouteTaken(f"predict_health_route {health_route} is already a route of Dormouse")
        health = next(route.handler for route in app.router.routes()
                      if route.method == "GET" and route.resource.get_info().get("path") == "/health")
        app.router.add_get(health_route, health)
    if settings.predict_route:
        if _route_taken(app, settings.predict_route):
            raise RouteTaken(f"predict_route {settings.predict_route} is already a route of Dormouse")
        app[ROUTES_BY_FORMAT] = routes_by_format(app, settings.predict_route)
        app.cleanup_ctx.append(_session)
        app.router.add_post(settings.predict_route, predict)

"""The aiohttp application: composition, and the one middleware that decides
who may call what before any handler runs. Handlers live in dialects/<name>/
request.py and admin/routes.py; the controller and settings are reached through AppKeys.

Access, in order (each refusal is an OpenAI error body):
- Host (on by default): a Host header naming a host this daemon is not known
  by is 403. A web page on a rebinding domain (evil.example resolving to
  127.0.0.1) reaches the daemon with its own name in Host. Known: localhost,
  *.localhost, loopback addresses, the addresses it is bound to (bound to
  0.0.0.0 or ::, any IP address and this machine's host name), and
  `allowed_hosts` ("*" there: any host).
- Origin: a POST whose Origin header names another host than Host is 403,
  unless `cors_origins` lists that origin. Browsers send Origin on every
  cross-origin POST (no-cors fetches and form posts included); curl and API
  clients send none. A listed origin gets CORS headers on every answer, and
  its OPTIONS preflight is answered 200 on every route (before keys: browsers
  send no Authorization on a preflight); an unlisted origin's preflight is a
  200 with no CORS headers (llama-server's answer: the browser refuses).
  "localhost" in cors_origins lists every origin on a loopback host.
- Keys: /v1/*, Ollama's /api/*, llama-server's /tokenize, /detokenize,
  /apply-template, /completion, /infill, /rerank and its unversioned aliases
  of /v1/* (/chat/completions ...), /props and /slots need an API key
  (`api_key` or one of the named `api_keys`; props and slots expose paths
  and request ids; the admin key opens all of these too), /sleep, /wake and
  /models/load|unload need `admin_key`, or an API key when no admin key is
  set, /health (and /health?model=ID) and /metrics need `metrics_key` when one
  is set. 401 otherwise. Anthropic's clients send the key as `x-api-key`,
  which is read beside `Authorization: Bearer`. The key found names the
  caller: its name is the request's prompt-cache scope (with the body's
  cache_salt, core/job.py's parse_body), and only the admin key (or, with no
  admin key set, any caller that may call /sleep) may load or unload a model
  through another route (Ollama's keep_alive and empty requests).
- Content-Type: a POST body must be declared `application/json` (415
  otherwise): a page can POST text/plain or a form cross-origin without a
  preflight, never application/json. /sleep and /wake may have no body and
  no Content-Type at all (`curl -XPOST .../sleep`; aiohttp's client says
  application/octet-stream for no body, which is let through too).

Errors are rendered in the dialect of the path (errors.dialect_of): OpenAI's
shape, Anthropic's under /v1/messages, Ollama's under /api/.

Every answered request gets one `request` log line (endpoint, status, code);
generation requests log theirs in core/run.py (tracked) with their timings.
"""

from __future__ import annotations

import hmac
import ipaddress
import time

from aiohttp import web
from pydantic import SecretStr
from yarl import URL

from config import Settings
from config.settings import is_loopback_host, normalize_host, normalize_origin
from daemon.fleet.owner import Fleet
from daemon.host_tools.registry import HostTools
from daemon.http.errors import ApiError, dialect_of
from daemon.http.keys import (ADMIN_NAME, CALLER, FLEET, LISTENING, LOG, LOGGED, METRICS, PRIVILEGED, SETTINGS,
                              Listening, cache_scope)
from daemon.metrics import MetricFamilies
from daemon.model.jobs import request_cache_scope

ADMIN_PATHS = frozenset({"/sleep", "/wake", "/models/load", "/models/unload"})
ADMIN_PREFIXES = ("/slots/",)  # POST /slots/{id}?action=save|restore|erase
# They read and write files, run commands on this host and fetch URLs from it: the admin key opens them when set.
TOOL_PATHS = frozenset({"/tools", "/cors-proxy"})
PROBE_PATHS = frozenset({"/health", "/metrics", "/v1/health"})
PRIVATE_GET_PATHS = frozenset({"/props", "/slots"})
# llama-server's extras and its unversioned aliases of /v1/*: model work like /v1/*, behind the same API key.
LLAMA_SERVER_PATHS = frozenset({"/tokenize", "/detokenize", "/apply-template", "/completion", "/infill", "/rerank",
                                "/reranking", "/chat/completions", "/completions", "/embeddings", "/models",
                                "/responses", "/responses/input_tokens", "/chat/completions/input_tokens"})
API_PREFIXES = ("/v1/", "/api/")
# Their endpoint names in logs and metrics labels (as the jobs' names: a handler names its job the same).
GENERATION_ENDPOINTS = {"/v1/completions": "completions", "/completions": "completion",
                        "/v1/chat/completions": "chat.completions", "/chat/completions": "chat.completions",
                        "/v1/embeddings": "embeddings", "/embeddings": "embeddings", "/completion": "completion",
                        "/tokenize": "tokenize", "/detokenize": "detokenize", "/apply-template": "apply-template",
                        "/v1/responses": "responses", "/v1/responses/input_tokens": "responses.input_tokens",
                        "/v1/chat/completions/input_tokens": "chat.input_tokens",
                        "/responses": "responses", "/responses/input_tokens": "responses.input_tokens",
                        "/chat/completions/input_tokens": "chat.input_tokens",
                        "/v1/messages": "messages", "/v1/messages/count_tokens": "messages.count_tokens",
                        "/api/chat": "ollama.chat", "/api/generate": "ollama.generate", "/api/embed": "ollama.embed",
                        "/api/embeddings": "ollama.embeddings", "/infill": "infill", "/v1/rerank": "rerank",
                        "/rerank": "rerank", "/reranking": "rerank", "/v1/reranking": "rerank"}
# Answers here change nothing and come every few seconds (probes, scrapes):
# their log line is at debug level, unless the request was refused.
QUIET_PATHS = frozenset({"/health", "/metrics", "/props", "/slots", "/v1/models", "/openapi.json"})
JSON = "application/json"


def _split_host(value: str) -> tuple[str, int | None]:
    """('example.com', 8080) from 'example.com:8080'; IPv6 in brackets; ('', None) when unreadable."""
    value = value.strip()
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
        if not bracket or (rest and port is None):
            return "", None
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, None
    if port is not None and not (port.isascii() and port.isdigit() and len(port) <= 5):
        return "", None
    return normalize_host(host), int(port) if port else None


def _check_host(request: web.Request, settings: Settings) -> None:
    """DNS rebinding: a page on evil.example made to resolve to 127.0.0.1 reaches the daemon with
    Host: evil.example. Always answered: localhost names, loopback addresses, the address the
    connection came in on and the bound ones (bound to a wildcard address: any IP address and this
    machine's host names), and `allowed_hosts`; "*" there turns the check off."""
    if "*" in settings.allowed_hosts:
        return
    host, _ = _split_host(request.headers.get("Host", ""))
    if host and _host_served(host, request, settings):
        return
    raise ApiError(403, "this host name is not served here: add it to allowed_hosts (a defense against DNS "
                        "rebinding; localhost and IP addresses the daemon is bound to are always served)",
                   "host_not_allowed")


def _host_served(host: str, request: web.Request, settings: Settings) -> bool:
    if host in settings.allowed_hosts or host == "localhost" or host.endswith(".localhost"):
        return True
    listening = request.app[LISTENING]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a DNS name: only the ones this daemon is known by
        return host in listening.names
    if is_loopback_host(host) or listening.wildcard or address.compressed in listening.addresses:
        return True
    # The local address the connection reached (a socket systemd passed, an address of a bound name).
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if isinstance(sockname, tuple) and sockname:
        try:
            return ipaddress.ip_address(str(sockname[0]).partition("%")[0]) == address
        except ValueError:
            return False
    return False


def _same_origin(origin: str, host_header: str) -> bool:
    try:
        url = URL(origin)
        origin_host, origin_port = normalize_host(url.host or ""), url.port  # yarl gives the scheme's default port
    except (ValueError, TypeError):
        return False
    host, port = _split_host(host_header)
    # A Host without port means the default port of the scheme the browser used, the Origin's.
    return bool(host) and host == origin_host and (port or origin_port) == origin_port


def _cors_allowed(origin: str | None, settings: Settings) -> bool:
    if origin is None or not settings.cors_origins:
        return False
    if "*" in settings.cors_origins:
        return True
    try:
        shown = normalize_origin(origin)
    except ValueError:
        return False
    if shown in ("*", "localhost"):
        return False  # the settings' keywords, never an Origin a browser sends
    # "localhost" (llama-server's --cors-origins localhost): a page served from this machine, any scheme and port.
    if "localhost" in settings.cors_origins and is_loopback_host(URL(shown).host or ""):
        return True
    return shown in settings.cors_origins


def _check_origin(request: web.Request, settings: Settings) -> None:
    origin = request.headers.get("Origin")
    if request.method == "POST" and origin is not None and not _same_origin(origin, request.headers.get("Host", "")) \
            and not _cors_allowed(origin, settings):
        raise ApiError(403, "cross-origin POST refused: the Origin header names another host than Host, and "
                            "cors_origins does not list it", "cross_origin")


def _bearer(request: web.Request) -> bytes:
    header = request.headers.get("Authorization", "")
    value = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("X-Api-Key", "")
    # aiohttp hands non-ASCII header bytes over as surrogates; compare bytes, never raise.
    return value.encode("utf-8", "surrogateescape")


def _api_keys(settings: Settings) -> list[tuple[str, SecretStr]]:
    """Every API key with its name ("" for the unnamed api_key)."""
    keys = [("", settings.api_key)] if settings.api_key else []
    return keys + list(settings.api_keys.items())


def _is_probe(path: str) -> bool:
    return path in PROBE_PATHS


def _keys_for(path: str, settings: Settings) -> tuple[list[tuple[str, SecretStr]], str]:
    """The keys (name, key) any one of which opens `path` (none: open), and what to call them.
    The admin key opens whatever an API key opens: it is the stronger key."""
    admin = [(ADMIN_NAME, settings.admin_key)] if settings.admin_key else []
    if _is_probe(path) or path == settings.predict_health_route:
        return [("", k) for k in (settings.metrics_key,) if k], "metrics key"
    if path.startswith(API_PREFIXES) or path in LLAMA_SERVER_PATHS or path in PRIVATE_GET_PATHS \
            or path == settings.predict_route:  # Vertex AI's: each instance is checked again as its own request
        api = _api_keys(settings)
        return (api + admin if api else []), "API key"
    if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIXES) or path in TOOL_PATHS:
        if settings.admin_key:
            return admin, "admin key"
        return _api_keys(settings), "API key"
    return [], ""


def _matching_key(given: bytes, keys: list[tuple[str, SecretStr]]) -> str | None:
    """The name of the key `given` is, or None. Every key is compared (no early exit), each in constant time."""
    found = None
    for name, key in keys:
        if hmac.compare_digest(given, key.get_secret_value().encode("utf-8", "surrogateescape")) and found is None:
            found = name
    return found


def _check_key(request: web.Request, settings: Settings) -> None:
    """Refuse a missing or wrong key; note who called (CALLER, PRIVILEGED) for the handlers."""
    keys, what = _keys_for(request.path, settings)
    given = _bearer(request)
    caller = _matching_key(given, keys) if keys else None
    if keys and caller is None:
        raise ApiError(401, f"missing or wrong {what} (send 'Authorization: Bearer <key>')", "invalid_api_key")
    if caller is None and given and not _is_probe(request.path):
        # An open route, but a key was sent: it still names the caller (its cache scope, its privileges).
        caller = _matching_key(given, _api_keys(settings) + ([(ADMIN_NAME, settings.admin_key)]
                                                             if settings.admin_key else []))
    request[CALLER] = caller
    # What /sleep needs: the admin key; with none set, whatever opens /sleep (the API key, or nothing).
    request[PRIVILEGED] = caller == ADMIN_NAME if settings.admin_key else \
        (caller is not None or not _api_keys(settings))
    request_cache_scope.set(cache_scope(caller, None))


def _check_content_type(request: web.Request) -> None:
    if request.method != "POST" or request.match_info.http_exception is not None:
        return  # not a route that takes a body: 404/405 follow
    declared = request.headers.get("Content-Type")
    # No body at all on /sleep, /wake and the slot actions: curl -XPOST and httpx send no type, aiohttp's client
    # application/octet-stream, which no browser sends cross-origin without a preflight.
    bodyless = request.path in ADMIN_PATHS or request.path.startswith(ADMIN_PREFIXES)  # /slots/{id}?action=erase
    if bodyless and not request.body_exists and (
            declared is None or request.content_type == "application/octet-stream"):
        return
    # Ollama's clients send their JSON as Ollama's own docs show: LiteLLM's sync calls with no Content-Type,
    # `curl -d` as a form (application/x-www-form-urlencoded), LiteLLM's ollama/ and ollama_chat/ async calls as
    # application/octet-stream; Ollama reads any of them as JSON. Browsers send Origin on every POST (refused
    # above unless cors_origins lists it), so a POST without Origin comes from no web page and its body is read
    # as JSON whatever it declares (not JSON: a 400 that says so). With Origin these are the types a page may
    # send cross-origin without a preflight: 415 stays.
    if request.path.startswith("/api/") and "Origin" not in request.headers and (
            declared is None
            or request.content_type.lower() in ("application/x-www-form-urlencoded", "application/octet-stream")):
        return
    # llama-server's web UI names every header of a proxied request, its Content-Type too (it sends the body as
    # text): a custom header a page cannot send cross-origin without a preflight.
    if request.path == "/cors-proxy" and "x-llama-server-proxy-header-content-type" in request.headers:
        return
    if declared is None or request.content_type.lower() != JSON:
        shown = "no Content-Type" if declared is None else f"Content-Type {request.content_type!r}"
        raise ApiError(415, f"{shown}: send the body as 'Content-Type: application/json'", "unsupported_media_type")


def check_access(request: web.Request, settings: Settings) -> None:
    """After the Host check and the preflight."""
    _check_origin(request, settings)
    _check_key(request, settings)
    _check_content_type(request)


def _log_answer(request: web.Request, status: int, code: str | None, started: float) -> None:
    if request.get(LOGGED):
        return
    endpoint = GENERATION_ENDPOINTS.get(request.path)
    # /health's 503 while loading is an answer, not a refusal; the status page and its files load like a scrape.
    quiet = code is None and (request.path in QUIET_PATHS or request.path == "/" or request.path.startswith("/ui"))
    log = request.app[LOG]
    (log.debug if quiet else log.info)("request", endpoint=endpoint or request.path[:200], method=request.method,
                                       status=status, code=code, seconds=round(time.monotonic() - started, 4))
    if endpoint is not None:  # refused before it became a job; a client's path never becomes a label
        # Refused before it was routed to a model: counted with an empty model label.
        request.app[METRICS].requests.labels(model="", endpoint=endpoint, status=str(status)).inc()


def _preflight(request: web.Request, settings: Settings) -> web.Response | None:
    """The answer to a CORS preflight for a route that exists; None: not a preflight.

    200 as llama-server answers it. An origin cors_origins does not list gets a 200 with no
    Access-Control-* header at all, as llama-server does: the browser then refuses the real request
    itself, and a preflight runs nothing. What keeps such a page from the model is not this answer but
    _check_origin: a POST a browser sends without a preflight (a form, text/plain) still gets its 403."""
    if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
        return None
    if not isinstance(request.match_info.http_exception, web.HTTPMethodNotAllowed):
        return None  # no such route: 404 follows
    if not _cors_allowed(request.headers.get("Origin"), settings):
        return web.Response(status=200)
    allowed = sorted(request.match_info.http_exception.allowed_methods | {"OPTIONS"})
    return web.Response(status=200, headers={
        "Access-Control-Allow-Methods": ", ".join(allowed),
        # Echoed: Authorization, Content-Type, x-api-key, anthropic-version, X-Dormouse-Max-Wait ... (keys still apply)
        "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", "")[:1024],
        "Access-Control-Max-Age": "600",
    })


EXPOSED_HEADERS = "Retry-After, X-Request-Id, X-Dormouse-Cold-Start, X-Dormouse-Wake-Seconds"


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """On every answer to an allowed origin, streams included (on_response_prepare: before headers go out)."""
    origin = request.headers.get("Origin")
    if _cors_allowed(origin, request.app[SETTINGS]):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        response.headers.add("Vary", "Origin")


@web.middleware
async def errors_and_access(request: web.Request, handler):
    settings = request.app[SETTINGS]
    started = time.monotonic()
    dialect = dialect_of(request.path)
    try:
        _check_host(request, settings)
        preflight = _preflight(request, settings)
        if preflight is not None:
            _log_answer(request, preflight.status, None, started)
            return preflight
        check_access(request, settings)
        response = await handler(request)
    except ApiError as exc:
        response = exc.response(dialect)
        _log_answer(request, exc.status, exc.code, started)
        return response
    except web.HTTPRequestEntityTooLarge:
        error = ApiError(413, f"request body is larger than {settings.max_body_bytes} bytes (max_body_bytes)",
                         "request_too_large")
        _log_answer(request, 413, error.code, started)
        return error.response(dialect)
    except web.HTTPException as exc:
        _log_answer(request, exc.status, None, started)
        if exc.status >= 400 and exc.content_type != JSON:
            return ApiError(exc.status, exc.reason or "error", None).response(dialect)
        raise
    except Exception:
        _log_answer(request, 500, "internal_error", started)
        raise
    _log_answer(request, response.status, None, started)
    return response


async def _host_tools_running(app: web.Application):
    """MCP servers listed and a --tools-runtime container started before the daemon listens; closed after."""
    from daemon.http.tool_routes import HOST_TOOLS

    tools = app[HOST_TOOLS]
    if tools.enabled:  # a runtime with no tool to run in it: no container to start
        await tools.start()
    yield
    await tools.close()


def build_app(fleet: Fleet, settings: Settings, metrics: MetricFamilies, log) -> web.Application:
    from daemon.http.admin import routes as admin
    from daemon.http.dialects.anthropic import request as anthropic
    from daemon.http.dialects.llama_server import infill, rerank, slot_files
    from daemon.http.dialects.llama_server import request as llama_server
    from daemon.http.dialects.ollama import request as ollama
    from daemon.http.dialects.openai import request as openai
    from daemon.http.dialects.responses import request as responses
    from daemon.http.status import page as status_page
    from daemon.http import tool_routes, vertex_predict

    from daemon.http.cold_start import cold_start_headers, max_wait_header

    # max_wait_header inside errors_and_access: a bad X-Dormouse-Max-Wait gets the dialect's 400.
    app = web.Application(middlewares=[errors_and_access, max_wait_header], client_max_size=settings.max_body_bytes)
    app.on_response_prepare.append(_cors_headers)
    app.on_response_prepare.append(cold_start_headers)
    app[FLEET] = fleet
    app[SETTINGS] = settings
    app[METRICS] = metrics
    app[LOG] = log
    listening = Listening()
    for host in settings.hosts:  # the server corrects them from the sockets it serves (daemon/server.py)
        listening.bind(host)
    app[LISTENING] = listening
    for routes in (openai, llama_server, responses, anthropic, ollama, infill, rerank, admin, slot_files, tool_routes):
        routes.add_routes(app)
    app[tool_routes.HOST_TOOLS] = HostTools(settings.tools, settings.tools_runtime, settings.mcp_servers, log)
    app.cleanup_ctx.append(_host_tools_running)
    if settings.status_page:  # off: / and /ui are 404, as llama-server's --no-ui leaves them
        status_page.add_routes(app)
    vertex_predict.add_routes(app)  # last: its formats are the routes above
    return app

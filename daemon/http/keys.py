"""What handlers reach through the app (AppKeys), and the model a request
names (model_for, model_param), in a module of their own so that the app and
the routes import it and not each other."""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from config import Settings
from config.settings import normalize_host
from daemon.fleet.owner import Fleet, FleetModel, UnknownModel
from daemon.http.errors import ApiError
from daemon.metrics import MetricFamilies

FLEET = web.AppKey("fleet", Fleet)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", MetricFamilies)
LOG = web.AppKey("log", object)

LOGGED = web.RequestKey("logged", bool)  # set by run_job, which writes the request's log line itself
JOB = web.RequestKey("job", object)  # the request's job (daemon.model.jobs.Job), for the cold-start headers
# Who called, as the access check found it (daemon/http/app.py): the name of the key that opened the route
# ("" for the unnamed api_key, ADMIN_NAME for the admin key; None: no key was asked or given), and
# whether the caller holds what /sleep needs (the admin key; or anyone, when no admin_key is set).
CALLER = web.RequestKey("caller", object)
PRIVILEGED = web.RequestKey("privileged", bool)
ADMIN_NAME = "#admin"  # never a name of api_keys (they start with a letter or digit)
MAX_CACHE_SALT_CHARS = 1024


@dataclass
class Listening:
    """What the daemon is bound to, for the Host check: filled from the settings when the app is
    built and corrected by the server from the sockets it really serves (socket activation included).
    Mutated in place (the app's state is frozen once it runs)."""

    addresses: set[str] = field(default_factory=set)  # IP literals, normalised as Host is
    wildcard: bool = False  # 0.0.0.0 or ::: any IP address reaches it
    names: set[str] = field(default_factory=set)  # DNS names it may legitimately be called by
    configured: set[str] = field(default_factory=set)  # the names among them that `host` gave (kept by serve())

    def serve(self, hosts: list[str], fqdn: str | None = None) -> None:
        """What the server really serves (its bound or inherited sockets), in place of what the settings said."""
        configured = set(self.configured)
        self.addresses.clear()
        self.names.clear()
        self.names.update(configured)  # bound by a name (host = "dormouse.lan"): the sockets show its addresses only
        self.wildcard = False
        for host in hosts:
            self.bind(host)
        if self.wildcard and fqdn and normalize_host(fqdn):
            self.names.add(normalize_host(fqdn))

    def bind(self, host: str) -> None:
        """Add one bound host (an address literal or a name), as settings.host or a socket says it."""
        shown = normalize_host(host.partition("%")[0])
        if not shown:
            return
        try:
            address = ipaddress.ip_address(shown)
        except ValueError:
            self.names.add(shown)
            self.configured.add(shown)
            return
        if address.is_unspecified:
            self.wildcard = True
            self.names.update(own_host_names())
        else:
            self.addresses.add(address.compressed)


def own_host_names() -> set[str]:
    """This machine's host name (and its short form): what a client on the network may call it by."""
    names = set()
    try:
        name = normalize_host(socket.gethostname())
    except OSError:
        name = ""
    if name:
        names.add(name)
        names.add(name.split(".")[0])
    return names


LISTENING = web.AppKey("listening", Listening)


def cache_scope(caller: str | None, salt: str | None) -> str:
    """The prompt-cache scope of a request (daemon/model/jobs.py request_cache_scope): the
    name of its key and its cache_salt, written so that no two pairs give one string;
    "" when both are absent (no named key, no salt: one shared scope, as before scopes)."""
    if not caller and salt is None:
        return ""
    return json.dumps([caller or "", salt], ensure_ascii=True, separators=(",", ":"))


def require_privilege(request: web.Request, what: str) -> None:
    """403 unless the caller holds what POST /sleep needs (the admin key, when one is set)."""
    if request.get(PRIVILEGED, False):
        return
    raise ApiError(403, f"{what} needs the admin key (admin_key is set, and it alone may put models to sleep or "
                        "load them); send 'Authorization: Bearer <admin key>'", "admin_key_required")


def no_room(request: web.Request, model: FleetModel, since: float) -> ApiError | None:
    """When a wait for a wake ran out because the fleet had no room for the model
    (its admission waits, or just gave up): the 503 that says so, else None."""
    room = request.app[FLEET].waiting_for_room(model.id, since=since)
    if room is None:
        return None
    wake_timeout = request.app[SETTINGS].wake_timeout
    return ApiError(503, f"model {model.id} could not be loaded within {wake_timeout:g}s (wake_timeout): {room}",
                    "insufficient_memory", retry_after=5)


def model_for(request: web.Request, name: str | None) -> FleetModel:
    """The model a request names (id or alias; none: the default), or 404 as OpenAI answers it."""
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "model: must be a string", "invalid_value", param="model")
    try:
        return request.app[FLEET].route(name)
    except UnknownModel as exc:
        raise ApiError(404, exc.message, "model_not_found", param="model") from None


def check_one_vector_per_input(model: FleetModel, route: str) -> None:
    """A route that answers one vector per input cannot serve a model with pooling none (a vector per token)."""
    if model.controller.settings.pooling == "none":
        raise ApiError(400, f"model {model.id!r} has pooling = \"none\" (a vector per token); {route} answers one "
                            "vector per input: POST /embeddings answers every token's, as llama-server does",
                       "pooling_none", param="model")


async def model_param(request: web.Request, required: bool = False) -> FleetModel | None:
    """The model an admin call names: `?model=ID`, or `{"model": ID}` in the body."""
    name = request.query.get("model")
    if name is None and request.method == "POST":
        raw = await request.read()
        if raw.strip():
            try:
                body = msgspec.json.decode(raw)
            except RecursionError:
                raise ApiError(400, "request body is not valid JSON: nested too deeply", "invalid_json") from None
            except msgspec.DecodeError as exc:
                raise ApiError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
            if not isinstance(body, dict):
                raise ApiError(400, "request body must be a JSON object", "invalid_json")
            name = body.get("model")
    if name is None:
        if required:
            raise ApiError(400, "model: required (a model id or alias, as GET /v1/models lists them)",
                           "invalid_value", param="model")
        return None
    return model_for(request, name)

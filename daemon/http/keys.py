"""What handlers reach through the app (AppKeys), in a module of their own so
that the app and the routes import it and not each other."""

from __future__ import annotations

from aiohttp import web

from config import Settings
from daemon.fleet.owner import Fleet, FleetModel, UnknownModel
from daemon.http.errors import ApiError
from daemon.metrics import MetricFamilies

FLEET = web.AppKey("fleet", Fleet)
SETTINGS = web.AppKey("settings", Settings)
METRICS = web.AppKey("metrics", MetricFamilies)
LOG = web.AppKey("log", object)

LOGGED = web.RequestKey("logged", bool)  # set by run_job, which writes the request's log line itself
JOB = web.RequestKey("job", object)  # the request's job (daemon.model.jobs.Job), for the cold-start headers


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

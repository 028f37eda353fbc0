"""Endpoints that answer from the daemon itself: /health, /props, /slots,
/metrics never wake a model nor touch an idle timer. /sleep, /wake and the
llama-server router's /models/load and /models/unload are the operator's
hands on each model's state machine; each takes an optional model (query
`?model=` or `{"model": ...}`; none: the default, and for /sleep every idle model)."""

from __future__ import annotations

import functools

import time

import msgspec
from aiohttp import web

from daemon.fleet.owner import FleetModel
from daemon.http.errors import ApiError
from daemon.http.keys import ADMIN_NAME, CALLER, FLEET, METRICS, SETTINGS, model_for, model_param, no_room
from daemon.http.dialects.llama_server.answer import default_generation_settings
from daemon.protocol import SlotInfo
from statemachine import TIERS, ServerState, SleepRequested, WakeRequested


async def tier_param(request: web.Request) -> str | None:
    """POST /sleep's tier (`?tier=` or `{"tier": ...}`): drowsy, light or deep; none: the model's own."""
    tier = request.query.get("tier")
    if tier is None and request.method == "POST":
        raw = await request.read()
        if raw.strip():
            body = msgspec.json.decode(raw)  # model_param has already refused a body that is not a JSON object
            tier = body.get("tier") if isinstance(body, dict) else None
    if tier is not None and (not isinstance(tier, str) or tier not in TIERS):
        shown = repr(tier)[:40]
        raise ApiError(400, f"tier: must be one of {', '.join(TIERS)} (got {shown})", "invalid_value", param="tier")
    return tier


async def health(request: web.Request) -> web.Response:
    """One answer for the process: ready (200) while any model can serve (ready, asleep, waking), so
    a broken model never takes a replica's others out of a balancer; the default model's state and
    every model's beside it. `?model=ID` (an id or alias): that model's readiness alone, 404 for none."""
    fleet = request.app[FLEET]
    name = request.query.get("model")
    if name is not None:
        return _model_health(model_for(request, name))
    controller = fleet.default_model.controller
    serving = any(m.controller.healthy for m in fleet.models.values())
    body: dict = {"status": "ok" if serving else "unavailable", "state": str(controller.state),
                  "tier": controller.sleep_tier}
    if controller.state is ServerState.FAILED:
        body["error"] = controller.machine.failure_reason
    if len(fleet.models) > 1:
        body["models"] = {m.id: m.status for m in fleet.models.values()}
        # Each model's sleep tier beside its status (None: awake or loading), as /v1/models says it.
        body["tiers"] = {m.id: m.controller.sleep_tier for m in fleet.models.values()}
    return web.json_response(body, status=200 if serving else 503)


def _model_health(model: FleetModel) -> web.Response:
    controller = model.controller
    body: dict = {"status": "ok" if controller.healthy else "unavailable", "model": model.id,
                  "state": str(controller.state), "tier": controller.sleep_tier}
    if controller.state is ServerState.FAILED:
        body["error"] = controller.machine.failure_reason
    return web.json_response(body, status=200 if controller.healthy else 503)


async def props(request: web.Request) -> web.Response:
    fleet = request.app[FLEET]
    model = await model_param(request) or fleet.default_model
    c = model.controller
    s = c.settings  # the reloaded settings (SIGHUP), not the ones the app started with
    return web.json_response({
        "id": model.id,
        "state": str(c.state),
        "state_since": c.state_since,
        "is_sleeping": c.state is ServerState.SLEEPING,
        "failure": c.machine.failure_reason,
        "model_path": c.model_path,
        "model": c.model_info or None,
        "n_ctx": s.ctx_size,
        "n_ctx_slot": c.n_ctx_slot or None,
        "total_slots": s.parallel,
        "slots": _slots(c, _hides_cache_counts(request)),
        # llama-server's: what a /completion that sends no sampling field gets (the server's defaults).
        "default_generation_settings": default_generation_settings(s, c.n_ctx_slot or s.slot_context),
        "sleep_idle_seconds": s.sleep_idle_seconds,
        # The latest accepted request's keep_alive (Ollama's), and the idle time it makes (-1: never).
        "keep_alive": c.machine.keep_alive,
        "idle_seconds": c.machine.idle_seconds,
        "idle_timer_remaining": c.idle_deadline(),
        "spawn_ahead": s.spawn_ahead,
        "spare_worker_pid": c.supervisor.spare.pid if c.supervisor.spare else None,
        "requests_in_flight": len(c.machine.in_flight),
        "requests_waiting": len(c.machine.waiting),
        "last_wake": c.last_wake,
        "last_sleep": c.last_sleep,
        "last_memory_check": c.last_memory_check,
        **c.tier_props(),  # tier, sleep_tiers, wake_prediction, wake_history, keeper, last_doze
        "kv_cache": {**_saved(c.kv_saved, _hides_cache_counts(request)), "min_tokens": s.kv_cache_min_tokens, "disk_budget_bytes": s.kv_cache_disk_bytes,
                     "ram_budget_bytes": s.prompt_cache_ram_bytes,
                     # Per tier (slot, ram, disk) as the worker last said: hits, tokens, bytes, entries, evictions.
                     "tiers": c.metrics.prompt_cache if c.slots and not _hides_cache_counts(request) else {}},
        "fleet": {"budget_bytes": fleet.budget, "planned_bytes": fleet.planned_bytes(), "admission": fleet.admitting,
                  "models": [fleet.describe(m) for m in fleet.models.values()]},
        # llama-server's router: role, max_instances (models_max; 0: the memory budget alone), models_autoload;
        # build_info as its "b<build>": the llama.cpp bindings' version and Dormouse's.
        "role": "model" if fleet.any_name else "router",
        "max_instances": fleet.max_models,
        "models_autoload": request.app[SETTINGS].models_autoload,
        "build_info": _build_info(),
    })


@functools.cache
def _build_info() -> str:
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "unknown"
    return f"b{of('llama_cpp_python')}-dormouse-{of('dormouse')}"


def _saved(saved: dict, hide: bool) -> dict:
    """The saved prompts' figures; without their lengths (every scope's) when cache counts are hidden."""
    return {k: v for k, v in saved.items() if k != "prefixes"} if hide else saved


def _hides_cache_counts(request: web.Request) -> bool:
    """report_cached_tokens = false: what the prompt cache holds (a slot's n_cached, the tiers' hits)
    is shown to the admin key alone, so that no API caller reads another's cache from it."""
    return not request.app[SETTINGS].report_cached_tokens and request.get(CALLER) != ADMIN_NAME


def _slots(c, hide_cached: bool = False) -> list[dict]:
    """Each slot as the worker last said, with llama-server's fields beside the state (n_ctx,
    speculative, is_processing). Asleep (or not loaded yet): the slots exist on paper, idle and empty."""
    infos = c.slots or [SlotInfo(i, "idle") for i in range(c.settings.parallel)]
    n_ctx = c.n_ctx_slot or c.settings.slot_context
    speculative = c.settings.model_draft is not None
    return [{"id": x.id, "state": x.state, "request_id": x.request_id, "n_cached": 0 if hide_cached else x.n_cached,
             "n_ctx": n_ctx,
             "speculative": speculative, "is_processing": x.state != "idle"} for x in infos]


async def slots(request: web.Request) -> web.Response:
    if not request.app[SETTINGS].slots_endpoint:
        raise ApiError(501, "GET /slots is turned off (slots_endpoint = false, llama-server's --no-slots); /props "
                            "lists the slots too", "not_supported")
    c = (await model_param(request) or request.app[FLEET].default_model).controller
    return web.json_response(_slots(c, _hides_cache_counts(request)))


async def metrics(request: web.Request) -> web.Response:
    if not request.app[SETTINGS].metrics_endpoint:
        raise ApiError(501, "GET /metrics is turned off (metrics_endpoint = false); set metrics_endpoint = true "
                            "(DORMOUSE_METRICS_ENDPOINT, or llama-server's --metrics) to serve it, guarded by "
                            "metrics_key if need be", "not_supported")
    for controller in request.app[FLEET].controllers:
        controller.sample_worker_memory()  # read at scrape time; never wakes anything
        controller.tier_gauges()  # the predicted wake as of now (the page cache moves without a transition)
    # metrics_compat: the names other tools read (daemon/metrics_compat.py); none: Dormouse's own only.
    body, content_type = request.app[METRICS].render(request.app[SETTINGS].metrics_compat)
    # llama-server's header: when this daemon process started (Unix seconds), so a scraper can tell a restart
    # (every counter back to zero) from a quiet spell.
    return web.Response(body=body, headers={"Content-Type": content_type, "Process-Start-Time-Unix": _STARTED})


def _process_start() -> str:
    import psutil

    return str(int(psutil.Process().create_time()))


_STARTED = _process_start()


async def _sleep_one(request: web.Request, model: FleetModel, tier: str | None = None) -> dict:
    controller = model.controller
    ok, message = await controller.admin(SleepRequested, tier=tier)
    if not ok:
        raise ApiError(409, f"model {model.id}: {message}", "cannot_sleep")
    await controller.wait_for(lambda s: s not in (ServerState.UNLOADING, ServerState.DOZING),
                              request.app[SETTINGS].shutdown_timeout + 10)
    return {"ok": True, "model": model.id, "message": message, "state": str(controller.state),
            "tier": controller.machine.tier, "last_sleep": controller.last_sleep}


async def sleep(request: web.Request) -> web.Response:
    """One model to sleep (409 while it serves), or without a model every idle one."""
    fleet = request.app[FLEET]
    model = await model_param(request)
    tier = await tier_param(request)
    if model is not None or len(fleet.models) == 1:
        return web.json_response(await _sleep_one(request, model or fleet.default_model, tier))
    answers = {}
    for m in fleet.models.values():
        try:
            answers[m.id] = await _sleep_one(request, m, tier)
        except ApiError as exc:  # busy: it keeps serving
            answers[m.id] = {"ok": False, "model": m.id, "message": exc.message, "state": str(m.controller.state)}
    return web.json_response({"ok": all(a["ok"] for a in answers.values()), "models": answers})


async def _wake_one(request: web.Request, model: FleetModel) -> dict:
    controller = model.controller
    began = time.monotonic()
    ok, message = await controller.admin(WakeRequested)
    if not ok:
        raise ApiError(409, f"model {model.id}: {message}", "cannot_wake")
    wake_timeout = request.app[SETTINGS].wake_timeout
    # Settled: ready, failed, stopping, or asleep again (the fleet did not admit the load).
    await controller.wait_for(lambda s: s not in (ServerState.WAKING, ServerState.LOADING, ServerState.UNLOADING,
                                                  ServerState.DOZING, ServerState.ROUSING),
                              wake_timeout)
    state = controller.state
    if state is ServerState.FAILED:
        raise ApiError(503, f"wake failed: {controller.machine.failure_reason}", "model_load_failed",
                       retry_after=controller.machine.retry_delay)
    if state is ServerState.STOPPING:
        raise ApiError(503, "the server is shutting down", "shutting_down", retry_after=1)
    if state is ServerState.SLEEPING and controller.last_refusal is not None:
        refusal = controller.last_refusal
        raise ApiError(503, refusal.reason, refusal.code, retry_after=refusal.retry_after)
    refused = no_room(request, model, since=began)
    if state is not ServerState.READY and refused is not None:  # its admission is (or just was) refused
        raise refused
    if state is not ServerState.READY:  # the wake goes on; this caller stops waiting for it
        raise ApiError(503, f"the model did not become ready within {wake_timeout:g}s (wake_timeout); it is still "
                       f"{state} and the wake goes on", "wake_timeout", retry_after=5)
    return {"ok": True, "model": model.id, "message": message, "state": str(state), "last_wake": controller.last_wake}


async def wake(request: web.Request) -> web.Response:
    return web.json_response(await _wake_one(request, await model_param(request) or request.app[FLEET].default_model))


async def load_model(request: web.Request) -> web.Response:
    """llama-server router's POST /models/load {"model": ID}: wake it (through the fleet's admission);
    its answer {"success": true} beside Dormouse's."""
    return web.json_response({"success": True, **await _wake_one(request, await model_param(request, required=True))})


async def unload_model(request: web.Request) -> web.Response:
    """llama-server router's POST /models/unload {"model": ID}: put it to sleep (409 while it serves)."""
    return web.json_response({"success": True, **await _sleep_one(request, await model_param(request, required=True))})


async def openapi(request: web.Request) -> web.Response:
    from daemon.http.admin.openapi import served_document

    return web.Response(body=served_document(request.app[SETTINGS]), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/health", health)  # llama-server's alias
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake", wake)
    app.router.add_post("/models/load", load_model)
    app.router.add_post("/models/unload", unload_model)

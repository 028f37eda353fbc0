"""Endpoints that answer from the daemon itself: /health, /props, /slots,
/metrics never wake the model nor touch the idle timer. /sleep and /wake are
the operator's hands on the state machine."""

from __future__ import annotations

from aiohttp import web

from daemon.http.errors import ApiError
from daemon.http.app import CONTROLLER, METRICS, SETTINGS
from statemachine import ServerState, SleepRequested, WakeRequested


async def health(request: web.Request) -> web.Response:
    controller = request.app[CONTROLLER]
    body = {"status": "ok" if controller.healthy else "unavailable", "state": str(controller.state)}
    if controller.state is ServerState.FAILED:
        body["error"] = controller.machine.failure_reason
    return web.json_response(body, status=200 if controller.healthy else 503)


async def props(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    s = c.settings  # the reloaded settings (SIGHUP), not the ones the app started with
    return web.json_response({
        "state": str(c.state),
        "state_since": c.state_since,
        "is_sleeping": c.state is ServerState.SLEEPING,
        "failure": c.machine.failure_reason,
        "model_path": c.model_path,
        "model": c.model_info or None,
        "n_ctx": s.ctx_size,
        "n_ctx_slot": c.n_ctx_slot or None,
        "total_slots": s.parallel,
        "slots": [_slot(x) for x in c.slots],
        "sleep_idle_seconds": s.sleep_idle_seconds,
        "idle_timer_remaining": c.idle_deadline(),
        "spawn_ahead": s.spawn_ahead,
        "spare_worker_pid": c.supervisor.spare.pid if c.supervisor.spare else None,
        "requests_in_flight": len(c.machine.in_flight),
        "requests_waiting": len(c.machine.waiting),
        "last_wake": c.last_wake,
        "last_sleep": c.last_sleep,
    })


def _slot(info) -> dict:
    return {"id": info.id, "state": info.state, "request_id": info.request_id, "n_cached": info.n_cached}


async def slots(request: web.Request) -> web.Response:
    c = request.app[CONTROLLER]
    if c.slots:
        return web.json_response([_slot(x) for x in c.slots])
    # Asleep (or not loaded yet): the slots exist on paper, all idle and empty.
    return web.json_response([{"id": i, "state": "idle", "request_id": None, "n_cached": 0}
                              for i in range(request.app[SETTINGS].parallel)])


async def metrics(request: web.Request) -> web.Response:
    request.app[CONTROLLER].sample_worker_memory()  # read at scrape time; never wakes anything
    body, content_type = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def sleep(request: web.Request) -> web.Response:
    controller = request.app[CONTROLLER]
    ok, message = await controller.admin(SleepRequested)
    if not ok:
        raise ApiError(409, message, "cannot_sleep")
    await controller.wait_for(lambda s: s is not ServerState.UNLOADING, request.app[SETTINGS].shutdown_timeout + 10)
    return web.json_response({"ok": True, "message": message, "state": str(controller.state),
                              "last_sleep": controller.last_sleep})


async def wake(request: web.Request) -> web.Response:
    controller = request.app[CONTROLLER]
    ok, message = await controller.admin(WakeRequested)
    if not ok:
        raise ApiError(409, message, "cannot_wake")
    settled = {ServerState.READY, ServerState.FAILED, ServerState.STOPPING}
    wake_timeout = request.app[SETTINGS].wake_timeout
    await controller.wait_for(lambda s: s in settled, wake_timeout)
    state = controller.state
    if state is ServerState.FAILED:
        raise ApiError(503, f"wake failed: {controller.machine.failure_reason}", "model_load_failed",
                       retry_after=controller.machine.retry_delay)
    if state is ServerState.STOPPING:
        raise ApiError(503, "the server is shutting down", "shutting_down", retry_after=1)
    if state is not ServerState.READY:  # the wake goes on; this caller stops waiting for it
        raise ApiError(503, f"the model did not become ready within {wake_timeout:g}s (wake_timeout); it is still "
                       f"{state} and the wake goes on", "wake_timeout", retry_after=5)
    return web.json_response({"ok": True, "message": message, "state": str(state), "last_wake": controller.last_wake})


async def openapi(request: web.Request) -> web.Response:
    from daemon.http.openapi import openapi_document

    return web.json_response(openapi_document())


def add_routes(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/slots", slots)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/sleep", sleep)
    app.router.add_post("/wake", wake)

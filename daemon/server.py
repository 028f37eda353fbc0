"""`dormouse serve`: bind HTTP, run the controller, handle signals.

systemd sees READY=1 once HTTP is bound (not when the model is loaded: the
daemon answers /health while it loads), STATUS= follows the state, WATCHDOG=1
comes from the event loop, SIGHUP reloads the idle timeout and log level
without touching the model, SIGTERM drains and tears down in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from typing import Any, Callable

from aiohttp import web

from config import ConfigError, Settings
from daemon.model.controller import CANCEL_GRACE_SECONDS, Controller
from daemon.http.agent import snapshot_of, start_agent
from daemon.http.app import build_app
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.systemd import Notifier, inherited_socket, watchdog_interval
from statemachine import PolicyChanged


# Open connections get this long to close once the worker is gone (their
# requests have been answered or failed by then).
HTTP_CLOSE_SECONDS = 3.0
# Slack for process reaping and logging on a loaded machine.
STOP_SLACK_SECONDS = 5.0


def stop_budget(settings: Settings) -> float:
    """The longest SIGTERM can take to exit: drain, cancel grace, teardown, HTTP
    close, slack. systemd's TimeoutStopSec must be at least this (the unit's
    60 s covers the defaults; tests/unit/test_shutdown_budget.py checks)."""
    return (settings.shutdown_timeout + CANCEL_GRACE_SECONDS + settings.teardown_timeout
            + HTTP_CLOSE_SECONDS + STOP_SLACK_SECONDS)


async def serve(settings: Settings, model_path: str, reload_settings: Callable[[], Settings] | None = None) -> int:
    log = get_logger()
    metrics = Metrics()
    controller = Controller(settings, model_path, metrics, log)
    notifier = Notifier()
    controller.state_listeners.append(lambda before, after: notifier.status(f"state: {after}"))

    app = build_app(controller, settings, metrics, log)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=HTTP_CLOSE_SECONDS)
    await runner.setup()
    sock = inherited_socket()
    site: web.BaseSite = web.SockSite(runner, sock) if sock else web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:
        log.error("http.bind_failed", host=settings.host, port=settings.port, error=exc.strerror)
        await runner.cleanup()
        return 1
    bound = [s.getsockname() for s in (runner.server and site._server.sockets or [])]  # type: ignore[union-attr]
    log.info("http.listening", addresses=[f"{a[0]}:{a[1]}" for a in bound], socket_activated=sock is not None,
             model=model_path, sleep_idle_seconds=settings.sleep_idle_seconds)
    agent = None
    if settings.agent_port:
        try:
            agent = await start_agent(settings.host, settings.agent_port, lambda: snapshot_of([controller]), log)
        except OSError as exc:
            log.error("agent.bind_failed", port=settings.agent_port, error=exc.strerror)
            await runner.cleanup()
            return 1
    notifier.ready(f"state: {controller.state}")

    owner = asyncio.create_task(controller.run(), name="controller")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    if reload_settings is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller, notifier, reload_settings, log))
    watchdog = asyncio.create_task(_watchdog(notifier)) if watchdog_interval() else None

    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({owner, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if owner in done and owner.exception() is not None:
        log.error("controller.crashed", error=repr(owner.exception()))
        code = 1
    else:
        log.info("shutdown.begin", in_flight=len(controller.machine.in_flight))
        notifier.stopping()
        # controller.shutdown is bounded by itself; this outer bound is the last
        # word, so that a bug there still exits within TimeoutStopSec.
        inner = settings.shutdown_timeout + CANCEL_GRACE_SECONDS + settings.teardown_timeout
        try:
            await asyncio.wait_for(controller.shutdown(settings.shutdown_timeout), inner + STOP_SLACK_SECONDS)
        except asyncio.TimeoutError:
            log.error("shutdown.forced", seconds=inner + STOP_SLACK_SECONDS)
            await controller.supervisor.close()
            code = 1
    stop_wait.cancel()
    if watchdog is not None:
        watchdog.cancel()
    await runner.cleanup()
    if agent is not None:
        agent.close()
    log.info("shutdown.done")
    notifier.close()
    return code


def _reload(controller: Controller, notifier: Notifier, reload_settings: Callable[[], Settings], log) -> None:
    notifier.reloading()
    try:
        fresh = reload_settings()
    except ConfigError as exc:
        log.error("reload.failed", error=str(exc))
        notifier.ready(f"state: {controller.state} (reload failed)")
        return
    configure_logging(controller.settings.log_format, fresh.log_level)
    controller.settings = controller.settings.model_copy(
        update={"sleep_idle_seconds": fresh.sleep_idle_seconds, "log_level": fresh.log_level})
    controller.metrics.idle_timeout_seconds.set(fresh.sleep_idle_seconds)
    controller.post(PolicyChanged(dataclasses.replace(controller.machine.policy, idle_seconds=fresh.sleep_idle_seconds)))
    log.info("reload.done", sleep_idle_seconds=fresh.sleep_idle_seconds, log_level=fresh.log_level)
    notifier.ready(f"state: {controller.state}")


async def _watchdog(notifier: Notifier) -> None:
    interval = watchdog_interval() or 10.0
    while True:
        notifier.watchdog()  # sent from the event loop: a blocked loop stops the pings
        await asyncio.sleep(interval)


def run(settings: Settings, model_path: str, reload_settings: Callable[[], Settings] | None = None) -> int:
    configure_logging(settings.log_format, settings.log_level)
    return asyncio.run(serve(settings, model_path, reload_settings))


__all__: list[Any] = ["run", "serve"]

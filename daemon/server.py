"""`dormouse serve`: bind HTTP, run the fleet and each model's controller, handle signals.

systemd sees READY=1 once HTTP is bound (not when a model is loaded: the
daemon answers /health while it loads), STATUS= follows the models' states,
WATCHDOG=1 comes from the event loop, SIGHUP reloads the idle timeouts and
log level without touching the models, SIGTERM and SIGINT (Ctrl-C) drain and tear every model
down in order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import signal
from typing import Any, Callable

from aiohttp import web

from config import ConfigError, Settings
from config.reloadable import needs_restart
from config.settings import admin_key_problem
from daemon.fleet.metrics import FleetMetrics
from daemon.fleet.owner import Fleet, FleetModel
from daemon.fleet.plans import ModelPlan, configured_as_router, footprint_store, memory_budget
from daemon.http.agent import snapshot_of, start_agent
from daemon.host_tools.runtime import RuntimeSpecError
from daemon.http.app import build_app
from daemon.http.tool_routes import HOST_TOOLS
from daemon.http.keys import LISTENING
from daemon.http.vertex_predict import RouteTaken
from daemon.model.chat_template_check import warn_untemplated
from daemon.logs import configure_logging, get_logger
from daemon.metrics import MetricFamilies, Metrics
from daemon.model.controller import CANCEL_GRACE_SECONDS, Controller
from daemon.model.files import state_dir
from daemon.model.footprint import counted, plausible
from daemon.state_dir_check import state_dir_warning
from daemon.state_lock import StateDirInUse, StateDirLock
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
    drain_grace = settings.drain_grace_seconds if settings.agent_port else 0.0
    return (drain_grace + settings.shutdown_timeout + CANCEL_GRACE_SECONDS + settings.teardown_timeout
            + HTTP_CLOSE_SECONDS + STOP_SLACK_SECONDS)


def build_fleet(settings: Settings, plans: list[ModelPlan], families: MetricFamilies, log) -> Fleet:
    """A controller per model, and the fleet that admits their loads by memory.

    A fleet of one (no [models.ID] tables, no memory_budget) asks no admission:
    it behaves as the single-model daemon always has, whatever its size."""
    store = footprint_store(settings, log)
    budget = memory_budget(settings)
    models = []
    by_id = {plan.id: plan for plan in plans}
    for plan in plans:
        controller = Controller(plan.settings, plan.model_path, Metrics(families, plan.id), log, model_id=plan.id)
        model = FleetModel(plan.id, controller, plan.predicted_bytes, plan.aliases, plan.pinned, plan.load_at_start,
                           tags=tuple(plan.settings.tags))
        if plan.measured and _stands(plan, plan.measured, budget.bytes):
            model.measured_components = counted(plan.predicted, plan.measured).components()
            model.measured_bytes = sum(model.measured_components.values())
        elif plan.measured:
            log.warning("footprint.stored_ignored", model=plan.id, stored_bytes=sum(plan.measured.values()),
                        predicted_bytes=plan.predicted_bytes, budget_bytes=budget.bytes)
        models.append(model)

    def keep_measurement(model: FleetModel) -> None:
        # What a load measured is what it held then; what grows after it (output and
        # compute buffers, the prompt cache's transfer) counts at its predicted size
        # where that is larger, for planning and for the next start alike.
        plan = by_id[model.id]
        model.measured_components = counted(plan.predicted, model.measured_components or {}).components()
        model.measured_bytes = sum(model.measured_components.values())
        # Kept only if the next start would believe it (a test's fake worker, a broken
        # ledger: shown, not kept). fsync: off the event loop.
        if plan.key and _stands(plan, model.measured_components, budget.bytes):
            asyncio.get_running_loop().run_in_executor(None, store.put, plan.key, model.measured_components)

    default = next(plan.id for plan in plans if plan.is_default)
    fleet = Fleet(models, default, budget.bytes, settings.wake_timeout, FleetMetrics(families.registry), log,
                  on_measured=keep_measurement, admit=len(plans) > 1 or settings.memory_budget is not None,
                  load_timeout=settings.load_timeout, max_models=settings.models_max,
                  any_name=not configured_as_router(settings, len(plans)))
    log.info("fleet.budget", bytes=budget.bytes, how=budget.how, admission=fleet.admitting,
             models={m.id: m.bytes for m in models})
    return fleet


def _stands(plan: ModelPlan, measured: dict[str, int], budget: int) -> bool:
    """A stored measurement may stand for the model when it is near the prediction
    (or, with none, at least half the weights on disk) and can fit in the budget."""
    if plan.predicted is not None:
        return plausible(measured, plan.predicted.total, budget)
    total = sum(measured.values())
    return _file_size(plan.model_path) // 2 <= total <= budget


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _open_off_loopback(addresses: list[Any], settings: Settings) -> str | None:
    """Why serving these socket addresses needs an admin_key that is not set, or None. A Unix
    socket (a path) reaches local users only, as loopback does."""
    for address in addresses:
        if isinstance(address, tuple) and address:
            problem = admin_key_problem(str(address[0]), int(address[1]), settings)
            if problem:
                return problem
    return None


async def _note_listening(app: web.Application, bound: list[Any]) -> None:
    """The Host check's view of what is served (daemon/http/app.py): the sockets' addresses, and
    bound to a wildcard address this machine's fully qualified name (looked up off the loop, bounded)."""
    import socket

    hosts = [str(a[0]) for a in bound if isinstance(a, tuple) and a]
    fqdn = None
    if any(host in ("0.0.0.0", "::") for host in hosts):
        try:
            fqdn = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, socket.getfqdn), 2.0)
        except (asyncio.TimeoutError, OSError):
            fqdn = None
    app[LISTENING].serve(hosts, fqdn)


def fleet_status(fleet: Fleet) -> str:
    """systemd's STATUS=: "state: ready" for one model; "chat: ready, coder: sleeping" for several."""
    if len(fleet.models) == 1:
        return f"state: {fleet.default_model.controller.state}"
    return ", ".join(f"{m.id}: {m.controller.state}" for m in fleet.models.values())


async def serve(settings: Settings, plans: list[ModelPlan], reload_settings: Callable[[], Settings] | None = None) -> int:
    log = get_logger()
    # First thing, so that no signal meets Python's default handler (a KeyboardInterrupt
    # traceback) while the daemon starts: one that comes early stops it as one that comes late.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(stop_signal, _on_stop_signal, stop_signal, stop, log)
    families = MetricFamilies()
    fleet = build_fleet(settings, plans, families, log)
    notifier = Notifier()
    if reload_settings is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload(fleet, notifier, reload_settings, log, settings))
    for controller in fleet.controllers:
        controller.state_listeners.append(lambda before, after: notifier.status(fleet_status(fleet)))

    try:
        app = build_app(fleet, settings, families, log)
    except RouteTaken as exc:  # nothing started yet: the fleet's tasks start below
        log.error("http.route_taken", error=str(exc))
        return 2
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=HTTP_CLOSE_SECONDS)
    try:
        await runner.setup()  # starts --tools-runtime's container and lists the MCP servers' tools
    except RuntimeSpecError as exc:
        log.error("tools.start_failed", error=str(exc))
        await runner.cleanup()
        return 2
    sock = inherited_socket()
    # The admin rule (no admin_key off loopback) is judged on the socket really served: one systemd
    # passes (socket activation) is bound wherever its unit says, whatever `host` is.
    refused = _open_off_loopback([sock.getsockname()] if sock else [], settings)
    if refused:
        log.error("http.admin_key_required", error=refused, socket_activated=True)
        await runner.cleanup()
        return 2
    # One site per address of `host` (llama-server's --host 127.0.0.1,::1 serves both).
    sites: list[web.BaseSite] = [web.SockSite(runner, sock)] if sock else [
        web.TCPSite(runner, host, settings.port) for host in settings.hosts]
    try:
        for site in sites:
            await site.start()
    except OSError as exc:
        log.error("http.bind_failed", host=settings.host, port=settings.port, error=exc.strerror)
        await runner.cleanup()
        return 1
    bound = [s.getsockname() for site in sites for s in (site._server.sockets or [])]  # type: ignore[union-attr]
    refused = _open_off_loopback(bound, settings)  # a name that resolved off loopback
    if refused:
        log.error("http.admin_key_required", error=refused, socket_activated=sock is not None)
        await runner.cleanup()
        return 2
    await _note_listening(app, bound)
    if sock is not None and not {f"{h}:{settings.port}" for h in settings.hosts} & {f"{a[0]}:{a[1]}" for a in bound}:
        # systemd bound the socket (dormouse.socket's ListenStream); host and port were not used
        log.warning("http.address_setting_unused", configured=f"{settings.host}:{settings.port}",
                    serving=[f"{a[0]}:{a[1]}" for a in bound],
                    fix="socket activation: set the address in dormouse.socket's ListenStream (systemctl edit dormouse.socket)")
    log.info("http.listening", addresses=[f"{a[0]}:{a[1]}" for a in bound], socket_activated=sock is not None,
             models={p.id: p.model_path for p in plans}, sleep_idle_seconds=settings.sleep_idle_seconds)
    agent = None
    if settings.agent_port:
        try:
            agent = await start_agent(settings.hosts if settings.host else "", settings.agent_port, lambda: snapshot_of(fleet.controllers, fleet.any_name, fleet.aliases), log)
        except OSError as exc:
            log.error("agent.bind_failed", port=settings.agent_port, error=exc.strerror)
            await runner.cleanup()
            return 1
    notifier.ready(fleet_status(fleet))

    planner = asyncio.create_task(fleet.run(), name="fleet")
    owners = {asyncio.create_task(m.controller.run(load_at_start=m.load_at_start), name=f"controller-{m.id}")
              for m in fleet.models.values()}
    watchdog = asyncio.create_task(_watchdog(notifier)) if watchdog_interval() else None
    await warn_untemplated(plans, log)  # once the loads are under way: the header reads never delay them

    stop_wait = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({*owners, planner, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    crashed = [task for task in done if task is not stop_wait and task.exception() is not None]
    if crashed:
        log.error("controller.crashed", task=crashed[0].get_name(), error=repr(crashed[0].exception()))
        code = 1
    grace = settings.drain_grace_seconds
    if agent is not None and not crashed and grace > 0:
        # The balancer reads the agent every agent-inter: until it has read the
        # zero weight, requests still come, and must still be served.
        agent.drain()
        log.info("shutdown.drain_grace", seconds=grace)
        await asyncio.sleep(grace)
    log.info("shutdown.begin", in_flight=sum(len(c.machine.in_flight) for c in fleet.controllers))
    notifier.stopping()
    await app[HOST_TOOLS].close()  # a tool call is not drained: it may run for minutes (docs/tools.md)
    # Each controller's shutdown is bounded by itself; this outer bound is the
    # last word, so that a bug there still exits within TimeoutStopSec.
    inner = settings.shutdown_timeout + CANCEL_GRACE_SECONDS + settings.teardown_timeout
    try:
        await asyncio.wait_for(asyncio.gather(*(c.shutdown(settings.shutdown_timeout) for c in fleet.controllers
                                                if not c.stopped.is_set())), inner + STOP_SLACK_SECONDS)
    except asyncio.TimeoutError:
        log.error("shutdown.forced", seconds=inner + STOP_SLACK_SECONDS)
        await asyncio.gather(*(c.supervisor.close() for c in fleet.controllers))
        code = 1
    planner.cancel()
    stop_wait.cancel()
    if watchdog is not None:
        watchdog.cancel()
    await runner.cleanup()
    if agent is not None:
        agent.close()
    log.info("shutdown.done")
    notifier.close()
    return code


def _on_stop_signal(sig: signal.Signals, stop: asyncio.Event, log) -> None:
    """SIGTERM (systemd, docker, kill) and SIGINT (Ctrl-C: the terminal sends it to the daemon
    alone, workers run in sessions of their own) stop the daemon the same way: requests drain,
    each model sleeps in order and its prompt caches go to disk (worker.kv_saved says what)."""
    if stop.is_set():
        log.info("shutdown.signal_again", signal=sig.name)
        return
    log.info("shutdown.signal", signal=sig.name)
    stop.set()


def _per_model(table, fresh: Settings, key: str) -> float:
    """A [models.ID] table's value for key where it sets one, else the daemon's."""
    value = getattr(table, key, None) if table is not None else None
    return getattr(fresh, key) if value is None else value


def _reload(fleet: Fleet, notifier: Notifier, reload_settings: Callable[[], Settings], log,
            running: Settings | None = None) -> None:
    notifier.reloading()
    try:
        fresh = reload_settings()
    except Exception as exc:  # noqa: BLE001 - a ConfigError names the problem; anything else is a bug, still answered
        log.error("reload.failed", error=str(exc) if isinstance(exc, ConfigError) else repr(exc))
        notifier.ready(f"{fleet_status(fleet)} (reload failed)")  # systemd hears READY=1 after RELOADING=1, always
        return
    configure_logging(fresh.log_format, fresh.log_level)
    applied = {}
    for model in fleet.models.values():
        table = fresh.models.get(model.id)
        tiers = {key: _per_model(table, fresh, key) for key in ("sleep_idle_seconds", "drowsy_after", "deep_after")}
        idle = tiers["sleep_idle_seconds"]
        controller = model.controller
        controller.settings = controller.settings.model_copy(update={**tiers, "log_level": fresh.log_level})
        controller.metrics.idle_timeout_seconds.set(idle)
        controller.post(PolicyChanged(dataclasses.replace(
            controller.machine.policy, idle_seconds=idle, drowsy_seconds=tiers["drowsy_after"],
            deep_after_seconds=tiers["deep_after"])))
        applied[model.id] = tiers
    log.info("reload.done", sleep_tiers=applied, log_level=fresh.log_level)
    skipped = needs_restart(running, fresh) if running is not None else []
    if skipped:  # read at start only: named, not dropped without a word (config/reloadable.py)
        log.warning("reload.needs_restart", keys=skipped,
                    error=f"changed, but a reload cannot apply them: {', '.join(skipped)} (needs a restart)")
        notifier.ready(f"{fleet_status(fleet)} (reload: {', '.join(skipped)[:200]} needs a restart)")
        return
    notifier.ready(fleet_status(fleet))


async def _watchdog(notifier: Notifier) -> None:
    interval = watchdog_interval() or 10.0
    while True:
        notifier.watchdog()  # sent from the event loop: a blocked loop stops the pings
        await asyncio.sleep(interval)


def run(settings: Settings, plans: list[ModelPlan], reload_settings: Callable[[], Settings] | None = None) -> int:
    configure_logging(settings.log_format, settings.log_level)
    lock = StateDirLock(state_dir(settings))
    unwritable = state_dir_warning(state_dir(settings))
    try:
        lock.acquire()
    except StateDirInUse as exc:
        get_logger().error("state_dir.in_use", error=str(exc), path=str(exc.directory), pid=exc.pid)
        return 1
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            get_logger().error("state_dir.unusable", error=f"cannot lock {lock.path}: {exc.strerror or exc}")
            return 1
        # A state directory this daemon cannot write: no two daemons can rewrite anything there.
        if not unwritable:  # else the line below says it, with what else will not persist
            get_logger().warning("state_dir.not_locked", path=str(lock.path), error=exc.strerror or str(exc))
    if unwritable:  # the one line that says what will not persist (daemon/state_dir_check.py)
        get_logger().warning("state_dir.read_only", path=str(state_dir(settings)), error=unwritable)
    try:
        return asyncio.run(serve(settings, plans, reload_settings))
    except KeyboardInterrupt:  # a Ctrl-C before serve() took the signals over (or after it gave them back)
        get_logger().info("shutdown.interrupted")
        return 130
    finally:
        lock.release()


__all__: list[Any] = ["run", "serve"]

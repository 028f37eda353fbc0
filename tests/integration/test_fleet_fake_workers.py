"""The fleet with fake workers (real protocol, real processes): admission by
memory, least-recently-used eviction, busy models kept, one load at a time,
refusals that name the sizes. Models are asked for through their controllers;
the HTTP routes have their own tests."""

from __future__ import annotations

import asyncio
import contextlib
import os

from prometheus_client import CollectorRegistry

from config import Settings
from daemon import protocol as p
from daemon.model.controller import Controller
from daemon.fleet.metrics import FleetMetrics
from daemon.fleet.owner import Fleet, FleetModel
from daemon.model.jobs import JobFailure
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from statemachine import ServerState

GiB = 2**30


@contextlib.asynccontextmanager
async def fleet_of(sizes: dict[str, float], budget: float, wake_timeout: float = 10, pinned=(), **overrides):
    configure_logging("json", "warning")
    log = get_logger()
    # The fake workers report what they hold: the size the test gives (all loaded models alike).
    os.environ["FAKE_MODEL_BYTES"] = str(int(min(sizes.values()) * GiB) - 100)
    models = []
    for model_id, size in sizes.items():
        settings = Settings(worker_module="tests.fakes.fake_worker", sleep_idle_seconds=-1, spawn_ahead=False,
                            wake_timeout=wake_timeout, **overrides)
        controller = Controller(settings, f"/models/{model_id}.gguf", Metrics(), log)
        models.append(FleetModel(model_id, controller, int(size * GiB), pinned=model_id in pinned))
    fleet = Fleet(models, models[0].id, int(budget * GiB), wake_timeout, FleetMetrics(CollectorRegistry()), log)
    tasks = [asyncio.create_task(fleet.run())]
    tasks += [asyncio.create_task(m.controller.run(load_at_start=False)) for m in models]
    await until(lambda: all(m.controller.state is ServerState.SLEEPING for m in models))
    try:
        yield fleet
    finally:
        await asyncio.gather(*(m.controller.shutdown(5) for m in models))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        del os.environ["FAKE_MODEL_BYTES"]


async def ask(fleet: Fleet, model_id: str, max_tokens: int = 3):
    """One completion on `model_id`: the Done, or the failure."""
    job = fleet.route(model_id).controller.new_job("completions", p.SamplingParams(max_tokens=max_tokens), prompt="hi")
    while True:
        item = await job.next(fleet.wake_timeout + 5)
        if isinstance(item, (p.Done, JobFailure)):
            return item


def states(fleet: Fleet) -> dict[str, str]:
    return {m.id: str(m.controller.state) for m in fleet.models.values()}


async def until(predicate, timeout=10):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_budget_for_two_of_three_evicts_the_least_recently_used():
    async with fleet_of({"a": 4, "b": 4, "c": 4}, budget=9) as fleet:
        assert states(fleet) == {"a": "sleeping", "b": "sleeping", "c": "sleeping"}
        assert isinstance(await ask(fleet, "a"), p.Done)
        assert isinstance(await ask(fleet, "b"), p.Done)
        assert isinstance(await ask(fleet, "a"), p.Done)  # a is now more recent than b
        assert isinstance(await ask(fleet, "c"), p.Done)
        assert states(fleet) == {"a": "ready", "b": "sleeping", "c": "ready"}
        b = fleet.models["b"].controller
        assert b.last_sleep["reason"] == "evict"
        assert fleet.metrics.evictions.labels(model="b")._value.get() == 1
        assert fleet.planned_bytes() <= fleet.budget


async def test_a_busy_model_is_never_evicted(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.02")
    async with fleet_of({"a": 4, "b": 4, "c": 4}, budget=9) as fleet:
        await ask(fleet, "b")
        await ask(fleet, "a")  # b is the least recently used...
        long_b = asyncio.create_task(ask(fleet, "b", max_tokens=100))  # ...but busy now
        await until(lambda: fleet.models["b"].controller.machine.in_flight)
        assert isinstance(await ask(fleet, "c"), p.Done)
        assert states(fleet)["a"] == "sleeping" and states(fleet)["b"] == "ready"
        done = await long_b
        assert isinstance(done, p.Done) and done.completion_tokens == 100  # its stream ran to the end


async def test_when_busy_models_hold_the_memory_the_load_waits_then_is_refused_with_retry_after(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.05")
    async with fleet_of({"a": 4, "b": 4, "c": 4}, budget=9, wake_timeout=0.5) as fleet:
        await ask(fleet, "a")
        await ask(fleet, "b")
        busy = [asyncio.create_task(ask(fleet, m, max_tokens=60)) for m in ("a", "b")]
        await until(lambda: all(fleet.models[m].controller.machine.in_flight for m in ("a", "b")))
        refused = await ask(fleet, "c")
        assert isinstance(refused, JobFailure) and refused.status == 503
        assert refused.code == "insufficient_memory" and refused.retry_after
        # It names what is in the way and its size: a, the least recently used, drains for it.
        assert "waiting for busy a (4096 MiB) to finish" in refused.message
        assert states(fleet)["c"] == "sleeping"
        await asyncio.gather(*busy)
        assert isinstance(await ask(fleet, "c"), p.Done)  # once they are idle, it fits


async def test_a_model_that_can_never_fit_is_refused_naming_its_size():
    async with fleet_of({"small": 1, "huge": 12}, budget=10) as fleet:
        refused = await ask(fleet, "huge")
        assert isinstance(refused, JobFailure) and refused.code == "model_too_large"
        assert "12288 MiB" in refused.message and "10240 MiB" in refused.message
        assert isinstance(await ask(fleet, "small"), p.Done)


async def test_a_pinned_model_is_never_evicted():
    async with fleet_of({"pin": 4, "a": 4, "b": 4}, budget=9, pinned=("pin",)) as fleet:
        await ask(fleet, "pin")
        await ask(fleet, "a")
        assert isinstance(await ask(fleet, "b"), p.Done)
        assert states(fleet) == {"pin": "ready", "a": "sleeping", "b": "ready"}


async def test_a_storm_of_cold_requests_loads_one_model_at_a_time(monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "0.3")
    async with fleet_of({"a": 1, "b": 1, "c": 1}, budget=10) as fleet:
        results = await asyncio.gather(*(ask(fleet, m) for m in ("a", "b", "c") for _ in range(4)))
        assert all(isinstance(r, p.Done) for r in results)
        assert fleet.metrics.loads_in_progress_max._value.get() == 1
        assert states(fleet) == {"a": "ready", "b": "ready", "c": "ready"}


async def test_unknown_model_names_the_ones_there_are():
    async with fleet_of({"a": 1, "b": 1}, budget=10) as fleet:
        try:
            fleet.route("zzz")
        except KeyError as exc:
            assert "zzz" in exc.message and "a, b" in exc.message
        else:
            raise AssertionError("an unknown model must not route")
        assert fleet.route(None).id == "a"

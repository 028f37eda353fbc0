"""Budgets that hold (issue 26): on CPU the prompt caches' RAM tiers grow while
their models serve, after the admission that planned them. Measured before:
two models of 295 MiB admitted within a budget of 600 MiB (planned 590), then
one model's tier grew to 59 MiB: 649 MiB held, and the planned-bytes gauge
still said 590. The fleet now tells each tier how far it may grow, within the
room the budget has, and shrinks tiers before it evicts a model.

Fake workers (real protocol, real processes) whose tier grows by one entry per
request (tests/fakes/fake_cache_worker.py); each worker logs what its tier
holds after every change, so the sums are checked against what the workers
really held, not only what the fleet last heard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

from prometheus_client import CollectorRegistry

from config import Settings
from daemon import protocol as p
from daemon.fleet.metrics import FleetMetrics
from daemon.fleet.owner import Fleet, FleetModel
from daemon.logs import configure_logging, get_logger
from daemon.metrics import Metrics
from daemon.model.controller import Controller
from statemachine import ServerState as S
from tests.integration.test_fleet_fake_workers import ask, states, until

MiB = 2**20


@contextlib.asynccontextmanager
async def fleet_with_tiers(tmp_path, predicted: dict[str, int], budget: int, ram: int, entry: int,
                           measured: dict[str, int] | None = None):
    """Models of `predicted` MiB (measured the same at load unless `measured` says otherwise), each
    with a RAM tier of `ram` MiB that grows by `entry` bytes per request."""
    configure_logging("json", "warning")
    log = get_logger()
    sizes = {m: (measured or {}).get(m, size) * MiB - 100 for m, size in predicted.items()}  # + 100 of context
    env = {"FAKE_MODEL_SIZES": json.dumps(sizes), "FAKE_CACHE_ENTRY_BYTES": str(entry),
           "FAKE_CACHE_LOG": str(tmp_path / "tiers.jsonl")}
    os.environ.update(env)
    models = []
    for model_id, size in predicted.items():
        settings = Settings(worker_module="tests.fakes.fake_cache_worker", sleep_idle_seconds=-1, spawn_ahead=False,
                            wake_timeout=10, prompt_cache_ram_bytes=ram * MiB, state_dir=tmp_path / "state")
        controller = Controller(settings, f"/models/{model_id}.gguf", Metrics(), log, model_id=model_id)
        models.append(FleetModel(model_id, controller, size * MiB))
    fleet = Fleet(models, models[0].id, budget * MiB, 10, FleetMetrics(CollectorRegistry()), log)
    tasks = [asyncio.create_task(fleet.run())]
    tasks += [asyncio.create_task(m.controller.run(load_at_start=False)) for m in models]
    await until(lambda: all(m.controller.state is S.SLEEPING for m in models))
    try:
        yield fleet
    finally:
        await asyncio.gather(*(m.controller.shutdown(5) for m in models))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for name in env:
            del os.environ[name]


def reported_tier(fleet: Fleet, model_id: str) -> int:
    """What the model's worker said its tier holds in its last Done."""
    return int(fleet.models[model_id].controller.metrics.prompt_cache.get("ram", {}).get("bytes", 0))


def worker_pid(fleet: Fleet, model_id: str) -> int:
    return fleet.models[model_id].controller.supervisor.current.pid


def most_held(tmp_path, pid: int) -> int:
    """The most the worker's tier held at any moment (its own log)."""
    lines = (tmp_path / "tiers.jsonl").read_text().splitlines()
    return max((json.loads(line)["bytes"] for line in lines if json.loads(line)["pid"] == pid), default=0)


async def assert_within_budget(fleet: Fleet) -> None:
    planned = fleet.planned_bytes()
    assert planned <= fleet.budget, f"planned {planned / MiB:.1f} MiB past the budget of {fleet.budget / MiB:.0f}"
    # The gauge follows the tiers as they grow (set by the owner task, once it has heard of the Done).
    await until(lambda: fleet.metrics.planned_bytes._value.get() == fleet.planned_bytes())


async def test_two_models_and_a_growing_tier_stay_within_the_budget(tmp_path):
    # The figures: 295 + 295 MiB planned of 600; a's tier alone would reach 59 MiB (649).
    async with fleet_with_tiers(tmp_path, {"a": 295, "b": 295}, budget=600, ram=64, entry=MiB) as fleet:
        assert isinstance(await ask(fleet, "a"), p.Done)
        assert isinstance(await ask(fleet, "b"), p.Done)
        models_bytes = sum(m.bytes for m in fleet.models.values())
        assert models_bytes == 590 * MiB
        for _ in range(59):
            assert isinstance(await ask(fleet, "a"), p.Done)
            await assert_within_budget(fleet)
        # The 10 MiB of room was shared when b came: each kept what it held (1 MiB) and took half of the
        # 9 MiB left. a holds what fits of its 5.5 MiB, and b keeps its 4.5 to grow into.
        limits = {m: fleet.models[m].cache_limit for m in ("a", "b")}
        assert limits == {"a": 5.5 * MiB, "b": 4.5 * MiB} and sum(limits.values()) + models_bytes == fleet.budget
        assert reported_tier(fleet, "a") == 5 * MiB
        for _ in range(8):
            assert isinstance(await ask(fleet, "b"), p.Done)
            await assert_within_budget(fleet)
        assert reported_tier(fleet, "b") == 4 * MiB and fleet.planned_bytes() == 599 * MiB
        # What the workers really held, at every moment, and not only what was last reported.
        most = most_held(tmp_path, worker_pid(fleet, "a")) + most_held(tmp_path, worker_pid(fleet, "b"))
        assert models_bytes + most <= fleet.budget
        assert states(fleet) == {"a": "ready", "b": "ready"}
        assert fleet.metrics.evictions.labels(model="a")._value.get() == 0


async def test_a_footprint_measured_above_its_prediction_shrinks_a_tier_not_a_model(tmp_path):
    # b was predicted at 240 MiB and measures 290 at its load: with a's full tier that is 644 MiB of
    # 600. The tiers give way (a's, the least recently used, to 15 MiB; b's may not grow); no model goes.
    async with fleet_with_tiers(tmp_path, {"a": 295, "b": 240}, budget=600, ram=64, entry=MiB,
                                measured={"b": 290}) as fleet:
        a = fleet.models["a"]
        for _ in range(59):
            assert isinstance(await ask(fleet, "a"), p.Done)
        assert reported_tier(fleet, "a") == 59 * MiB and a.cache_limit is None  # alone, room for its whole tier
        await assert_within_budget(fleet)
        used = a.last_used
        assert isinstance(await ask(fleet, "b"), p.Done)
        assert fleet.models["b"].measured_bytes == 290 * MiB
        assert states(fleet) == {"a": "ready", "b": "ready"}
        assert fleet.metrics.evictions.labels(model="a")._value.get() == 0
        assert a.cache_limit == 15 * MiB and fleet.models["b"].cache_limit == 0
        assert fleet.planned_bytes() == 600 * MiB
        assert a.last_used == used  # the shrink's answer is no use of a: it stays the first to go
        # Once a's worker has acted on it, its reports say so too.
        assert isinstance(await ask(fleet, "a"), p.Done)
        assert reported_tier(fleet, "a") == 15 * MiB
        await assert_within_budget(fleet)


async def test_a_model_woken_again_gets_a_fresh_limit_before_its_first_request(tmp_path):
    from statemachine import SleepRequested

    async with fleet_with_tiers(tmp_path, {"a": 295, "b": 295}, budget=600, ram=64, entry=MiB) as fleet:
        await ask(fleet, "a")
        await ask(fleet, "b")
        b = fleet.models["b"]
        b.controller.post(SleepRequested(0, reason="admin"))
        await until(lambda: b.controller.state is S.SLEEPING)
        assert b.cache_limit is None
        for _ in range(3):  # b is asleep: a's tier could not grow back (a worker's tier is only lowered)
            await ask(fleet, "a")
        assert reported_tier(fleet, "a") <= 5.5 * MiB
        await ask(fleet, "b")  # its new worker is told its room before the request that grows its tier
        assert fleet.models["b"].cache_limit + fleet.models["a"].cache_limit == 600 * MiB - 590 * MiB
        pid = worker_pid(fleet, "b")
        for _ in range(8):
            await ask(fleet, "b")
        assert most_held(tmp_path, pid) <= fleet.models["b"].cache_limit
        await assert_within_budget(fleet)

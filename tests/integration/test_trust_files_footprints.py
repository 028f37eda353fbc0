"""Issue 16, section 5: footprints.json is a claim, not the truth.

One stored value of 10^12 bytes refused the model forever (never loaded, so
never measured again) while /health said ok; a load that measured less than
the prediction for what grows after it (an embeddings context's output
buffer) saved the lower figure for the next start. Fake workers: real
processes and protocol, no llama.cpp.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager

from config import Settings
from daemon.fleet.plans import ModelPlan
from daemon.logs import configure_logging, get_logger
from daemon.metrics import MetricFamilies
from daemon.model.footprint import Footprint
from daemon.model.footprint_store import FootprintStore, footprint_key
from daemon.server import build_fleet
from statemachine import ServerState
from tests.conftest import FAKE_DEFAULTS, DaemonProcess

GiB = 2**30
FAKE = {"DORMOUSE_WORKER_MODULE": "tests.fakes.fake_worker"}


@asynccontextmanager
async def fleet_of_one(tmp_path, predicted: Footprint, stored: dict[str, int] | None, **settings):
    """build_fleet on one plan with a prediction, a store key and what the store held."""
    configure_logging("json", "warning")
    own = Settings(**{**FAKE_DEFAULTS, "state_dir": tmp_path, "memory_budget": 4 * GiB, **settings})
    plan = ModelPlan("m", own, str(tmp_path / "m.gguf"), is_default=True, predicted=predicted, measured=stored,
                     key="the-key")
    fleet = build_fleet(own, [plan], MetricFamilies(), get_logger())
    tasks = [asyncio.create_task(fleet.run())]
    tasks += [asyncio.create_task(m.controller.run(load_at_start=True)) for m in fleet.models.values()]
    try:
        yield fleet
    finally:
        await asyncio.gather(*(c.shutdown(5) for c in fleet.controllers if not c.stopped.is_set()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def ready(fleet, timeout=10):
    controller = fleet.default_model.controller
    assert await controller.wait_for(lambda s: s is ServerState.READY, timeout), controller.state


async def test_a_stored_value_that_cannot_fit_falls_back_to_the_prediction_and_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(GiB))
    predicted = Footprint(model=GiB, context=100)
    async with fleet_of_one(tmp_path, predicted, {"model": 10**12}) as fleet:
        assert fleet.default_model.bytes == predicted.total
        await ready(fleet)  # was: 503 insufficient_memory on every try, forever


async def test_a_stored_value_far_from_the_prediction_is_ignored_even_when_it_fits(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(GiB))
    predicted = Footprint(model=GiB, context=100)
    for stored in ({"model": 3 * GiB}, {"model": 1000}):  # 3x too big, or a fake worker's tiny figure
        async with fleet_of_one(tmp_path, predicted, stored) as fleet:
            assert fleet.default_model.bytes == predicted.total


async def test_a_plausible_stored_value_stands_raised_to_the_prediction_for_what_grows(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(GiB))
    predicted = Footprint(model=GiB, context=300 * 2**20)
    stored = {"model": GiB - 4096, "context": 200 * 2**20}  # measured at an earlier load: less context than predicted
    async with fleet_of_one(tmp_path, predicted, stored, sleep_idle_seconds=-1) as fleet:
        assert fleet.default_model.bytes == GiB - 4096 + 300 * 2**20


async def test_a_load_that_measured_less_than_the_prediction_keeps_the_larger_figure(tmp_path, monkeypatch):
    """The embeddings case: the fake worker measures a 100-byte context where the
    prediction says 300 MiB (room for a batch of outputs, used after the load)."""
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(GiB))
    predicted = Footprint(model=GiB, context=300 * 2**20)
    async with fleet_of_one(tmp_path, predicted, None) as fleet:
        await ready(fleet)
        model = fleet.default_model
        assert model.bytes == GiB + 300 * 2**20  # counted for planning: not the 1 GiB + 100 B the load held
        for _ in range(200):
            if (tmp_path / "footprints.json").exists():
                break
            await asyncio.sleep(0.02)
    kept = FootprintStore(tmp_path).get("the-key")
    assert kept is not None and kept["model"] == GiB and kept["context"] == 300 * 2**20


def _bundled_key(model: str) -> str:
    s = Settings()
    return footprint_key(os.path.realpath(model), s.ctx_size, s.parallel, n_gpu_layers=s.n_gpu_layers,
                         batch_size=s.batch_size, draft_max=s.draft_max)


def test_the_daemon_loads_a_model_whose_stored_footprint_is_absurd(tmp_path, bundled_model):
    state = tmp_path / "state"
    state.mkdir()
    (state / "footprints.json").write_text(json.dumps({"version": 1, "entries": {
        _bundled_key(bundled_model): {"model": 10**12, "context": 0}}}))
    d = DaemonProcess("--model", bundled_model, "--sleep-idle-seconds", "-1", "--state-dir", str(state),
                      "--memory-budget", "2GiB", env=FAKE, log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready", timeout=30)
        assert "footprint.stored_ignored" in d.log()
    finally:
        d.stop()


def test_a_fifo_planted_as_footprints_json_does_not_stop_the_start(tmp_path, bundled_model):
    state = tmp_path / "state"
    state.mkdir()
    os.mkfifo(state / "footprints.json")  # opened for reading, it would wait for a writer forever
    d = DaemonProcess("--model", bundled_model, "--sleep-idle-seconds", "-1", "--state-dir", str(state), env=FAKE,
                      log_path=tmp_path / "d.log")
    try:
        d.wait_state("ready", timeout=30)  # the file is ignored (cli reads it without a logger)
    finally:
        d.stop()

"""The early refusal (503 wake_too_slow) against the bounds it stands for
(daemon/model/sleep_tiers.py too_slow): wake_timeout bounds the wait for a wake
alone, so a wake storm that fits it is served whole however long the queue
behind it; a client's own X-Dormouse-Max-Wait is its time to first token, so a
queue still refuses it early.

The wake history is written before the daemon starts (a host whose wakes of
this file took 0.5 s), so the prediction is "measured" and the same on every
run; the pace of the queue (the running mean of a request's seconds) is set as
a model whose answers take 2 s would have measured it."""

from __future__ import annotations

import asyncio
import json

import pytest

from statemachine import ServerState as S
from tests.integration.test_sleep_tiers import tier_daemon, until

pytestmark = pytest.mark.timeout(180)
BODY = {"prompt": "hi", "max_tokens": 2}
TIMED = "tests.fixtures.timed_fake_worker"
FILE_BYTES = 1 << 20


def measured_history(state_dir, model="fake", seconds=0.5, weights_seconds=0.1, count=4) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    samples = [{"model": model, "tier": "deep", "bytes": FILE_BYTES, "cold_bytes": 0, "seconds": seconds,
                "weights_seconds": weights_seconds, "at": 1.0} for _ in range(count)]
    (state_dir / "wake_history.json").write_text(json.dumps({"version": 1, "samples": samples}))


async def asleep_with_a_measured_history(controller, client, gguf) -> None:
    controller.model_path = str(gguf)  # the file the history measured (the fake's own path is made up)
    await until(controller, S.READY)
    assert (await client.post("/sleep")).status == 200
    await until(controller, S.SLEEPING)
    prediction = controller.predict_wake()
    assert prediction.basis == "measured" and prediction.seconds < 2, prediction


async def storm(controller, client, count: int, headers=None) -> list[asyncio.Task]:
    """`count` requests, each sent once the owner task has taken in the one before (as requests
    arriving over the network are): the queue each one sees is the whole queue ahead of it."""
    tasks = []
    for i in range(count):
        tasks.append(asyncio.create_task(client.post("/v1/completions", json=BODY, headers=headers or {})))
        for _ in range(500):
            if len(controller.machine.waiting) + len(controller.machine.in_flight) > i or tasks[-1].done():
                break
            await asyncio.sleep(0.002)
    return tasks


def refusals(metrics: str) -> float:
    line = next((x for x in metrics.splitlines() if x.startswith('dormouse_wake_refusals_total{model="fake"}')), None)
    return float(line.split()[-1]) if line else 0.0


async def test_a_wake_storm_that_fits_wake_timeout_is_served_whole(tmp_path, monkeypatch):
    """64 requests on a sleeping model whose wake is predicted at 0.5 s (it takes ~2 s, within
    wake_timeout 10); each answer takes 2 s as measured, so the last of them would wait ~30 s for
    a slot: the wake is what wake_timeout bounds, and every one of them is served."""
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "2.0")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\4" * FILE_BYTES)
    measured_history(tmp_path / "state")
    async with tier_daemon(state_dir=tmp_path / "state", worker_module=TIMED, parallel=4, wake_timeout=10) \
            as (controller, client):
        await asleep_with_a_measured_history(controller, client, gguf)
        controller.service_seconds = 2.0
        responses = await asyncio.gather(*await storm(controller, client, 64))
        statuses = [r.status for r in responses]
        codes = [(await r.json())["error"]["code"] for r in responses if r.status != 200]
        assert statuses == [200] * 64, f"{len(codes)} refused: {codes[:3]}"
        assert responses[0].headers["X-Dormouse-Cold-Start"] == "true"
        assert refusals(await (await client.get("/metrics")).text()) == 0


async def test_without_a_measured_wake_a_storm_is_served_too(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "0.2")
    async with tier_daemon(state_dir=tmp_path / "state", parallel=2, wake_timeout=10) as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep")
        controller.service_seconds = 5.0
        responses = await asyncio.gather(*(client.post("/v1/completions", json=BODY) for _ in range(16)))
        assert [r.status for r in responses] == [200] * 16


async def test_a_client_whose_max_wait_cannot_cover_the_queue_is_refused_early(tmp_path, monkeypatch):
    """16 requests wait for a wake (2 s long: the queue stays in place); with 4 slots and
    2 s answers, a 17th's first token is ~8.5 s away: X-Dormouse-Max-Wait 4 is refused at
    once with the queue named, 60 is served, and so is one without the header."""
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "2.0")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\5" * FILE_BYTES)
    measured_history(tmp_path / "state")
    async with tier_daemon(state_dir=tmp_path / "state", worker_module=TIMED, parallel=4, wake_timeout=10) \
            as (controller, client):
        await asleep_with_a_measured_history(controller, client, gguf)
        controller.service_seconds = 2.0
        queue = await storm(controller, client, 16)
        assert len(controller.jobs) >= 16 and controller.state is not S.READY
        refused = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": "4"})
        assert refused.status == 503 and int(refused.headers["Retry-After"]) >= 5
        error = (await refused.json())["error"]
        assert error["code"] == "wake_too_slow"
        assert "behind the requests already accepted" in error["message"]
        assert "time to first token" in error["message"] and "X-Dormouse-Max-Wait" in error["message"]
        patient = asyncio.create_task(client.post("/v1/completions", json=BODY,
                                                  headers={"X-Dormouse-Max-Wait": "60"}))
        plain = asyncio.create_task(client.post("/v1/completions", json=BODY))
        done = await asyncio.gather(*queue, patient, plain)
        assert [r.status for r in done] == [200] * 18


async def test_a_wake_longer_than_wake_timeout_is_still_refused_at_once(tmp_path, monkeypatch):
    """The wake alone past wake_timeout: refused without the header (a measured prediction)."""
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "0.2")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\6" * FILE_BYTES)
    measured_history(tmp_path / "state", seconds=30.0, weights_seconds=0.1)
    async with tier_daemon(state_dir=tmp_path / "state", wake_timeout=10) as (controller, client):
        controller.model_path = str(gguf)
        await until(controller, S.READY)
        await client.post("/sleep")
        await until(controller, S.SLEEPING)
        response = await client.post("/v1/completions", json=BODY)
        assert response.status == 503
        error = (await response.json())["error"]
        assert error["code"] == "wake_too_slow" and "wake_timeout" in error["message"]
        assert "behind the requests" not in error["message"]


async def test_in_a_fleet_the_loads_ahead_count_in_the_wake(tmp_path, monkeypatch):
    """One load at a time: a wake waits for the fleet's other loads. While b loads (its wakes
    measured at 4.5 s here, each within wake_timeout 5), a's wake (3 s) is predicted at 3 s plus
    what is left of b's, more than 5: refused at once, naming the fleet; a's load is queued."""
    from tests.conftest import fake_fleet

    monkeypatch.setenv("FAKE_LOAD_SECONDS", "1.5")
    files = {}
    for name in ("a", "b"):
        files[name] = tmp_path / f"{name}.gguf"
        files[name].write_bytes(name.encode() * FILE_BYTES)
    state = tmp_path / "state"
    measured_history(state, model="a", seconds=3.0)
    samples = json.loads((state / "wake_history.json").read_text())["samples"]
    samples += [{**samples[0], "model": "b", "seconds": 4.5} for _ in range(4)]
    (state / "wake_history.json").write_text(json.dumps({"version": 1, "samples": samples}))
    async with fake_fleet(models={"a": {}, "b": {}}, state_dir=state, wake_timeout=5) as (fleet, client):
        a, b = fleet.models["a"].controller, fleet.models["b"].controller
        a.model_path, b.model_path = str(files["a"]), str(files["b"])
        await until(a, S.READY)
        assert (await client.post("/sleep", json={"model": "a"})).status == 200
        await until(a, S.SLEEPING)
        assert a.predict_wake().basis == "measured" and 2.5 < a.predict_wake().seconds < 3.5
        assert fleet.admission_wait("a") == 0  # nothing loading
        b_request = asyncio.create_task(client.post("/v1/completions", json={**BODY, "model": "b"}))
        await until(b, S.WAKING)
        for _ in range(500):
            if fleet.models["b"].admitted:
                break
            await asyncio.sleep(0.01)
        assert fleet.admission_wait("b") == 0  # its own load is under way
        assert fleet.admission_wait("a") > 2  # what is left of b's 4.5 s
        refused = await client.post("/v1/completions", json={**BODY, "model": "a"})
        assert refused.status == 503
        message = (await refused.json())["error"]["message"]
        assert "fleet's other loads" in message and "wake_timeout" in message
        assert (await b_request).status == 200
        await until(a, S.READY)  # the refusal started a's wake, after b's

"""The sleep tiers, the cold-start headers and the early refusal, on the fake worker
(tests/fakes/fake_worker.py speaks Doze/Rouse as the real worker does)."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

import pytest

from statemachine import ServerState as S
from tests.conftest import fake_fleet

pytestmark = pytest.mark.timeout(120)
BODY = {"prompt": "hi", "max_tokens": 2}


@asynccontextmanager
async def tier_daemon(**overrides):
    """fake_daemon, with daemon/http/cold_start.py wired as app.py is asked to wire it
    (unless it already is): the max-wait middleware and the cold-start headers."""
    from aiohttp import web

    from daemon.http import cold_start

    original = web.Application.__init__

    def wired(self, *args, middlewares=(), **kwargs):
        middlewares = list(middlewares)
        if cold_start.max_wait_header not in middlewares:
            middlewares.append(cold_start.max_wait_header)
        original(self, *args, middlewares=middlewares, **kwargs)
        if cold_start.cold_start_headers not in self.on_response_prepare:
            self.on_response_prepare.append(cold_start.cold_start_headers)

    web.Application.__init__ = wired
    try:
        async with fake_fleet(**overrides) as (fleet, client):
            web.Application.__init__ = original
            yield fleet.default_model.controller, client
    finally:
        web.Application.__init__ = original


async def until(controller, *states, timeout=20):
    assert await controller.wait_for(lambda s: s in states, timeout), f"still {controller.state}"


async def test_drowsy_after_idle_then_a_request_rouses_without_a_new_load(tmp_path, monkeypatch):
    loads, dozes = tmp_path / "loads", tmp_path / "dozes"
    monkeypatch.setenv("FAKE_LOAD_COUNTER", str(loads))
    monkeypatch.setenv("FAKE_DOZE_COUNTER", str(dozes))
    async with tier_daemon(drowsy_after=0.1, state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        assert (await client.post("/v1/completions", json=BODY)).status == 200
        await until(controller, S.DROWSY)
        props = await (await client.get("/props")).json()
        assert props["tier"] == "drowsy" and props["last_doze"]["phases"][-1]["name"] == "context"
        assert props["wake_prediction"]["tier"] == "drowsy"
        assert (await (await client.get("/health")).json())["tier"] == "drowsy"
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["tier"] == "drowsy" and models["data"][0]["status"] == "loaded"
        response = await client.post("/v1/completions", json=BODY)
        assert response.status == 200 and response.headers["X-Dormouse-Cold-Start"] == "true"
        assert float(response.headers["X-Dormouse-Wake-Seconds"]) >= 0
        assert controller.last_wake["tier"] == "drowsy"
        assert len(loads.read_text().split()) == 1 and len(dozes.read_text().split()) >= 1  # one load, a rouse
        metrics = await (await client.get("/metrics")).text()
        assert 'dormouse_sleep_tier{model="fake",tier="awake"} 1.0' in metrics


async def test_light_then_deep_with_the_keeper_on_real_files(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * (1 << 20))
    async with tier_daemon(sleep_idle_seconds=0.1, deep_after=0.6, state_dir=tmp_path / "state") as (controller, client):
        controller.model_path = str(gguf)  # the keeper maps the model's files; the fake's path is made up
        await until(controller, S.READY)
        await until(controller, S.LIGHT_SLEEP)
        props = await (await client.get("/props")).json()
        assert props["tier"] == "light" and props["keeper"]["bytes"] == 1 << 20
        assert props["wake_prediction"] == {**props["wake_prediction"], "tier": "light", "cold_bytes": 0}
        metrics = await (await client.get("/metrics")).text()
        assert 'dormouse_keeper_bytes{kind="mapped",model="fake"} 1.048576e+06' in metrics
        await until(controller, S.SLEEPING)
        assert controller.keeper is None and (await (await client.get("/props")).json())["tier"] == "deep"


async def test_a_request_while_light_wakes_it_and_the_keeper_goes(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\1" * 4096)
    async with tier_daemon(deep_after=-1, state_dir=tmp_path / "state") as (controller, client):
        controller.model_path = str(gguf)
        await until(controller, S.READY)
        answer = await (await client.post("/sleep", json={"tier": "light"})).json()
        assert answer["state"] == "light_sleep" and answer["tier"] == "light"
        response = await client.post("/v1/completions", json=BODY)
        assert response.status == 200 and response.headers["X-Dormouse-Cold-Start"] == "true"
        assert controller.keeper is None and controller.last_wake["tier"] == "light"
        assert controller.last_wake["bytes"] == 4096 and controller.last_wake["predicted"]["tier"] == "light"
        warm = await client.post("/v1/completions", json=BODY)
        assert warm.headers["X-Dormouse-Cold-Start"] == "false" and "X-Dormouse-Wake-Seconds" not in warm.headers


async def test_post_sleep_walks_down_the_tiers(tmp_path):
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        assert (await (await client.post("/sleep?tier=drowsy")).json())["state"] == "drowsy"
        assert (await (await client.post("/sleep", json={"tier": "deep"})).json())["state"] == "sleeping"
        assert (await client.post("/wake")).status == 200
        assert controller.state is S.READY


@pytest.mark.parametrize("query, body", [("?tier=dreamy", None), ("?tier=", None), (None, {"tier": 3}),
                                         (None, {"tier": ["deep"]}), (None, {"tier": "x" * 100_000}),
                                         (None, {"tier": {"a": {"b": {}}}})])
async def test_a_bad_tier_is_a_400_naming_it(tmp_path, query, body):
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        response = await client.post("/sleep" + (query or ""), json=body)
        assert response.status == 400
        error = (await response.json())["error"]
        assert error["param"] == "tier" and "tier" in error["message"]
        assert controller.state is S.READY


async def test_a_wake_that_cannot_fit_the_clients_wait_is_refused_at_once_and_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "1.0")
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep")
        started = time.monotonic()
        response = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": "0"})
        refused_after = time.monotonic() - started
        assert response.status == 503 and int(response.headers["Retry-After"]) >= 1
        error = (await response.json())["error"]
        assert error["code"] == "wake_too_slow" and "X-Dormouse-Max-Wait" in error["message"]
        assert response.headers["X-Dormouse-Cold-Start"] == "false"  # it did not wait
        assert refused_after < 1.0  # well before the load (1 s) could have answered it
        await until(controller, S.READY)  # the refusal started the wake: a retry finds it awake
        ok = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": "0"})
        assert ok.status == 200 and ok.headers["X-Dormouse-Cold-Start"] == "false"
        assert 'dormouse_wake_refusals_total{model="fake"} 1.0' in await (await client.get("/metrics")).text()


async def test_a_wait_that_fits_is_served_and_without_the_header_a_default_guess_refuses_nothing(tmp_path):
    async with tier_daemon(state_dir=tmp_path / "state", wake_timeout=0.01) as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep")
        # wake_timeout is shorter than the default prediction, but no wake was measured here
        # (the fake's file does not exist): the request waits and times out as before.
        response = await client.post("/v1/completions", json=BODY)
        assert (await response.json())["error"]["code"] in ("wake_timeout",)
    async with tier_daemon(state_dir=tmp_path / "state2") as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep")
        response = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": "60"})
        assert response.status == 200 and response.headers["X-Dormouse-Cold-Start"] == "true"


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1e309", "1" * 100, "86401", ""])
async def test_a_bad_max_wait_header_is_a_400_in_the_dialects_shape(tmp_path, value):
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        response = await client.post("/v1/completions", json=BODY, headers={"X-Dormouse-Max-Wait": value})
        assert response.status == 400
        assert (await response.json())["error"]["param"] == "X-Dormouse-Max-Wait"
        anthropic = await client.post("/v1/messages", json={}, headers={"X-Dormouse-Max-Wait": value})
        assert anthropic.status == 400 and (await anthropic.json())["type"] == "error"


async def test_a_rouse_that_fails_fails_the_waiting_request_clearly(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_ROUSE_ERROR", "cannot create context: out of memory")
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep", json={"tier": "drowsy"})
        response = await client.post("/v1/completions", json=BODY)
        assert response.status == 503 and "out of memory" in (await response.json())["error"]["message"]
        assert controller.state is S.FAILED


async def test_a_killed_drowsy_worker_leaves_the_model_asleep_and_the_next_request_loads(tmp_path):
    async with tier_daemon(state_dir=tmp_path / "state") as (controller, client):
        await until(controller, S.READY)
        await client.post("/sleep", json={"tier": "drowsy"})
        controller.supervisor.current.proc.kill()
        await until(controller, S.SLEEPING)
        assert (await client.post("/v1/completions", json=BODY)).status == 200


async def test_cycles_of_every_tier_leave_no_task_or_keeper_behind(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\2" * 8192)
    async with tier_daemon(deep_after=-1, state_dir=tmp_path / "state") as (controller, client):
        controller.model_path = str(gguf)
        await until(controller, S.READY)
        for tier in ("drowsy", "light", "deep") * 3:
            assert (await client.post("/sleep", json={"tier": tier})).status == 200
            assert (await client.post("/v1/completions", json=BODY)).status == 200
            names = [t.get_name() for t in asyncio.all_tasks()]
            assert len(names) == len(set(names)), names  # one watch per worker, however often it rouses
            assert not any(name.startswith("keeper-") for name in names)
        assert controller.keeper is None


async def test_the_agent_and_the_metrics_say_the_tier(tmp_path):
    """HAProxy's agent tags a drowsy or light model's answer with its tier (per model, and for a
    plain check that names none); the predicted wake's gauge is read again at each scrape."""
    from daemon.http.agent import SERVE, WAKE, WARM, Agent, Question, snapshot_of

    class Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\3" * 8192)
    async with tier_daemon(deep_after=-1, state_dir=tmp_path / "state") as (controller, client):
        controller.model_path = str(gguf)
        agent = Agent(lambda: snapshot_of([controller]), Quiet())
        await until(controller, S.READY)
        assert agent.reply(Question(SERVE, "fake")) == "up 100%\n"
        await client.post("/sleep", json={"tier": "drowsy"})
        assert agent.reply(Question(WARM, "fake")) == "up 100% #drowsy\n"  # a rouse is preferred to a load
        assert agent.reply(Question(WARM, None)) == "up 100% #drowsy\n"
        await client.post("/sleep", json={"tier": "light"})
        assert agent.reply(Question(WAKE, "fake")) == "up 100% #light\n"
        assert agent.reply(Question(SERVE, None)) == "up 0% #light\n"
        metrics = await (await client.get("/metrics")).text()
        assert 'dormouse_sleep_tier{model="fake",tier="light"} 1.0' in metrics
        predicted = next(line for line in metrics.splitlines() if line.startswith("dormouse_wake_predicted_seconds{"))
        assert float(predicted.split()[-1]) > 0
        await client.post("/sleep", json={"tier": "deep"})
        assert agent.reply(Question(WAKE, "fake")) == "up 100% #deep\n"
        assert (await client.post("/v1/completions", json=BODY)).status == 200
        metrics = await (await client.get("/metrics")).text()
        assert 'dormouse_wake_predicted_seconds{model="fake"} 0.0' in metrics

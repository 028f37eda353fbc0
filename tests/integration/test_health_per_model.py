"""/health and a fleet (issue 27, item 6): the replica is ready while any
model can serve, so a broken default model does not take the others out of a
Kubernetes Service or a balancer; `/health?model=ID` answers for one model
(probes and balancers that route by model)."""

from __future__ import annotations

import asyncio

from statemachine import ServerState
from tests.conftest import fake_fleet

BROKEN = {"worker_module": "tests.fixtures.broken_model_worker"}


async def failed(controller, tries: int = 400) -> None:
    for _ in range(tries):  # bounded by count: the load fails at once
        if controller.state is ServerState.FAILED:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"still {controller.state}")


async def test_a_broken_default_model_leaves_the_replica_ready_for_the_others():
    async with fake_fleet({"broken": BROKEN, "chat": {}}) as (fleet, client):
        await failed(fleet.models["broken"].controller)
        response = await client.get("/health")
        body = await response.json()
        assert response.status == 200, body
        assert body["status"] == "ok" and body["state"] == "failed"  # the default's state, as before
        assert "not a GGUF file" in body["error"] and body["models"]["chat"] != "failed"
        # The other model serves.
        answer = await client.post("/v1/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2})
        assert answer.status == 200, await answer.text()


async def test_health_for_one_model():
    async with fake_fleet({"broken": BROKEN, "chat": {"aliases": ["gpt-4o-mini"]}}) as (fleet, client):
        await failed(fleet.models["broken"].controller)
        response = await client.get("/health", params={"model": "broken"})
        body = await response.json()
        assert response.status == 503 and body["status"] == "unavailable" and body["model"] == "broken"
        assert body["state"] == "failed" and "not a GGUF file" in body["error"]
        for name in ("chat", "gpt-4o-mini"):
            response = await client.get("/health", params={"model": name})
            body = await response.json()
            assert response.status == 200 and body["model"] == "chat" and body["status"] == "ok", body
        response = await client.get("/v1/health", params={"model": "chat"})  # llama-server's alias too
        assert response.status == 200
        response = await client.get("/health", params={"model": "nope"})
        assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
        assert fleet.models["chat"].controller.state is ServerState.SLEEPING  # a probe never wakes a model


async def test_every_model_broken_is_503_and_the_metrics_key_guards_the_model_probe():
    async with fake_fleet({"broken": BROKEN}, metrics_key="m1") as (fleet, client):
        await failed(fleet.models["broken"].controller)
        assert (await client.get("/health", params={"model": "broken"})).status == 401
        headers = {"Authorization": "Bearer m1"}
        assert (await client.get("/health", headers=headers)).status == 503
        assert (await client.get("/health", params={"model": "broken"}, headers=headers)).status == 503

"""llama-server's router options on the fleet, over HTTP on fake workers: models_max (--models-max)
puts the least recently used idle model to sleep for another, and never one under its requests;
models_autoload = false (--no-models-autoload) refuses a model that is not loaded until
POST /models/load, while one that fell asleep when idle still wakes; /props says both; a router,
even of one model, answers only its models' names."""

from __future__ import annotations

import asyncio

from statemachine import ServerState
from tests.conftest import fake_fleet
from tests.integration.test_fleet_http import until

GiB = 2**30
TWO = {"a": {}, "b": {}}


async def complete(client, model, **body):
    return await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "model": model, **body})


def state(fleet, model_id):
    return fleet.models[model_id].controller.state


async def test_models_max_puts_the_other_model_to_sleep_though_the_memory_would_fit():
    async with fake_fleet(TWO, memory_budget=100 * GiB, models_max=1) as (fleet, client):
        props = await (await client.get("/props")).json()
        assert props["role"] == "router" and props["max_instances"] == 1 and props["models_autoload"] is True
        assert props["build_info"].startswith("b0.")  # llama-server's "b<build>": the bindings' version first
        for model_id, other in (("a", "b"), ("b", "a"), ("a", "b")):
            response = await complete(client, model_id)
            assert response.status == 200, await response.text()
            assert state(fleet, model_id) is ServerState.READY
            await until(lambda: state(fleet, other) is ServerState.SLEEPING)


async def test_models_max_waits_for_a_busy_model_rather_than_evict_it():
    async with fake_fleet(TWO, memory_budget=100 * GiB, models_max=1) as (fleet, client):
        assert (await complete(client, "a")).status == 200
        # A long answer keeps "a" busy; "b" must wait for it, and "a" finishes whole.
        busy = asyncio.create_task(complete(client, "a", max_tokens=60))
        await until(lambda: fleet.models["a"].controller.machine.in_flight)
        waiting = asyncio.create_task(complete(client, "b"))
        first = await busy
        assert first.status == 200 and (await first.json())["usage"]["completion_tokens"] == 60
        second = await waiting
        assert second.status == 200, await second.text()
        assert state(fleet, "a") in (ServerState.SLEEPING, ServerState.UNLOADING)


async def test_without_autoload_a_model_is_served_only_once_loaded():
    async with fake_fleet(TWO, memory_budget=100 * GiB, models_autoload=False,
                          sleep_idle_seconds=0.5) as (fleet, client):
        await until(lambda: state(fleet, "a") is ServerState.READY)  # the default model loads at start
        assert (await complete(client, "a")).status == 200
        refused = await complete(client, "b")
        assert refused.status == 400
        error = (await refused.json())["error"]
        assert error["code"] == "model_not_loaded" and "POST /models/load" in error["message"]
        assert state(fleet, "b") is not ServerState.READY  # the refusal woke nothing
        loaded = await client.post("/models/load", json={"model": "b"})
        assert loaded.status == 200 and (await loaded.json())["success"] is True
        assert (await complete(client, "b")).status == 200
        unloaded = await client.post("/models/unload", json={"model": "b"})
        assert unloaded.status == 200
        assert (await complete(client, "b")).status == 400  # unloaded by the operator: refused again
        # Asleep by its idle timer, "a" is still loaded in the router's sense: a request wakes it.
        await until(lambda: state(fleet, "a") is ServerState.SLEEPING)
        assert (await complete(client, "a")).status == 200
        # Unloaded by the operator after its idle timer put it to sleep: refused, as any unloaded model.
        await until(lambda: state(fleet, "a") is ServerState.SLEEPING)
        assert (await client.post("/models/unload", json={"model": "a"})).status == 200
        assert (await complete(client, "a")).status == 400
        assert (await (await client.get("/props")).json())["models_autoload"] is False


async def test_one_model_with_router_options_says_router_and_without_them_model():
    """llama-server's test_router_props: `--models-max 2 --no-models-autoload` is a router, even of one model."""
    async with fake_fleet(models_max=2, models_autoload=False) as (_, client):
        props = await (await client.get("/props")).json()
        assert (props["role"], props["max_instances"], props["models_autoload"]) == ("router", 2, False)
    async with fake_fleet() as (_, client):
        assert (await (await client.get("/props")).json())["role"] == "model"


async def test_a_router_of_one_model_answers_only_its_names_and_a_single_model_daemon_any():
    """llama-server's test_router_chat_completion_stream: its router answers an unknown model 404, while a
    single-model server answers whatever a client names (clients send "gpt-4o"); the HAProxy agent agrees."""
    from daemon.http.agent import snapshot_of

    async with fake_fleet(models_max=1) as (fleet, client):
        assert not fleet.any_name
        unknown = await complete(client, "non-existent/model", stream=True)
        assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "model_not_found"
        assert (await complete(client, "fake")).status == 200
        replica = snapshot_of(fleet.controllers, fleet.any_name)
        assert replica.model("non-existent/model") is None and replica.model("fake") is not None
    async with fake_fleet() as (fleet, client):
        assert fleet.any_name
        assert (await complete(client, "gpt-4o")).status == 200
        assert snapshot_of(fleet.controllers, fleet.any_name).model("gpt-4o") is not None



async def test_router_options_beside_a_named_model_keep_it_answering_any_name(tmp_path):
    """llama-server is a router only without -m or -hf: `-m x.gguf --models-max 2` serves that model under
    any name; a models_dir makes a router whatever else is set."""
    from daemon.fleet.plans import configured_as_router
    from config import Settings

    async with fake_fleet(model="/models/fake.gguf", models_max=2, models_autoload=False) as (fleet, client):
        assert fleet.any_name and (await (await client.get("/props")).json())["role"] == "model"
        assert (await complete(client, "gpt-4o")).status == 200
    assert not configured_as_router(Settings(hf_repo="org/repo", models_max=1), 1)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    assert configured_as_router(Settings(model="/m/x.gguf", models_dir=str(tmp_path)), 1)
    assert configured_as_router(Settings(models_autoload=False), 1)
    assert configured_as_router(Settings(models={"a": {"path": "/m/a.gguf"}}, models_max=1), 1)
    assert not configured_as_router(Settings(models={"a": {"path": "/m/a.gguf"}}), 1)

"""The fleet over HTTP, on fake workers: routing by model name, /v1/models
with statuses, the router's /models/load and /models/unload, per-model
admin calls, refusals with their codes, per-model metrics, hostile input."""

from __future__ import annotations

import asyncio

import pytest

from statemachine import ServerState
from tests.conftest import fake_fleet
from tests.metrics_text import samples, value

GiB = 2**30
THREE = {"chat": {"aliases": ["gpt-4o-mini"]}, "coder": {"ctx_size": 2048}, "tiny": {"parallel": 2}}


async def until(predicate, timeout=10):
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def complete(client, model=None, **body):
    body = {"prompt": "hi", "max_tokens": 3, **body}
    if model is not None:
        body["model"] = model
    return await client.post("/v1/completions", json=body)


def statuses(listing: dict) -> dict[str, str]:
    return {m["id"]: m["status"] for m in listing["data"]}


async def test_models_are_listed_with_their_status_and_listing_wakes_nothing():
    tagged = {**THREE, "chat": {**THREE["chat"], "tags": ["fast", "small"]}}
    async with fake_fleet(tagged, memory_budget=100 * GiB, tags=["local"]) as (fleet, client):
        await until(lambda: fleet.models["chat"].controller.state is ServerState.READY)
        listing = await (await client.get("/v1/models")).json()
        assert statuses(listing) == {"chat": "loaded", "coder": "sleeping", "tiny": "sleeping"}
        chat = next(m for m in listing["data"] if m["id"] == "chat")
        assert chat["aliases"] == ["gpt-4o-mini"] and chat["default"] is True
        # tags: a table's replace the top level's; /models (llama-server's spelling) is the same list
        assert {m["id"]: m["tags"] for m in listing["data"]} == {"chat": ["fast", "small"], "coder": ["local"],
                                                                   "tiny": ["local"]}
        assert (await (await client.get("/models")).json())["data"] == listing["data"]
        assert statuses(await (await client.get("/v1/models")).json())["coder"] == "sleeping"


async def test_requests_route_by_id_alias_or_default_and_unknown_is_404():
    async with fake_fleet(THREE, memory_budget=100 * GiB) as (fleet, client):
        for name, model_id in (("coder", "coder"), ("gpt-4o-mini", "chat"), (None, "chat"), ("tiny", "tiny")):
            response = await complete(client, name)
            assert response.status == 200, await response.text()
            assert (await response.json())["model"] == model_id
        missing = await complete(client, "gpt-5")
        assert missing.status == 404
        error = (await missing.json())["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "chat, coder, tiny" in error["message"]
        assert (await complete(client, 42)).status == 400  # a model name is a string


async def test_router_load_and_unload_and_per_model_admin_calls():
    async with fake_fleet(THREE, memory_budget=100 * GiB) as (fleet, client):
        loaded = await client.post("/models/load", json={"model": "coder"})
        assert loaded.status == 200 and (await loaded.json())["state"] == "ready"
        assert fleet.models["coder"].controller.last_wake["reason"] == "admin"
        props = await (await client.get("/props", params={"model": "coder"})).json()
        assert props["id"] == "coder" and props["n_ctx"] == 2048 and props["state"] == "ready"
        assert {m["id"] for m in props["fleet"]["models"]} == {"chat", "coder", "tiny"}
        slots = await (await client.get("/slots", params={"model": "tiny"})).json()
        assert len(slots) == 2
        unloaded = await client.post("/models/unload", json={"model": "coder"})
        assert unloaded.status == 200 and (await unloaded.json())["state"] == "sleeping"
        woken = await client.post("/wake?model=tiny")
        assert woken.status == 200
        # /sleep without a model puts every idle model to sleep.
        slept = await client.post("/sleep")
        body = await slept.json()
        assert slept.status == 200 and body["ok"] and set(body["models"]) == {"chat", "coder", "tiny"}
        assert {m.controller.state for m in fleet.models.values()} == {ServerState.SLEEPING}


@pytest.mark.parametrize("path", ["/models/load", "/models/unload"])
async def test_router_calls_refuse_bad_input_by_name(path):
    async with fake_fleet(THREE, memory_budget=100 * GiB) as (fleet, client):
        cases = [
            (dict(json={}), 400, "invalid_value"),
            (dict(json={"model": 7}), 400, "invalid_value"),
            (dict(json={"model": "x" * 100_000}), 404, "model_not_found"),
            (dict(json=[1, 2]), 400, "invalid_json"),
            (dict(data=b"{not json", headers={"Content-Type": "application/json"}), 400, "invalid_json"),
            (dict(data=b'{"model": "chat"}', headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
        ]
        for kwargs, status, code in cases:
            response = await client.post(path, **kwargs)
            assert response.status == status, (kwargs, await response.text())
            assert (await response.json())["error"]["code"] == code
        assert (await client.get("/props", params={"model": "nope"})).status == 404


async def test_over_http_a_model_that_never_fits_is_refused_and_a_full_budget_says_retry_after(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.05")
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(4 * GiB - 100))
    sizes = {"chat": 4 * GiB, "coder": 4 * GiB, "tiny": 4 * GiB}
    async with fake_fleet(THREE, sizes=sizes, memory_budget=9 * GiB, wake_timeout=0.5) as (fleet, client):
        await until(lambda: fleet.models["chat"].controller.state is ServerState.READY)
        assert (await complete(client, "coder")).status == 200
        busy = [asyncio.create_task(complete(client, m, max_tokens=60)) for m in ("chat", "coder")]
        await until(lambda: all(fleet.models[m].controller.machine.in_flight for m in ("chat", "coder")))
        refused = await complete(client, "tiny")
        assert refused.status == 503 and refused.headers["Retry-After"]
        assert (await refused.json())["error"]["code"] == "insufficient_memory"
        load = await client.post("/models/load", json={"model": "tiny"})
        assert load.status == 503 and (await load.json())["error"]["code"] == "insufficient_memory"
        assert [r.status for r in await asyncio.gather(*busy)] == [200, 200]
    async with fake_fleet({"a": {}, "huge": {}}, sizes={"a": GiB, "huge": 20 * GiB}, memory_budget=10 * GiB) as (
            fleet, client):
        refused = await complete(client, "huge")
        assert refused.status == 503
        error = (await refused.json())["error"]
        assert error["code"] == "model_too_large" and "20480 MiB" in error["message"]


async def test_metrics_carry_the_model_and_the_fleet():
    async with fake_fleet(THREE, memory_budget=100 * GiB) as (fleet, client):
        await complete(client, "coder")
        text = await (await client.get("/metrics")).text()
        assert value(text, "dormouse_state", model="coder", state="ready") == 1
        assert value(text, "dormouse_state", model="tiny", state="sleeping") == 1
        assert value(text, "dormouse_requests_total", model="coder", endpoint="completions", status="200") == 1
        assert value(text, "dormouse_fleet_memory_budget_bytes") == 100 * GiB
        assert value(text, "dormouse_fleet_loads_in_progress_max") == 1
        assert samples(text, "dormouse_model_footprint_bytes", model="coder", source="measured")
        health = await (await client.get("/health")).json()
        assert health["state"] == "ready" and health["models"]["coder"] == "loaded"
        assert health["tiers"]["coder"] is None and health["tiers"]["tiny"] == "deep"


async def test_router_names_with_slashes_route_load_and_keep_their_own_directories(tmp_path):
    """llama-server's router names models owner/name:QUANT; such an id is one directory name of its own."""
    models = {"ggml-org/gemma:Q8_0": {}, "ggml-org/gemma:Q4_0": {"aliases": ["unsloth/gemma"]}, "ggml-org": {}}
    async with fake_fleet(models, memory_budget=100 * GiB, state_dir=tmp_path) as (fleet, client):
        for name, model_id in (("ggml-org/gemma:Q8_0", "ggml-org/gemma:Q8_0"), ("unsloth/gemma", "ggml-org/gemma:Q4_0"),
                               ("ggml-org", "ggml-org")):
            response = await complete(client, name)
            assert response.status == 200 and (await response.json())["model"] == model_id, await response.text()
        one = await client.get("/v1/models/ggml-org/gemma:Q4_0")
        assert one.status == 200 and (await one.json())["id"] == "ggml-org/gemma:Q4_0"
        assert (await client.get("/v1/models/ggml-org/gemma")).status == 404
        unloaded = await client.post("/models/unload", json={"model": "ggml-org/gemma:Q8_0"})
        assert unloaded.status == 200 and (await unloaded.json())["state"] == "sleeping"
        assert (await client.get("/health", params={"model": "ggml-org/gemma:Q4_0"})).status == 200
        dirs = {m.id: m.controller.kv_dir for m in fleet.models.values()}
        assert dirs["ggml-org/gemma:Q8_0"] == tmp_path / "kv" / "ggml-org%2Fgemma:Q8_0"
        assert len({d.parent for d in dirs.values()}) == 1  # none inside another's ("ggml-org"'s)

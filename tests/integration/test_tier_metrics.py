"""What /metrics says in each sleep tier, through a real controller on the fake worker:
dormouse_state and dormouse_sleep_tier (awake only while ready; waking counts in the tier
it wakes from), and vLLM's engine_sleep_state (drowsy and light: weights_offloaded, vLLM's
level 1; deep: discard_all, level 2)."""

from __future__ import annotations

import asyncio

import pytest

from statemachine import ServerState as S
from tests.integration.test_sleep_tiers import tier_daemon, until
from tests.metrics_text import value

pytestmark = pytest.mark.timeout(120)
BODY = {"prompt": "hi", "max_tokens": 2}
TIERS = ("awake", "drowsy", "light", "deep")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


async def scrape(client) -> str:
    return await (await client.get("/metrics")).text()


def ones(text: str) -> tuple[str, list[str], list[str]]:
    state = [s for s in ("ready", "drowsy", "light_sleep", "sleeping", "waking")
             if value(text, "dormouse_state", model="fake", state=s) == 1]
    tiers = [t for t in TIERS if value(text, "dormouse_sleep_tier", model="fake", tier=t) == 1]
    vllm = [s for s in SLEEP_STATES if value(text, "vllm:engine_sleep_state", model_name="fake", sleep_state=s) == 1]
    return state[0] if state else "", tiers, vllm


async def test_each_tier_is_said_by_dormouses_gauges_and_vllms(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "1.0")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\x08" * 8192)
    async with tier_daemon(deep_after=-1, state_dir=tmp_path / "state", metrics_compat=["vllm"]) \
            as (controller, client):
        controller.model_path = str(gguf)
        await until(controller, S.READY)
        assert ones(await scrape(client)) == ("ready", ["awake"], ["awake"])
        await client.post("/sleep", json={"tier": "drowsy"})
        assert ones(await scrape(client)) == ("drowsy", ["drowsy"], ["weights_offloaded"])
        await client.post("/sleep", json={"tier": "light"})
        await until(controller, S.LIGHT_SLEEP)
        assert ones(await scrape(client)) == ("light_sleep", ["light"], ["weights_offloaded"])
        waking = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await until(controller, S.WAKING)
        assert ones(await scrape(client)) == ("waking", ["light"], ["weights_offloaded"])
        assert (await waking).status == 200
        await client.post("/sleep", json={"tier": "deep"})
        await until(controller, S.SLEEPING)
        assert ones(await scrape(client)) == ("sleeping", ["deep"], ["discard_all"])
        waking = asyncio.create_task(client.post("/v1/completions", json=BODY))
        await until(controller, S.WAKING)
        assert ones(await scrape(client)) == ("waking", ["deep"], ["discard_all"])
        assert (await waking).status == 200
        assert ones(await scrape(client)) == ("ready", ["awake"], ["awake"])

"""A model put to sleep for another, and asked for again while it is still
going to sleep, must not hold up the model it made room for.

Found by tests/reliability/test_fleet_reliability.py: with room for one of
two models, a request for b evicts a; a request for a arrives during a's
teardown, so a goes from unloading straight to waking (no stop in sleeping)
and queues for admission behind b. The planner must then see a as holding
nothing: its worker is gone. If a still counts as admitted, b waits for "a
is loading" while a waits for b's turn, until b's wake_timeout (503).
Fake workers: real processes and protocol, no llama.cpp.
"""

from __future__ import annotations

import asyncio

from statemachine import ServerState
from tests.conftest import fake_fleet

GiB = 2**30


async def until(predicate, timeout=10):
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_a_model_asked_for_while_it_is_evicted_does_not_block_the_load_it_made_room_for(monkeypatch):
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(6 * GiB // 10 - 100))  # measured = predicted: one fits, not two
    monkeypatch.setenv("FAKE_TEARDOWN_SECONDS", "0.5")  # a window to ask for a while it goes to sleep
    sizes = {"a": 6 * GiB // 10, "b": 6 * GiB // 10}
    async with fake_fleet({"a": {}, "b": {}}, sizes=sizes, memory_budget=GiB, wake_timeout=5) as (fleet, client):
        a = fleet.models["a"].controller
        await until(lambda: a.state is ServerState.READY)
        for_b = asyncio.create_task(client.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 2}))
        await until(lambda: a.state is ServerState.UNLOADING)  # evicted for b
        for_a = asyncio.create_task(client.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 2}))
        responses = await asyncio.wait_for(asyncio.gather(for_b, for_a), 30)
        answers = [(r.status, (await r.json()).get("error", {}).get("message")) for r in responses]
        assert answers == [(200, None), (200, None)]
        # Each was loaded once for its request: b after a's eviction, a after b's.
        assert fleet.metrics.loads_in_progress_max._value.get() == 1

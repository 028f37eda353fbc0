"""Issue 16, section 4: no model starves, no load blocks the queue.

On fake workers (real processes and protocol, no llama.cpp), in this process:
- a model its clients never leave idle is drained (its new requests held,
  bounded in number and in time) so that the model waiting for its memory
  loads, and the held requests then wake it again, none lost;
- a load that can never fit beside pinned, never-sleeping models is refused at
  once, naming them and their sizes, and the loads behind it go on;
- "last used" is when a request ended, not when it arrived;
- the fleet keeps nothing of an admission once it is answered.

Every wait is bounded; no test asserts how long anything took, only what
happened and in which order.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections import deque

from daemon import protocol as p
from daemon.model.controller import Controller
from daemon.model.jobs import JobFailure
from statemachine import ServerState
from tests.conftest import fake_fleet
from tests.integration.test_fleet_rewake import until

GiB = 2**30
ONE_OF_TWO = 6 * GiB // 10  # two of these do not fit in 1 GiB
WAKE_LIMIT = 30  # how long these tests' own clients wait for a first token (the daemon's bounds are lower)




async def run(controller: Controller, max_tokens: int = 3, started: asyncio.Event | None = None):
    """One completion through the controller: its Done or its failure ("timed out"
    if no first item came within WAKE_LIMIT). `started` is set at its first item."""
    job = controller.new_job("completions", p.SamplingParams(max_tokens=max_tokens), prompt="hi")
    try:
        item = await job.next(WAKE_LIMIT)
        if started is not None:
            started.set()
        while isinstance(item, p.Tokens):
            item = await job.next(WAKE_LIMIT)
        return item
    except TimeoutError:
        return "timed out"
    finally:
        if started is not None:
            started.set()
        controller.abandon(job)


async def complete(client, model: str, **body):
    return await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 3, **body})


def counter(metric, **labels) -> float:
    return metric.labels(**labels)._value.get()


def one_of_two(monkeypatch):
    """Fake workers that measure what was predicted: room for one of two models."""
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(ONE_OF_TWO - 100))
    return {"a": ONE_OF_TWO, "b": ONE_OF_TWO}


async def test_a_model_its_clients_never_leave_idle_is_drained_so_that_the_other_model_loads(monkeypatch):
    """Room for one of two models. a's clients overlap: each next request is sent
    while the one before still runs, so a is never idle and was never evicted
    (b got 503 insufficient_memory until a's clients stopped). Now b's load holds
    a's new requests, a finishes what it runs and is put to sleep, b loads and
    answers, and the held requests wake a again: every request is answered."""
    sizes = one_of_two(monkeypatch)
    async with fake_fleet({"a": {}, "b": {}}, sizes=sizes, memory_budget=GiB, wake_timeout=5) as (fleet, client):
        a, b = fleet.models["a"].controller, fleet.models["b"].controller
        await until(lambda: a.state is ServerState.READY)
        b_answered = asyncio.Event()

        async def overlapping_clients():
            """Requests for a, each sent once the one before has its first token,
            until three more were sent after b's answer (at most 500)."""
            runs, after_b = [], 0
            while after_b < 3 and len(runs) < 500:
                started = asyncio.Event()
                runs.append(asyncio.create_task(run(a, max_tokens=10, started=started)))
                await started.wait()  # set however the run ends
                after_b += b_answered.is_set()
            return await asyncio.gather(*runs)

        clients = asyncio.create_task(overlapping_clients())
        await until(lambda: len(a.machine.in_flight) >= 2)  # two of a's requests overlap
        answer_b = await run(b)
        b_answered.set()
        answers_a = await clients

        assert isinstance(answer_b, p.Done) and answer_b.finish_reason == "length", answer_b
        assert all(isinstance(x, p.Done) and x.finish_reason == "length" for x in answers_a), \
            [x for x in answers_a if not isinstance(x, p.Done) or x.finish_reason != "length"]
        # a was put to sleep once, idle, for b; b once, for a's held requests, which woke a.
        assert counter(fleet.metrics.evictions, model="a") == 1 and counter(fleet.metrics.evictions, model="b") == 1
        assert counter(fleet.metrics.drains, model="a") == 1
        assert a.state is ServerState.READY and a.last_wake["reason"] == "request"
        assert not a.holding and not a.held


async def test_when_the_waiting_load_gives_up_the_held_requests_are_served(monkeypatch):
    """b's wait is bounded (wake_timeout); when it gives up, a's held requests go
    on to a, which was never put to sleep under its stream."""
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.02")
    sizes = one_of_two(monkeypatch)
    async with fake_fleet({"a": {}, "b": {}}, sizes=sizes, memory_budget=GiB, wake_timeout=0.5) as (fleet, client):
        a, b = fleet.models["a"].controller, fleet.models["b"].controller
        await until(lambda: a.state is ServerState.READY)
        long_stream = asyncio.create_task(run(a, max_tokens=150))  # outlasts b's wait
        await until(lambda: a.machine.in_flight)
        for_b = asyncio.create_task(run(b))
        await until(lambda: a.holding)
        held = asyncio.create_task(run(a))
        await until(lambda: len(a.held) == 1)
        refused = await for_b
        assert isinstance(refused, JobFailure) and refused.status == 503 and refused.code == "insufficient_memory"
        assert refused.retry_after and "waiting for busy a (614 MiB) to finish" in refused.message
        served = await held
        assert isinstance(served, p.Done) and served.finish_reason == "length"
        done = await long_stream
        assert isinstance(done, p.Done) and done.completion_tokens == 150  # never cut by an eviction
        assert counter(fleet.metrics.evictions, model="a") == 0 and not a.holding
        assert b.state is ServerState.SLEEPING


async def test_held_requests_are_bounded_in_number_and_in_time_then_503_with_retry_after(monkeypatch):
    """An operator's load may wait for room as long as a load may take; the
    requests it holds may not: past the model's queue size they are refused at
    once, and each waits at most wake_timeout; both are 503 with Retry-After."""
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.02")
    sizes = one_of_two(monkeypatch)
    async with fake_fleet({"a": {"parallel": 1}, "b": {}}, sizes=sizes, memory_budget=GiB, wake_timeout=1,
                          load_timeout=60, max_queued=1) as (fleet, client):
        a, b = fleet.models["a"].controller, fleet.models["b"].controller
        await until(lambda: a.state is ServerState.READY)
        long_stream = asyncio.create_task(complete(client, "a", max_tokens=150))  # outlasts the held one's wait
        await until(lambda: a.machine.in_flight)
        load_b = asyncio.create_task(client.post("/models/load", json={"model": "b"}))
        await until(lambda: a.holding)
        held = asyncio.create_task(complete(client, "a"))
        await until(lambda: len(a.held) == 1)

        over = await complete(client, "a")  # one in flight and one held fill a's two places
        assert over.status == 503 and over.headers["Retry-After"]
        assert (await over.json())["error"]["code"] == "queue_full"

        timed_out = await held
        error = (await timed_out.json())["error"]
        assert timed_out.status == 503 and timed_out.headers["Retry-After"], error
        assert error["code"] == "insufficient_memory" and "held until b is loaded" in error["message"]

        assert (await long_stream).status == 200  # the stream in flight runs to its end...
        await load_b
        await until(lambda: b.state is ServerState.READY)  # ... then a makes room and b loads
        assert a.state is ServerState.SLEEPING and counter(fleet.metrics.evictions, model="a") == 1
        assert not a.held


async def test_a_load_that_can_never_fit_beside_a_pinned_never_sleeping_model_is_refused_at_once(monkeypatch):
    """It waited at the head of the queue (up to load_timeout) and every cold
    load behind it failed; now it is refused at once, naming the model in the
    way and its size, and the load behind it goes on."""
    sizes = {"pin": 8 * GiB, "big": 4 * GiB, "small": GiB}
    monkeypatch.setenv("FAKE_MODEL_SIZES", json.dumps({m: n - 100 for m, n in sizes.items()}))
    models = {"pin": {"pinned": True, "sleep_idle_seconds": -1}, "big": {}, "small": {}}
    async with fake_fleet(models, sizes=sizes, memory_budget=10 * GiB, wake_timeout=2, load_timeout=60) as (
            fleet, client):
        pin, big = fleet.models["pin"].controller, fleet.models["big"].controller
        await until(lambda: pin.state is ServerState.READY)
        load_big = asyncio.create_task(client.post("/models/load", json={"model": "big"}))
        await until(lambda: big.last_refusal is not None or fleet.waiting_for_room("big", since=0) is not None)
        behind = await complete(client, "small")  # fits beside pin: it must not wait behind big
        assert behind.status == 200, await behind.text()

        refused = await load_big
        error = (await refused.json())["error"]
        assert refused.status == 503 and error["code"] == "model_too_large", error
        assert "Retry-After" not in refused.headers  # retrying cannot help until the operator changes something
        assert "pin (8192 MiB)" in error["message"] and "4096 MiB" in error["message"]
        asked = await complete(client, "big")  # a request is refused the same way
        assert asked.status == 503 and (await asked.json())["error"]["code"] == "model_too_large"
        assert counter(fleet.metrics.admission_refusals, model="big", reason="never_fits") == 2
        assert counter(fleet.metrics.evictions, model="small") == 0  # nothing was put to sleep for it


async def test_the_least_recently_used_is_the_one_whose_last_request_ended_first(monkeypatch):
    """a's long stream began before b's short request and ended after it: a was
    used more recently, so c's load puts b to sleep, not a."""
    monkeypatch.setenv("FAKE_MODEL_BYTES", str(4 * GiB - 100))
    sizes = {"a": 4 * GiB, "b": 4 * GiB, "c": 4 * GiB}
    async with fake_fleet({"a": {}, "b": {}, "c": {}}, sizes=sizes, memory_budget=9 * GiB) as (fleet, client):
        a, b, c = (fleet.models[m].controller for m in ("a", "b", "c"))
        await until(lambda: a.state is ServerState.READY)
        assert isinstance(await run(b), p.Done)
        long_a = asyncio.create_task(run(a, max_tokens=100))
        await until(lambda: a.machine.in_flight)
        assert isinstance(await run(b), p.Done)  # arrived after a's, ended before it
        assert not long_a.done()
        assert isinstance(await long_a, p.Done)
        assert isinstance(await run(c), p.Done)
        assert (a.state, b.state, c.state) == (ServerState.READY, ServerState.SLEEPING, ServerState.READY)
        assert b.last_sleep["reason"] == "evict"


async def test_the_fleet_keeps_nothing_of_an_answered_admission(monkeypatch):
    """Every admission that waited was remembered for ever (Fleet._waited)."""
    sizes = one_of_two(monkeypatch)
    async with fake_fleet({"a": {}, "b": {}}, sizes=sizes, memory_budget=GiB) as (fleet, client):
        a, b = fleet.models["a"].controller, fleet.models["b"].controller
        await until(lambda: a.state is ServerState.READY)
        for _ in range(3):
            assert isinstance(await run(b), p.Done)  # each puts the other to sleep: a wait
            assert isinstance(await run(a), p.Done)
        assert counter(fleet.metrics.admission_waits, model="a") + counter(fleet.metrics.admission_waits,
                                                                            model="b") == 6
        gc.collect()
        # What the fleet holds of its own (not its models, which hold their controllers).
        kept = {name: value for name, value in vars(fleet).items() if name != "models" and _holds_a_future(value)}
        assert not kept, kept


def _holds_a_future(value) -> bool:
    """A future, or a container (or a container's tuples and records) with one."""
    if isinstance(value, asyncio.Future):
        return True
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple, set, frozenset, deque)):
        return False
    return any(isinstance(v, asyncio.Future) or (isinstance(v, tuple) and any(isinstance(x, asyncio.Future) for x in v))
               or any(isinstance(x, asyncio.Future) for x in getattr(v, "__dict__", {}).values()) for v in value)

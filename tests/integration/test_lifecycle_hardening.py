"""Issue 9, the lifecycle half: one request or one fault never leaves the
daemon stuck, dead or hung for everyone. The controller runs in this process
against the fake worker, which speaks the real protocol (pings included)."""

from __future__ import annotations

import asyncio
import os
import time

import psutil

from daemon.model.controller import POISON_CRASHES
from statemachine import ServerState, WorkerReady
from tests.conftest import fake_daemon
from tests.metrics_text import samples, value


async def ready(controller, timeout=10):
    assert await controller.wait_for(lambda s: s is ServerState.READY, timeout), controller.state


async def complete(client, **body):
    body.setdefault("prompt", "hi")
    body.setdefault("max_tokens", 3)
    return await client.post("/v1/completions", json=body)


# -- item 1: wake_timeout bounds the wake, not the wait for a slot --------------------------


async def test_queued_request_on_a_ready_model_waits_for_its_slot_past_wake_timeout(monkeypatch):
    monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.05")
    async with fake_daemon(parallel=1, wake_timeout=0.3) as (controller, client):
        await ready(controller)
        first = asyncio.create_task(complete(client, max_tokens=20))  # ~1 s on the only slot
        await asyncio.sleep(0.1)
        second = await complete(client, max_tokens=2)  # waits for the slot longer than wake_timeout
        assert second.status == 200, await second.text()
        assert (await first).status == 200


# -- item 6: a start or stop task that raises still ends its state --------------------------


async def test_unreadable_chat_template_fails_the_load_with_its_name(tmp_path):
    template = tmp_path / "template.jinja"
    template.mkdir()  # reading a directory raises IsADirectoryError
    async with fake_daemon(chat_template_file=template) as (controller, client):
        assert await controller.wait_for(lambda s: s is ServerState.FAILED, 10), controller.state
        body = await (await client.get("/health")).json()
        assert str(template) in body["error"]
        response = await complete(client)
        assert response.status == 503 and str(template) in (await response.json())["error"]["message"]


async def test_start_task_that_raises_ends_in_failed_not_loading():
    async with fake_daemon() as (controller, client):
        await ready(controller)

        async def broken_start(spec, timeout):
            raise OSError(24, "Too many open files")

        controller.supervisor.start = broken_start
        assert (await client.post("/sleep")).status == 200
        response = await complete(client)  # wakes: the start raises something that is not LoadFailed
        assert response.status == 503
        assert "Too many open files" in (await response.json())["error"]["message"]
        assert controller.state is ServerState.FAILED
        assert value(await (await client.get("/metrics")).text(), "dormouse_transition_errors_total") == 1


async def test_stop_task_that_raises_ends_in_sleeping_and_kills_the_worker():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        pid = controller.supervisor.current.pid

        async def broken_stop(timeout):
            raise RuntimeError("teardown bug")

        controller.supervisor.stop = broken_stop
        response = await client.post("/sleep")
        assert response.status == 200
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10), controller.state
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# -- item 7: a hung worker is noticed, killed, and its requests fail ------------------------


async def test_hung_worker_is_killed_and_its_streams_fail_with_a_clear_error(monkeypatch):
    monkeypatch.setenv("FAKE_HANG_AFTER_TOKENS", "4")
    async with fake_daemon(worker_liveness_timeout=0.5, early_crash_seconds=0) as (controller, client):
        await ready(controller)
        pid = controller.supervisor.current.pid
        responses = await asyncio.gather(complete(client, max_tokens=50, stream=True),
                                         complete(client, max_tokens=50, stream=True))
        for response in responses:
            raw = (await response.read()).decode()
            assert "hung" in raw and "worker_liveness_timeout" in raw and "[DONE]" not in raw
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10), controller.state
        assert not controller.machine.in_flight
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        # The next request wakes a fresh worker.
        monkeypatch.delenv("FAKE_HANG_AFTER_TOKENS")
        assert (await complete(client)).status == 200


async def test_shutdown_ends_even_when_the_worker_hangs_and_never_answers_a_cancel(monkeypatch):
    monkeypatch.setenv("FAKE_HANG_AFTER_TOKENS", "2")
    # No liveness check: the shutdown's own bound must end it.
    async with fake_daemon(worker_liveness_timeout=0, shutdown_timeout=0.3, teardown_timeout=0.5) as (controller, client):
        await ready(controller)
        stream = asyncio.create_task(complete(client, max_tokens=500, stream=True))
        while not controller.machine.in_flight:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the worker is stopped by now
        started = time.monotonic()
        await asyncio.wait_for(controller.shutdown(0.3), 30)  # hang guard, not a speed claim
        print(f"shutdown with a hung worker took {time.monotonic() - started:.2f}s")
        assert controller.stopped.is_set()
        raw = (await (await stream).read()).decode()
        assert "[DONE]" not in raw


# -- item 8: an event with no row is counted, never fatal ------------------------------------


async def test_event_without_a_row_is_counted_and_the_daemon_keeps_serving():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        controller.post(WorkerReady(4))  # READY has no row for a second Ready: a bug, on purpose
        assert (await complete(client)).status == 200
        text = await (await client.get("/metrics")).text()
        assert value(text, "dormouse_invalid_transitions_total", event="WorkerReady", state="ready") == 1


# -- item 9: a crash right after a load backs off; a poison request is refused ---------------


async def test_crash_soon_after_a_load_counts_as_a_failed_load(monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AFTER_TOKENS", "2")
    async with fake_daemon(early_crash_seconds=60, retry_max_seconds=30) as (controller, client):
        await ready(controller)
        response = await complete(client, max_tokens=10)
        assert response.status == 503 and (await response.json())["error"]["code"] == "worker_exited"
        assert controller.state is ServerState.FAILED
        assert controller.machine.consecutive_load_failures == 1
        assert "after loading" in controller.machine.failure_reason
        # While it backs off, requests are refused at once with the delay, not woken into a crash.
        refused = await complete(client)
        assert refused.status == 503 and refused.headers["Retry-After"] == "1"


async def test_request_in_flight_at_two_crashes_is_refused_then(monkeypatch):
    monkeypatch.setenv("FAKE_CRASH_AFTER_TOKENS", "2")
    poison = {"prompt": "the poison prompt", "max_tokens": 10}
    async with fake_daemon(early_crash_seconds=0) as (controller, client):
        await ready(controller)
        for _ in range(POISON_CRASHES):  # each crash leaves it asleep; the retry wakes it
            response = await complete(client, **poison)
            assert response.status == 503, await response.text()
        refused = await complete(client, **poison)
        assert refused.status == 400
        body = await refused.json()
        assert body["error"]["code"] == "request_crashed_worker"
        # Other requests are served.
        monkeypatch.delenv("FAKE_CRASH_AFTER_TOKENS")
        assert (await complete(client, prompt="something else")).status == 200
        text = await (await client.get("/metrics")).text()
        assert value(text, "dormouse_poison_requests_refused_total") == 1


# -- item 12: a crashed worker's slots and bytes are gone; its memory is checked -------------


async def test_after_a_crash_slots_and_memory_gauges_are_cleared_and_memory_checked(monkeypatch):
    async with fake_daemon(early_crash_seconds=0, parallel=2) as (controller, client):
        await ready(controller)
        monkeypatch.setenv("FAKE_TOKEN_SECONDS", "0.05")
        text = await (await client.get("/metrics")).text()
        assert samples(text, "dormouse_memory_bytes")
        pid = controller.supervisor.current.pid
        stream = asyncio.create_task(complete(client, max_tokens=200))
        while not any(s.request_id for s in controller.slots):
            await asyncio.sleep(0.01)
        os.kill(pid, 9)
        assert (await stream).status == 503
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10)
        slots = await (await client.get("/slots")).json()
        assert all(s["request_id"] is None and s["state"] == "idle" for s in slots)
        text = await (await client.get("/metrics")).text()
        assert not samples(text, "dormouse_memory_bytes")
        assert samples(text, "dormouse_slots", state="generating") == [0.0]
        for _ in range(100):
            if controller.last_memory_check:
                break
            await asyncio.sleep(0.05)
        assert controller.last_memory_check["after"] == "crash"
        assert controller.last_memory_check["pid"] == pid
        assert controller.last_memory_check["process_gone"] is True


async def test_resume_seconds_are_labelled_by_reason():
    async with fake_daemon() as (controller, client):
        await ready(controller)
        assert (await client.post("/sleep")).status == 200
        assert (await client.post("/wake")).status == 200
        text = await (await client.get("/metrics")).text()
        assert value(text, "dormouse_resume_seconds_count", reason="startup") == 1
        assert value(text, "dormouse_resume_seconds_count", reason="admin") == 1

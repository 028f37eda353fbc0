"""Issue 27 item 1: liveness is judged so that a worker that is slow but progressing
is never killed, while one that is stuck (a step that never ends, though its channel
thread still answers) or stopped (answers nothing) still is.

The worker here is tests/fixtures/slow_step_worker.py: the real channel (pings
answered by its thread, with the age of the current step) and the real decode loop
(daemon.worker.__main__.serve) around a fake engine whose steps are slow. Nothing
is asserted about wall-clock time: tokens, kills and the reasons given are counted."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from statemachine import ServerState
from tests.conftest import fake_daemon
from tests.metrics_text import value

LIVENESS = 1.0  # seconds; pings every LIVENESS / 4
WORKER = "tests.fixtures.slow_step_worker"


async def ready(controller, timeout=10):
    assert await controller.wait_for(lambda s: s is ServerState.READY, timeout), controller.state


async def stream(client, max_tokens):
    response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": max_tokens, "stream": True})
    return response.status, (await response.read()).decode()


async def test_slow_but_progressing_worker_is_not_killed(monkeypatch):
    # Each step takes 2/3 of the liveness bound, and the request needs 12 of them (8 bounds in
    # all): pings land mid-step, and are answered there with the step's age.
    monkeypatch.setenv("SLOW_STEP_SECONDS", str(LIVENESS * 2 / 3))
    async with fake_daemon(worker_module=WORKER, worker_liveness_timeout=LIVENESS, early_crash_seconds=0) as (controller, client):
        await ready(controller)
        worker = controller.supervisor.current
        ages = []

        async def watch():
            for _ in range(400):  # bounded: the request ends first
                ages.append(worker.step_seconds)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch())
        status, raw = await stream(client, 12)
        watcher.cancel()
        assert status == 200 and "[DONE]" in raw, raw
        assert all(f"t{i} " in raw for i in range(12))
        assert controller.supervisor.current is worker and worker.proc.returncode is None  # the same worker, alive
        assert worker.kill_reason is None
        assert any(age > 0 for age in ages)  # Pongs came mid-step, from the channel thread
        text = await (await client.get("/metrics")).text()
        assert value(text, "dormouse_worker_restarts_total") in (None, 0)


async def test_worker_stuck_in_a_step_is_killed_though_it_answers_pings(monkeypatch):
    monkeypatch.setenv("SLOW_STUCK_AT_STEP", "3")
    async with fake_daemon(worker_module=WORKER, worker_liveness_timeout=LIVENESS, early_crash_seconds=0) as (controller, client):
        await ready(controller)
        worker = controller.supervisor.current
        status, raw = await stream(client, 50)
        assert "t0 " in raw and "t1 " in raw and "t2 " not in raw and "[DONE]" not in raw
        assert "hung" in raw and "worker_liveness_timeout" in raw and "one step ran" in raw, raw
        assert worker.kill_reason and worker.kill_reason.startswith("one step ran")
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10), controller.state


async def test_worker_that_answers_nothing_is_killed(monkeypatch):
    monkeypatch.setenv("SLOW_STOP_AT_STEP", "3")
    async with fake_daemon(worker_module=WORKER, worker_liveness_timeout=LIVENESS, early_crash_seconds=0) as (controller, client):
        await ready(controller)
        worker = controller.supervisor.current
        status, raw = await stream(client, 50)
        assert "t0 " in raw and "t1 " in raw and "t2 " not in raw and "[DONE]" not in raw
        assert "answered no ping" in raw and "worker_liveness_timeout" in raw, raw
        assert await controller.wait_for(lambda s: s is ServerState.SLEEPING, 10), controller.state
        # The next request wakes a fresh worker, which serves it.
        monkeypatch.delenv("SLOW_STOP_AT_STEP")
        status, raw = await stream(client, 2)
        assert status == 200 and "[DONE]" in raw
        assert controller.supervisor.current is not worker


async def test_a_pause_of_the_whole_host_kills_no_worker():
    # The host pauses both processes (steal time, swap): the worker is stopped and this
    # process's loop blocked for several liveness bounds, then both go on. The watcher wakes
    # late with nothing heard for that long, and the worker, resumed a moment after it, has not
    # answered yet. That is a pause of the host, not a hang: the worker stays and serves.
    async with fake_daemon(worker_module=WORKER, worker_liveness_timeout=LIVENESS, early_crash_seconds=0) as (controller, client):
        await ready(controller)
        worker = controller.supervisor.current
        await asyncio.sleep(LIVENESS / 2)  # the watcher is running, pings answered
        os.kill(worker.pid, signal.SIGSTOP)
        time.sleep(LIVENESS * 3)  # blocks this loop: the daemon is paused too
        await asyncio.sleep(LIVENESS / 6)  # the daemon resumes first; the watcher wakes late and judges
        os.kill(worker.pid, signal.SIGCONT)
        status, raw = await stream(client, 4)
        assert status == 200 and "[DONE]" in raw, raw
        assert controller.supervisor.current is worker and worker.proc.returncode is None
        assert worker.kill_reason is None

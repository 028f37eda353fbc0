"""daemon/model/liveness.py: a worker is hung when silent or stuck for the timeout, counted
only over time this process itself ran on schedule (a pause of the host is nobody's fault)."""

from __future__ import annotations

import random

from daemon.model.liveness import LivenessClock

TIMEOUT, INTERVAL = 60.0, 15.0


def run(clock: LivenessClock, wakes: list[float], start: float = 0.0) -> float:
    """The watcher wakes after each of these sleeps (seconds; INTERVAL is on time)."""
    now = start
    for slept in wakes:
        clock.woke(now + slept, now + INTERVAL)
        now += slept
    return now


def test_on_time_silence_past_the_timeout_is_a_hang():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL] * 4)
    assert clock.verdict(now, last_heard=0.0, reported_step=0.0) is None  # 60 s is not past 60 s
    now = run(clock, [INTERVAL], start=now)
    assert clock.verdict(now, last_heard=0.0, reported_step=0.0) == "silent"


def test_a_late_wake_restarts_the_silence_and_an_on_time_one_after_it_still_catches_a_hang():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL, INTERVAL * 20])  # the host paused for five minutes
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0) is None
    assert clock.silent_seconds(now, last_heard=INTERVAL) == 0.0
    now = run(clock, [INTERVAL] * 4, start=now)
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0) is None
    now = run(clock, [INTERVAL], start=now)  # nothing heard for the timeout since the host came back
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0) == "silent"


def test_a_little_lateness_is_no_stall():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL * 1.9] * 3)  # late, but by less than an interval each time
    assert not clock.stalls and clock.verdict(now, last_heard=0.0, reported_step=0.0) == "silent"


def test_a_step_loses_the_stalls_it_ran_through_and_only_those():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL, INTERVAL + 100.0])  # a 100 s stall ending at t=130
    assert clock.stalls[-1] == (130.0, 100.0)
    # A pong heard at t=140 says the step began 110 s ago, at t=30: it ran through the stall.
    assert clock.step_seconds(110.0, last_heard=140.0) == 10.0
    assert clock.verdict(now + 10, last_heard=140.0, reported_step=110.0) is None
    # A step that began after the stall keeps its whole age.
    assert clock.step_seconds(61.0, last_heard=200.0) == 61.0
    assert clock.verdict(200.0, last_heard=200.0, reported_step=61.0) == "stuck"
    assert clock.step_seconds(0.0, last_heard=200.0) == 0.0  # between steps


def test_random_wakes_judge_only_a_worker_that_stopped_answering():
    # Wakes are on time, a little late, or stalls of the host. A live worker's pong to the last
    # ping lands at some moment of each sleep that was no stall (after a stall it is still on its
    # way). Such a worker is never judged; once it stops answering, on-time wakes catch it within
    # the timeout's count of intervals.
    rng = random.Random(7)
    for _ in range(200):  # bounded by count
        clock = LivenessClock(TIMEOUT, INTERVAL)
        now, last_heard = 0.0, 0.0
        for _ in range(50):
            kind = rng.random()
            slept = INTERVAL if kind < 0.6 else rng.uniform(INTERVAL, INTERVAL * (2 if kind < 0.8 else 30))
            before, due = now, now + INTERVAL
            now += slept
            clock.woke(now, due)
            if now - due <= INTERVAL:
                last_heard = rng.uniform(before, now)
            assert clock.verdict(now, last_heard, reported_step=0.0) is None, (now, last_heard, list(clock.stalls))
        for wakes in range(1, 100):  # it stops answering
            due = now + INTERVAL
            now += INTERVAL
            clock.woke(now, due)
            if clock.verdict(now, last_heard, reported_step=0.0) == "silent":
                break
        assert wakes <= TIMEOUT / INTERVAL + 1

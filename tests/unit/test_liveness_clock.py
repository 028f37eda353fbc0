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
    assert clock.verdict(now, last_heard=0.0, reported_step=0.0)[0] == "silent"


def test_a_stall_of_this_process_is_not_counted_as_silence_and_on_time_wakes_still_catch_a_hang():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL, INTERVAL * 20])  # the host paused for almost five minutes
    assert list(clock.stalls) == [(2 * INTERVAL, 21 * INTERVAL)]
    assert clock.silent_seconds(now, last_heard=INTERVAL) == INTERVAL  # only the on-time interval before it
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0) is None
    now = run(clock, [INTERVAL] * 3, start=now)
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0) is None
    now = run(clock, [INTERVAL], start=now)  # nothing heard for the timeout's worth of running time
    assert clock.verdict(now, last_heard=INTERVAL, reported_step=0.0)[0] == "silent"


def test_a_loop_that_is_always_late_still_catches_a_silent_worker():
    # Every wake over two intervals apart: each a stall, each after one on-time interval that counts.
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now, wakes = 0.0, 0
    while clock.verdict(now, last_heard=0.0, reported_step=0.0) is None and wakes < 100:
        now = run(clock, [INTERVAL * 2.01], start=now)
        wakes += 1
    assert wakes <= TIMEOUT / INTERVAL + 1, wakes


def test_a_little_lateness_is_no_stall():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL * 1.9] * 3)  # late, but by less than an interval each time
    assert not clock.stalls and clock.verdict(now, last_heard=0.0, reported_step=0.0)[0] == "silent"


def test_a_step_loses_the_part_of_each_stall_it_ran_through():
    clock = LivenessClock(TIMEOUT, INTERVAL)
    now = run(clock, [INTERVAL, INTERVAL + 100.0])  # stalled from t=30 to t=130
    assert list(clock.stalls) == [(30.0, 130.0)]
    # A pong heard at t=140 says the step began 110 s ago, at t=30: it ran through the whole stall.
    assert clock.step_seconds(110.0, last_heard=140.0) == 10.0
    assert clock.verdict(now + 10, last_heard=140.0, reported_step=110.0) is None
    # One that began at t=120, 10 s before the stall ended, loses those 10 s only.
    assert clock.step_seconds(80.0, last_heard=200.0) == 70.0
    assert clock.verdict(200.0, last_heard=200.0, reported_step=80.0)[0] == "stuck"
    # A step that began after the stall keeps its whole age.
    assert clock.step_seconds(61.0, last_heard=200.0) == 61.0
    assert clock.step_seconds(0.0, last_heard=200.0) == 0.0  # between steps


def test_random_pauses_of_the_host_never_judge_a_worker_that_answers_and_a_stop_is_caught():
    # A simulation of both processes under random pauses of the whole host. The watcher pings at
    # each wake and means to wake one interval later; a pause (up to 30 intervals) may begin at
    # any moment of a sleep, and then the watcher wakes at the pause's end or its due time,
    # whichever is later. A live worker's pong lands a moment of running time after the ping
    # (paused time does not count: the worker is paused too), and is heard when it lands. Such a
    # worker is never judged; once it stops answering, on-time wakes catch it within the
    # timeout's count of intervals.
    rng = random.Random(7)
    for _ in range(200):  # bounded by count
        clock = LivenessClock(TIMEOUT, INTERVAL)
        now, last_heard, in_flight = 0.0, 0.0, []  # in_flight: running seconds each pong still needs
        for _ in range(50):
            before, due = now, now + INTERVAL
            if rng.random() < 0.4:
                start = before + rng.uniform(0, INTERVAL)
                end = start + rng.uniform(0, INTERVAL * 30)
                now = max(due, end)
                running = [(before, start), (end, now)] if end < now else [(before, start)]
            else:
                now = due + rng.choice([0.0, rng.uniform(0, INTERVAL)])  # on time, or a little late
                running = [(before, now)]
            for a, b in running:
                for i, needed in enumerate(in_flight):
                    if needed is not None and needed <= b - a:
                        last_heard, in_flight[i] = max(last_heard, a + needed), None
                    elif needed is not None:
                        in_flight[i] = needed - (b - a)
            in_flight = [needed for needed in in_flight if needed is not None]
            clock.woke(now, due)
            assert clock.verdict(now, last_heard, reported_step=0.0) is None, (now, last_heard, list(clock.stalls))
            in_flight.append(rng.uniform(1e-4, INTERVAL / 100))  # this wake's ping
        for wakes in range(1, 100):  # it stops answering
            due = now + INTERVAL
            now += INTERVAL
            clock.woke(now, due)
            verdict = clock.verdict(now, last_heard, reported_step=0.0)
            if verdict is not None and verdict[0] == "silent":
                break
        assert wakes <= TIMEOUT / INTERVAL + 1

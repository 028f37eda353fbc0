"""When is a serving worker hung? Pure logic, fed the times the supervisor's watcher sees.

A worker is hung when it has answered nothing for `timeout` (stopped, wedged), or when
its pongs say one step has run longer than `timeout` (a kernel that never returns,
while the channel thread still answers). Both are judged by this process's clock, so
both must forgive the time this process itself was not running: when the host pauses
(steal time on a busy VM, swap, a long garbage collection) the daemon's watcher wakes
late, the worker was most likely paused too, and its pong may still be on its way.
Without that, a healthy worker is killed by a pause that was nobody's fault.

A wake more than one ping interval past its due time is a stall of this process, from
the due time to the wake. Silence and a step's age count only the time outside stalls.
Every wake adds at least one on-time interval, so a worker that really is hung is
still caught, within the timeout's count of wakes, even by a loop that is always late.
What cannot be known is where in the last interval before a wake a pause began: that
part counts as running time, so a step within one interval of the timeout when the
host paused may still be judged stuck."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class LivenessClock:
    timeout: float  # worker_liveness_timeout, seconds
    interval: float  # how often the watcher pings
    # (start, end) of this process's stalls, oldest first. Each one follows at least one on-time interval, so
    # the oldest dropped is older than 64 intervals: longer than any silence or step that is not already hung.
    stalls: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))

    def woke(self, now: float, due: float) -> None:
        """The watcher meant to wake at `due` and woke at `now`."""
        if now - due > self.interval:
            self.stalls.append((due, now))

    def running_seconds(self, since: float, now: float) -> float:
        """Seconds from `since` to `now` outside this process's stalls."""
        stalled = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.stalls)
        return max(0.0, now - since - stalled)

    def silent_seconds(self, now: float, last_heard: float) -> float:
        return self.running_seconds(last_heard, now)

    def step_seconds(self, reported: float, last_heard: float) -> float:
        """A step's age as its last pong (heard at `last_heard`) reported it, less this process's stalls
        since the step began."""
        return self.running_seconds(last_heard - reported, last_heard) if reported > 0 else 0.0

    def verdict(self, now: float, last_heard: float, reported_step: float) -> tuple[str, float] | None:
        """None while the worker is alive; ("silent", its silence) or ("stuck", its step's age) when it is hung."""
        silent = self.silent_seconds(now, last_heard)
        if silent > self.timeout:
            return "silent", silent
        step = self.step_seconds(reported_step, last_heard)
        if step > self.timeout:
            return "stuck", step
        return None

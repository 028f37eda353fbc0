"""When is a serving worker hung? Pure logic, fed the times the supervisor's watcher sees.

A worker is hung when it has answered nothing for `timeout` (stopped, wedged), or when
its pongs say one step has run longer than `timeout` (a kernel that never returns,
while the channel thread still answers). Both are judged by this process's clock, so
both must forgive the time this process itself was not running: when the host pauses
(steal time on a busy VM, swap, a long garbage collection) the daemon's watcher wakes
late, the worker was most likely paused too, and its pong may still be on its way.
Without that, a healthy worker is killed by a pause that was nobody's fault.

A wake later than one ping interval past its due time is a stall of this process.
Silence is counted from the end of the last stall at the earliest; a step's age loses
the stalls that happened while it ran. A worker that really is hung is still caught:
one on-time interval after a stall, the clock runs again."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class LivenessClock:
    timeout: float  # worker_liveness_timeout, seconds
    interval: float  # how often the watcher pings
    resumed_at: float = float("-inf")  # when this process last came back from a stall
    stalls: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))  # (resumed_at, seconds)

    def woke(self, now: float, due: float) -> None:
        """The watcher meant to wake at `due` and woke at `now`."""
        late = now - due
        if late > self.interval:
            self.resumed_at = now
            self.stalls.append((now, late))

    def stalled_since(self, since: float) -> float:
        """Seconds this process spent stalled after `since` (a stall is counted whole when it ended after it)."""
        return sum(seconds for resumed, seconds in self.stalls if resumed > since)

    def silent_seconds(self, now: float, last_heard: float) -> float:
        return now - max(last_heard, self.resumed_at)

    def step_seconds(self, reported: float, last_heard: float) -> float:
        """A step's age as its last pong (heard at `last_heard`) reported it, less this process's stalls
        since the step began."""
        return reported - self.stalled_since(last_heard - reported) if reported > 0 else 0.0

    def verdict(self, now: float, last_heard: float, reported_step: float) -> str | None:
        """None while the worker is alive; "silent" or "stuck" when it is hung."""
        if self.silent_seconds(now, last_heard) > self.timeout:
            return "silent"
        if self.step_seconds(reported_step, last_heard) > self.timeout:
            return "stuck"
        return None

"""HAProxy's agent check: each replica tells the balancer how much traffic it wants.

A sleeping replica is healthy but cold: HTTP health checks cannot tell it
from an awake one, so a balancer would send the next request to it and pay
a wake while an awake replica sits idle. With `agent-check` on a server line,
HAProxy connects to `agent_port` every `agent-inter`, sends the line's
`agent-send` string, reads one line back and applies it: a weight, or "down".

deploy/haproxy/haproxy.cfg lists every replica on three server lines, each
naming its role in `agent-send`; the reply depends on the role:

| replica is        | serve (active) | wake (backup) | overflow  |
| ----------------- | -------------- | ------------- | --------- |
| awake, free slot  | up 100%        | up 0%         | up 100%   |
| awake, saturated  | up 0%          | up 0%         | up 100%   |
| waking / loading  | up 100%        | up 0%         | up 100%   |
| asleep            | up 0%          | up 100%       | up 100%   |
| stopping/draining | up 0%          | up 0%         | up 0%     |
| every model failed| down           | down          | down      |

HAProxy sends a request to an active server (`balance first`: the
lowest-numbered one) while any has a weight above 0; only when none has does
it use the first usable backup (one sleeping replica, woken by the request);
only when no server of that backend is usable does the frontend switch to the
overflow backend (every replica saturated: they queue). A weight of 0 makes a
server unusable (HAProxy's srv_currently_usable), which is what activates the
next tier: a low weight like 1% would keep a cold replica in the rotation.

Never "drain" or "ready": those set HAProxy's administrative state, which
outlives the process. A "drain" from a stopping daemon would stay in force
after it restarts unless every later reply said "ready", and "ready" would
undo an operator's own `set server ... state maint` at the next check. A
weight of 0 has the same effect on new requests (the stats page shows it as
DRAIN) and the next process's first reply replaces it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from statemachine import ServerState

FULL = "up 100%\n"
OFF = "up 0%\n"  # out of this tier: the next one is tried
DOWN = "down\n"  # every model failed to load

SERVE, WAKE, OVERFLOW = "serve", "wake", "overflow"
ROLES = (SERVE, WAKE, OVERFLOW)
# HAProxy sends `agent-send` as soon as it connects; a line without it (a
# plain `agent-check`) gets the serve answer once this has passed.
ROLE_READ_SECONDS = 0.25
ROLE_MAX_BYTES = 64

_WARMING = (ServerState.STARTING, ServerState.LOADING, ServerState.WAKING)


@dataclass(frozen=True)
class ReplicaSnapshot:
    state: str  # stopping, ready, waking (a load under way), asleep (sleeping or unloading), failed
    free_slots: int  # slots not serving a request, over the models that are ready


STOPPING = ReplicaSnapshot("stopping", 0)


def snapshot_of(controllers: Iterable) -> ReplicaSnapshot:
    """One answer for the process, over its models: awake if any model is."""
    controllers = list(controllers)
    states = [c.state for c in controllers]
    if ServerState.STOPPING in states:
        return STOPPING
    ready = [c for c in controllers if c.state is ServerState.READY]
    if ready:
        free = sum(max(0, c.machine.policy.parallel - len(c.machine.in_flight)) for c in ready)
        return ReplicaSnapshot("ready", free)
    if any(s in _WARMING for s in states):
        return ReplicaSnapshot("waking", 0)
    if states and all(s is ServerState.FAILED for s in states):
        return ReplicaSnapshot("failed", 0)
    return ReplicaSnapshot("asleep", 0)


def agent_reply(snapshot: ReplicaSnapshot, role: str = SERVE) -> str:
    if snapshot.state == "failed":
        return DOWN
    if snapshot.state == "stopping":
        return OFF
    if role == WAKE:
        return FULL if snapshot.state == "asleep" else OFF
    if role == OVERFLOW:
        return FULL
    # serve: a waking replica keeps its weight, so that the requests after
    # the one that woke it wait for that wake instead of waking another.
    if snapshot.state == "waking" or (snapshot.state == "ready" and snapshot.free_slots > 0):
        return FULL
    return OFF


def parse_role(data: bytes) -> str:
    word = data.split(b"\n", 1)[0].strip().decode("ascii", "replace").lower()
    return word if word in ROLES else SERVE


class Agent:
    """The listening agent. `drain()` makes every later answer "up 0%" while
    the daemon still serves, so that the balancer stops sending before the
    HTTP listener closes (the drain grace of a SIGTERM)."""

    def __init__(self, snapshot: Callable[[], ReplicaSnapshot], log) -> None:
        self._snapshot = snapshot
        self._log = log
        self.draining = False
        self.server: asyncio.AbstractServer | None = None
        self.answered: Counter[str] = Counter()  # answers given, by role

    def drain(self) -> None:
        self.draining = True

    def current(self) -> ReplicaSnapshot:
        return STOPPING if self.draining else self._snapshot()

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                data = await asyncio.wait_for(reader.read(ROLE_MAX_BYTES), ROLE_READ_SECONDS)
            except asyncio.TimeoutError:
                data = b""
            role = parse_role(data)
            writer.write(agent_reply(self.current(), role).encode("ascii"))
            await writer.drain()
            self.answered[role] += 1
        except (ConnectionError, OSError):
            pass  # the balancer went away; it asks again at its next interval
        finally:
            writer.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def start_agent(host: str, port: int, snapshot: Callable[[], ReplicaSnapshot], log) -> Agent:
    """Answer every connection with one line, then close (HAProxy's agent protocol)."""
    agent = Agent(snapshot, log)
    agent.server = await asyncio.start_server(agent.answer, host, port)
    log.info("agent.listening", host=host, port=port)
    return agent

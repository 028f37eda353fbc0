"""HAProxy's agent check: each replica tells the balancer how much traffic it wants.

A sleeping replica is healthy but cold: HTTP health checks cannot tell it
from an awake one, so a balancer would send the next request to it and pay
a wake while an awake replica sits idle. With `agent-check` on a server line,
HAProxy connects to `agent_port` every `agent-inter`, reads one line and
applies it: a weight ("up 100%"), "drain" (no new requests, keep the open
ones) or "down". deploy/haproxy/ and docs/SCALING.md say how the weights
below compose with the backend's settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable, Iterable

from statemachine import ServerState

FULL = "up 100%\n"  # awake with a free slot: all the traffic it can take
COLD = "up 1%\n"  # asleep, waking or saturated: only when no awake replica can take it
DRAIN = "drain\n"  # stopping: finish what is open, take nothing new
DOWN = "down\n"  # every model failed to load


@dataclass(frozen=True)
class ReplicaSnapshot:
    state: str  # stopping, ready, failed, or cold (asleep, loading, waking, unloading)
    free_slots: int  # slots not serving a request, over the models that are ready


def snapshot_of(controllers: Iterable) -> ReplicaSnapshot:
    """One answer for the process, over its models."""
    controllers = list(controllers)
    states = [c.state for c in controllers]
    if ServerState.STOPPING in states:
        return ReplicaSnapshot("stopping", 0)
    ready = [c for c in controllers if c.state is ServerState.READY]
    if ready:
        free = sum(max(0, c.machine.policy.parallel - len(c.machine.in_flight)) for c in ready)
        return ReplicaSnapshot("ready", free)
    if states and all(s is ServerState.FAILED for s in states):
        return ReplicaSnapshot("failed", 0)
    return ReplicaSnapshot("cold", 0)


def agent_reply(snapshot: ReplicaSnapshot) -> str:
    if snapshot.state == "stopping":
        return DRAIN
    if snapshot.state == "failed":
        return DOWN
    if snapshot.state == "ready" and snapshot.free_slots > 0:
        return FULL
    return COLD


async def start_agent(host: str, port: int, snapshot: Callable[[], ReplicaSnapshot], log) -> asyncio.AbstractServer:
    """Answer every connection with one line, then close (HAProxy's agent protocol)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(agent_reply(snapshot()).encode("ascii"))
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the balancer went away; it asks again at its next interval
        finally:
            writer.close()

    server = await asyncio.start_server(answer, host, port)
    log.info("agent.listening", host=host, port=port)
    return server

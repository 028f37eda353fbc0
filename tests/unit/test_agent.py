"""The agent check's answers (daemon/http/agent.py): the table that
deploy/haproxy/haproxy.cfg's three tiers rely on, the snapshot of a fleet,
and the protocol over a real socket. tests/reliability/test_haproxy.py runs
them against the real HAProxy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon.http.agent import (DOWN, FULL, OFF, OVERFLOW, SERVE, WAKE, Agent, ReplicaSnapshot,
                               agent_reply, parse_role, snapshot_of, start_agent)
from statemachine import ServerState as S

FREE, SATURATED = ReplicaSnapshot("ready", 1), ReplicaSnapshot("ready", 0)
WAKING, ASLEEP = ReplicaSnapshot("waking", 0), ReplicaSnapshot("asleep", 0)
STOPPING, FAILED = ReplicaSnapshot("stopping", 0), ReplicaSnapshot("failed", 0)

# (snapshot, serve, wake, overflow): the module docstring's table.
TABLE = [
    (FREE, FULL, OFF, FULL),
    (SATURATED, OFF, OFF, FULL),  # out of the serve tier: a sleeper is woken, else overflow
    (WAKING, FULL, OFF, FULL),  # keeps taking requests: they wait for the wake under way
    (ASLEEP, OFF, FULL, FULL),
    (STOPPING, OFF, OFF, OFF),
    (FAILED, DOWN, DOWN, DOWN),
]


@pytest.mark.parametrize("snapshot, serve, wake, overflow", TABLE)
def test_reply_by_state_and_role(snapshot, serve, wake, overflow):
    assert (agent_reply(snapshot, SERVE), agent_reply(snapshot, WAKE), agent_reply(snapshot, OVERFLOW)) == (
        serve, wake, overflow)


def test_exactly_one_tier_wants_a_healthy_replica_in_the_first_backend():
    """In the first backend (serve + wake lines) a replica that can serve is
    in exactly one tier: never both (two routes to it) nor neither (invisible
    while it could take the request), except saturated and stopping."""
    for snapshot, serve, wake, _ in TABLE:
        if snapshot in (SATURATED, STOPPING, FAILED):
            continue
        assert (serve == FULL) != (wake == FULL), snapshot


def test_replies_never_set_an_administrative_state():
    # "drain", "maint" and "ready" outlive the process in HAProxy (the
    # reliability test shows drain staying after "up 100%").
    for snapshot, *replies in TABLE:
        for reply in replies:
            assert reply.endswith("\n")
            assert not {"drain", "maint", "ready"} & set(reply.split()), reply


@pytest.mark.parametrize("data, role", [
    (b"serve\n", SERVE), (b"wake\n", WAKE), (b"overflow\n", OVERFLOW), (b"WAKE\r\n", WAKE),
    (b"", SERVE), (b"nonsense\n", SERVE), (b"\xff\xfe\n", SERVE), (b"wake", WAKE),
])
def test_role_parsing_defaults_to_serve(data, role):
    assert parse_role(data) == role


def controller(state: S, parallel: int = 4, in_flight: int = 0):
    return SimpleNamespace(state=state, machine=SimpleNamespace(
        policy=SimpleNamespace(parallel=parallel), in_flight=set(range(in_flight))))


@pytest.mark.parametrize("states, expected", [
    ([S.READY], ReplicaSnapshot("ready", 4)),
    ([S.SLEEPING], ASLEEP),
    ([S.UNLOADING], ASLEEP),  # going to sleep: taking a request costs a wake
    ([S.WAKING], WAKING),
    ([S.LOADING], WAKING),
    ([S.STARTING], WAKING),
    ([S.FAILED], FAILED),
    ([S.STOPPING], STOPPING),
    # A fleet: awake if any model is; the free slots of the ready ones.
    ([S.READY, S.SLEEPING], ReplicaSnapshot("ready", 4)),
    ([S.READY, S.READY], ReplicaSnapshot("ready", 8)),
    ([S.SLEEPING, S.WAKING], WAKING),
    ([S.FAILED, S.SLEEPING], ASLEEP),  # one model can still be woken
    ([S.FAILED, S.FAILED], FAILED),
    ([S.READY, S.STOPPING], STOPPING),
])
def test_snapshot_of_a_fleet(states, expected):
    assert snapshot_of([controller(s) for s in states]) == expected


def test_snapshot_counts_busy_slots():
    assert snapshot_of([controller(S.READY, parallel=2, in_flight=1)]) == ReplicaSnapshot("ready", 1)
    # More in flight than slots (the worker queues): none free, never negative.
    assert snapshot_of([controller(S.READY, parallel=2, in_flight=5)]) == SATURATED


class Quiet:
    def info(self, *args, **kwargs):
        pass


async def ask(port: int, send: bytes | None) -> str:
    """One agent check as HAProxy makes it: connect, send agent-send if any, read a line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    if send is not None:
        writer.write(send)
        await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    return line.decode()


async def test_agent_over_a_socket_answers_by_role_and_drains():
    state = {"snapshot": ASLEEP}
    agent = await start_agent("127.0.0.1", 0, lambda: state["snapshot"], Quiet())
    port = agent.server.sockets[0].getsockname()[1]
    try:
        assert await ask(port, b"serve\n") == OFF
        assert await ask(port, b"wake\n") == FULL
        state["snapshot"] = FREE
        assert await ask(port, b"serve\n") == FULL
        # A plain agent-check sends nothing: the serve answer, once the role wait is over.
        assert await ask(port, None) == FULL
        # The drain grace: every role says 0 while the daemon still serves.
        agent.drain()
        assert [await ask(port, role) for role in (b"serve\n", b"wake\n", b"overflow\n")] == [OFF] * 3
        assert agent.answered == {SERVE: 4, WAKE: 2, OVERFLOW: 1}
    finally:
        agent.close()


async def test_a_client_that_goes_away_does_not_break_the_agent():
    agent = Agent(lambda: FREE, Quiet())
    agent.server = await asyncio.start_server(agent.answer, "127.0.0.1", 0)
    port = agent.server.sockets[0].getsockname()[1]
    try:
        for _ in range(5):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.transport.abort()  # reset before the answer
        assert await ask(port, b"serve\n") == FULL
    finally:
        agent.close()

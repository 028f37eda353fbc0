"""The agent check's answers (daemon/http/agent.py): the table that
deploy/haproxy/haproxy.cfg's tiers rely on, per model and for the process,
the snapshot of a fleet, and the protocol over a real socket.
tests/reliability/test_haproxy.py runs them against the real HAProxy."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from daemon.http.agent import (DOWN, FULL, MAX_QUESTIONS_COUNTED, OFF, OVERFLOW, SERVE, TIER_HOLD_SECONDS, WAKE,
                               WARM, WOKEN_BUSY_HOLD_SECONDS, Agent, Question,
                               ReplicaSnapshot, agent_reply, parse_question, parse_role, snapshot_of, start_agent)
from statemachine import ServerState as S

FREE, SATURATED = ReplicaSnapshot("ready", 1), ReplicaSnapshot("ready", 0)
WAKING, ASLEEP = ReplicaSnapshot("waking", 0), ReplicaSnapshot("asleep", 0)
STOPPING, FAILED = ReplicaSnapshot("stopping", 0), ReplicaSnapshot("failed", 0)

# (snapshot, serve, warm, wake, overflow): the module docstring's table.
TABLE = [
    (FREE, FULL, OFF, OFF, FULL),
    (SATURATED, OFF, OFF, OFF, FULL),  # out of the first backend: a load under way, a sleeper, else overflow
    (WAKING, OFF, FULL, OFF, FULL),  # behind every free replica, before every sleeper
    (ASLEEP, OFF, OFF, FULL, FULL),
    (STOPPING, OFF, OFF, OFF, OFF),
    (FAILED, DOWN, DOWN, DOWN, DOWN),
    (None, DOWN, DOWN, DOWN, DOWN),  # a model this replica does not serve
]


@pytest.mark.parametrize("snapshot, serve, warm, wake, overflow", TABLE)
def test_reply_by_state_and_role(snapshot, serve, warm, wake, overflow):
    assert [agent_reply(snapshot, role) for role in (SERVE, WARM, WAKE, OVERFLOW)] == [serve, warm, wake, overflow]


def test_exactly_one_tier_wants_a_healthy_replica_in_the_first_backend():
    """In a model's backend (serve, warm and wake lines) a replica that can
    take the request is in exactly one tier: never two (two routes to it)
    nor none (invisible while it could take it), except busy and stopping."""
    for snapshot, serve, warm, wake, _ in TABLE:
        if snapshot in (SATURATED, STOPPING, FAILED, None):
            continue
        assert [serve, warm, wake].count(FULL) == 1, snapshot


def test_replies_never_set_an_administrative_state():
    # "drain", "maint" and "ready" outlive the process in HAProxy (the
    # reliability test shows drain staying after "up 100%").
    for _, *replies in TABLE:
        for reply in replies:
            assert reply.endswith("\n")
            assert not {"drain", "maint", "ready"} & set(reply.split()), reply


@pytest.mark.parametrize("data, role", [
    (b"serve\n", SERVE), (b"warm\n", WARM), (b"wake\n", WAKE), (b"overflow\n", OVERFLOW), (b"WAKE\r\n", WAKE),
    (b"", SERVE), (b"nonsense\n", SERVE), (b"\xff\xfe\n", SERVE), (b"wake", WAKE),
])
def test_role_parsing_defaults_to_serve(data, role):
    assert parse_role(data) == role


@pytest.mark.parametrize("data, question", [
    (b"serve chat\n", Question(SERVE, "chat")),
    (b"warm qwen2.5:7b-instruct\n", Question(WARM, "qwen2.5:7b-instruct")),  # ids may hold '.', ':', '-'
    (b"wake coder", Question(WAKE, "coder")),
    (b"overflow  chat \r\n", Question(OVERFLOW, "chat")),
    (b"serve\n", Question(SERVE, None)),  # no model: the process's answer
    (b"", Question(SERVE, None)),
    (b"chat\n", Question(SERVE, None)),  # not a role: the process's serve answer, as before models
])
def test_question_names_a_role_and_a_model(data, question):
    assert parse_question(data) == question


def controller(state: S, parallel: int = 4, in_flight: int = 0, model_id: str = "default", holding: bool = False,
               failure_reason: str | None = None):
    return SimpleNamespace(state=state, model_id=model_id, holding=holding, machine=SimpleNamespace(
        policy=SimpleNamespace(parallel=parallel), in_flight=set(range(in_flight)), failure_reason=failure_reason))


def fleet(*states: S, **options) -> list:
    return [controller(s, model_id=f"m{i}", **options) for i, s in enumerate(states)]


def process(snapshot: ReplicaSnapshot) -> tuple[str, int]:
    return snapshot.state, snapshot.free_slots


@pytest.mark.parametrize("states, expected", [
    ([S.READY], ("ready", 4)),
    ([S.SLEEPING], ("asleep", 0)),
    ([S.UNLOADING], ("asleep", 0)),  # going to sleep: taking a request costs a wake
    ([S.WAKING], ("waking", 0)),
    ([S.LOADING], ("waking", 0)),
    ([S.STARTING], ("waking", 0)),
    ([S.FAILED], ("failed", 0)),
    ([S.STOPPING], ("stopping", 0)),
    # A fleet: awake if any model is; the free slots of the ready ones.
    ([S.READY, S.SLEEPING], ("ready", 4)),
    ([S.READY, S.READY], ("ready", 8)),
    ([S.SLEEPING, S.WAKING], ("waking", 0)),
    ([S.FAILED, S.SLEEPING], ("asleep", 0)),  # one model can still be woken
    ([S.FAILED, S.FAILED], ("failed", 0)),
    ([S.READY, S.STOPPING], ("stopping", 0)),
])
def test_the_process_snapshot_of_a_fleet(states, expected):
    assert process(snapshot_of(fleet(*states))) == expected


def test_snapshot_counts_busy_slots():
    assert process(snapshot_of(fleet(S.READY, parallel=2, in_flight=1))) == ("ready", 1)
    # More in flight than slots (the worker queues): none free, never negative.
    assert process(snapshot_of(fleet(S.READY, parallel=2, in_flight=5))) == ("ready", 0)


def test_each_model_answers_for_itself():
    """A fleet on one replica: every model is in its own tier of its own
    backend; a failed one is down without taking the others with it."""
    replica = snapshot_of([controller(S.READY, model_id="chat", in_flight=1),
                           controller(S.SLEEPING, model_id="coder"),
                           controller(S.FAILED, model_id="embed", failure_reason="bad template"),
                           controller(S.WAKING, model_id="rerank")])
    replies = {name: [agent_reply(replica.model(name), role) for role in (SERVE, WARM, WAKE, OVERFLOW)]
               for name in ("chat", "coder", "embed", "rerank", "absent")}
    assert replies == {
        "chat": [FULL, OFF, OFF, FULL],
        "coder": [OFF, OFF, FULL, FULL],
        "embed": [DOWN] * 4,
        "rerank": [OFF, FULL, OFF, FULL],
        "absent": [DOWN] * 4,  # not one of this replica's models
    }
    assert replica.model("chat") == ReplicaSnapshot("ready", 3)


def test_a_retried_load_after_a_failure_stays_down_until_ready():
    # The backoff's retry is a load like any other, but the last one failed:
    # requests sent to it would most likely wait for another failure.
    retrying = snapshot_of([controller(S.LOADING, model_id="coder", failure_reason="bad template")])
    assert agent_reply(retrying.model("coder"), WARM) == DOWN
    first_load = snapshot_of([controller(S.LOADING, model_id="coder")])
    assert agent_reply(first_load.model("coder"), WARM) == FULL


def test_a_model_held_for_another_models_load_takes_no_new_requests():
    # The fleet holds a busy model's new requests while another model waits
    # for its memory: other replicas should take them meanwhile.
    held = snapshot_of([controller(S.READY, model_id="chat", holding=True), controller(S.SLEEPING, model_id="x")])
    assert agent_reply(held.model("chat"), SERVE) == OFF
    assert agent_reply(held.model("chat"), OVERFLOW) == FULL


def test_a_fleet_of_one_answers_for_any_model_name():
    # Its HTTP routes serve every request with its one model (Fleet.route).
    one = snapshot_of([controller(S.READY, model_id="default")])
    assert agent_reply(one.model("chat"), SERVE) == FULL
    assert agent_reply(one.model("anything"), SERVE) == FULL


def test_a_router_of_one_answers_for_its_names_only_and_aliases_everywhere():
    # A daemon configured as a router (Fleet.any_name false) answers only its models' names, as its
    # HTTP routes do; an alias means its model, whatever the fleet's size.
    router = snapshot_of([controller(S.READY, model_id="chat")], any_name=False, aliases={"gpt": "chat"})
    assert [agent_reply(router.model(name), SERVE) for name in ("chat", "gpt", "anything")] == [FULL, FULL, DOWN]
    two = snapshot_of([controller(S.READY, model_id="chat"), controller(S.SLEEPING, model_id="coder")],
                      aliases={"code": "coder"})
    assert two.model("code") == two.model("coder") != two.model("chat")


def test_made_up_names_grow_nothing_the_agent_keeps():
    # Anyone who reaches the agent port may ask about endless names: a daemon that serves any name
    # keeps one entry for them all, a router none for a name it does not serve, and the count of
    # questions asked stops growing at its bound.
    for any_name in (True, False):
        agent = Agent(lambda: snapshot_of([controller(S.SLEEPING, model_id="chat")], any_name), Quiet(), clock=Clock())
        for i in range(MAX_QUESTIONS_COUNTED * 2):
            agent.reply(Question(SERVE, f"made-up-{i}"))
        assert set(agent._tiers) <= {"chat"} and set(agent._held) <= {"chat"}


async def test_the_count_of_questions_is_bounded_over_a_socket():
    agent = await start_agent("127.0.0.1", 0, lambda: snapshot_of([controller(S.READY, model_id="chat")]), Quiet())
    port = agent.server.sockets[0].getsockname()[1]
    try:
        for i in range(MAX_QUESTIONS_COUNTED + 20):
            assert await ask(port, f"serve made-up-{i}\n".encode()) == FULL  # any name: the one model
        assert len(agent.answered) == MAX_QUESTIONS_COUNTED
        assert await ask(port, b"serve made-up-0\n") == FULL
        assert agent.answered[Question(SERVE, "made-up-0")] == 2  # a question already counted still counts
    finally:
        agent.close()


def test_stopping_says_zero_for_every_model():
    stopping = snapshot_of([controller(S.READY, model_id="chat"), controller(S.STOPPING, model_id="coder")])
    assert [agent_reply(stopping.model(name), SERVE) for name in ("chat", "coder", "absent")] == [OFF] * 3


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


async def test_agent_over_a_socket_answers_by_role_and_model_and_drains():
    states = {"chat": S.SLEEPING, "coder": S.FAILED}
    agent = await start_agent("127.0.0.1", 0, lambda: snapshot_of(
        [controller(state, model_id=name) for name, state in states.items()]), Quiet())
    port = agent.server.sockets[0].getsockname()[1]
    try:
        assert await ask(port, b"serve chat\n") == deep(OFF)  # asleep: the stats page says its tier
        assert await ask(port, b"wake chat\n") == deep(FULL)
        assert await ask(port, b"wake coder\n") == DOWN
        states["chat"] = S.READY
        assert await ask(port, b"serve chat\n") == FULL
        # No model named: the process's answer (awake: chat is).
        assert await ask(port, b"serve\n") == FULL
        # A plain agent-check sends nothing: the serve answer, once the role wait is over.
        assert await ask(port, None) == FULL
        # The drain grace: every role of every model says 0 while the daemon still serves.
        agent.drain()
        assert [await ask(port, q) for q in (b"serve chat\n", b"warm chat\n", b"wake chat\n", b"overflow chat\n",
                                             b"serve coder\n", b"serve\n")] == [OFF] * 6
        assert agent.answered == {Question(SERVE, "chat"): 3, Question(SERVE, None): 3, Question(WAKE, "chat"): 2,
                                  Question(WAKE, "coder"): 1, Question(WARM, "chat"): 1, Question(OVERFLOW, "chat"): 1,
                                  Question(SERVE, "coder"): 1}
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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def held_agent(states: dict[str, S]):
    clock = Clock()
    agent = Agent(lambda: snapshot_of([controller(state, model_id=name) for name, state in states.items()]),
                  Quiet(), clock=clock)
    return agent, clock


def deep(line: str) -> str:
    """A line as a model in the deep sleep tier answers it: its tier after the weight."""
    return f"{line.rstrip()} #deep\n"


def answers(agent: Agent, model: str) -> list[str]:
    return [agent.reply(Question(role, model)) for role in (SERVE, WARM, WAKE, OVERFLOW)]


def test_a_warmer_tier_is_made_before_the_colder_one_breaks():
    """HAProxy asks each line on its own timer: the line of the tier a model
    leaves for a warmer one stays on a moment, so that there is no instant
    with neither on (another replica's sleeper would be woken in it)."""
    states = {"chat": S.SLEEPING, "coder": S.SLEEPING}
    agent, clock = held_agent(states)
    assert answers(agent, "chat") == [deep(OFF), deep(OFF), deep(FULL), deep(FULL)]
    states["chat"] = S.WAKING
    assert answers(agent, "chat") == [OFF, FULL, FULL, FULL]  # wake held while warm is on
    clock.now += TIER_HOLD_SECONDS / 2
    states["chat"] = S.READY
    assert answers(agent, "chat") == [FULL, FULL, FULL, FULL]  # warm held too; wake's hold still running
    clock.now += TIER_HOLD_SECONDS / 2
    assert answers(agent, "chat") == [FULL, FULL, OFF, FULL]  # wake's hold is over
    clock.now += TIER_HOLD_SECONDS / 2
    assert answers(agent, "chat") == [FULL, OFF, OFF, FULL]  # and warm's: the table's answer
    assert answers(agent, "coder") == [deep(OFF), deep(OFF), deep(FULL), deep(FULL)]  # per model: coder never moved


@pytest.mark.parametrize("colder", [S.UNLOADING, S.FAILED, S.STOPPING])
def test_a_colder_tier_takes_effect_at_once(colder):
    states = {"chat": S.SLEEPING, "coder": S.SLEEPING}
    agent, clock = held_agent(states)
    answers(agent, "chat")
    states["chat"] = S.READY
    assert answers(agent, "chat")[:3] == [FULL, OFF, FULL]  # wake held
    states["chat"] = colder
    expected = {S.UNLOADING: [deep(OFF), deep(OFF), deep(FULL), deep(FULL)], S.FAILED: [DOWN] * 4,
                S.STOPPING: [OFF] * 4}[colder]
    assert answers(agent, "chat") == expected  # no hold left over


def test_busy_sheds_at_once_and_the_drain_clears_every_hold():
    states = {"chat": S.WAKING, "coder": S.SLEEPING}
    agent, clock = held_agent(states)
    answers(agent, "chat")
    states["chat"] = S.READY
    assert answers(agent, "chat")[:2] == [FULL, FULL]  # warm held
    agent._snapshot = lambda: snapshot_of([controller(S.READY, model_id="chat", parallel=1, in_flight=1),
                                           controller(S.SLEEPING, model_id="coder")])
    assert answers(agent, "chat") == [OFF, OFF, OFF, FULL]  # busy: out of the first backend now
    agent._snapshot = lambda: snapshot_of([controller(S.READY, model_id="chat"), controller(S.SLEEPING, model_id="coder")])
    answers(agent, "chat")
    agent.drain()
    assert answers(agent, "chat") == [OFF] * 4 and answers(agent, "coder") == [OFF] * 4


def test_a_wake_that_ends_busy_keeps_its_warm_line_for_haproxys_late_retries():
    """A replica that woke with more requests than slots: its warm line stays
    on for WOKEN_BUSY_HOLD_SECONDS (HAProxy retries a refused connection after
    1 s, within the backend it chose), also once a slot frees, until the serve
    line has surely been asked again; then the table's answer."""
    states = {"chat": S.SLEEPING, "coder": S.SLEEPING}
    agent, clock = held_agent(states)
    answers(agent, "chat")
    states["chat"] = S.WAKING
    answers(agent, "chat")
    busy = lambda: snapshot_of([controller(S.READY, model_id="chat", parallel=1, in_flight=1),  # noqa: E731
                                controller(S.SLEEPING, model_id="coder")])
    agent._snapshot = busy
    assert answers(agent, "chat")[:2] == [OFF, FULL]  # busy, and the warm line still on
    clock.now += WOKEN_BUSY_HOLD_SECONDS / 2
    agent._snapshot = lambda: snapshot_of([controller(S.READY, model_id="chat"), controller(S.SLEEPING, model_id="coder")])
    assert answers(agent, "chat")[:2] == [FULL, FULL]  # a slot free: serve on, warm still held
    clock.now += WOKEN_BUSY_HOLD_SECONDS
    assert answers(agent, "chat")[:3] == [FULL, OFF, OFF]  # the hold is over


def test_busy_from_serving_holds_nothing():
    states = {"chat": S.READY, "coder": S.SLEEPING}
    agent, clock = held_agent(states)
    assert answers(agent, "chat")[:3] == [FULL, OFF, OFF]
    agent._snapshot = lambda: snapshot_of([controller(S.READY, model_id="chat", parallel=1, in_flight=1),
                                           controller(S.SLEEPING, model_id="coder")])
    assert answers(agent, "chat") == [OFF, OFF, OFF, FULL]  # off the ring at once: bounded load

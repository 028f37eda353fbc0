"""The server state machine, row by row. Pure: no asyncio, no processes."""

import itertools

import pytest

from statemachine import (
    TRANSITIONS,
    ArmIdleTimer,
    ArmRetryTimer,
    CancelRequest,
    DisarmIdleTimer,
    Dispatch,
    DozeCompleted,
    Exit,
    FailRequests,
    IdleTimerFired,
    InvalidTransition,
    LoadNotAdmitted,
    PolicyChanged,
    Policy,
    Reject,
    Reply,
    RequestAbandoned,
    RequestArrived,
    RequestFinished,
    RetryTimerFired,
    ServerMachine,
    ServerState as S,
    SleepCompleted,
    SleepRequested,
    Started,
    StartWorker,
    StopRequested,
    StopWorker,
    WakeRequested,
    WorkerExited,
    WorkerLoadFailed,
    WorkerReady,
)
from statemachine.events import Event


def kinds(commands):
    return [type(c) for c in commands]


def machine_in(state: S, **policy) -> ServerMachine:
    """Drive a fresh machine into `state` through real events."""
    m = ServerMachine(Policy(idle_seconds=10, parallel=2, max_queued=2, **policy))
    if state is S.STARTING:
        return m
    m.handle(Started())
    if state is S.LOADING:
        return m
    if state is S.FAILED:
        m.handle(WorkerLoadFailed("boom"))
        return m
    m.handle(WorkerReady(2))
    if state is S.READY:
        return m
    if state in (S.DOZING, S.DROWSY, S.ROUSING):
        m.handle(SleepRequested(1, tier="drowsy"))
        if state is S.DOZING:
            return m
        m.handle(DozeCompleted())
        if state is S.DROWSY:
            return m
        m.handle(WakeRequested())
        return m
    if state is S.LIGHT_SLEEP:
        m.handle(SleepRequested(1, tier="light"))
        m.handle(SleepCompleted())
        return m
    if state is S.STOPPING:
        m.handle(StopRequested())
        return m
    m.handle(IdleTimerFired(m.idle_generation))
    if state is S.UNLOADING:
        return m
    m.handle(SleepCompleted())
    if state is S.SLEEPING:
        return m
    m.handle(WakeRequested())
    assert state is S.WAKING
    return m


@pytest.mark.parametrize("state", list(S))
def test_machine_in_reaches_each_state(state):
    assert machine_in(state).state is state


def test_every_row_is_exercised_and_returns_commands():
    """Each row of the table runs from its state without raising."""
    samples = {
        Started: Started(), WorkerReady: WorkerReady(2), WorkerLoadFailed: WorkerLoadFailed("x"),
        WorkerExited: WorkerExited("x"), SleepCompleted: SleepCompleted(), RequestArrived: RequestArrived("r"),
        RequestFinished: RequestFinished("r"), RequestAbandoned: RequestAbandoned("r"),
        IdleTimerFired: IdleTimerFired(0), RetryTimerFired: RetryTimerFired(0), SleepRequested: SleepRequested(1),
        WakeRequested: WakeRequested(1), StopRequested: StopRequested(), PolicyChanged: PolicyChanged(Policy()),
        LoadNotAdmitted: LoadNotAdmitted("x"), DozeCompleted: DozeCompleted(),
    }
    for (state, event_type) in TRANSITIONS:
        m = machine_in(state)
        commands = m.handle(samples[event_type])
        assert isinstance(commands, list), (state, event_type)


def test_an_event_without_a_row_raises():
    missing = [(s, e) for s, e in itertools.product(S, Event.__subclasses__()) if (s, e) not in TRANSITIONS]
    assert missing, "the table should not accept everything everywhere"
    for state, event_type in missing:
        m = machine_in(state)
        sample = {Started: Started(), WorkerReady: WorkerReady(1), WorkerLoadFailed: WorkerLoadFailed("x"),
                  WorkerExited: WorkerExited("x"), SleepCompleted: SleepCompleted(),
                  RequestFinished: RequestFinished("r"), LoadNotAdmitted: LoadNotAdmitted("x"),
                  DozeCompleted: DozeCompleted(), IdleTimerFired: IdleTimerFired(0)}[event_type]
        with pytest.raises(InvalidTransition):
            m.handle(sample)


def test_start_loads_then_ready_arms_idle_timer():
    m = ServerMachine(Policy(idle_seconds=5))
    assert kinds(m.handle(Started())) == [StartWorker]
    assert m.state is S.LOADING
    commands = m.handle(WorkerReady(4))
    assert m.state is S.READY
    assert commands == [ArmIdleTimer(5, m.idle_generation)]


def test_never_sleep_arms_no_timer():
    m = ServerMachine(Policy(idle_seconds=-1))
    m.handle(Started())
    assert m.handle(WorkerReady(4)) == []


def test_request_in_ready_dispatches_and_disarms_then_rearms_when_done():
    m = machine_in(S.READY)
    commands = m.handle(RequestArrived("a"))
    assert kinds(commands) == [DisarmIdleTimer, Dispatch]
    assert m.in_flight == {"a"}
    assert kinds(m.handle(RequestFinished("a"))) == [ArmIdleTimer]


def test_idle_timer_is_not_armed_while_anything_is_in_flight():
    m = machine_in(S.READY)
    m.handle(RequestArrived("a"))
    m.handle(RequestArrived("b"))
    assert m.handle(RequestFinished("a")) == []
    assert kinds(m.handle(RequestFinished("b"))) == [ArmIdleTimer]


def test_stale_idle_timer_does_not_unload():
    """The timer fired just as a request was accepted: the request wins."""
    m = machine_in(S.READY)
    old = m.idle_generation
    m.handle(RequestArrived("a"))
    assert m.handle(IdleTimerFired(old)) == []
    assert m.state is S.READY
    m.handle(RequestFinished("a"))
    assert m.handle(IdleTimerFired(old)) == []  # superseded by the new arming
    assert m.state is S.READY


def test_current_idle_timer_unloads():
    m = machine_in(S.READY)
    assert kinds(m.handle(IdleTimerFired(m.idle_generation))) == [StopWorker]
    assert m.state is S.UNLOADING


def test_requests_while_sleeping_cause_one_wake_and_are_dispatched_together():
    m = machine_in(S.SLEEPING)
    assert kinds(m.handle(RequestArrived("a"))) == [StartWorker]
    assert m.state is S.WAKING
    assert m.handle(RequestArrived("b")) == []
    commands = m.handle(WorkerReady(2))
    assert m.state is S.READY
    assert commands == [Dispatch(("a", "b"))]


def test_request_during_unloading_wakes_right_after():
    m = machine_in(S.UNLOADING)
    assert m.handle(RequestArrived("a")) == []
    assert kinds(m.handle(SleepCompleted())) == [StartWorker]
    assert m.state is S.WAKING


def test_capacity_bound_rejects_with_retry_after():
    m = machine_in(S.SLEEPING)  # capacity = parallel 2 + queued 2
    for rid in "abcd":
        m.handle(RequestArrived(rid))
    (reject,) = m.handle(RequestArrived("e"))
    assert isinstance(reject, Reject) and reject.code == "queue_full" and reject.retry_after


def test_load_failure_rejects_waiters_and_backs_off():
    m = machine_in(S.SLEEPING, retry_base_seconds=1, retry_max_seconds=3)
    m.handle(RequestArrived("a"))
    commands = m.handle(WorkerLoadFailed("bad file"))
    assert m.state is S.FAILED
    reject, retry = commands
    assert reject.request_ids == ("a",) and "bad file" in reject.reason
    assert retry == ArmRetryTimer(1, m.retry_generation)
    m.handle(RetryTimerFired(m.retry_generation))
    m.handle(WorkerExited("crashed"))
    m.handle(RetryTimerFired(m.retry_generation))
    (retry,) = [c for c in m.handle(WorkerLoadFailed("again")) if isinstance(c, ArmRetryTimer)]
    assert retry.seconds == 3  # 1, 2, then capped at 3


def test_failed_rejects_requests_naming_the_cause():
    m = machine_in(S.FAILED)
    (reject,) = m.handle(RequestArrived("a"))
    assert "boom" in reject.reason and reject.code == "model_unavailable"


def test_wake_from_failed_retries_and_makes_pending_retry_stale():
    m = machine_in(S.FAILED)
    stale = m.retry_generation
    assert kinds(m.handle(WakeRequested(7))) == [StartWorker, Reply]
    assert m.state is S.LOADING
    m.handle(WorkerLoadFailed("x"))
    assert m.handle(RetryTimerFired(stale)) == []


def test_worker_crash_while_ready_fails_in_flight_and_sleeps():
    m = machine_in(S.READY)
    m.handle(RequestArrived("a"))
    commands = m.handle(WorkerExited("SIGKILL"))
    assert m.state is S.SLEEPING
    (fail,) = [c for c in commands if isinstance(c, FailRequests)]
    assert fail.request_ids == ("a",)
    assert not m.in_flight


def test_abandon_waiting_removes_and_abandon_in_flight_cancels():
    m = machine_in(S.SLEEPING)
    m.handle(RequestArrived("a"))
    assert m.handle(RequestAbandoned("a")) == []
    assert not m.waiting
    m = machine_in(S.READY)
    m.handle(RequestArrived("b"))
    assert m.handle(RequestAbandoned("b")) == [CancelRequest("b")]


def test_admin_sleep_refused_while_busy_and_accepted_when_idle():
    m = machine_in(S.READY)
    m.handle(RequestArrived("a"))
    (reply,) = m.handle(SleepRequested(3))
    assert reply == Reply(3, False, "busy: 1 requests in flight")
    m.handle(RequestFinished("a"))
    commands = m.handle(SleepRequested(4))
    assert m.state is S.UNLOADING
    assert kinds(commands) == [DisarmIdleTimer, StopWorker, Reply]


def test_wake_while_unloading_wakes_after_teardown():
    m = machine_in(S.UNLOADING)
    m.handle(WakeRequested(1))
    assert kinds(m.handle(SleepCompleted())) == [StartWorker]


def test_stop_drains_in_flight_then_tears_down_then_exits():
    m = machine_in(S.READY)
    m.handle(RequestArrived("a"))
    commands = m.handle(StopRequested())
    assert m.state is S.STOPPING and StopWorker not in kinds(commands)
    (reject,) = m.handle(RequestArrived("late"))
    assert reject.code == "shutting_down"
    assert kinds(m.handle(RequestFinished("a"))) == [StopWorker]
    assert kinds(m.handle(SleepCompleted())) == [Exit]


def test_stop_while_sleeping_exits_at_once():
    m = machine_in(S.SLEEPING)
    assert kinds(m.handle(StopRequested())) == [DisarmIdleTimer, Exit]


def test_policy_change_rearms_idle_timer_with_new_timeout():
    m = machine_in(S.READY)
    commands = m.handle(PolicyChanged(Policy(idle_seconds=42)))
    assert commands[-1] == ArmIdleTimer(42, m.idle_generation)


def test_start_and_stop_commands_carry_their_reason():
    m = ServerMachine(Policy(idle_seconds=5))
    assert m.handle(Started()) == [StartWorker("startup")]
    m.handle(WorkerReady(2))
    assert m.handle(IdleTimerFired(m.idle_generation)) == [StopWorker("idle")]
    m.handle(WakeRequested(1))  # asked during the teardown
    assert m.handle(SleepCompleted()) == [StartWorker("admin")]
    m.handle(WorkerReady(2))
    assert StopWorker("admin") in m.handle(SleepRequested(2))
    m.handle(SleepCompleted())
    assert m.handle(RequestArrived("a")) == [StartWorker("request")]
    m.handle(WorkerLoadFailed("x"))
    assert m.handle(RetryTimerFired(m.retry_generation)) == [StartWorker("retry")]
    m.handle(WorkerReady(2))
    assert StopWorker("shutdown") in m.handle(StopRequested())


def test_load_not_admitted_sleeps_and_rejects_the_waiters_with_its_reason():
    from statemachine import LoadNotAdmitted

    m = machine_in(S.SLEEPING)
    m.handle(RequestArrived("r1"))
    assert m.state is S.WAKING
    commands = m.handle(LoadNotAdmitted("model b needs 4096 MiB", "insufficient_memory", 5.0))
    assert m.state is S.SLEEPING and not m.waiting and not m.worker_up
    assert commands == [Reject(("r1",), "model b needs 4096 MiB", "insufficient_memory", 5.0)]
    # The next request tries again.
    assert kinds(m.handle(RequestArrived("r2"))) == [StartWorker]


def test_eviction_is_a_sleep_with_its_own_reason():
    m = machine_in(S.READY)
    commands = m.handle(SleepRequested(7, reason="evict"))
    assert m.state is S.UNLOADING
    assert StopWorker("evict") in commands and Reply(7, True, "going to sleep") in commands
    busy = machine_in(S.READY)
    busy.handle(RequestArrived("r"))
    assert busy.handle(SleepRequested(8, reason="evict"))[0].ok is False  # never a busy model


def test_a_lazy_model_starts_asleep_and_loads_on_its_first_request():
    m = ServerMachine(Policy())
    assert m.handle(Started(load=False)) == [] and m.state is S.SLEEPING
    assert kinds(m.handle(RequestArrived("r"))) == [StartWorker] and m.state is S.WAKING


# -- keep_alive (Ollama's): the latest accepted request's decides how long the model stays awake once idle --

def _ready_machine(idle: float) -> ServerMachine:
    m = ServerMachine(Policy(idle_seconds=idle))
    m.handle(Started())
    m.handle(WorkerReady(1, {}))
    return m


def _finish(m: ServerMachine, rid: str, keep_alive) -> list:
    m.handle(RequestArrived(rid, keep_alive))
    return m.handle(RequestFinished(rid, ok=True))


@pytest.mark.parametrize("idle, keep_alive, armed", [
    (300, None, 300), (300, 0, 0), (300, 10, 300), (300, 900, 900), (300, -1, None),
    (-1, None, None), (-1, 0, 0), (-1, 60, None), (0.5, 2.5, 2.5),
])
def test_keep_alive_sets_the_idle_timer(idle, keep_alive, armed):
    commands = _finish(_ready_machine(idle), "r1", keep_alive)
    timers = [c for c in commands if isinstance(c, ArmIdleTimer)]
    assert [t.seconds for t in timers] == ([] if armed is None else [armed])


def test_the_latest_accepted_request_decides_and_a_rejected_one_does_not():
    m = ServerMachine(Policy(idle_seconds=300, parallel=1, max_queued=0))
    m.handle(Started())
    m.handle(WorkerReady(1, {}))
    m.handle(RequestArrived("r1", 0))
    refused = m.handle(RequestArrived("r2", -1))  # over capacity: rejected, its keep_alive ignored
    assert any(isinstance(c, Reject) for c in refused)
    assert m.keep_alive == 0
    timers = [c for c in m.handle(RequestFinished("r1", ok=True)) if isinstance(c, ArmIdleTimer)]
    assert [t.seconds for t in timers] == [0]
    # The next request without keep_alive goes back to the policy.
    timers = [c for c in _finish(m, "r3", None) if isinstance(c, ArmIdleTimer)]
    assert [t.seconds for t in timers] == [300]


def test_a_wake_asked_for_after_a_keep_alive_0_unload_stays_awake():
    # Ollama's keep_alive 0 put the model to sleep; POST /wake (or /models/load) must not
    # send it straight back to sleep with that request's keep_alive.
    m = _ready_machine(300)
    timers = [c for c in _finish(m, "r1", 0) if isinstance(c, ArmIdleTimer)]
    assert [t.seconds for t in timers] == [0]
    m.handle(IdleTimerFired(m.idle_generation))
    m.handle(SleepCompleted())
    assert m.state is S.SLEEPING
    assert isinstance(m.handle(WakeRequested(1))[0], StartWorker)
    timers = [c for c in m.handle(WorkerReady(2, {})) if isinstance(c, ArmIdleTimer)]
    assert [t.seconds for t in timers] == [300]


@pytest.mark.parametrize("permanent", [False, True])
def test_a_permanent_load_failure_arms_no_retry(permanent):
    m = ServerMachine(Policy(retry_max_seconds=60))
    m.handle(Started())
    commands = m.handle(WorkerLoadFailed("chat template: unknown tag", permanent=permanent))
    assert m.state is S.FAILED
    assert any(isinstance(c, ArmRetryTimer) for c in commands) is not permanent
    refused = m.handle(RequestArrived("r1"))
    assert [type(c) for c in refused] == [Reject]
    assert ("loading again cannot help" in refused[0].reason) is permanent
    assert refused[0].retry_after == (60 if permanent else 1.0)
    assert isinstance(m.handle(WakeRequested(1))[0], StartWorker)  # the operator may always ask again

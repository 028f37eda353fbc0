"""The sleep tiers in the state machine, row by row: drowsy (DOZING, DROWSY,
ROUSING), light (LIGHT_SLEEP, the keeper) and deep (SLEEPING). Pure."""

import pytest

from statemachine import (ArmIdleTimer, DisarmIdleTimer, Dispatch, Doze, DozeCompleted, Exit, IdleTimerFired, Policy,
                          PolicyChanged, ReleaseKeeper, Reply, RequestArrived, RequestFinished, Rouse, ServerMachine,
                          ServerState as S, SleepCompleted, SleepRequested, Started, StartWorker, StopRequested,
                          StopWorker, WakeRequested, WorkerExited, WorkerLoadFailed, WorkerReady)
from statemachine.states import HEALTHY_STATES, TIER_OF_STATE


def kinds(commands):
    return [type(c) for c in commands]


def ready(**policy) -> ServerMachine:
    m = ServerMachine(Policy(**{"idle_seconds": 10, "parallel": 2, "max_queued": 2, **policy}))
    m.handle(Started())
    m.handle(WorkerReady(2))
    return m


def fire(m: ServerMachine):
    return m.handle(IdleTimerFired(m.idle_generation))


def test_defaults_are_todays_sleep_deep_at_once_and_no_drowsy():
    m = ready()
    assert m.policy.sleep_tier == "deep"
    commands = fire(m)
    assert m.state is S.UNLOADING and commands == [StopWorker("idle", "deep")]
    assert m.handle(SleepCompleted()) == [] and m.state is S.SLEEPING and m.tier == "deep"


def test_drowsy_then_light_then_deep_escalate_with_idle_time():
    m = ready(drowsy_seconds=2, deep_after_seconds=30)
    armed = m._arm_idle_if_quiet()
    assert armed == [ArmIdleTimer(2, m.idle_generation)]  # drowsy first
    assert fire(m) == [Doze()] and m.state is S.DOZING and m.tier == "drowsy"
    commands = m.handle(DozeCompleted())
    assert m.state is S.DROWSY and commands == [ArmIdleTimer(8, m.idle_generation)]  # 10 s idle in all
    assert fire(m) == [StopWorker("idle", "light")] and m.state is S.UNLOADING and m.keeper_held and m.tier == "light"
    commands = m.handle(SleepCompleted())
    assert m.state is S.LIGHT_SLEEP and commands == [ArmIdleTimer(30, m.idle_generation)]
    assert fire(m) == [ReleaseKeeper()] and m.state is S.SLEEPING and not m.keeper_held


def test_drowsy_is_skipped_when_not_shorter_than_the_sleep_or_keep_alive_is_zero():
    m = ready(drowsy_seconds=20)
    assert kinds(m._arm_idle_if_quiet()) == [ArmIdleTimer] and m.idle_target == "sleep"
    m = ready(drowsy_seconds=1)
    m.handle(RequestArrived("r", keep_alive=0))
    m.handle(RequestFinished("r"))
    assert m.idle_target == "sleep"  # keep_alive 0: asleep at once, no stop on the way
    m = ready(drowsy_seconds=1, idle_seconds=-1)
    m._arm_idle_if_quiet()
    assert m.idle_target == "drowsy"  # never asleep, but drowsy


def test_a_light_model_never_goes_deep_with_deep_after_minus_one():
    m = ready(deep_after_seconds=-1)
    fire(m)
    assert m.handle(SleepCompleted()) == [] and m.state is S.LIGHT_SLEEP


def test_a_light_sleep_asked_by_name_stays_light_when_the_policy_has_no_light_tier():
    m = ready()  # deep_after 0: an idle sleep is deep at once
    assert StopWorker("admin", "light") in m.handle(SleepRequested(1, tier="light"))
    assert m.handle(SleepCompleted()) == [] and m.state is S.LIGHT_SLEEP and m.keeper_held  # no 0 s timer
    assert ReleaseKeeper() in m.handle(SleepRequested(2, tier="deep")) and m.state is S.SLEEPING
    m = ready(deep_after_seconds=5)
    m.handle(SleepRequested(1, tier="light"))
    assert m.handle(SleepCompleted()) == [ArmIdleTimer(5, m.idle_generation)]


def test_a_request_while_drowsy_rouses_and_is_dispatched_on_ready():
    m = ready(drowsy_seconds=1)
    m._arm_idle_if_quiet()
    fire(m)
    m.handle(DozeCompleted())
    commands = m.handle(RequestArrived("r"))
    assert m.state is S.ROUSING and Rouse("request") in commands and DisarmIdleTimer() in commands
    commands = m.handle(WorkerReady(2))
    assert m.state is S.READY and Dispatch(("r",)) in commands


def test_a_request_while_dozing_waits_and_the_doze_ends_in_a_rouse():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    assert m.handle(RequestArrived("r")) == [] and m.state is S.DOZING
    assert m.handle(DozeCompleted()) == [Rouse("request")] and m.state is S.ROUSING


def test_a_request_while_light_wakes_and_the_keeper_goes_once_ready():
    m = ready(deep_after_seconds=-1)
    fire(m)
    m.handle(SleepCompleted())
    commands = m.handle(RequestArrived("r"))
    assert m.state is S.WAKING and StartWorker("request") in commands and ReleaseKeeper() not in commands
    commands = m.handle(WorkerReady(2))
    assert commands[:2] == [ReleaseKeeper(), Dispatch(("r",))] and not m.keeper_held


def test_a_failed_wake_from_light_lets_the_keeper_go():
    m = ready(deep_after_seconds=-1)
    fire(m)
    m.handle(SleepCompleted())
    m.handle(RequestArrived("r"))
    assert ReleaseKeeper() in m.handle(WorkerLoadFailed("boom")) and m.state is S.FAILED


@pytest.mark.parametrize("tier, state, tier_after", [("drowsy", S.DOZING, "drowsy"), ("light", S.UNLOADING, "light"),
                                                     ("deep", S.UNLOADING, "deep"), (None, S.UNLOADING, "deep")])
def test_post_sleep_takes_a_tier(tier, state, tier_after):
    m = ready()
    commands = m.handle(SleepRequested(7, tier=tier))
    assert m.state is state and m.tier == tier_after and Reply(7, True, "dozing" if tier == "drowsy" else "going to sleep") in commands


def test_sleep_deeper_from_drowsy_and_from_light():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    m.handle(DozeCompleted())
    assert m.handle(SleepRequested(2, tier="drowsy")) == [Reply(2, True, "already drowsy")]
    assert StopWorker("admin", "light") in m.handle(SleepRequested(3, tier="light"))
    m.handle(SleepCompleted())
    assert m.state is S.LIGHT_SLEEP
    assert m.handle(SleepRequested(4, tier="light")) == [Reply(4, True, "already asleep (light)")]
    commands = m.handle(SleepRequested(5, tier="deep"))
    assert m.state is S.SLEEPING and ReleaseKeeper() in commands
    assert m.handle(SleepRequested(6, tier="light")) == [Reply(6, True, "already asleep")]


def test_deep_asked_while_unloading_to_light_releases_the_keeper_once_unloaded():
    m = ready()
    m.handle(SleepRequested(1, tier="light"))
    assert m.handle(SleepRequested(2, tier="deep"))[0].ok
    assert m.handle(SleepCompleted()) == [ReleaseKeeper()] and m.state is S.SLEEPING


def test_sleep_refused_while_rousing_and_drowsy_sleep_refused_while_asleep():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    m.handle(DozeCompleted())
    m.handle(WakeRequested(2))
    assert m.state is S.ROUSING
    assert not m.handle(SleepRequested(3, tier="deep"))[0].ok
    m = ready()
    m.handle(SleepRequested(1))
    m.handle(SleepCompleted())
    assert m.handle(SleepRequested(2, tier="drowsy")) == [Reply(2, True, "already asleep")]


def test_wake_from_each_tier():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    assert m.handle(WakeRequested(2)) == [Reply(2, True, "will rouse once dozed")]
    assert m.handle(DozeCompleted()) == [Rouse("admin")]
    m = ready(deep_after_seconds=-1)
    m.handle(SleepRequested(1))
    m.handle(SleepCompleted())
    assert StartWorker("admin") in m.handle(WakeRequested(2)) and m.state is S.WAKING


def test_a_drowsy_worker_that_dies_leaves_the_model_deep_or_wakes_a_new_one_for_waiters():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    m.handle(DozeCompleted())
    m.handle(WorkerExited("killed"))
    assert m.state is S.SLEEPING and not m.worker_up
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    m.handle(RequestArrived("r"))
    assert StartWorker("request") in m.handle(WorkerExited("killed")) and m.state is S.WAKING


def test_a_rouse_that_fails_is_a_failed_load():
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    m.handle(DozeCompleted())
    m.handle(RequestArrived("r"))
    commands = m.handle(WorkerLoadFailed("cannot create context"))
    assert m.state is S.FAILED and any(getattr(c, "request_ids", ()) == ("r",) for c in commands)


@pytest.mark.parametrize("via", ["dozing", "rousing"])
def test_stop_while_dozing_or_rousing_waits_for_it_then_stops(via):
    m = ready()
    m.handle(SleepRequested(1, tier="drowsy"))
    if via == "rousing":
        m.handle(DozeCompleted())
        m.handle(WakeRequested(2))
    assert StopWorker not in kinds(m.handle(StopRequested()))
    outcome = DozeCompleted() if via == "dozing" else WorkerReady(2)
    assert m.handle(outcome) == [StopWorker("shutdown", "deep")]
    assert m.handle(SleepCompleted()) == [Exit()]


def test_stop_while_light_releases_the_keeper_and_exits():
    m = ready(deep_after_seconds=-1)
    fire(m)
    m.handle(SleepCompleted())
    assert m.handle(StopRequested())[-2:] == [ReleaseKeeper(), Exit()]


def test_stale_timers_in_the_tiers_do_nothing():
    m = ready(drowsy_seconds=1, deep_after_seconds=5)
    m._arm_idle_if_quiet()
    fire(m)
    m.handle(DozeCompleted())
    assert m.handle(IdleTimerFired(m.idle_generation - 1)) == [] and m.state is S.DROWSY
    fire(m)
    m.handle(SleepCompleted())
    assert m.handle(IdleTimerFired(m.idle_generation - 1)) == [] and m.state is S.LIGHT_SLEEP


def test_policy_change_rearms_the_tier_timers():
    m = ready(deep_after_seconds=5)
    fire(m)
    m.handle(SleepCompleted())
    commands = m.handle(PolicyChanged(Policy(idle_seconds=10, deep_after_seconds=50)))
    assert ArmIdleTimer(50, m.idle_generation) in commands


def test_every_resting_tier_is_healthy_and_named():
    for state, tier in TIER_OF_STATE.items():
        assert state in HEALTHY_STATES and tier in ("drowsy", "light", "deep")

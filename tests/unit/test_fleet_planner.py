"""The fleet planner, case by case and over random fleets. Pure: no asyncio."""

import random

import pytest

from statemachine import ServerState as S
from statemachine.fleet import EvictFirst, ModelView, Refuse, StartNow, Wait, plan_load

GiB = 2**30


def fleet(*models: ModelView) -> dict[str, ModelView]:
    return {m.id: m for m in models}


def asleep(id: str, size: float, last_used: float = 0, **kw) -> ModelView:
    return ModelView(id, int(size * GiB), False, S.SLEEPING, last_used, **kw)


def loaded(id: str, size: float, last_used: float = 0, **kw) -> ModelView:
    return ModelView(id, int(size * GiB), True, S.READY, last_used, **kw)


def test_fits_beside_what_is_resident():
    models = fleet(loaded("a", 4), asleep("b", 4))
    assert plan_load("b", models, 10 * GiB) == StartNow()


def test_evicts_least_recently_used_first_and_only_as_many_as_needed():
    models = fleet(loaded("old", 3, last_used=1), loaded("mid", 3, last_used=2), loaded("new", 3, last_used=3),
                   asleep("b", 4))
    assert plan_load("b", models, 10 * GiB) == EvictFirst(("old",))
    assert plan_load("b", models, 9 * GiB) == EvictFirst(("old", "mid"))


def test_never_evicts_a_busy_or_pinned_model():
    models = fleet(loaded("busy", 4, last_used=1, busy=True), loaded("pin", 4, last_used=0, pinned=True),
                   loaded("idle", 3, last_used=9), asleep("b", 4))
    decision = plan_load("b", models, 12 * GiB)
    assert decision == EvictFirst(("idle",))
    models = fleet(loaded("busy", 4, busy=True), loaded("pin", 4, pinned=True), asleep("b", 4))
    decision = plan_load("b", models, 10 * GiB)
    assert isinstance(decision, Wait) and "busy models hold 4096 MiB" in decision.reason


def test_one_load_at_a_time():
    models = fleet(ModelView("a", GiB, True, S.WAKING, 0), asleep("b", 1))
    decision = plan_load("b", models, 100 * GiB)
    assert isinstance(decision, Wait) and "a is loading" in decision.reason


def test_waits_for_a_teardown_under_way_rather_than_evicting_more():
    models = fleet(ModelView("going", 4 * GiB, True, S.UNLOADING, 0), loaded("idle", 4, last_used=1), asleep("b", 4))
    decision = plan_load("b", models, 10 * GiB)
    assert isinstance(decision, Wait) and "going to sleep" in decision.reason


def test_refuses_what_can_never_fit_naming_the_sizes():
    decision = plan_load("big", fleet(asleep("big", 12)), 10 * GiB)
    assert isinstance(decision, Refuse)
    assert "12288 MiB" in decision.reason and "10240 MiB" in decision.reason
    # Pinned models holding the room make it wait, not refuse: they sleep when idle all the same.
    decision = plan_load("b", fleet(loaded("pin", 8, pinned=True), asleep("b", 4)), 10 * GiB)
    assert isinstance(decision, Wait)


def test_a_resident_model_starts_at_once():
    assert plan_load("a", fleet(loaded("a", 4)), GiB) == StartNow()


def test_failed_and_sleeping_models_hold_nothing():
    models = fleet(ModelView("f", 8 * GiB, False, S.FAILED, 0), asleep("s", 8), asleep("b", 8))
    assert plan_load("b", models, 10 * GiB) == StartNow()


STATES = [S.READY, S.READY, S.READY, S.SLEEPING, S.SLEEPING, S.UNLOADING, S.WAKING, S.FAILED]


def random_fleet(rng: random.Random) -> dict[str, ModelView]:
    models = {}
    for i in range(rng.randrange(2, 7)):
        state = rng.choice(STATES)
        resident = state in (S.READY, S.UNLOADING) or (state is S.WAKING and rng.random() < 0.5)
        models[f"m{i}"] = ModelView(f"m{i}", rng.randrange(1, 8) * GiB, resident, state, rng.random(),
                                    busy=state is S.READY and rng.random() < 0.3, pinned=rng.random() < 0.15)
    return models


@pytest.mark.parametrize("seed", range(500))
def test_random_fleets(seed):
    rng = random.Random(seed)
    models = random_fleet(rng)
    budget = rng.randrange(4, 20) * GiB
    sleeping = [m for m in models.values() if not m.resident]
    if not sleeping:
        return
    target = rng.choice(sleeping).id
    want = models[target].bytes
    others = [m for m in models.values() if m.id != target and m.resident]
    held = sum(m.bytes for m in others)
    decision = plan_load(target, models, budget)
    if isinstance(decision, StartNow):
        assert held + want <= budget  # never over the budget
        assert not any(m.state in (S.LOADING, S.WAKING) for m in others)  # one load at a time
    elif isinstance(decision, EvictFirst):
        victims = [models[v] for v in decision.victims]
        assert all(v.evictable for v in victims)  # never busy, pinned, loading or the target
        assert target not in decision.victims
        coming_back = sum(m.bytes for m in others if m.state is S.UNLOADING)
        assert held - coming_back - sum(v.bytes for v in victims) + want <= budget  # then it fits
        assert held - coming_back - sum(v.bytes for v in victims[:-1]) + want > budget  # and no more were taken
        rest = [m for m in others if m.evictable and m.id not in decision.victims]
        assert all(m.last_used >= max(v.last_used for v in victims) for m in rest)  # least recently used first
    elif isinstance(decision, Refuse):
        assert want > budget
    else:
        assert isinstance(decision, Wait)
        loading = any(m.state in (S.LOADING, S.WAKING) for m in others)
        evictable = sum(m.bytes for m in others if m.evictable or m.state is S.UNLOADING)
        assert loading or held + want > budget  # it does not fit now
        if not loading and not any(m.state is S.UNLOADING for m in others):
            assert held - evictable + want > budget  # evicting everything it may would not be enough

"""The fleet planner, case by case and over random fleets. Pure: no asyncio."""

import itertools
import random

import pytest

from statemachine import ServerState as S
from statemachine.fleet import Drain, EvictFirst, ModelView, Refuse, StartNow, Wait, fewest_to_free, plan_load

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
    # A busy model is drained (fed nothing new until it is idle), not evicted under its requests.
    models = fleet(loaded("busy", 4, busy=True), loaded("pin", 4, pinned=True), asleep("b", 4))
    decision = plan_load("b", models, 10 * GiB)
    assert isinstance(decision, Drain) and decision.models == ("busy",)
    assert "busy (4096 MiB)" in decision.reason


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
    # Pinned models holding the room make it wait, not refuse, when they sleep when idle.
    decision = plan_load("b", fleet(loaded("pin", 8, pinned=True), asleep("b", 4)), 10 * GiB)
    assert isinstance(decision, Wait)
    assert "pin (8192 MiB, pinned, idle)" in decision.reason  # named with its size, never "0 MiB"


def test_a_resident_model_starts_at_once():
    assert plan_load("a", fleet(loaded("a", 4)), GiB) == StartNow()


def test_failed_and_sleeping_models_hold_nothing():
    models = fleet(ModelView("f", 8 * GiB, False, S.FAILED, 0), asleep("s", 8), asleep("b", 8))
    assert plan_load("b", models, 10 * GiB) == StartNow()


def test_refuses_at_once_what_cannot_fit_beside_pinned_models_that_never_sleep():
    """Waiting could only block the loads behind it: the pinned, never-sleeping model never leaves."""
    pin = loaded("pin", 8, pinned=True, sleeps_when_idle=False)
    decision = plan_load("b", fleet(pin, loaded("idle", 1), asleep("b", 4)), 10 * GiB)
    assert isinstance(decision, Refuse) and decision.code == "model_too_large"
    assert "pin (8192 MiB)" in decision.reason and "4096 MiB" in decision.reason and "2048 MiB" in decision.reason
    # Even while another load is under way: the answer does not depend on it.
    waking = ModelView("w", GiB, True, S.WAKING, 0)
    assert isinstance(plan_load("b", fleet(pin, waking, asleep("b", 4)), 10 * GiB), Refuse)
    # One that fits beside it is not refused: the idle one makes room.
    assert plan_load("b", fleet(pin, loaded("idle", 1), asleep("b", 2)), 10 * GiB) == EvictFirst(("idle",))
    # A pinned model that sleeps when idle, or one already going to sleep, does leave: wait.
    assert isinstance(plan_load("b", fleet(loaded("pin", 8, pinned=True), asleep("b", 4)), 10 * GiB), Wait)
    going = ModelView("pin", 8 * GiB, True, S.UNLOADING, 0, pinned=True, sleeps_when_idle=False)
    assert isinstance(plan_load("b", fleet(going, asleep("b", 4)), 10 * GiB), Wait)
    # An unpinned model that never sleeps is evicted when idle, drained when busy.
    never = loaded("never", 8, sleeps_when_idle=False)
    assert plan_load("b", fleet(never, asleep("b", 4)), 10 * GiB) == EvictFirst(("never",))
    never_busy = loaded("never", 8, sleeps_when_idle=False, busy=True)
    assert isinstance(plan_load("b", fleet(never_busy, asleep("b", 4)), 10 * GiB), Drain)


def test_evicts_the_fewest_idle_models_least_recently_used_among_equals():
    # One recent 6 GiB model rather than two older 3 GiB ones: one reload later, not two.
    models = fleet(loaded("old", 3, last_used=1), loaded("mid", 3, last_used=2), loaded("new", 6, last_used=3),
                   asleep("b", 6))
    assert plan_load("b", models, 12 * GiB) == EvictFirst(("new",))
    # Among sets of one size: the one whose newest member is the oldest.
    models = fleet(loaded("a", 3, last_used=1), loaded("b", 2, last_used=2), loaded("c", 3, last_used=3),
                   loaded("d", 5, last_used=4), asleep("t", 7))
    assert plan_load("t", models, 14 * GiB) == EvictFirst(("a", "c"))  # {a, c}, not {b, d} nor {a, d}
    # Equal sizes and times: by id, so the answer never depends on dict order.
    models = fleet(loaded("y", 4, last_used=1), loaded("x", 4, last_used=1), asleep("t", 4))
    assert plan_load("t", models, 8 * GiB) == EvictFirst(("x",))


def test_drains_the_fewest_busy_models_only_when_idle_ones_cannot_make_room():
    models = fleet(loaded("idle", 1, last_used=5), loaded("old", 4, busy=True, last_used=1),
                   loaded("new", 4, busy=True, last_used=2), loaded("big", 6, busy=True, last_used=0), asleep("t", 5))
    decision = plan_load("t", models, 16 * GiB)  # free 1, the idle one 1 more: 3 more are needed
    assert isinstance(decision, Drain) and decision.models == ("big",)  # one is enough: the least recently used
    assert "big (6144 MiB)" in decision.reason
    # Once the drained one is idle it is the one evicted; the small idle one stays.
    models = {**models, "big": loaded("big", 6, last_used=0)}
    assert plan_load("t", models, 16 * GiB) == EvictFirst(("big",))
    # A busy pinned model is never drained: nothing else would make room, so it waits, naming it.
    models = fleet(loaded("pin", 8, pinned=True, busy=True), asleep("t", 4))
    decision = plan_load("t", models, 10 * GiB)
    assert isinstance(decision, Wait) and "pin (8192 MiB, pinned, busy)" in decision.reason
    # Draining is only worth it when it is enough: here the pinned one must go as well.
    models = fleet(loaded("pin", 4, pinned=True, busy=True), loaded("busy", 4, busy=True), asleep("t", 8))
    assert isinstance(plan_load("t", models, 10 * GiB), Wait)


def test_fewest_to_free():
    a, b, c = loaded("a", 1, last_used=3), loaded("b", 2, last_used=2), loaded("c", 3, last_used=1)
    assert fewest_to_free([a, b, c], 0) == ()
    assert fewest_to_free([a, b, c], 7 * GiB) is None
    assert fewest_to_free([a, b, c], 6 * GiB) == (c, b, a)
    assert fewest_to_free([a, b, c], 2 * GiB) == (c,)  # b is enough too, but c is older
    assert fewest_to_free([a, b, c], 4 * GiB) == (c, b)  # {a, c} too, but a is the most recently used
STATES = [S.READY, S.READY, S.READY, S.SLEEPING, S.SLEEPING, S.UNLOADING, S.WAKING, S.FAILED]


def random_fleet(rng: random.Random) -> dict[str, ModelView]:
    models = {}
    for i in range(rng.randrange(2, 7)):
        state = rng.choice(STATES)
        resident = state in (S.READY, S.UNLOADING) or (state is S.WAKING and rng.random() < 0.5)
        models[f"m{i}"] = ModelView(f"m{i}", rng.randrange(1, 8) * GiB, resident, state, rng.randrange(4),
                                    busy=state is S.READY and rng.random() < 0.4, pinned=rng.random() < 0.2,
                                    sleeps_when_idle=rng.random() < 0.7)
    return models


def subsets_that_free(candidates: list[ModelView], need: int) -> list[tuple[ModelView, ...]]:
    """Every subset of `candidates` that frees `need` bytes, by brute force."""
    return [combo for k in range(len(candidates) + 1) for combo in itertools.combinations(candidates, k)
            if sum(m.bytes for m in combo) >= need]


def recency(models) -> list[float]:
    """How recently a set was used, newest member first: smaller is less recently used."""
    return sorted((m.last_used for m in models), reverse=True)


def assert_fewest_then_least_recent(chosen: tuple[ModelView, ...], candidates: list[ModelView], need: int):
    assert sum(m.bytes for m in chosen) >= need  # it makes room
    fitting = subsets_that_free(candidates, need)
    fewest = min(len(c) for c in fitting)
    assert len(chosen) == fewest  # minimal: no smaller set makes room
    assert recency(chosen) == min(recency(c) for c in fitting if len(c) == fewest)  # least recently used of those


@pytest.mark.parametrize("seed", range(1000))
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
    staying = sum(m.bytes for m in others if m.never_leaves)
    loading = any(m.state in (S.LOADING, S.WAKING) for m in others)
    coming_back = sum(m.bytes for m in others if m.state in (S.UNLOADING, S.STOPPING))
    idle = [m for m in others if m.evictable]
    drainable = [m for m in others if m.drainable]
    need = held - coming_back + want - budget  # what has still to be freed once the teardowns end
    decision = plan_load(target, models, budget)
    # Refused exactly when only models that never leave block: everything else leaves in time.
    assert isinstance(decision, Refuse) == (want > budget - staying)
    if isinstance(decision, StartNow):
        assert held + want <= budget  # never over the budget
        assert not loading  # one load at a time
    elif isinstance(decision, EvictFirst):
        victims = tuple(models[v] for v in decision.victims)
        assert target not in decision.victims
        assert all(v.evictable for v in victims)  # never busy, pinned, loading or asleep
        assert not any(v.busy or v.pinned for v in victims)
        assert_fewest_then_least_recent(victims, idle, need)
    elif isinstance(decision, Drain):
        drained = tuple(models[d] for d in decision.models)
        assert all(d.drainable and not d.pinned for d in drained)  # busy, and evictable once it is done
        assert not loading and need > 0
        assert sum(m.bytes for m in idle) < need  # the idle ones alone could not make room
        assert_fewest_then_least_recent(drained, drainable, need - sum(m.bytes for m in idle))
    elif isinstance(decision, Wait):
        assert loading or held + want > budget  # it does not fit now
        if not loading and need > 0:
            assert sum(m.bytes for m in idle + drainable) < need  # neither evicting nor draining would be enough


# -- the sleep tiers: what a drowsy or light model holds -----------------------------


def drowsy(id: str, size: float, weights: float, last_used: float = 0, **kw) -> ModelView:
    return ModelView(id, int(size * GiB), True, S.DROWSY, last_used, held=int(weights * GiB), **kw)


def light(id: str, size: float, pages: float, last_used: float = 0, **kw) -> ModelView:
    return ModelView(id, int(size * GiB), pages > 0, S.LIGHT_SLEEP, last_used, held=int(pages * GiB), **kw)


def test_a_drowsy_model_counts_its_weights_only():
    # 4 GiB awake, 3 GiB of weights: 7 GiB fit in 10 beside it, 8 do not.
    assert plan_load("b", fleet(drowsy("a", 4, 3), asleep("b", 7)), 10 * GiB) == StartNow()
    assert plan_load("b", fleet(drowsy("a", 4, 3), asleep("b", 8)), 10 * GiB) == EvictFirst(("a",))


def test_a_light_model_on_cpu_counts_its_page_cache_and_is_evicted_to_deep():
    assert plan_load("b", fleet(light("a", 4, 2), asleep("b", 9)), 10 * GiB) == EvictFirst(("a",))
    assert plan_load("b", fleet(light("a", 4, 2), asleep("b", 8)), 10 * GiB) == StartNow()


def test_a_light_model_on_a_gpu_holds_nothing_of_the_budget():
    assert plan_load("b", fleet(light("a", 4, 0), asleep("b", 10)), 10 * GiB) == StartNow()


def test_the_fewest_victims_are_chosen_by_what_they_hold_now():
    # Freeing 3 GiB: the drowsy model's 3 GiB of weights do it alone; the ready 2 GiB one cannot.
    models = fleet(drowsy("a", 5, 3, last_used=2), loaded("c", 2, last_used=1), asleep("b", 8))
    assert plan_load("b", models, 10 * GiB) == EvictFirst(("a",))


def test_a_rousing_model_is_a_load_under_way():
    rousing = ModelView("a", 4 * GiB, True, S.ROUSING, 0)
    assert isinstance(plan_load("b", fleet(rousing, asleep("b", 1)), 10 * GiB), Wait)


# -- models_max (llama-server's --models-max): a count, checked before the bytes --

def test_models_max_puts_the_least_recently_used_idle_model_to_sleep_though_the_bytes_fit():
    models = fleet(loaded("old", 1, last_used=1), loaded("new", 1, last_used=2), asleep("b", 1))
    assert plan_load("b", models, 100 * GiB) == StartNow()  # no count limit: the bytes fit
    assert plan_load("b", models, 100 * GiB, max_models=2) == EvictFirst(("old",))
    assert plan_load("b", models, 100 * GiB, max_models=1) == EvictFirst(("old", "new"))
    assert plan_load("b", models, 100 * GiB, max_models=3) == StartNow()
    assert plan_load("new", models, 100 * GiB, max_models=1) == StartNow()  # resident already


def test_models_max_drains_a_busy_model_rather_than_evict_it_under_its_requests():
    # llama-server's test_router_queue_does_not_evict_busy_model: models_max 1, the one model busy.
    models = fleet(loaded("a", 1, busy=True), asleep("b", 1))
    decision = plan_load("b", models, 100 * GiB, max_models=1)
    assert isinstance(decision, Drain) and decision.models == ("a",) and "models_max = 1" in decision.reason
    # An idle one goes first; the busy one is drained only for what the idle ones cannot make.
    models = fleet(loaded("busy", 1, last_used=0, busy=True), loaded("idle", 1, last_used=5), asleep("b", 1))
    assert plan_load("b", models, 100 * GiB, max_models=2) == EvictFirst(("idle",))
    decision = plan_load("b", models, 100 * GiB, max_models=1)
    assert isinstance(decision, Drain) and decision.models == ("busy",)


def test_models_max_counts_no_leaving_model_and_waits_for_pinned_ones():
    models = fleet(ModelView("going", GiB, True, S.UNLOADING, 0), loaded("a", 1), asleep("b", 1))
    assert plan_load("b", models, 100 * GiB, max_models=2) == StartNow()
    models = fleet(loaded("pin", 1, pinned=True), asleep("b", 1))
    decision = plan_load("b", models, 100 * GiB, max_models=1)
    assert isinstance(decision, Wait) and "pin" in decision.reason  # it sleeps when idle: then there is room
    models = fleet(loaded("pin", 1, pinned=True, sleeps_when_idle=False), asleep("b", 1))
    decision = plan_load("b", models, 100 * GiB, max_models=1)
    assert isinstance(decision, Refuse) and decision.code == "too_many_models" and "pin" in decision.reason


def test_models_max_is_never_exceeded_over_random_fleets():
    """Whatever the fleet, a StartNow under models_max leaves at most models_max models staying."""
    rng = random.Random(7)
    for _ in range(400):
        n, cap = rng.randint(1, 6), rng.randint(1, 4)
        models = {}
        for i in range(n):
            state = rng.choice([S.READY, S.READY, S.SLEEPING, S.UNLOADING, S.DROWSY])
            models[f"m{i}"] = ModelView(f"m{i}", GiB, state not in (S.SLEEPING,), state, rng.random(),
                                        busy=rng.random() < 0.3, pinned=rng.random() < 0.2)
        target = rng.choice(list(models))
        decision = plan_load(target, models, 100 * GiB, max_models=cap)
        staying = [m for m in models.values() if m.resident and m.state is not S.UNLOADING and m.id != target]
        if isinstance(decision, StartNow) and not models[target].resident:
            assert len(staying) + 1 <= cap
        if isinstance(decision, EvictFirst):
            assert all(models[v].evictable for v in decision.victims)
            assert len(staying) - len(decision.victims) + 1 <= cap

"""The fleet and the prompt cache's RAM tier (issue 18): on CPU the tier is
the same RAM the models use, so the planner counts it in the budget, and
shrinks caches before it evicts a model. Pure planner cases, then the owner
with fake workers (real protocol, real processes)."""

from __future__ import annotations

import pytest

from statemachine import ServerState as S
from statemachine.fleet import (EvictFirst, ModelView, Refuse, ShrinkCaches, StartNow, cache_limits, plan_load,
                              shrink_caches)

GiB = 2**30


def fleet(*models: ModelView) -> dict[str, ModelView]:
    return {m.id: m for m in models}


def loaded(id: str, size: float, cache: float = 0, last_used: float = 0, **kw) -> ModelView:
    return ModelView(id, int(size * GiB), True, S.READY, last_used, cache=int(cache * GiB), **kw)


def asleep(id: str, size: float) -> ModelView:
    return ModelView(id, int(size * GiB), False, S.SLEEPING, 0)


def test_a_ram_tier_counts_in_the_budget():
    assert plan_load("b", fleet(loaded("a", 4), asleep("b", 4)), 9 * GiB) == StartNow()
    assert plan_load("b", fleet(loaded("a", 4, cache=2), asleep("b", 4)), 9 * GiB) != StartNow()


def test_caches_are_shrunk_before_a_model_is_evicted_least_recently_used_first():
    models = fleet(loaded("old", 3, cache=1, last_used=1), loaded("new", 3, cache=2, last_used=2), asleep("b", 3))
    # 9 held of 10: b needs 2 more. old's whole cache (1), then 1 of new's.
    assert plan_load("b", models, 10 * GiB) == ShrinkCaches((("old", 0), ("new", 1 * GiB)))
    # Only as far as needed: 0.5 GiB short takes half of old's cache.
    assert plan_load("b", models, int(11.5 * GiB)) == ShrinkCaches((("old", GiB // 2),))


def test_when_the_caches_are_not_enough_a_model_goes_and_its_cache_with_it():
    models = fleet(loaded("old", 3, cache=1, last_used=1), loaded("new", 3, cache=1, last_used=2), asleep("b", 5))
    assert plan_load("b", models, 9 * GiB) == EvictFirst(("old",))  # 8 held, 1 free: caches free 2 of the 4 needed


def test_a_busy_or_pinned_models_cache_is_shrunk_too_and_a_pinned_one_is_not_refused_for_its_cache():
    models = fleet(loaded("p", 4, cache=3, pinned=True, sleeps_when_idle=False), loaded("busy", 1, cache=1, busy=True),
                   asleep("b", 4))
    assert plan_load("b", models, 10 * GiB) == ShrinkCaches((("busy", 0), ("p", 1 * GiB)))  # 3 short
    # Beside a pinned model that never sleeps only its weights are for good: its cache can go.
    assert not isinstance(plan_load("b", fleet(loaded("p", 4, cache=4, pinned=True, sleeps_when_idle=False),
                                               asleep("b", 5)), 9 * GiB), Refuse)


@pytest.mark.parametrize("need", [0, 1, GiB, 3 * GiB, 3 * GiB + 1])
def test_shrinking_frees_exactly_what_is_needed_or_nothing(need):
    models = [loaded("a", 1, cache=1, last_used=2), loaded("b", 1, cache=2, last_used=1), loaded("c", 1)]
    budgets = shrink_caches(models, need)
    if need > 3 * GiB:
        assert budgets is None
        return
    freed = sum(m.cache - dict(budgets).get(m.id, m.cache) for m in models)
    assert freed == need and all(0 <= b for _, b in budgets)
    assert [m for m, _ in budgets] == ["b", "a"][:len(budgets)]  # b was used longer ago


# -- the owner, with fake workers --

async def test_the_owner_shrinks_a_models_ram_tier_instead_of_evicting_it():
    from daemon import protocol as p
    from statemachine import SleepRequested
    from tests.integration.test_fleet_fake_workers import ask, fleet_of, states, until

    async with fleet_of({"a": 4, "b": 4}, budget=10) as fleet:
        assert isinstance(await ask(fleet, "a"), p.Done)
        a = fleet.models["a"]
        a.controller.metrics.prompt_cache = {"ram": {"bytes": 3 * GiB}}  # as a's worker reported it
        assert fleet.views()["a"].cache == 3 * GiB and fleet.planned_bytes() > 7 * GiB - 1000
        assert isinstance(await ask(fleet, "b"), p.Done)
        assert states(fleet) == {"a": "ready", "b": "ready"}  # a was not evicted: its cache was shrunk
        assert a.cache_limit is not None and a.cache_limit <= 2 * GiB + 200
        assert fleet.metrics.evictions.labels(model="a")._value.get() == 0
        assert fleet.planned_bytes() <= fleet.budget
        # Its worker gone, the next one starts with an empty tier and no limit; the gone one's report is not counted.
        a.controller.post(SleepRequested(0, reason="admin"))
        await until(lambda: a.controller.state is S.SLEEPING)
        assert a.cache_limit is None
        assert isinstance(await ask(fleet, "a"), p.Done)
        assert fleet.views()["a"].cache == 0  # the fake worker reports no tiers: the old report is not its


# -- how far each tier may grow between loads (issue 26) --

def test_the_room_beside_the_models_is_shared_among_the_tiers_that_can_grow():
    # 590 of 600 planned to models; a holds 1 and may grow to 64, b holds nothing yet.
    MiB = 2**20
    a = ModelView("a", 295 * MiB, True, S.READY, 1, cache=1 * MiB, cache_ceiling=64 * MiB)
    b = ModelView("b", 295 * MiB, True, S.LOADING, 2, cache_ceiling=64 * MiB)
    assert cache_limits([a, b], 600 * MiB) == {"a": int(5.5 * MiB), "b": int(4.5 * MiB)}
    # What one cannot take goes to the others; with room to spare, each its own ceiling.
    small = ModelView("a", 295 * MiB, True, S.READY, 1, cache=1 * MiB, cache_ceiling=2 * MiB)
    assert cache_limits([small, b], 600 * MiB) == {"a": 2 * MiB, "b": 8 * MiB}
    assert cache_limits([a, b], 2000 * MiB) == {"a": 64 * MiB, "b": 64 * MiB}
    # Asleep or without a tier (a GPU's, an embedder's): nothing to limit, and its bytes still count.
    assert cache_limits([asleep("c", 1), a], 600 * MiB) == {"a": 64 * MiB}
    on_gpu = ModelView("g", 5 * MiB, True, S.READY, 0)  # its tier is not the budget's: it holds 5 beside them
    assert cache_limits([on_gpu, a, b], 600 * MiB) == {"a": 3 * MiB, "b": 2 * MiB}


def test_past_the_budget_the_tiers_shrink_least_recently_used_first_and_none_grows():
    MiB = 2**20
    old = ModelView("old", 295 * MiB, True, S.READY, 1, cache=59 * MiB, cache_ceiling=64 * MiB)
    new = ModelView("new", 290 * MiB, True, S.READY, 2, cache=10 * MiB, cache_ceiling=64 * MiB)
    assert cache_limits([old, new], 600 * MiB) == {"old": 5 * MiB, "new": 10 * MiB}  # 654: 54 from old's 59
    assert cache_limits([old, new], 580 * MiB) == {"old": 0, "new": 0}  # the models alone are past it


def random_tiers(rng):
    states = [S.READY, S.READY, S.LOADING, S.UNLOADING, S.SLEEPING, S.DROWSY]
    models = []
    for i in range(rng.randrange(1, 6)):
        state = rng.choice(states)
        resident = state is not S.SLEEPING
        ceiling = rng.choice([0, rng.randrange(0, 40)]) if state in (S.READY, S.LOADING) else 0
        cache = rng.randrange(0, ceiling + 1) if state is S.READY else rng.choice([0, rng.randrange(0, 20)])
        cache = cache if state in (S.READY, S.UNLOADING) else 0
        models.append(ModelView(f"m{i}", rng.randrange(1, 60), resident, state, rng.randrange(5),
                                cache=cache, cache_ceiling=ceiling))
    return models


def test_over_random_fleets_models_plus_tiers_never_pass_the_budget():
    import random

    rng = random.Random(26)
    for _ in range(3000):
        models = random_tiers(rng)
        budget = rng.randrange(1, 250)
        limits = cache_limits(models, budget)
        resident = [m for m in models if m.resident]
        weights = sum(m.holding - m.cache for m in resident)
        held = sum(m.cache for m in resident)
        by_id = {m.id: m for m in models}
        assert all(by_id[i].resident for i in limits) and all(v >= 0 for v in limits.values())
        planned = weights + sum(limits.get(m.id, m.cache) for m in resident)
        if weights + held <= budget:
            assert planned <= budget  # every tier grown to its limit still fits
            assert all(limits[i] >= by_id[i].cache for i in limits)  # and none was lowered below what it holds
            assert all(limits[i] <= max(by_id[i].cache, by_id[i].cache_ceiling) for i in limits)
            # No room left unshared while a tier could still grow.
            if budget - planned > 0:
                assert all(limits[i] >= by_id[i].cache_ceiling for i in limits)
        else:
            # Past it: the tiers give what they can, only as far as needed, and none grows.
            assert all(limits[i] <= by_id[i].cache for i in limits)
            freed = held - sum(limits.get(m.id, m.cache) for m in resident)
            assert freed == min(held, weights + held - budget)

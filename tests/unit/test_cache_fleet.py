"""The fleet and the prompt cache's RAM tier (issue 18): on CPU the tier is
the same RAM the models use, so the planner counts it in the budget, and
shrinks caches before it evicts a model. Pure planner cases, then the owner
with fake workers (real protocol, real processes)."""

from __future__ import annotations

import pytest

from statemachine import ServerState as S
from statemachine.fleet import EvictFirst, ModelView, Refuse, ShrinkCaches, StartNow, plan_load, shrink_caches

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

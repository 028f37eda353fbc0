"""The fleet planner: which models may hold memory at once, within a budget.

Pure logic, like the server state machine: the fleet's owner task describes
every model (its bytes, whether its worker holds memory, its state, when it
was last used, whether it is busy, pinned, or sleeps when idle) and asks what
a load request for one model should do. The answer is one of:

- StartNow: the model fits beside what is resident; load it.
- EvictFirst(victims): put these idle models to sleep, then ask again: their
  memory comes back when their workers exit, not when the decision is made.
  The victims are the fewest idle models that make room (fewer evictions,
  fewer reloads), the least recently used among sets of that size; never a
  busy or pinned one.
- Drain(models): idle models cannot make room, but these busy ones can once
  they finish. Stop feeding them new requests (the owner holds those, in
  order, bounded) so that they fall idle and can be evicted; ask again. A
  model that always has one more request in flight would otherwise never be
  idle, and the waiting model would starve (Ollama's scheduler, too, holds
  every request while its head waits for a runner to unload).
- Wait(reason): another load or a teardown is under way (one load at a time
  per device, so two cold models never load at once and run out of memory),
  or pinned models that do sleep when idle hold the room. The owner asks
  again when anything changes; the request's wait is bounded.
- ShrinkCaches(budgets): the prompt caches' RAM tiers of the resident models
  (counted in the budget on CPU: the same RAM the models use) can make room
  without evicting any model: lower those tiers to these bytes, least
  recently used models' first, then ask again. A cache is shrunk before a
  model is evicted; an eviction frees its model's cache too. Between loads
  the tiers grow as their models serve: cache_limits tells each tier how far
  it may grow, within the room the budget has beside the models.
- Refuse(reason, code): it can never fit: bigger than the whole budget, or
  bigger than what is left beside the models that never leave (pinned and
  never sleeping). Waiting could only block the loads behind it, so the
  answer is at once, and names the models in the way and their sizes.

Peers admit by count (Ollama's OLLAMA_MAX_LOADED_MODELS, llama-server's
--models-max); a count cannot know that two big models do not fit together
or that three small ones do. A count may still be asked for (models_max,
llama-server's --models-max): it is checked first, with the same rules
(least recently used idle models leave, busy ones are drained), then the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Iterable, Mapping, Sequence

from statemachine.states import ServerState as S

LOADING_STATES = frozenset({S.LOADING, S.WAKING, S.ROUSING})  # a rouse allocates the contexts again
LEAVING_STATES = frozenset({S.UNLOADING, S.STOPPING})
# Idle and holding memory: READY (all of it), DROWSY (the weights), LIGHT_SLEEP (on CPU, the
# page cache of its files: the same RAM the budget is of). An eviction frees what it holds.
RESTING_STATES = frozenset({S.READY, S.DROWSY, S.LIGHT_SLEEP})


@dataclass(frozen=True)
class ModelView:
    id: str
    bytes: int  # predicted before its first load, measured after
    resident: bool  # its worker holds memory, or has been admitted and is acquiring it
    state: S
    last_used: float  # monotonic seconds its last request ended (or it loaded); larger is more recent
    busy: bool = False  # requests in flight or waiting
    pinned: bool = False  # never evicted
    sleeps_when_idle: bool = True  # its idle timer is armed (sleep_idle_seconds >= 0)
    # What it holds of the budget now, when not all of `bytes` (the sleep tiers: drowsy
    # holds the weights, light on CPU the page cache of its files); None: `bytes`.
    held: int | None = None
    # Bytes of its prompt cache's RAM tier that count in the budget (on CPU; 0 on a GPU,
    # whose budget is not host RAM): held on top of the above, and freed by a shrink alone.
    cache: int = 0
    # The most its RAM tier can grow to without being told (its own budget, or the lower one
    # the fleet set: a worker's tier is only ever lowered); 0 when it cannot grow (asleep,
    # leaving, on a GPU, no tier). A model admitted and still loading: its setting.
    cache_ceiling: int = 0

    @property
    def holding(self) -> int:
        return (self.bytes if self.held is None else self.held) + self.cache

    @property
    def evictable(self) -> bool:
        """May be put to sleep now to make room (an eviction frees what it holds)."""
        return self.resident and self.state in RESTING_STATES and not self.busy and not self.pinned

    @property
    def drainable(self) -> bool:
        """Busy, but evictable once its requests are done (if it is fed no more)."""
        return self.resident and self.state is S.READY and self.busy and not self.pinned

    @property
    def never_leaves(self) -> bool:
        """Holds its memory for good: never evicted (pinned) and never asleep on its own."""
        return self.resident and self.pinned and not self.sleeps_when_idle and self.state not in LEAVING_STATES


@dataclass(frozen=True)
class StartNow:
    pass


@dataclass(frozen=True)
class EvictFirst:
    victims: tuple[str, ...]


@dataclass(frozen=True)
class Drain:
    models: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ShrinkCaches:
    budgets: tuple[tuple[str, int], ...]  # (model, the bytes its RAM tier may hold from now on)


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Refuse:
    reason: str
    code: str = "model_too_large"


Decision = StartNow | EvictFirst | ShrinkCaches | Drain | Wait | Refuse


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def named(models: Iterable[ModelView]) -> str:
    """'a (4096 MiB), b (2048 MiB)': the models in the way, with what they hold."""
    return ", ".join(f"{m.id} ({mib(m.holding)})" for m in models)


def described(models: Iterable[ModelView]) -> str:
    """'p (4096 MiB, pinned, busy), a (2048 MiB, idle)': why each one is still there."""
    def tags(m: ModelView) -> str:
        return ", ".join(t for t, on in (("pinned", m.pinned), ("busy", m.busy), ("idle", not m.busy),
                                         ("never sleeps", not m.sleeps_when_idle)) if on)
    return ", ".join(f"{m.id} ({mib(m.holding)}, {tags(m)})" for m in models)


def fewest_to_free(candidates: Sequence[ModelView], need: int) -> tuple[ModelView, ...] | None:
    """The smallest set of `candidates` whose bytes add up to `need`, least
    recently used among the sets of that size (the one whose most recently used
    member is the oldest, then its next, ...); None if even all are not enough.

    Fewest first: each eviction is a reload later. Among sets of one size, the
    choice is made newest member first: walking the candidates oldest first,
    the newest member is the first one that, with the largest of the older
    ones, makes room; the rest is chosen the same way among the older ones."""
    if need <= 0:
        return ()
    largest_first = accumulate(sorted((m.holding for m in candidates), reverse=True))
    size = next((k for k, freed in enumerate(largest_first, 1) if freed >= need), None)
    if size is None:
        return None
    oldest_first = sorted(candidates, key=lambda m: (m.last_used, m.id))

    def choose(pool: list[ModelView], k: int, need: int) -> list[ModelView]:
        if need <= 0:
            return []
        for j in range(k - 1, len(pool)):
            older = sorted((m.holding for m in pool[:j]), reverse=True)[:k - 1]
            if pool[j].holding + sum(older) >= need:
                return choose(pool[:j], k - 1, need - pool[j].holding) + [pool[j]]
        raise AssertionError("unreachable: a set of this size makes room")  # pragma: no cover

    return tuple(choose(oldest_first, size, need))


def shrink_caches(candidates: Sequence[ModelView], need: int) -> tuple[tuple[str, int], ...] | None:
    """The RAM tiers' new budgets that free `need` bytes, least recently used
    models' caches first, each lowered only as far as needed; None when all of
    them together are not enough (then models go, and their caches with them)."""
    caches = sorted((m for m in candidates if m.cache > 0), key=lambda m: (m.last_used, m.id))
    if not caches or sum(m.cache for m in caches) < need:
        return None
    budgets = []
    for m in caches:
        if need <= 0:
            break
        cut = min(m.cache, need)
        budgets.append((m.id, m.cache - cut))
        need -= cut
    return tuple(budgets)


def cache_limits(models: Iterable[ModelView], budget: int) -> dict[str, int]:
    """What each resident model's RAM tier may hold from now on (issue 26: the tiers
    grew past the budget after the admissions that had planned them):

    - within the budget: each tier keeps what it holds, and the room the budget has
      beside the resident models and their tiers is shared out equally among the
      tiers that can grow (each up to its ceiling; what one cannot take goes to the
      others). So models + tiers held + what every tier may grow to <= budget.
    - past it (a footprint measured above its prediction, a tier reported late): the
      tiers are shrunk least recently used first, only as far as needed, as for a
      load; none grows. A tier never frees more than it holds: models are evicted
      only for a load, and their caches go with them.

    The planner admits on what the tiers hold (plan_load); the owner calls this
    after every admission and every report, so the room a new model takes is taken
    from the other tiers' growth before it loads."""
    resident = [m for m in models if m.resident]
    tiers = [m for m in resident if m.cache > 0 or m.cache_ceiling > 0]
    over = sum(m.holding for m in resident) - budget
    if over > 0:
        cut = dict(shrink_caches(tiers, over) or ((m.id, 0) for m in tiers))
        return {m.id: cut.get(m.id, m.cache) for m in tiers}
    room = -over
    limits = {m.id: m.cache for m in tiers}
    growing = sorted((m for m in tiers if m.cache_ceiling > m.cache), key=lambda m: (m.cache_ceiling - m.cache, m.id))
    for left, m in zip(range(len(growing), 0, -1), growing):  # the smallest wants first: the rest is shared again
        share = min(room // left, m.cache_ceiling - m.cache)
        limits[m.id] += share
        room -= share
    return limits


def plan_load(target: str, models: Mapping[str, ModelView], budget: int, max_models: int = 0) -> Decision:
    """What a load of `target` should do now (see the module docstring). max_models: at most
    this many models resident at once (0: no count limit), checked before the bytes."""
    want = models[target]
    if want.resident:
        return StartNow()  # it already holds its memory
    others = [m for m in models.values() if m.id != target and m.resident]
    if want.bytes > budget:
        return Refuse(f"model {target} needs {mib(want.bytes)}, more than the whole memory budget of {mib(budget)}")
    staying = [m for m in others if m.never_leaves]
    room_beside_staying = budget - sum(m.holding - m.cache for m in staying)  # their caches can be shrunk
    if want.bytes > room_beside_staying:
        return Refuse(f"model {target} needs {mib(want.bytes)}; of the memory budget of {mib(budget)}, "
                      f"{mib(room_beside_staying)} is left beside pinned models that never sleep: {named(staying)} "
                      f"(unpin one, let it sleep when idle, or put it to sleep with POST /models/unload)")
    if max_models and len(staying) >= max_models:
        return Refuse(f"models_max = {max_models}, and as many pinned models that never sleep hold memory: "
                      f"{named(staying)}", "too_many_models")
    loading = [m.id for m in others if m.state in LOADING_STATES]
    if loading:
        return Wait(f"one load at a time: {loading[0]} is loading")
    present = [m for m in others if m.state not in LEAVING_STATES]  # the resident ones not on their way out
    if max_models and len(present) >= max_models:
        return _room_by_count(present, len(present) + 1 - max_models, max_models)
    free = budget - sum(m.holding for m in others)
    if want.bytes <= free:
        return StartNow()
    going = [m for m in others if m.state in LEAVING_STATES]
    need = want.bytes - free - sum(m.holding for m in going)
    if need <= 0:
        return Wait(f"waiting for {', '.join(m.id for m in going)} to finish going to sleep")
    shrunk = shrink_caches(present, need)
    if shrunk is not None:
        return ShrinkCaches(shrunk)
    idle = [m for m in others if m.evictable]
    victims = fewest_to_free(idle, need)
    if victims is not None:
        return EvictFirst(tuple(m.id for m in victims))
    # Every idle model together is not enough: busy ones must finish first. The
    # idle ones are not evicted yet (they may serve meanwhile, and the fewest
    # victims are chosen again once the drained ones are idle).
    short = f"model {target} needs {mib(want.bytes)}; {mib(free)} of the memory budget of {mib(budget)} is free"
    drained = fewest_to_free([m for m in others if m.drainable], need - sum(m.holding for m in idle))
    if drained is not None:
        return Drain(tuple(m.id for m in drained),
                     f"{short}; waiting for busy {named(drained)} to finish the requests in flight "
                     f"(new requests for {'it' if len(drained) == 1 else 'them'} wait until {target} is loaded)")
    return Wait(f"{short}; in the way: {described(present)} (a pinned model leaves only when it sleeps when idle)")


def _room_by_count(staying: Sequence[ModelView], over: int, max_models: int) -> Decision:
    """models_max: `over` of the models that stay must leave first, the least recently used idle
    ones; when too few are idle, the least recently used busy ones are drained, as for bytes."""
    oldest_first = sorted(staying, key=lambda m: (m.last_used, m.id))
    idle = [m for m in oldest_first if m.evictable]
    if len(idle) >= over:
        return EvictFirst(tuple(m.id for m in idle[:over]))
    short = f"models_max = {max_models}, and {len(staying)} models hold memory"
    drained = [m for m in oldest_first if m.drainable][:over - len(idle)]
    if len(idle) + len(drained) >= over:
        return Drain(tuple(m.id for m in drained),
                     f"{short}; waiting for busy {named(drained)} to finish the requests in flight "
                     f"(new requests for {'it' if len(drained) == 1 else 'them'} wait)")
    return Wait(f"{short}; in the way: {described(staying)} (a pinned model leaves only when it sleeps when idle)")

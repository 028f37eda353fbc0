"""The fleet planner: which models may hold memory at once, within a budget.

Pure logic, like the server state machine: the fleet's owner task describes
every model (its bytes, whether its worker holds memory, its state, when it
was last used, whether it is busy or pinned) and asks what a load request
for one model should do. The answer is one of:

- StartNow: the model fits beside what is resident; load it.
- EvictFirst(victims): put these models to sleep (least recently used first,
  never a busy or pinned one), then ask again: their memory comes back when
  their workers exit, not when the decision is made.
- Wait(reason): busy models hold the memory, or another load or a teardown is
  under way (one load at a time per device, so two cold models never load
  at once and run out of memory). The owner asks again when anything
  changes; the request's wait is bounded by wake_timeout.
- Refuse(reason): it can never fit (bigger than the whole budget); the
  message names the sizes. (Pinned models that hold the room make it wait:
  they still go to sleep when idle.)

Peers admit by count (Ollama's OLLAMA_MAX_LOADED_MODELS, llama-server's
--models-max); a count cannot know that two big models do not fit together
or that three small ones do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from statemachine.states import ServerState as S

LOADING_STATES = frozenset({S.LOADING, S.WAKING})


@dataclass(frozen=True)
class ModelView:
    id: str
    bytes: int  # predicted before its first load, measured after
    resident: bool  # its worker holds memory, or has been admitted and is acquiring it
    state: S
    last_used: float  # monotonic seconds; larger is more recent
    busy: bool = False  # requests in flight or waiting
    pinned: bool = False  # never evicted

    @property
    def evictable(self) -> bool:
        return self.resident and self.state is S.READY and not self.busy and not self.pinned


@dataclass(frozen=True)
class StartNow:
    pass


@dataclass(frozen=True)
class EvictFirst:
    victims: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    reason: str


@dataclass(frozen=True)
class Refuse:
    reason: str


Decision = StartNow | EvictFirst | Wait | Refuse


def mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


def plan_load(target: str, models: Mapping[str, ModelView], budget: int) -> Decision:
    """What a load of `target` should do now (see the module docstring)."""
    want = models[target]
    if want.resident:
        return StartNow()  # it already holds its memory
    others = [m for m in models.values() if m.id != target and m.resident]
    if want.bytes > budget:
        return Refuse(f"model {target} needs {mib(want.bytes)}, more than the whole memory budget of {mib(budget)}")
    loading = [m.id for m in others if m.state in LOADING_STATES]
    if loading:
        return Wait(f"one load at a time: {loading[0]} is loading")
    free = budget - sum(m.bytes for m in others)
    if want.bytes <= free:
        return StartNow()
    coming_back = sum(m.bytes for m in others if m.state is S.UNLOADING)
    if want.bytes <= free + coming_back:
        return Wait("waiting for a model to finish going to sleep")
    victims: list[str] = []
    freed = coming_back
    for m in sorted((m for m in others if m.evictable), key=lambda m: (m.last_used, m.id)):
        victims.append(m.id)
        freed += m.bytes
        if want.bytes <= free + freed:
            return EvictFirst(tuple(victims))
    busy = sum(m.bytes for m in others if m.busy)
    return Wait(f"model {target} needs {mib(want.bytes)}; {mib(free)} of the memory budget of {mib(budget)} "
                f"is free and busy models hold {mib(busy)}")

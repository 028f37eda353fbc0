"""The fleet: several models behind one endpoint, admitted by memory.

Each model has its own controller (state machine, worker, idle timer), as a
single model has. What the fleet adds is the one decision no model can take
alone: which models may hold memory at once. The planner
(statemachine.fleet.plan_load) decides; this owner carries the decisions out
from one task, one pending load at a time in the order they were asked for
(so a big model waiting for busy ones to finish is not overtaken forever by
small ones), and re-plans whenever any model's state or load changes.

A model's controller asks `admit(model_id)` before it starts a worker; the
answer comes when the load may start (after evictions, if any), or as a
LoadNotAdmitted when it can never fit or did not fit within wake_timeout.

While the head of the queue waits for busy models to finish (the planner's
Drain), those models' new requests are held by their controllers, so that
they fall idle and can be put to sleep; the hold is lifted when the head
leaves the queue (admitted, refused or given up), and the held requests, in
order, then wake their model again through this same queue. Held requests are
bounded as accepted ones are (the model's queue size, then 503 queue_full)
and wait at most wake_timeout (then 503 with Retry-After).

On CPU the prompt caches' RAM tiers are the same RAM as the models, and they
grow while their models serve, after the admission that planned them (issue
26: 649 MiB held against a budget of 600). So after every admission and every
report a worker sends (each Done carries its tiers), each awake model's tier
is told how far it may grow: within the room the budget has beside the models
and what the tiers hold (statemachine.fleet.cache_limits), shrunk least
recently used first when the sum is past the budget, before any model is
evicted. The new limit goes to a worker as soon as it says Ready, before its
first request.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from daemon import protocol as p
from daemon.model.controller import Controller
from daemon.fleet.metrics import FleetMetrics
from statemachine import (Event, LoadNotAdmitted, RequestFinished, ServerState, SleepCompleted, SleepRequested,
                          WorkerExited, WorkerLoadFailed)
from statemachine.fleet import (Drain, EvictFirst, ModelView, Refuse, ShrinkCaches, StartNow, Wait, cache_limits,
                                 plan_load)

S = ServerState
# A model holds memory in these states whether or not the fleet admitted it
# (a worker is up: serving, tearing down, or draining at shutdown).
HOLDING = frozenset({S.READY, S.UNLOADING, S.STOPPING})
STATUS = {S.STARTING: "sleeping", S.LOADING: "loading", S.WAKING: "loading", S.READY: "loaded",
          S.UNLOADING: "unloading", S.SLEEPING: "sleeping", S.FAILED: "failed", S.STOPPING: "unloading",
          # The router's names have no tiers: drowsy is still loaded (the weights are), light is asleep.
          S.DOZING: "loaded", S.DROWSY: "loaded", S.ROUSING: "loading", S.LIGHT_SLEEP: "sleeping"}
WEIGHTS = ("model", "draft_model", "mmproj")  # the components a drowsy worker keeps
RETRY_AFTER_NO_ROOM = 5.0
# The id prefix of the fleet's prompt_cache_shrink queries: their Answers match no request (the
# controller posts a RequestFinished that the state machine ignores), and are no use of the model.
CACHE_QUERY = "fleet-shrink-"
WORKER_GONE = (SleepCompleted, WorkerExited, WorkerLoadFailed)


class UnknownModel(KeyError):
    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        shown = name if len(name) <= 100 else name[:100] + "..."
        self.message = f"model {shown!r} does not exist; this server has {', '.join(known)}"


@dataclass
class FleetModel:
    id: str
    controller: Controller
    predicted_bytes: int
    aliases: tuple[str, ...] = ()
    pinned: bool = False
    load_at_start: bool = False
    tags: tuple[str, ...] = ()  # labels /v1/models shows (llama-server's --tags); never read for routing
    measured_bytes: int | None = None
    measured_components: dict[str, int] | None = None
    last_used: float = 0.0  # monotonic time its last request ended, or it last loaded
    admitted: bool = False  # allowed to load; cleared when its worker is gone
    # The prompt cache's RAM tier (daemon/worker/prompt_cache.py): the budget the fleet lowered it
    # to in this worker (None: its setting), and the worker's (or engine's) last report once that
    # worker is gone, or its engine was made again (a rouse).
    cache_limit: int | None = None
    cache_report_gone: Any = None

    @property
    def bytes(self) -> int:
        return self.measured_bytes if self.measured_bytes is not None else self.predicted_bytes

    @property
    def status(self) -> str:
        return STATUS[self.controller.state]


@dataclass
class PendingLoad:
    """One load asked for, in the admission queue."""

    model_id: str
    future: asyncio.Future  # the answer: None (load now) or a LoadNotAdmitted
    waited: bool = False  # counted once in dormouse_fleet_load_waits_total
    drained: set[str] = field(default_factory=set)  # models whose new requests are held for it


class Fleet:
    def __init__(self, models: list[FleetModel], default: str, budget: int, wake_timeout: float,
                 metrics: FleetMetrics, log, on_measured: Callable[[FleetModel], None] | None = None,
                 admit: bool = True, load_timeout: float = 600.0, max_models: int = 0,
                 any_name: bool | None = None) -> None:
        self.models = {m.id: m for m in models}
        # A fleet of one not configured as a router answers whatever model a request names, as a
        # single-model llama-server does (clients send "gpt-4o" and the like); a router answers
        # only its models' names, as llama-server's router does, whatever their number.
        self.any_name = len(models) == 1 if any_name is None else any_name and len(models) == 1
        self.max_models = max_models  # models_max: at most this many resident at once (0: bytes alone)
        self.default = default
        self.budget = budget
        self.wake_timeout = wake_timeout
        self.load_timeout = load_timeout
        self.metrics = metrics
        self.log = log
        self.on_measured = on_measured
        self.admitting = admit  # False: loads start without asking (a fleet of one with no budget set)
        self._names: dict[str, FleetModel] = {}
        for m in models:
            for name in (m.id, *m.aliases):
                self._names[name] = m
        # Each alias -> its model's id: the HAProxy agent resolves a line's name as route() does.
        self.aliases = {name: m.id for name, m in self._names.items() if name != m.id}
        self._pending: deque[PendingLoad] = deque()
        self._last_wait: dict[str, str] = {}
        self._held_for: dict[str, str] = {}  # model whose new requests are held -> the model it drains for
        self._gave_up: dict[str, tuple[str, float]] = {}  # model -> (why, when) its last admission timed out
        self._changed = asyncio.Event()
        self._file_bytes: dict[str, int] = {}
        self._most_loading = 0
        for m in models:
            self._attach(m)
        metrics.budget_bytes.set(budget)
        for m in models:
            metrics.footprint_bytes.labels(model=m.id, source="predicted").set(m.predicted_bytes)

    # -- routing --------------------------------------------------------------------

    def route(self, name: str | None) -> FleetModel:
        """The model a request names (id or alias). No name, or any name where any is served: the default."""
        if name is None or self.any_name:
            return self.models[self.default]
        model = self._names.get(name)
        if model is None:
            raise UnknownModel(name, list(self.models))
        return model

    @property
    def controllers(self) -> list[Controller]:
        return [m.controller for m in self.models.values()]

    @property
    def default_model(self) -> FleetModel:
        return self.models[self.default]

    @property
    def max_ctx_size(self) -> int:
        """No slot of any model holds a longer prompt."""
        return max(m.controller.settings.ctx_size for m in self.models.values())

    # -- admission ------------------------------------------------------------------

    async def admit(self, model_id: str, reason: str = "request") -> LoadNotAdmitted | None:
        """Wait until `model_id` may load; None when it may, else why not. A load
        for a request waits as long as the request does (wake_timeout); one at
        start, by an operator or a retry waits as long as a load may take."""
        bound = self.wake_timeout if reason == "request" else max(self.wake_timeout, self.load_timeout)
        future = asyncio.get_running_loop().create_future()
        self._pending.append(PendingLoad(model_id, future))
        self._changed.set()
        try:
            return await asyncio.wait_for(asyncio.shield(future), bound)
        except asyncio.TimeoutError:
            if future.done():
                return future.result()
            future.cancel()  # the owner drops it from the queue
            self.metrics.admission_refusals.labels(model=model_id, reason="timeout").inc()
            why = self._last_wait.get(model_id, "the memory did not come free")
            self._gave_up[model_id] = (why, time.monotonic())
            self.log.warning("fleet.admission_timeout", model=model_id, reason=why)
            return LoadNotAdmitted(f"model {model_id} could not be loaded within {bound:g}s: {why}",
                                   "insufficient_memory", RETRY_AFTER_NO_ROOM)
        finally:
            if not future.done():
                future.cancel()
            self._changed.set()

    def admission_wait(self, model_id: str) -> float:
        """Seconds a load of `model_id` would wait for the fleet's other loads (one at a time):
        what is left of the one under way and the predicted wakes of those asked for before it.
        Only predictions from this host's wakes count (a default guess never refuses a request,
        daemon/model/sleep_tiers.py too_slow); a wait for busy models to finish is not predicted."""
        if not self.admitting or self.models[model_id].admitted:
            return 0.0

        def measured(model: FleetModel) -> float:
            prediction = model.controller.predict_wake()
            return prediction.seconds if prediction is not None and prediction.basis == "measured" else 0.0

        total = sum(measured(m) for m in self.models.values()
                    if m.id != model_id and m.admitted and m.controller.state in (S.LOADING, S.WAKING))
        for load in self._pending:
            if load.model_id == model_id:
                break
            if not load.future.done():
                total += measured(self.models[load.model_id])
        return total

    def waiting_for_room(self, model_id: str, since: float) -> str | None:
        """Why `model_id`'s load is waiting for the fleet, or gave up waiting
        after `since` (a request's wake bound and its admission's expire in the
        same loop turn; the request's answer should say why either way)."""
        if any(load.model_id == model_id and not load.future.done() for load in self._pending):
            return self._last_wait.get(model_id, "waiting for its turn to load")
        gave_up = self._gave_up.get(model_id)
        if gave_up is not None and gave_up[1] >= since:
            return gave_up[0]
        if model_id in self._held_for:
            waiting = self._held_for[model_id]
            return (f"its new requests are held until {waiting} is loaded, so that {model_id} finishes "
                    f"the requests in flight and makes room ({self._last_wait.get(waiting, 'waiting for room')})")
        return None

    async def run(self) -> None:
        """The owner task: re-plan the head of the queue whenever anything changes."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            self._plan()
            self._fit_caches()
            self._update_gauges()  # planned bytes with the tiers as last reported

    def _plan(self) -> None:
        while self._pending:
            head = self._pending[0]
            model_id, future = head.model_id, head.future
            if future.done():  # timed out or called off
                self._pending.popleft()
                continue
            model = self.models[model_id]
            decision = plan_load(model_id, self.views(), self.budget, self.max_models)
            if isinstance(decision, StartNow):
                self._pending.popleft()
                model.admitted = True
                self._last_wait.pop(model_id, None)
                self._fit_caches(for_model=model_id)  # the other tiers leave it its room before it loads
                self.log.info("fleet.admit", model=model_id, bytes=model.bytes, planned=self.planned_bytes())
                future.set_result(None)
                self._update_gauges()
                continue  # the next pending load now sees this one loading, and waits
            if isinstance(decision, Refuse):
                self._pending.popleft()
                self.metrics.admission_refusals.labels(model=model_id, reason="never_fits").inc()
                self.log.warning("fleet.refuse", model=model_id, reason=decision.reason)
                future.set_result(LoadNotAdmitted(decision.reason, decision.code, None))
                continue
            if not head.waited:
                head.waited = True
                self.metrics.admission_waits.labels(model=model_id).inc()
            if isinstance(decision, ShrinkCaches):
                if self._shrink_caches(decision, model_id):
                    continue  # the room is there now: plan again (StartNow)
                break  # nothing lowered (cannot happen: every budget is below what is held); do not spin
            if isinstance(decision, EvictFirst):
                self._last_wait[model_id] = f"putting {', '.join(decision.victims)} to sleep"
                for victim in decision.victims:
                    tier = self.evict_tier(self.models[victim])
                    self.log.info("fleet.evict", model=victim, for_model=model_id, tier=tier)
                    self.models[victim].controller.post(SleepRequested(0, reason="evict", tier=tier))
            elif isinstance(decision, Drain):
                self._last_wait[model_id] = decision.reason
                head.drained.update(decision.models)
            elif isinstance(decision, Wait):
                self._last_wait[model_id] = decision.reason
            break  # the head waits; the ones behind it wait their turn
        self._hold_for(self._pending[0] if self._pending else None)

    def _hold_for(self, head: PendingLoad | None) -> None:
        """Hold new requests of exactly the models the head drains (until it is
        admitted, refused or gives up: a drained model that fell idle is then
        evicted for it, and must not be woken by its own requests meanwhile);
        release every other model's, in order."""
        drained = head.drained if head is not None else set()
        for model in self.models.values():
            controller = model.controller
            if model.id in drained:
                self._held_for[model.id] = head.model_id
                if not controller.holding:
                    self.metrics.drains.labels(model=model.id).inc()
                    self.log.info("fleet.drain", model=model.id, for_model=head.model_id)
                    controller.hold_requests()
            elif controller.holding:
                self._held_for.pop(model.id, None)
                self.log.info("fleet.drain_lifted", model=model.id, released=len(controller.held))
                controller.release_held()

    # -- what the planner sees ----------------------------------------------------------

    def views(self) -> dict[str, ModelView]:
        views = {}
        for m in self.models.values():
            state = m.controller.state
            resident, held = m.admitted or state in HOLDING, None
            if state in (S.DOZING, S.DROWSY, S.ROUSING):
                resident, held = True, self.weight_bytes(m)  # the contexts are gone (dozing: going)
                if state is not S.DROWSY:
                    held = m.bytes  # until the doze is done, or once the rouse begins: all of it
            elif state is S.LIGHT_SLEEP:
                # Its files' pages are RAM: on CPU that is the budget's; on a GPU they are not the GPU's.
                held = 0 if self.on_gpu(m) else self.file_bytes(m)
                resident = held > 0
            cache = self.cache_bytes(m) if state in HOLDING and not self.on_gpu(m) else 0
            views[m.id] = ModelView(m.id, m.bytes, resident, state, m.last_used,
                                    busy=m.controller.machine.busy, pinned=m.pinned,
                                    sleeps_when_idle=m.controller.machine.policy.idle_seconds >= 0, held=held,
                                    cache=cache, cache_ceiling=self.cache_ceiling(m) if resident else 0)
        return views

    # -- the prompt caches' RAM tiers -----------------------------------------------------

    @staticmethod
    def cache_bytes(model: FleetModel) -> int:
        """What its worker's RAM tier holds, as its last answer said (the tier grows only while
        it serves, so a load planned now sees it), at most the budget the fleet lowered it to."""
        report = model.controller.metrics.prompt_cache
        if report is model.cache_report_gone:  # said by a worker that has exited since
            return 0
        held = int((report or {}).get("ram", {}).get("bytes", 0) or 0)
        return held if model.cache_limit is None else min(held, model.cache_limit)

    def cache_ceiling(self, model: FleetModel) -> int:
        """The most its RAM tier can grow to without being told again (0: it cannot grow, or does not count)."""
        c = model.controller
        if self.on_gpu(model) or c.settings.embeddings:  # a GPU's budget is not host RAM; an embedder has no tier
            return 0
        setting = c.settings.prompt_cache_ram_bytes
        if c.state is S.READY:
            return setting if model.cache_limit is None else min(setting, model.cache_limit)
        if model.admitted and c.state in (S.LOADING, S.WAKING, S.ROUSING):
            return setting  # its next engine starts with its setting (told its limit when it says Ready)
        return 0

    def _fit_caches(self, for_model: str | None = None) -> None:
        """Tell each awake model's tier how far it may grow (statemachine.fleet.cache_limits): within
        the room the budget has, shrunk least recently used first when the sum is past it."""
        if not self.admitting:
            return  # a fleet of one with no budget set: its tier keeps its own
        for model_id, limit in cache_limits(self.views().values(), self.budget).items():
            model = self.models[model_id]
            if model.controller.state is S.READY:  # the others are told when they say Ready
                self._limit_cache(model, limit, for_model)

    def _limit_cache(self, model: FleetModel, budget: int, for_model: str | None) -> bool:
        """Lower its worker's RAM tier to `budget` bytes (PromptCache.shrink: the least recently used
        entries go, between two decode steps; they are on disk already). False when it is that low
        already: a worker's tier is only ever lowered, so a higher budget would change nothing."""
        setting = model.controller.settings.prompt_cache_ram_bytes
        current = setting if model.cache_limit is None else min(setting, model.cache_limit)
        if budget >= max(current, self.cache_bytes(model)):
            return False
        model.cache_limit = budget
        self.log.info("fleet.shrink_prompt_cache", model=model.id, for_model=for_model, budget_bytes=budget,
                      held_bytes=self.cache_bytes(model), planned=self.planned_bytes())
        # Out of band, as a Cancel: not a request (the idle timer and the busy flag are not touched);
        # its Answer matches no job and is dropped.
        model.controller.supervisor.send(
            p.Query(f"{CACHE_QUERY}{model.id}-{time.monotonic_ns()}", "prompt_cache_shrink", tokens=[budget]))
        return True

    def _shrink_caches(self, decision: ShrinkCaches, for_model: str) -> bool:
        """Lower the RAM tiers the planner named. True if any was lowered."""
        lowered = False
        for model_id, budget in decision.budgets:
            lowered = self._limit_cache(self.models[model_id], budget, for_model) or lowered
        return lowered

    # -- what each tier holds ----------------------------------------------------------

    def file_bytes(self, model: FleetModel) -> int:
        """The sizes of its files (a light model's page cache; a drowsy one's weights when unmeasured)."""
        if model.id not in self._file_bytes:
            total = 0
            for path in model.controller.model_files:
                try:
                    total += os.stat(path).st_size
                except OSError:
                    pass
            self._file_bytes[model.id] = total
        return self._file_bytes[model.id]

    def weight_bytes(self, model: FleetModel) -> int:
        if model.measured_components:
            return sum(v for k, v in model.measured_components.items() if k in WEIGHTS)
        return min(model.bytes, self.file_bytes(model)) or model.bytes

    @staticmethod
    def on_gpu(model: FleetModel) -> bool:
        c = model.controller
        return c.settings.n_gpu_layers != 0 and c.nvml.available

    def evict_tier(self, model: FleetModel) -> str:
        """The tier an eviction puts a model in: the shallowest that frees all it holds of the
        budget. On a GPU a light sleep does (its pages are host RAM) when the model has the light
        tier at all; on CPU the page cache is the budget's, so deep."""
        if self.on_gpu(model):
            return model.controller.machine.policy.sleep_tier
        return "deep"

    def planned_bytes(self) -> int:
        return sum(v.holding for v in self.views().values() if v.resident)

    def _update_gauges(self) -> None:
        loading = sum(1 for m in self.models.values() if m.admitted and m.controller.state in (S.LOADING, S.WAKING))
        self.metrics.loads_in_progress.set(loading)
        self._most_loading = max(self._most_loading, loading)
        self.metrics.loads_in_progress_max.set(self._most_loading)
        self.metrics.planned_bytes.set(self.planned_bytes())

    # -- listening to each model ----------------------------------------------------------

    def _attach(self, model: FleetModel) -> None:
        controller = model.controller

        def on_event(event: Event) -> None:
            if isinstance(event, RequestFinished) and not event.request_id.startswith(CACHE_QUERY):
                # When a request ends, not when it arrives: a model that served a
                # long stream until a moment ago was used more recently than one
                # whose short request came after the stream began and ended before.
                # (A shrink's answer is no use of the model: it must not make it the last to go.)
                model.last_used = time.monotonic()
            if isinstance(event, WORKER_GONE):
                # Its memory is back. Not only on reaching SLEEPING: a model asked for
                # during its teardown goes from UNLOADING straight to WAKING, and must
                # not count as holding memory while it queues for its next admission.
                model.admitted = False
                # And its RAM tier: the next worker starts one empty, with the tier's own budget.
                model.cache_limit, model.cache_report_gone = None, controller.metrics.prompt_cache
            self._changed.set()

        def on_state(before: S, after: S) -> None:
            if after in (S.SLEEPING, S.FAILED, S.LIGHT_SLEEP):
                model.admitted = False  # its worker is gone, and so is its memory
            if after is S.UNLOADING and isinstance(controller.machine.last_event, SleepRequested) \
                    and controller.machine.last_event.reason == "evict":
                self.metrics.evictions.labels(model=model.id).inc()
            if after is S.READY and before is not S.READY:
                model.last_used = time.monotonic()  # just loaded (for a request or an operator): not the first to go
                self._measured(model)
                # A new engine (a load, a wake, a rouse): its tier is empty, with its setting's budget; what
                # was reported before was another engine's. Its limit goes now, before its first request
                # (the controller dispatches the waiting requests after telling its listeners).
                model.cache_limit, model.cache_report_gone = None, controller.metrics.prompt_cache
                self._fit_caches(for_model=model.id)
            self._update_gauges()

        controller.event_listeners.append(on_event)
        controller.state_listeners.append(on_state)
        if self.admitting:
            controller.admission = lambda reason: self.admit(model.id, reason)
            controller.fleet_wait = lambda: self.admission_wait(model.id)

    def _measured(self, model: FleetModel) -> None:
        by_device: dict[str, dict[str, int]] = model.controller.model_info.get("memory_by_device") or {}
        components = {component: sum(devices.values()) for component, devices in by_device.items()}
        if not components:
            return
        if sum(components.values()) <= 0:
            return  # nothing measured: the prediction stands
        model.measured_components = components
        model.measured_bytes = sum(components.values())
        self.metrics.footprint_bytes.labels(model=model.id, source="measured").set(model.measured_bytes)
        self.metrics.footprint_error_ratio.labels(model=model.id).set(
            (model.predicted_bytes - model.measured_bytes) / model.measured_bytes)
        if self.on_measured is not None:
            self.on_measured(model)

    # -- what /v1/models and the CLI show -----------------------------------------------------

    def describe(self, model: FleetModel) -> dict[str, Any]:
        c = model.controller
        return {"id": model.id, "aliases": list(model.aliases), "tags": list(model.tags), "status": model.status,
                "state": str(c.state), "tier": c.sleep_tier,
                "pinned": model.pinned,
                "footprint_bytes": {"predicted": model.predicted_bytes, "measured": model.measured_bytes},
                "default": model.id == self.default}

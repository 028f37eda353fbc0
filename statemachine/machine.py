"""The server state machine: one table of transitions, events in, commands out.

`ServerMachine.handle(event)` looks up the row for (current state, event type)
and runs it. A missing row is a bug and raises `InvalidTransition`: every event
that can legitimately arrive in a state has a row, even if the row ignores it
(for instance a timer that fired just before it was disarmed, or a request's
finish that arrives after its worker crashed). The controller logs and counts
such a bug and carries on; the table stays strict so that tests find it.

The machine also keeps the request bookkeeping that the idle policy needs: a
request counts as in flight from the moment it is accepted, so the idle timer
is armed only when nothing is in flight or waiting, and a request can never
race the teardown.
"""

from collections import deque
from dataclasses import dataclass
from typing import Callable

from statemachine.commands import (
    ArmIdleTimer,
    ArmRetryTimer,
    CancelRequest,
    Command,
    DisarmIdleTimer,
    Dispatch,
    Doze,
    Exit,
    FailRequests,
    Reject,
    ReleaseKeeper,
    Reply,
    Rouse,
    StartWorker,
    StopWorker,
)
from statemachine.events import (
    DozeCompleted,
    Event,
    IdleTimerFired,
    LoadNotAdmitted,
    PolicyChanged,
    RequestAbandoned,
    RequestArrived,
    RequestFinished,
    RetryTimerFired,
    SleepCompleted,
    SleepRequested,
    Started,
    StopRequested,
    WakeRequested,
    WorkerExited,
    WorkerLoadFailed,
    WorkerReady,
)
from statemachine.states import TIER_OF_STATE
from statemachine.states import ServerState as S


class InvalidTransition(RuntimeError):
    """An event arrived in a state that has no row for it."""


@dataclass(frozen=True)
class Policy:
    idle_seconds: float = 300.0  # < 0: never sleep on idle
    parallel: int = 4  # slots the worker will have
    max_queued: int = 128  # requests accepted beyond the slots (or during a wake)
    retry_base_seconds: float = 1.0  # backoff after a failed load: base * 2**(n-1)
    retry_max_seconds: float = 60.0
    # A worker that crashes within this many seconds of its load counts as a
    # failed load (backoff, FAILED): a poison request cannot loop wake, crash,
    # retry at the speed of its client.
    early_crash_seconds: float = 30.0
    # The sleep tiers (docs/SCALING.md), escalating with idle time. drowsy_seconds:
    # idle seconds before the worker frees its contexts and keeps the weights (< 0:
    # no drowsy tier); idle_seconds then still counts from the start of the idle time.
    # deep_after_seconds: seconds in the light tier (worker gone, the keeper holds the
    # GGUF's pages) before the keeper lets go; 0: no light tier, a sleep is deep at
    # once (the default: what a sleep always was), and a light sleep asked for by
    # name (POST /sleep) stays light until woken or sent deep; < 0: never deep on its own.
    drowsy_seconds: float = -1.0
    deep_after_seconds: float = 0.0

    @property
    def capacity(self) -> int:
        return self.parallel + self.max_queued

    @property
    def sleep_tier(self) -> str:
        """The tier a sleep (idle, POST /sleep without a tier) goes to."""
        return "deep" if self.deep_after_seconds == 0 else "light"


class ServerMachine:
    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()
        self.state = S.STARTING
        self.in_flight: set[str] = set()  # handed to the worker
        self.waiting: deque[str] = deque()  # accepted, waiting for a worker
        self.worker_up = False  # a worker process exists (loading, loaded or tearing down)
        self.stop_sent = False
        self.wake_pending = False
        self.failure_reason: str | None = None
        self.consecutive_load_failures = 0
        self.retry_delay = 0.0
        self.idle_generation = 0
        self.keep_alive: float | None = None  # the latest accepted request's (RequestArrived.keep_alive)
        self.retry_generation = 0
        self.last_event: Event | None = None
        self.idle_target = "sleep"  # what the armed idle timer does: drowsy, sleep (light or deep), deep
        self.unloading_tier = "deep"  # the tier an UNLOADING worker goes to
        self.keeper_held = False  # the daemon's keeper holds this model's GGUF in the page cache

    # -- entry point -------------------------------------------------------

    def handle(self, event: Event) -> list[Command]:
        row = TRANSITIONS.get((self.state, type(event)))
        if row is None:
            raise InvalidTransition(f"no transition for {type(event).__name__} in state {self.state}")
        self.last_event = event
        return row(self, event)

    @property
    def busy(self) -> bool:
        return bool(self.in_flight or self.waiting)

    @property
    def tier(self) -> str | None:
        """The sleep tier the model is in (or, UNLOADING, going to); None while awake or on its way."""
        if self.state is S.UNLOADING:
            return self.unloading_tier
        return TIER_OF_STATE.get(self.state)

    # -- helpers -----------------------------------------------------------

    @property
    def idle_seconds(self) -> float:
        """How long the model stays awake once idle (< 0: until asked): the
        policy's, unless the latest accepted request set its own keep_alive."""
        keep_alive, policy = self.keep_alive, self.policy.idle_seconds
        if keep_alive is None:
            return policy
        if keep_alive == 0:
            return 0.0
        if keep_alive < 0 or policy < 0:
            return -1.0
        return max(keep_alive, policy)  # "at least that long"

    def _next_tier(self) -> tuple[str, float]:
        """What the idle timer does from the current resting state, and after how long (< 0: nothing)."""
        idle, drowsy = self.idle_seconds, self.policy.drowsy_seconds
        if self.state is S.READY:
            if drowsy >= 0 and self.keep_alive != 0 and (idle < 0 or drowsy < idle):
                return "drowsy", drowsy
            return "sleep", idle
        if self.state is S.DROWSY:  # idle_seconds counts from the start of the idle time
            return "sleep", idle if idle < 0 else max(0.0, idle - max(drowsy, 0.0))
        if self.state is S.LIGHT_SLEEP:
            # deep_after 0 (no light tier of its own): only POST /sleep {"tier": "light"} comes
            # here, and that stays light until woken or sent deeper, not for 0 seconds.
            deep_after = self.policy.deep_after_seconds
            return "deep", deep_after if deep_after != 0 else -1.0
        return "", -1.0

    def _arm_idle_if_quiet(self) -> list[Command]:
        target, seconds = self._next_tier()
        if self.busy or seconds < 0:
            return []
        self.idle_generation += 1
        self.idle_target = target
        return [ArmIdleTimer(seconds, self.idle_generation)]

    def _disarm_idle(self) -> list[Command]:
        self.idle_generation += 1
        return [DisarmIdleTimer()]

    def _start_worker(self, state: S, reason: str) -> list[Command]:
        self.state = state
        self.worker_up = True
        self.stop_sent = False
        self.wake_pending = False
        return [StartWorker(reason)]

    def _stop_worker(self, reason: str, tier: str = "deep") -> list[Command]:
        if not self.worker_up or self.stop_sent:
            return []
        self.stop_sent = True
        self.unloading_tier = tier
        if tier == "light":
            self.keeper_held = True  # the controller opens the keeper before the worker lets go
        return [StopWorker(reason, tier)]

    def _release_keeper(self) -> list[Command]:
        if not self.keeper_held:
            return []
        self.keeper_held = False
        return [ReleaseKeeper()]

    def _take_waiting(self) -> tuple[str, ...]:
        ids = tuple(self.waiting)
        self.waiting.clear()
        return ids

    # -- rows --------------------------------------------------------------

    def _ignore(self, event: Event) -> list[Command]:
        return []

    def _begin_first_load(self, event: Started) -> list[Command]:
        if not event.load:
            self.state = S.SLEEPING
            return []
        return self._start_worker(S.LOADING, "startup")

    def _worker_ready(self, event: WorkerReady) -> list[Command]:
        # consecutive_load_failures is not reset here: a load that crashes at
        # its first decode must keep backing off. It resets once the worker
        # proves itself (a request answered, a clean sleep, a long uptime).
        self.state = S.READY
        self.failure_reason = None
        ids = self._take_waiting()
        self.in_flight.update(ids)
        commands: list[Command] = self._release_keeper()  # the worker holds the weights now
        if ids:
            commands.append(Dispatch(ids))
        return commands + self._arm_idle_if_quiet()

    def _load_failed(self, event: WorkerLoadFailed | WorkerExited) -> list[Command]:
        permanent = getattr(event, "permanent", False)
        self.state = S.FAILED
        self.worker_up = False
        self.failure_reason = event.reason + (" (loading again cannot help: fix the configuration, then restart or "
                                              "POST /wake)" if permanent else "")
        self.consecutive_load_failures += 1
        self.retry_delay = self.policy.retry_max_seconds if permanent else min(
            self.policy.retry_base_seconds * 2 ** (self.consecutive_load_failures - 1),
            self.policy.retry_max_seconds,
        )
        self.retry_generation += 1
        commands: list[Command] = self._release_keeper()
        ids = self._take_waiting()
        if ids:
            commands.append(Reject(ids, f"model failed to load: {self.failure_reason}", "model_load_failed",
                                   self.retry_delay))
        if not permanent:
            commands.append(ArmRetryTimer(self.retry_delay, self.retry_generation))
        return commands

    def _not_admitted(self, event: LoadNotAdmitted) -> list[Command]:
        # No worker was started: nothing holds memory, so the model sleeps and
        # the requests that waited for it are told why (and when to retry).
        self.state = S.SLEEPING
        self.worker_up = False
        self.wake_pending = False
        ids = self._take_waiting()
        commands = self._release_keeper()  # it did not fit: it holds nothing, pages included
        return commands + ([Reject(ids, event.reason, event.code, event.retry_after)] if ids else [])

    def _crashed_while_ready(self, event: WorkerExited) -> list[Command]:
        # The worker is gone, so nothing holds the model: that is sleeping. The
        # requests it was serving fail; the next request wakes a new worker.
        # A crash right after a load is a load that did not hold: it backs off.
        ids = tuple(sorted(self.in_flight))
        self.in_flight.clear()
        commands = self._disarm_idle()
        if ids:
            commands.append(FailRequests(ids, f"worker exited: {event.reason}"))
        if event.uptime is not None and event.uptime < self.policy.early_crash_seconds:
            return commands + self._load_failed(WorkerLoadFailed(f"crashed {event.uptime:.1f}s after loading: {event.reason}"))
        self.consecutive_load_failures = 0
        self.state = S.SLEEPING
        self.worker_up = False
        return commands

    def _crashed_while_resting(self, event: WorkerExited) -> list[Command]:
        # A dozing or drowsy worker died: nothing is in flight (requests wait for a
        # rouse), nothing holds the model. Whoever waits gets a new worker.
        commands = self._disarm_idle()
        self.worker_up = False
        if self.waiting or self.wake_pending:
            return commands + self._start_worker(S.WAKING, "admin" if self.wake_pending else "request")
        self.state = S.SLEEPING
        return commands

    def _unloaded(self, event: SleepCompleted | WorkerExited) -> list[Command]:
        self.worker_up = False
        if isinstance(event, SleepCompleted):
            self.consecutive_load_failures = 0
        if self.waiting or self.wake_pending:
            return self._start_worker(S.WAKING, "admin" if self.wake_pending else "request")
        if self.unloading_tier == "light" and self.keeper_held:
            self.state = S.LIGHT_SLEEP
            return self._arm_idle_if_quiet()  # deep after deep_after_seconds
        self.state = S.SLEEPING
        return self._release_keeper()

    def _dozed(self, event: DozeCompleted) -> list[Command]:
        self.state = S.DROWSY
        if self.waiting or self.wake_pending:
            reason = "admin" if self.wake_pending else "request"
            self.wake_pending = False
            self.state = S.ROUSING
            return [Rouse(reason)]
        return self._arm_idle_if_quiet()

    def _idle_fired(self, event: IdleTimerFired) -> list[Command]:
        if event.generation != self.idle_generation or self.busy:
            return []  # stale: a request came in after the timer was armed
        if self.idle_target == "drowsy":
            self.state = S.DOZING
            return [Doze()]
        self.state = S.UNLOADING
        return self._stop_worker("idle", self.policy.sleep_tier)

    def _drowsy_idle_fired(self, event: IdleTimerFired) -> list[Command]:
        if event.generation != self.idle_generation:
            return []
        self.state = S.UNLOADING
        return self._stop_worker("idle", self.policy.sleep_tier)

    def _light_idle_fired(self, event: IdleTimerFired) -> list[Command]:
        if event.generation != self.idle_generation:
            return []
        self.state = S.SLEEPING
        return self._release_keeper()

    def _retry_fired(self, event: RetryTimerFired) -> list[Command]:
        if event.generation != self.retry_generation:
            return []
        return self._start_worker(S.LOADING, "retry")

    def _request_arrived(self, event: RequestArrived) -> list[Command]:
        rid = event.request_id
        if self.state is S.STOPPING:
            return [Reject((rid,), "server is shutting down", "shutting_down")]
        if self.state is S.FAILED:
            return [
                Reject((rid,), f"model unavailable: {self.failure_reason}", "model_unavailable", self.retry_delay)
            ]
        if len(self.in_flight) + len(self.waiting) >= self.policy.capacity:
            return [Reject((rid,), f"server busy: {self.policy.capacity} requests already accepted", "queue_full", 1.0)]
        self.keep_alive = event.keep_alive
        if self.state is S.READY:
            self.in_flight.add(rid)
            return self._disarm_idle() + [Dispatch((rid,))]
        self.waiting.append(rid)
        if self.state is S.SLEEPING:
            return self._start_worker(S.WAKING, "request")
        if self.state is S.LIGHT_SLEEP:  # the keeper stays until the new worker holds the weights
            return self._disarm_idle() + self._start_worker(S.WAKING, "request")
        if self.state is S.DROWSY:
            self.state = S.ROUSING
            return self._disarm_idle() + [Rouse("request")]
        return []  # STARTING, LOADING, WAKING, UNLOADING, DOZING, ROUSING: the load under way (or next) serves it

    def _request_finished(self, event: RequestFinished) -> list[Command]:
        if event.request_id not in self.in_flight:
            return []  # already failed: its worker crashed before this finish was decided
        self.in_flight.discard(event.request_id)
        if event.ok:
            self.consecutive_load_failures = 0
        if self.state is S.STOPPING:
            return [] if self.in_flight else self._stop_worker("shutdown")
        return self._arm_idle_if_quiet()

    def _request_abandoned(self, event: RequestAbandoned) -> list[Command]:
        rid = event.request_id
        if rid in self.waiting:
            self.waiting.remove(rid)
            return []
        if rid in self.in_flight:
            return [CancelRequest(rid)]  # the worker answers with a finish
        return []

    def _sleep_requested(self, event: SleepRequested) -> list[Command]:
        t = event.ticket
        tier = event.tier or self.policy.sleep_tier
        if self.state is S.READY and self.busy:
            return [Reply(t, False, f"busy: {len(self.in_flight)} requests in flight")]
        if self.state is S.READY and tier == "drowsy":
            self.state = S.DOZING
            return self._disarm_idle() + [Doze(), Reply(t, True, "dozing")]
        if self.state in (S.READY, S.DROWSY) and tier != "drowsy":
            self.state = S.UNLOADING
            return self._disarm_idle() + self._stop_worker(event.reason, tier) + [Reply(t, True, "going to sleep")]
        if self.state in (S.DROWSY, S.DOZING) and tier == "drowsy":
            return [Reply(t, True, f"already {self.state}")]
        if tier == "deep" and self.state in (S.LIGHT_SLEEP, S.UNLOADING) and self.keeper_held:
            if self.state is S.UNLOADING:  # the keeper goes once the worker is gone
                self.unloading_tier = "deep"
                return [Reply(t, True, "already going to sleep; deep once unloaded")]
            self.state = S.SLEEPING
            return self._disarm_idle() + self._release_keeper() + [Reply(t, True, "keeper released: deep")]
        if self.state in (S.SLEEPING, S.UNLOADING, S.LIGHT_SLEEP):
            return [Reply(t, True, "already asleep" + (f" ({self.tier})" if self.tier != "deep" else ""))]
        return [Reply(t, False, f"cannot sleep ({tier}) while {self.state}")]

    def _wake_requested(self, event: WakeRequested) -> list[Command]:
        t = event.ticket
        if self.state not in (S.READY, S.LOADING, S.WAKING, S.ROUSING):
            # A wake that was asked for outlives the keep_alive that put the model to sleep: a
            # request's keep_alive 0 (Ollama's unload) would otherwise send it back at once.
            self.keep_alive = None
        if self.state is S.SLEEPING:
            return self._start_worker(S.WAKING, "admin") + [Reply(t, True, "waking")]
        if self.state is S.LIGHT_SLEEP:
            return self._disarm_idle() + self._start_worker(S.WAKING, "admin") + [Reply(t, True, "waking")]
        if self.state is S.DROWSY:
            self.state = S.ROUSING
            return self._disarm_idle() + [Rouse("admin"), Reply(t, True, "rousing")]
        if self.state is S.DOZING:
            self.wake_pending = True
            return [Reply(t, True, "will rouse once dozed")]
        if self.state is S.FAILED:
            self.retry_generation += 1  # the pending retry timer is now stale
            return self._start_worker(S.LOADING, "admin") + [Reply(t, True, "retrying the load")]
        if self.state is S.UNLOADING:
            self.wake_pending = True
            return [Reply(t, True, "will wake once unloaded")]
        if self.state in (S.READY, S.LOADING, S.WAKING, S.ROUSING):
            return [Reply(t, True, f"already {self.state}")]
        return [Reply(t, False, f"cannot wake while {self.state}")]

    def _policy_changed(self, event: PolicyChanged) -> list[Command]:
        self.policy = event.policy
        if self.state in (S.READY, S.DROWSY, S.LIGHT_SLEEP) and not self.busy:
            return self._disarm_idle() + self._arm_idle_if_quiet()  # re-armed with the new timeout
        return []

    def _stop_requested(self, event: StopRequested) -> list[Command]:
        previous = self.state
        self.state = S.STOPPING
        commands = self._disarm_idle()
        ids = self._take_waiting()
        if ids:
            commands.append(Reject(ids, "server is shutting down", "shutting_down"))
        if not self.worker_up:
            return commands + self._release_keeper() + [Exit()]
        if previous in (S.UNLOADING, S.DOZING, S.ROUSING) or self.in_flight:
            return commands  # finish the teardown, doze or rouse / let in-flight requests drain
        return commands + self._stop_worker("shutdown")

    def _worker_gone_while_stopping(
        self, event: SleepCompleted | WorkerExited | WorkerLoadFailed | LoadNotAdmitted
    ) -> list[Command]:
        self.worker_up = False
        commands: list[Command] = []
        ids = tuple(sorted(self.in_flight))
        self.in_flight.clear()
        if ids:
            commands.append(FailRequests(ids, "server is shutting down"))
        return commands + [Exit()]

    def _ready_while_stopping(self, event: WorkerReady) -> list[Command]:
        # A worker that says Ready exists and holds the model, whatever stop was
        # asked before (one sent while it was still starting had nothing to stop).
        self.stop_sent = False
        return self._stop_worker("shutdown")


Row = Callable[[ServerMachine, Event], list[Command]]
M = ServerMachine
ALL_STATES = tuple(S)

# The transition table. Read it by state: which events may arrive, and what each does.
TRANSITIONS: dict[tuple[S, type[Event]], Row] = {
    (S.STARTING, Started): M._begin_first_load,
    (S.LOADING, WorkerReady): M._worker_ready,
    (S.WAKING, WorkerReady): M._worker_ready,
    (S.LOADING, WorkerLoadFailed): M._load_failed,
    (S.WAKING, WorkerLoadFailed): M._load_failed,
    (S.LOADING, WorkerExited): M._load_failed,
    (S.WAKING, WorkerExited): M._load_failed,
    (S.LOADING, LoadNotAdmitted): M._not_admitted,
    (S.WAKING, LoadNotAdmitted): M._not_admitted,
    (S.STOPPING, LoadNotAdmitted): M._worker_gone_while_stopping,
    (S.READY, WorkerExited): M._crashed_while_ready,
    (S.UNLOADING, SleepCompleted): M._unloaded,
    (S.UNLOADING, WorkerExited): M._unloaded,
    (S.READY, IdleTimerFired): M._idle_fired,
    (S.FAILED, RetryTimerFired): M._retry_fired,
    (S.STOPPING, SleepCompleted): M._worker_gone_while_stopping,
    (S.STOPPING, WorkerExited): M._worker_gone_while_stopping,
    (S.STOPPING, WorkerLoadFailed): M._worker_gone_while_stopping,
    (S.STOPPING, WorkerReady): M._ready_while_stopping,
    (S.STOPPING, StopRequested): M._ignore,
    # The sleep tiers: drowsy (the worker keeps the weights), light (the keeper keeps the pages).
    (S.DOZING, DozeCompleted): M._dozed,
    (S.STOPPING, DozeCompleted): M._ready_while_stopping,
    (S.DOZING, WorkerExited): M._crashed_while_resting,
    (S.DROWSY, WorkerExited): M._crashed_while_resting,
    (S.DROWSY, IdleTimerFired): M._drowsy_idle_fired,
    (S.ROUSING, WorkerReady): M._worker_ready,
    (S.ROUSING, WorkerLoadFailed): M._load_failed,
    (S.ROUSING, WorkerExited): M._load_failed,
    (S.LIGHT_SLEEP, IdleTimerFired): M._light_idle_fired,
}
for _state in ALL_STATES:
    TRANSITIONS[(_state, RequestArrived)] = M._request_arrived
    TRANSITIONS[(_state, RequestAbandoned)] = M._request_abandoned
    TRANSITIONS[(_state, SleepRequested)] = M._sleep_requested
    TRANSITIONS[(_state, WakeRequested)] = M._wake_requested
    TRANSITIONS[(_state, PolicyChanged)] = M._policy_changed
    # A finish can trail its worker's crash (a dispatch that failed to encode
    # posts one while the WorkerExited is already queued): stale unless in flight.
    TRANSITIONS[(_state, RequestFinished)] = M._request_finished
    TRANSITIONS.setdefault((_state, StopRequested), M._stop_requested)
    # A timer can fire just before it is disarmed; outside its state it is stale.
    TRANSITIONS.setdefault((_state, IdleTimerFired), M._ignore)
    TRANSITIONS.setdefault((_state, RetryTimerFired), M._ignore)
del _state

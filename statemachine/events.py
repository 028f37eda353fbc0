"""Events fed into the server state machine. Each is a plain frozen value."""

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Event:
    pass


@dataclass(frozen=True)
class Started(Event):
    """The daemon is up and HTTP is bound: begin the first load, or (a fleet's
    model that is not the default nor pinned) sleep until the first request."""

    load: bool = True


@dataclass(frozen=True)
class WorkerReady(Event):
    n_slots: int
    info: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class WorkerLoadFailed(Event):
    reason: str
    # The error cannot change by loading again (a chat template that does not compile):
    # no retry timer; POST /wake (or a restart with another configuration) loads again.
    permanent: bool = False


@dataclass(frozen=True)
class LoadNotAdmitted(Event):
    """The fleet did not let this model load (it does not fit beside busy
    models within wake_timeout, or it can never fit): no worker was started."""

    reason: str
    code: str = "insufficient_memory"
    retry_after: float | None = None


@dataclass(frozen=True)
class WorkerExited(Event):
    """The worker process went away without being asked to (crashed, killed,
    or killed by the daemon because it stopped answering)."""

    reason: str
    # Seconds it had been serving since it said Ready; None if it never did. A
    # crash soon after a load (the first decode) counts as a failed load.
    uptime: float | None = None


@dataclass(frozen=True)
class SleepCompleted(Event):
    """The worker tore down in order, sent its report and exited."""

    report: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class DozeCompleted(Event):
    """The worker freed its contexts and holds only the weights (the drowsy tier)."""

    report: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class RequestArrived(Event):
    request_id: str
    # Ollama's keep_alive, in seconds: None: the policy's idle_seconds; 0: sleep as soon as idle;
    # > 0: awake at least this long once idle; < 0: never sleep on idle. The latest accepted request's decides.
    keep_alive: float | None = None


@dataclass(frozen=True)
class RequestFinished(Event):
    """The worker is done with a request (answered, failed or cancelled)."""

    request_id: str
    ok: bool = True


@dataclass(frozen=True)
class RequestAbandoned(Event):
    """The client gave up (disconnect or wake timeout)."""

    request_id: str


@dataclass(frozen=True)
class IdleTimerFired(Event):
    generation: int


@dataclass(frozen=True)
class RetryTimerFired(Event):
    generation: int


@dataclass(frozen=True)
class SleepRequested(Event):
    ticket: int = 0
    reason: str = "admin"  # admin (POST /sleep), evict (the fleet needs the memory)
    tier: str | None = None  # drowsy, light, deep; None: the policy's tier for a sleep (Policy.sleep_tier)


@dataclass(frozen=True)
class WakeRequested(Event):
    ticket: int = 0


@dataclass(frozen=True)
class StopRequested(Event):
    pass


@dataclass(frozen=True)
class PolicyChanged(Event):
    """The operator reloaded the configuration (SIGHUP)."""

    policy: Any

"""Commands the state machine asks the daemon to carry out."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    pass


@dataclass(frozen=True)
class StartWorker(Command):
    """Take the pre-spawned worker (or spawn one) and load the model."""

    reason: str = "request"  # startup, request, admin, retry


@dataclass(frozen=True)
class StopWorker(Command):
    """Ask the worker to tear down in order and exit."""

    reason: str = "idle"  # idle, admin, shutdown


@dataclass(frozen=True)
class Dispatch(Command):
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Reject(Command):
    """Answer requests that were never dispatched with an error."""

    request_ids: tuple[str, ...]
    reason: str
    code: str
    retry_after: float | None = None


@dataclass(frozen=True)
class FailRequests(Command):
    """Answer dispatched requests whose worker went away."""

    request_ids: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class CancelRequest(Command):
    request_id: str


@dataclass(frozen=True)
class ArmIdleTimer(Command):
    seconds: float
    generation: int


@dataclass(frozen=True)
class DisarmIdleTimer(Command):
    pass


@dataclass(frozen=True)
class ArmRetryTimer(Command):
    seconds: float
    generation: int


@dataclass(frozen=True)
class Reply(Command):
    """Answer an admin call (POST /sleep, POST /wake) identified by ticket."""

    ticket: int
    ok: bool
    message: str


@dataclass(frozen=True)
class Exit(Command):
    """Nothing is left to tear down: the daemon may exit."""

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
    # light: the daemon's keeper holds the GGUF in the page cache from before the
    # worker lets go of it (so no page is dropped in between); deep: nothing is held.
    tier: str = "deep"


@dataclass(frozen=True)
class Doze(Command):
    """Ask the worker to save its prompt caches and free its contexts, keeping the weights."""


@dataclass(frozen=True)
class Rouse(Command):
    """Ask the drowsy worker to create its contexts again (answered by Ready)."""

    reason: str = "request"  # request, admin


@dataclass(frozen=True)
class ReleaseKeeper(Command):
    """The keeper lets go of the GGUF's pages (the light tier ends)."""


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

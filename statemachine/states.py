"""The states a Dormouse server and its slots can be in."""

from enum import StrEnum


class ServerState(StrEnum):
    STARTING = "starting"  # process up, HTTP binding, nothing loaded yet
    LOADING = "loading"  # first load at start (or a retry after FAILED)
    READY = "ready"  # worker up, model loaded, requests run in slots
    UNLOADING = "unloading"  # ordered teardown in the worker, then it exits
    SLEEPING = "sleeping"  # no process holds a model
    WAKING = "waking"  # a new worker is loading because someone asked
    FAILED = "failed"  # could not load; retried with backoff or on POST /wake
    STOPPING = "stopping"  # shutting down: drain, tear down, exit


class SlotState(StrEnum):
    IDLE = "idle"
    STARTED = "started"
    PROCESSING_PROMPT = "processing_prompt"
    GENERATING = "generating"


# /health answers 200 in these states: the daemon can take a request and will
# answer it (possibly after a wake). LOADING at start and FAILED are 503.
HEALTHY_STATES = frozenset(
    {ServerState.READY, ServerState.SLEEPING, ServerState.WAKING, ServerState.UNLOADING}
)

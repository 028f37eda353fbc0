"""The states a Dormouse server and its slots can be in."""

from enum import StrEnum


class ServerState(StrEnum):
    STARTING = "starting"  # process up, HTTP binding, nothing loaded yet
    LOADING = "loading"  # first load at start (or a retry after FAILED)
    READY = "ready"  # worker up, model loaded, requests run in slots
    UNLOADING = "unloading"  # ordered teardown in the worker, then it exits
    SLEEPING = "sleeping"  # no process holds a model (the deep tier: nothing is held for it)
    DOZING = "dozing"  # the worker frees its contexts (KV cache, compute buffers) and keeps the weights
    DROWSY = "drowsy"  # the worker holds the weights, no context: a wake is a context creation
    ROUSING = "rousing"  # the drowsy worker creates its contexts again
    LIGHT_SLEEP = "light_sleep"  # no worker; the daemon keeps the GGUF warm in the page cache (keeper)
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
    {ServerState.READY, ServerState.SLEEPING, ServerState.WAKING, ServerState.UNLOADING,
     ServerState.DOZING, ServerState.DROWSY, ServerState.ROUSING, ServerState.LIGHT_SLEEP}
)

# The sleep tiers, shallowest first (docs/SCALING.md): what a sleeping model still holds.
TIERS = ("drowsy", "light", "deep")
# The tier each resting state is in; a model that is awake (or on its way
# somewhere) has none. UNLOADING's is the tier it is going to (ServerMachine.tier).
TIER_OF_STATE = {ServerState.DOZING: "drowsy", ServerState.DROWSY: "drowsy", ServerState.ROUSING: "drowsy",
                 ServerState.LIGHT_SLEEP: "light", ServerState.SLEEPING: "deep"}

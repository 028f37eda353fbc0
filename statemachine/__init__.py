"""Pure logic of Dormouse: states, events, commands and the transition table.

Nothing here does I/O or knows asyncio; the daemon feeds events in and
carries out the commands that come back.
"""

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
from statemachine.machine import InvalidTransition, Policy, ServerMachine, TRANSITIONS
from statemachine.slots import SLOT_TRANSITIONS, InvalidSlotTransition, check_slot_transition
from statemachine.states import TIERS, ServerState, SlotState

__all__ = [name for name in dir() if not name.startswith("_")]

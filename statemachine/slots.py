"""Slot lifecycle, as llama-server has it: IDLE -> STARTED -> PROCESSING_PROMPT
-> GENERATING -> IDLE. A slot can go back to IDLE from any state (the request
finished, failed or was cancelled)."""

from statemachine.states import SlotState

SLOT_TRANSITIONS: frozenset[tuple[SlotState, SlotState]] = frozenset(
    {
        (SlotState.IDLE, SlotState.STARTED),
        (SlotState.STARTED, SlotState.PROCESSING_PROMPT),
        (SlotState.PROCESSING_PROMPT, SlotState.GENERATING),
        (SlotState.STARTED, SlotState.IDLE),
        (SlotState.PROCESSING_PROMPT, SlotState.IDLE),
        (SlotState.GENERATING, SlotState.IDLE),
    }
)


class InvalidSlotTransition(RuntimeError):
    pass


def check_slot_transition(current: SlotState, new: SlotState) -> SlotState:
    if (current, new) not in SLOT_TRANSITIONS:
        raise InvalidSlotTransition(f"slot cannot go from {current} to {new}")
    return new

import pytest

from daemon.worker.text import StopMatcher, Utf8Assembler
from statemachine import InvalidSlotTransition, SlotState, check_slot_transition


def test_slot_lifecycle_and_invalid_transition():
    state = SlotState.IDLE
    for nxt in (SlotState.STARTED, SlotState.PROCESSING_PROMPT, SlotState.GENERATING, SlotState.IDLE):
        state = check_slot_transition(state, nxt)
    with pytest.raises(InvalidSlotTransition):
        check_slot_transition(SlotState.IDLE, SlotState.GENERATING)


def test_stop_string_spanning_tokens_is_never_emitted():
    m = StopMatcher(["</end>"])
    out = [m.feed(t) for t in ["Hello ", "wor", "ld</", "en", "d> tail"]]
    assert "".join(out) == "Hello world"
    assert m.stopped
    assert out[2] == "ld"  # "</" held back: it might become the stop


def test_held_back_text_is_released_when_it_is_not_a_stop():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("ART") == "START"
    assert m.feed(" S") == " "
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins():
    m = StopMatcher(["b", "xyz"])
    assert m.feed("axyzb") == "a"


def test_utf8_split_across_tokens():
    a = Utf8Assembler()
    data = "é🙂".encode()
    assert a.feed(data[:1]) == ""
    assert a.feed(data[1:3]) == "é"
    assert a.feed(data[3:]) == "🙂"

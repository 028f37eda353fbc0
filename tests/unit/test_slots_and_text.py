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


def _slot(seq_id: int, cache: list[int], last_used: float):
    from daemon.worker.slot import Slot

    slot = Slot(seq_id)
    slot.cache = list(cache)
    slot.last_used = last_used
    return slot


def test_slot_choice_keeps_other_conversations_cached():
    """An unrelated prompt shares only BOS with a used slot: it takes an empty
    slot instead of overwriting the other conversation (issue 9, item 2)."""
    from daemon.worker.slot import choose_slot

    bos = 2
    used = _slot(0, [bos, 10, 11, 12, 13, 14, 15, 16, 17, 18], last_used=5.0)
    empty = [_slot(i, [], 0.0) for i in (1, 2, 3)]
    unrelated = [bos, 50, 51, 52, 53, 54, 55, 56, 57, 58]
    assert choose_slot([used, *empty], unrelated, lambda s: s.common_prefix(unrelated)).id == 1
    # The same conversation, one turn later, goes back to its slot.
    turn = [bos, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    assert choose_slot([used, *empty], turn, lambda s: s.common_prefix(turn)).id == 0


def test_slot_choice_takes_the_least_recently_used_when_all_are_used():
    from daemon.worker.slot import choose_slot

    slots = [_slot(0, [2, 1, 1], 9.0), _slot(1, [2, 3, 3], 3.0), _slot(2, [2, 4, 4], 6.0)]
    prompt = [2, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]
    assert choose_slot(slots, prompt, lambda s: s.common_prefix(prompt)).id == 1
    # A real share wins over recency.
    prompt = [2, 4, 4, 5]
    assert choose_slot(slots, prompt, lambda s: s.common_prefix(prompt)).id == 2

"""Whoever hears that a request ended finds its slot idle: the worker sends the slots' states before
the request's Done (the full run caught /slots saying "generating" after requests_in_flight read 0,
when the states followed at the end of the step). The real engine in this process, counted in
messages, never timed."""

from __future__ import annotations

import pytest

from daemon import protocol as p

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engine(bundled_model):
    from tests.e2e.test_structured_warmup import engine_on, load

    runtime = load(bundled_model)  # 1024 tokens, 2 slots, no RAM tier
    eng = engine_on(runtime)
    yield eng
    eng.close()
    runtime.teardown()


def slots_when_done(messages: list, request_id: str) -> dict[str | None, str]:
    """The slots' states as last reported before `request_id`'s Done: request id -> state."""
    last: list[p.SlotInfo] = []
    for message in messages:
        if isinstance(message, p.SlotStates):
            last = message.slots
        if isinstance(message, p.Done) and message.request_id == request_id:
            return {s.request_id: s.state for s in last}
    raise AssertionError(f"no Done for {request_id}")


def test_the_slot_is_reported_idle_before_the_done_of_a_finished_or_cancelled_request(engine):
    params = p.SamplingParams(max_tokens=4, temperature=0)
    engine.submit(p.Submit("finished", params, prompt=[2, 1000, 1001]))
    engine.submit(p.Submit("cancelled", p.SamplingParams(max_tokens=500, temperature=0, ignore_eos=True),
                           prompt=[2, 2000, 2001]))
    for _ in range(3):
        engine.step()
    engine.cancel("cancelled")
    while engine.busy:
        engine.step()
    for request_id in ("finished", "cancelled"):
        states = slots_when_done(engine.messages, request_id)
        assert request_id not in states and set(states.values()) <= {"idle", "generating"}, states

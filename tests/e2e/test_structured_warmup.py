"""Structured output's tokenizer (llguidance's trie over the 262k pieces) is
built off the decode thread at the first structured request, and kept while
the model file is the same (issue 28).

- While the build is held in flight (the build's gate), a plain stream on the
  other slot keeps producing one token per step, and the structured request
  waits in the queue (cancellable there); once built, it runs and its answer
  matches the schema. During the build proper the stream goes on while the
  262k pieces are read (Python, sharing the interpreter); llguidance's own
  constructor, at the end, holds the GIL (structured.py says so).
- Across a drowsy wake (contexts freed and made again, the same weights) and
  across a reload of the same file in this process (a new llama_vocab), the
  tokenizer is built once, and its tokenize callback reaches the vocabulary
  attached now, never the freed one.
- An engine closed while the build is in flight stops it before the
  vocabulary can be freed.

The real engine and the bundled model in this process (no daemon): steps,
pieces and builds are counted, never timed."""

from __future__ import annotations

import json
import sys

import pytest

from daemon import protocol as p
from daemon.grammar import grammar_for

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
PLAIN = [2, *range(3000, 3040)]
STRUCTURED = [2, *range(4000, 4020)]


@pytest.fixture()
def fresh_tokenizers(monkeypatch):
    """A tokenizer registry of this test's own: nothing built yet, builds counted from 0."""
    import daemon.worker.engine  # noqa: F401 - every module that holds the registry, imported first
    from daemon.worker import structured

    fresh, old = structured._Tokenizers(), structured.tokenizers
    for module in list(sys.modules.values()):  # wherever the engine's modules took it by name
        if getattr(module, "__name__", "").startswith("daemon.worker") and getattr(module, "tokenizers", None) is old:
            monkeypatch.setattr(module, "tokenizers", fresh)
    return fresh


def load(bundled_model, parallel: int = 2):
    from daemon.worker.runtime import Runtime

    spec = p.ModelSpec(model=bundled_model, ctx_size=1024, parallel=parallel, threads=2, prompt_cache_ram_bytes=0)
    runtime = Runtime(spec)
    runtime.load()
    return runtime


def engine_on(runtime):
    from daemon.worker.engine import Engine

    messages: list = []
    engine = Engine(runtime, messages.append)
    engine.messages = messages
    return engine


def structured(request_id: str) -> p.Submit:
    return p.Submit(request_id, p.SamplingParams(max_tokens=12, temperature=0, grammar=grammar_for(json_schema=SCHEMA)),
                    prompt=STRUCTURED)


def finish(engine) -> None:
    for _ in range(2000):
        if not engine.busy:
            return
        engine.step()
    raise AssertionError("the engine never went idle")


def done_of(engine, request_id: str) -> p.Done:
    found = [m for m in engine.messages if isinstance(m, p.Done) and m.request_id == request_id]
    assert len(found) == 1, found
    return found[0]


def text_of(engine, request_id: str) -> str:
    return "".join(m.text for m in engine.messages if isinstance(m, p.Tokens) and m.request_id == request_id)


def test_a_plain_stream_keeps_decoding_while_the_first_structured_request_builds_the_tokenizer(
        bundled_model, fresh_tokenizers):
    runtime = load(bundled_model)
    engine = engine_on(runtime)
    try:
        engine.submit(p.Submit("plain", p.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True), prompt=PLAIN))
        while not any(s.job is not None and s.job.n_generated > 0 for s in engine.slots):
            engine.step()
        plain = next(s for s in engine.slots if s.job is not None)
        fresh_tokenizers.gate.clear()  # the build starts, and waits here: in flight for as long as the test says
        try:
            engine.submit(structured("first-structured"))
            engine.submit(structured("cancelled-while-waiting"))
            before = plain.job.n_generated
            pieces_before = sum(1 for m in engine.messages if isinstance(m, p.Tokens) and m.request_id == "plain")
            for _ in range(20):
                engine.step()
            assert fresh_tokenizers.builds == 1 and not fresh_tokenizers.ready(runtime.vocab)
            assert plain.job.n_generated == before + 20  # one token per step: the build holds nothing up
            pieces = sum(1 for m in engine.messages if isinstance(m, p.Tokens) and m.request_id == "plain")
            assert pieces - pieces_before == 20
            assert [m.request_id for m in engine.queue] == ["first-structured", "cancelled-while-waiting"]
            engine.cancel("cancelled-while-waiting")  # a waiting structured request is in the queue: cancellable
            assert done_of(engine, "cancelled-while-waiting").finish_reason == "cancelled"
        finally:
            fresh_tokenizers.gate.set()
        # The build itself (262k pieces read, then llguidance's constructor): the stream goes on during the read.
        during_build = 0
        while not fresh_tokenizers.ready(runtime.vocab) and plain.job is not None:
            generated = plain.job.n_generated
            engine.step()
            during_build += plain.job.n_generated - generated if plain.job is not None else 1
        assert during_build >= 1
        finish(engine)
        done = done_of(engine, "first-structured")
        assert done.finish_reason == "stop" and done.error is None
        answer = json.loads(text_of(engine, "first-structured"))
        assert isinstance(answer["n"], int) and 1 <= answer["n"] <= 9
        assert done_of(engine, "plain").completion_tokens == 48
        assert fresh_tokenizers.builds == 1
    finally:
        engine.close()
        runtime.teardown()


def test_the_tokenizer_is_built_once_across_a_drowsy_wake_and_a_reload_of_the_same_file(
        bundled_model, fresh_tokenizers):
    runtime = load(bundled_model, parallel=1)
    engine = engine_on(runtime)
    try:
        engine.submit(structured("before-sleep"))
        finish(engine)
        assert done_of(engine, "before-sleep").finish_reason == "stop"
        tokens_then = fresh_tokenizers.get(runtime.vocab).tokenize_str('{"n": 3}')
        engine.close()  # a drowsy doze: the contexts go, the weights stay
        runtime.free_contexts()
        runtime.create_contexts()
        engine = engine_on(runtime)
        engine.submit(structured("after-drowsy-wake"))
        finish(engine)
        assert done_of(engine, "after-drowsy-wake").finish_reason == "stop"
        assert fresh_tokenizers.builds == 1
    finally:
        engine.close()
        runtime.teardown()  # the vocabulary the tokenizer was built on is freed
    runtime = load(bundled_model, parallel=1)  # the same file again: a new llama_vocab
    engine = engine_on(runtime)
    try:
        engine.submit(structured("after-reload"))
        finish(engine)
        assert done_of(engine, "after-reload").finish_reason == "stop"
        assert json.loads(text_of(engine, "after-reload"))["n"] in range(1, 10)
        assert fresh_tokenizers.builds == 1  # 1 build, not 2
        # llguidance's tokenize callback goes to the vocabulary attached now (the freed one would crash or differ)
        assert fresh_tokenizers.get(runtime.vocab).tokenize_str('{"n": 3}') == tokens_then
    finally:
        engine.close()
        runtime.teardown()


def test_closing_the_engine_stops_a_build_in_flight_and_the_next_request_builds_again(
        bundled_model, fresh_tokenizers):
    runtime = load(bundled_model, parallel=1)
    engine = engine_on(runtime)
    try:
        fresh_tokenizers.gate.clear()
        engine.submit(structured("waiting"))
        engine.step()
        assert fresh_tokenizers.builds == 1 and not fresh_tokenizers.ready(runtime.vocab)
        engine.close()  # joins the build thread: it stopped before reading a piece of the vocabulary
        assert done_of(engine, "waiting").finish_reason == "cancelled"
        engine = engine_on(runtime)
        engine.submit(structured("next"))
        finish(engine)
        assert done_of(engine, "next").finish_reason == "stop" and fresh_tokenizers.builds == 2
    finally:
        engine.close()
        runtime.teardown()

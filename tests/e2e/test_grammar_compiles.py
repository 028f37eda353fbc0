"""The grammars daemon.grammar builds, on the bundled model's real vocabulary
through the worker's own llguidance matcher (daemon/worker/structured.py):
they compile, accept valid output and refuse invalid output token by token,
and a grammar with no way on is GrammarDeadEnd (the request's 400), never a
crash. Only the vocabulary is loaded (vocab_only)."""

from __future__ import annotations

import json

import pytest

from daemon.grammar import grammar_for

pytestmark = pytest.mark.e2e

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
_QUIET = None


@pytest.fixture(scope="module")
def vocab(bundled_model):
    from daemon.worker.llama_lib import llama

    global _QUIET
    _QUIET = llama.llama_log_callback(lambda level, text, user_data: None)  # kept: llama.cpp holds its address
    llama.llama_log_set(_QUIET, None)
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    model = llama.llama_model_load_from_file(bundled_model.encode(), params)
    assert model, "cannot load the bundled model's vocabulary"
    yield llama.llama_model_get_vocab(model), llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    llama.llama_model_free(model)


def walk(vocab, grammar: str, text: str) -> bool:
    """The text's tokens through the matcher as the worker drives it; True when all pass and an end may follow."""
    from daemon.worker.structured import Matcher, tokenizers

    v, n = vocab
    matcher = Matcher.compile(grammar, v, n)
    for token in tokenizers.get(v).tokenize_str(text):
        if not matcher.allows(token):
            return False
        assert matcher.mask()[token]  # the slow path's mask agrees with the one-token check
        matcher.accept(token)
    return any(matcher.allows(end) for end in tokenizers.ends)


def test_valid_output_passes_and_invalid_is_refused(vocab):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
              "required": ["n"]}
    g = grammar_for(json_schema=schema)
    assert walk(vocab, g, json.dumps({"n": 3, "tags": ["a", "b"]}))
    assert not walk(vocab, g, json.dumps({"n": 10}))
    assert not walk(vocab, g, json.dumps({"n": 3, "tags": ["a", "b", "c"]}))
    assert not walk(vocab, g, '{"n": 3')  # incomplete: no end token allowed yet


def test_forced_calls_on_the_real_vocabulary(vocab):
    g = grammar_for(tools=[WEATHER, TIME], tool_choice="required")
    assert walk(vocab, g, '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]')
    assert walk(vocab, g, '[{"name": "get_time", "arguments": {}}]')
    assert not walk(vocab, g, '[{"name": "get_weather", "arguments": {"unit": "c"}}]')


def test_a_fork_follows_its_own_tokens(vocab):
    from daemon.worker.structured import Matcher, tokenizers

    v, n = vocab
    first = Matcher.compile(grammar_for(grammar='root ::= "yes" | "no"'), v, n)
    other = first.fork()
    yes, no = tokenizers.get(v).tokenize_str("yes"), tokenizers.get(v).tokenize_str("no")
    first.accept(yes[0])
    assert other.allows(no[0]) and not first.allows(no[0])


def test_grammars_with_no_way_on_are_dead_ends_not_crashes(vocab):
    from daemon.worker.structured import GrammarDeadEnd, Matcher, tokenizers

    v, n = vocab
    with pytest.raises(GrammarDeadEnd):  # matches nothing at all: refused before the first token
        Matcher.compile(grammar_for(grammar='root ::= root "a"'), v, n)
    matcher = Matcher.compile(grammar_for(grammar='root ::= "a" x\nx ::= x "b"'), v, n)
    matcher.accept(tokenizers.get(v).tokenize_str("a")[0])
    with pytest.raises(GrammarDeadEnd, match="structured output stopped"):  # at the slow path's mask
        matcher.mask()

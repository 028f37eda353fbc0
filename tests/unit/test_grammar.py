"""daemon.grammar: which request fields give which llguidance grammar, what it
enforces (checked byte by byte with llguidance's byte tokenizer, and against
jsonschema), and every refusal names the field and the problem. No model:
tests/e2e/test_grammar_compiles.py checks the grammars on the real vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from daemon.grammar import GrammarRefused, grammar_for

SCHEMA_PARAM = "response_format.json_schema.schema"
BYTES = LLTokenizer("byte")


def schema_format(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def accepts(grammar: str, text: str) -> bool:
    """The whole text, byte by byte, and the grammar complete after it."""
    matcher = LLMatcher(BYTES, grammar, log_level=0)
    data = list(text.encode())
    return matcher.try_consume_tokens(data) == len(data) and matcher.is_accepting()


def refused(param: str, *words: str, **fields) -> GrammarRefused:
    with pytest.raises(GrammarRefused) as info:
        grammar_for(**fields)
    assert info.value.param == param, (info.value.param, str(info.value))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return info.value


class Address(BaseModel):
    street: str
    zip_code: Optional[str] = None


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    address: Address
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2,4}$")


@pytest.mark.parametrize("make", [lambda m: m.model_json_schema(), to_strict_json_schema], ids=["pydantic", "strict"])
def test_pydantic_and_openai_strict_schemas_are_enforced(make):
    g = grammar_for(response_format=schema_format(make(Person)))
    good = {"name": "Ann", "age": 30, "address": {"street": "Main", "zip_code": None}, "code": "ABC-123"}
    assert accepts(g, json.dumps(good))
    assert not accepts(g, json.dumps({**good, "age": 121}))
    assert not accepts(g, json.dumps({**good, "code": "abc-1"}))
    assert not accepts(g, json.dumps({**good, "extra": 1}))  # listed properties only (schema_check.py)


# Refused by the GBNF converter before llguidance; enforced now: (schema, valid, invalid).
ENFORCED = [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
     {"a": 1}, {"b": 1}),
    ({"type": "string", "format": "email"}, "a@b.co", "not an email"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, {"a": 1}, {}),
    ({"type": "number", "minimum": 0, "maximum": 1}, 0.5, 2),
    ({"type": "integer", "multipleOf": 3}, 9, 10),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "aa", "aaaa"),
]


@pytest.mark.parametrize("case", range(len(ENFORCED)))
def test_keywords_refused_before_are_enforced(case):
    schema, good, bad = ENFORCED[case]
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema, format_checker=jsonschema.FormatChecker())
    g = grammar_for(json_schema=schema)
    assert accepts(g, json.dumps(good)) and not accepts(g, json.dumps(bad))


def test_whitespace_is_one_optional_space():
    g = grammar_for(response_format={"type": "json_object"})
    assert accepts(g, '{"a": [1, 2]}') and accepts(g, '{"a":[1,2]}')
    assert not accepts(g, '{"a":  1}') and not accepts(g, '{\n"a": 1}')


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "at": {"$ref": "#/$defs/Place"}},
    "required": ["city"], "$defs": {"Place": {"type": "string", "maxLength": 3}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_forced_calls_are_the_array_of_calls_each_tied_to_its_tool():
    g = grammar_for(tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(g, '[{"name": "get_weather", "arguments": {"city": "Oslo", "at": "abc"}}]')
    assert not accepts(g, '[{"name": "get_weather", "arguments": {"city": "Oslo", "at": "abcd"}}]')  # $ref rebased
    assert accepts(g, '[{"name": "get_time", "arguments": {}}]')
    assert not accepts(g, '[{"name": "get_time", "arguments": {"city": "x"}}]')
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]'
    assert not accepts(g, two)  # one call unless parallel_tool_calls
    assert accepts(grammar_for(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True), two)
    named = grammar_for(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert not accepts(named, '[{"name": "get_weather", "arguments": {"city": "x"}}]')
    for choice in (None, "none", "auto"):
        assert grammar_for(tools=[WEATHER], tool_choice=choice) is None


def test_a_forced_call_wins_over_response_format_as_in_openai():
    alone = grammar_for(tools=[WEATHER], tool_choice="required")
    assert grammar_for(tools=[WEATHER], tool_choice="required", response_format=schema_format({"type": "object"})) \
        == alone
    assert grammar_for(tools=[WEATHER], json_schema={"type": "string"},
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}) == alone
    refused("tool_choice", "grammar", tools=[WEATHER], tool_choice="required", grammar='root ::= "x"')


def test_tool_refusals():
    refused("tool_choice", "not among the tools", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "missing"}})
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tools", "list", tools={"name": "x"}, tool_choice="required")
    refused("tools[1].function.name", "twice", tools=[WEATHER, WEATHER], tool_choice="required")
    refused("tools[0].function.parameters", "object",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            tool_choice="required")
    refused("tools[0].function.parameters", '"not"', tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "null"}}}}}}], tool_choice="required")
    refused("tools", "at most 128", tools=[TIME] * 129, tool_choice="required")
    refused("parallel_tool_calls", "true or false", tools=[WEATHER], tool_choice="required", parallel_tool_calls="yes")


def test_wrong_shapes_and_conflicts_name_the_field():
    refused("response_format", "object", response_format="json")
    refused("response_format.type", "'yaml'", response_format={"type": "yaml"})
    refused("response_format.json_schema.schema", "missing", response_format={"type": "json_schema",
                                                                              "json_schema": {"name": "x"}})
    refused("response_format.json_schema.strict", "bool",
            response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}})
    refused("json_schema", "JSON Schema object", json_schema="{}")
    refused("grammar", "GBNF text", grammar=b'root ::= "x"')
    refused("grammar", "json_schema", grammar='root ::= "x"', json_schema={"type": "object"})
    refused("json_schema", "both", json_schema={"type": "object"}, response_format={"type": "json_object"})
    assert grammar_for() is None and grammar_for(response_format={"type": "text"}) is None


def test_unenforced_and_unknown_keywords_are_refused():
    cases = [
        ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, ['"not"']),
        ({"type": "array", "uniqueItems": True}, ["uniqueItems"]),
        ({"type": "string", "format": "weird"}, ["weird"]),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, ["oneOf"]),
        ({"type": "string", "frobnicate": True}, ["/frobnicate", "unknown keyword 'frobnicate'"]),
        ({"type": "object", "properties": {"a": {"type": "string", "maxLenght": 2}}},
         ["/properties/a/maxLenght", "unknown keyword"]),
        ({"type": "string", "x-guidance": {"lenient": True}}, ["x-guidance"]),
        ({"type": "object", "properties": {"": {}}}, ["empty property name"]),
        ({"type": "object", "properties": {"a": {"type": "string", "$id": "x"}}}, ["nested $id"]),
    ]
    for schema, words in cases:
        refused(SCHEMA_PARAM, *words, response_format=schema_format(schema))
    assert accepts(grammar_for(json_schema={"type": "string", "x-vendor": 1, "title": "T"}), '"x"')


def test_remote_refs_are_refused_and_never_fetched(monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the grammar builder opened a connection")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    refused("json_schema", "does not fetch", json_schema={"$ref": "https://example.com/schema.json"})


def test_hostile_schemas_are_refused_before_compiling():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(1000)}}
    refused("json_schema", "bytes of JSON", "65536", json_schema=wide)
    deep: dict = {"type": "string"}
    for _ in range(10_000):
        deep = {"type": "array", "items": deep}
    refused("json_schema", "nested deeper than 32", json_schema=deep)


def test_raw_grammar_is_gbnf_read_by_llguidance():
    g = grammar_for(grammar='root ::= "yes" | "no"\n')
    assert accepts(g, "yes") and accepts(g, "no") and not accepts(g, "maybe")
    refused("grammar", "empty", grammar="  \n")
    refused("grammar", "root", grammar='start ::= "x"')
    assert "65536" in str(refused("grammar", "bytes", grammar='root ::= "x"\n' + "# " + "x" * (1 << 20)))
    refused("grammar", "NUL", grammar='root ::= "x\x00"')
    refused("grammar", "unterminated", grammar="root ::= [a-z")
    refused("grammar", "nest", grammar="root ::= " + "(" * 40 + '"a"' + ")" * 40)


def test_the_daemon_does_not_import_llama_cpp():
    code = ("import sys; from daemon.grammar import grammar_for; grammar_for(json_schema={'type': 'object'}); "
            "print(sorted(m for m in sys.modules if m.startswith('llama_cpp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_raw_grammar_within_the_rule_bound_is_read_and_one_past_it_refused():
    from daemon.grammar.gbnf_check import MAX_RULES, GbnfRefused, check_gbnf

    def chain(n: int) -> str:  # n + 2 rules; the strings' "::=" is not a rule
        return "".join(f'a{i} ::= "::=" | "k{i}" a{i + 1}\n' for i in range(n)) + f'a{n} ::= "end"\nroot ::= a0\n'

    check_gbnf(chain(MAX_RULES - 2))
    with pytest.raises(GbnfRefused, match=f"more than {MAX_RULES} rules"):
        check_gbnf(chain(MAX_RULES - 1))

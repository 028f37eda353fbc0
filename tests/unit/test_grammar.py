"""daemon.grammar: which request fields give which grammar, and every refusal
names the field and the problem. Pure: no llama.cpp (tests/e2e/
test_grammar_compiles.py checks the grammars in the real sampler)."""

from __future__ import annotations

import enum
import subprocess
import sys
import uuid
from typing import Literal, Optional, Union

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, ConfigDict, Field

from daemon.grammar import GrammarRefused, grammar_for

SCHEMA_PARAM = "response_format.json_schema.schema"


def schema_format(schema, name="out"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def for_schema(schema):
    return grammar_for(response_format=schema_format(schema))


def refused(param: str, *words: str, **fields) -> GrammarRefused:
    with pytest.raises(GrammarRefused) as info:
        grammar_for(**fields)
    assert info.value.param == param, (info.value.param, str(info.value))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    return info.value


def schema_refused(schema, *words: str) -> GrammarRefused:
    return refused(SCHEMA_PARAM, *words, response_format=schema_format(schema))


def rules(gbnf: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in gbnf.splitlines())


# -- pydantic and openai strict schemas ------------------------------------------------


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Address(BaseModel):
    street: str
    zip_code: Optional[str] = None


class Node(BaseModel):
    value: int
    children: list["Node"] = []


class Cat(BaseModel):
    kind: Literal["cat"]
    indoor: bool


class Dog(BaseModel):
    kind: Literal["dog"]
    weight: float


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="full name", examples=["Ann"])
    age: int
    color: Color
    address: Address
    tags: list[str]
    nickname: Optional[str] = None
    pet: Union[Cat, Dog] = Field(discriminator="kind")
    either: Union[int, str]
    tree: Node
    pair: tuple[int, str]
    scores: dict[str, float]
    id: uuid.UUID
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2,4}$")
    short: str = Field(max_length=5)


@pytest.mark.parametrize("make", [lambda m: m.model_json_schema(), to_strict_json_schema], ids=["pydantic", "strict"])
@pytest.mark.parametrize("model", [Person, Address, Node, Cat])
def test_pydantic_and_openai_strict_schemas_give_a_grammar(make, model):
    gbnf = for_schema(make(model))
    assert "root" in rules(gbnf)


def test_the_person_grammar_ties_every_field():
    r = rules(for_schema(to_strict_json_schema(Person)))
    color = r["C" if "C" in r else "Color"]  # a prefix tree: the quote they share, then where they differ
    assert color == '"\\"" Color-0' and r["Color-0"] == '"green\\"" | "red\\""'
    assert r["root"].startswith('"{" space name-kv "," space age-kv')
    assert r["Node-children-item"] == "Node"  # recursion through $defs, by name
    assert r["code"] == '"\\"" [A-Z]{3} "-" [0-9]{2,4} "\\"" space'
    assert r["nickname"] == "string | null"
    assert "date" not in r and "uuid" in r


def test_json_object_and_text():
    assert grammar_for() is None
    assert grammar_for(response_format={"type": "text"}) is None
    assert rules(grammar_for(response_format={"type": "json_object"}))["root"] == "object"
    with_schema = grammar_for(response_format={"type": "json_object", "schema": Address.model_json_schema()})
    assert "street" in with_schema


def test_llama_server_json_schema_and_grammar():
    assert rules(grammar_for(json_schema={"type": "integer"}))["root"].startswith('("-"? integral-part)')
    assert grammar_for(grammar='root ::= "yes" | "no"\n') == 'root ::= "yes" | "no"\n'


def test_whitespace_is_one_optional_space():
    assert rules(grammar_for(response_format={"type": "json_object"}))["space"] == '" "?'


def test_control_characters_are_not_allowed_raw_in_strings():
    assert r"\x00-\x1F" in rules(for_schema({"type": "string"}))["char"]


def test_literals_with_quotes_and_backslashes_are_escaped():
    r = rules(for_schema({"enum": ['a"b', "c\\d", "é"]}))
    assert r["root"] == r'"\"" root-0'
    assert r["root-0"] == r'"a\\\"b\"" | "c\\\\d\"" | "é\""'


def test_a_property_named_like_a_def_does_not_stand_in_for_it():
    """The stock converter looked a $def up by name among all rules."""
    schema = {"type": "object", "required": ["Item", "thing"],
              "properties": {"Item": {"type": "object", "properties": {"n": {"type": "integer"}}},
                             "thing": {"$ref": "#/$defs/Item"}},
              "$defs": {"Item": {"type": "string", "maxLength": 2}}}
    r = rules(for_schema(schema))
    assert r["Item"] == '"{" space ( "\\"" Item-keys-0 )? "}" space'  # the optional names' tree
    assert r["Item-keys-0"] == '"n\\"" space ":" space integer'
    assert r["thing"] == "Item-ref" and r["Item-ref"] == '"\\"" (char (char)?)? "\\"" space'


# -- tools --------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_choice_none_and_auto_give_no_grammar():
    for choice in (None, "none", "auto"):
        assert grammar_for(tools=[WEATHER], tool_choice=choice) is None


def test_required_tools_give_an_array_of_calls_tied_to_each_tool():
    r = rules(grammar_for(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True))
    assert r["root"] == ('"[" space call ("," space call ("," space call ("," space call ("," space call '
                         '("," space call ("," space call ("," space call)?)?)?)?)?)?)? "]" space')  # 1..8 calls
    # The names are a prefix tree ("get_" once), each leaf going on with its own tool's arguments.
    assert r["call"] == '"{" space "\\"name\\"" space ":" space "\\"get_" call-name-0 "}" space'
    assert r["call-name-0"] == ('"time\\"" "," space "\\"arguments\\"" space ":" space call-get-time-arguments | '
                                '"weather\\"" "," space "\\"arguments\\"" space ":" space call-get-weather-arguments')
    assert r["call-get-time-arguments"] == '"{" space "}" space'
    assert r["call-get-weather-arguments"] == '"{" space call-get-weather-arguments-city-kv "}" space'


def test_one_call_unless_parallel_is_asked_or_when_named():
    """parallel_tool_calls defaults to false, as llama-server's (issue 16: with it true by default the bundled
    model repeated the same forced call until max_tokens)."""
    for one in (grammar_for(tools=[WEATHER, TIME], tool_choice="required"),
                grammar_for(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)):
        assert rules(one)["root"] == '"[" space call "]" space'
    named = rules(grammar_for(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
                              parallel_tool_calls=True))
    assert named["root"] == '"[" space call "]" space'
    assert named["call"] == ('"{" space "\\"name\\"" space ":" space "\\"get_time\\"" "," space "\\"arguments\\"" '
                             'space ":" space call-get-time-arguments "}" space')
    assert "get_weather" not in "\n".join(named.values())


def test_tool_refusals():
    refused("tool_choice", "'missing'", "not among the tools", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "missing"}})
    refused("tool_choice", "needs tools", tool_choice="required")
    refused("tool_choice", "tool_choice", tools=[WEATHER], tool_choice="sometimes")
    refused("tool_choice", "tool_choice", tools=[WEATHER], tool_choice={"type": "allowed_tools"})
    refused("tools", "list", tools={"name": "x"}, tool_choice="required")
    refused("tools[0].type", "function", tools=[{"type": "retrieval"}], tool_choice="required")
    refused("tools[0].function", "object", tools=[{"type": "function", "function": "f"}], tool_choice="required")
    refused("tools[0].function.name", "name", tools=[{"type": "function", "function": {"name": ""}}],
            tool_choice="required")
    refused("tools[1].function.name", "twice", tools=[WEATHER, WEATHER], tool_choice="required")
    refused("tools[0].function.parameters", "JSON Schema",
            tools=[{"type": "function", "function": {"name": "f", "parameters": []}}], tool_choice="required")
    refused("tools[0].function.parameters", "object",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            tool_choice="required")
    refused("tools[0].function.parameters", "'not'", "/properties/a",
            tools=[{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"not": {"type": "null"}}}}}}], tool_choice="required")
    refused("tools", "at most 128", tools=[TIME] * 129, tool_choice="required")
    refused("parallel_tool_calls", "true or false", tools=[WEATHER], tool_choice="required",
            parallel_tool_calls="yes")


def test_forced_tool_call_and_a_response_format_are_ambiguous():
    error = refused("tool_choice", "response_format", "required", tools=[WEATHER], tool_choice="required",
                    response_format=schema_format({"type": "object"}))
    assert "both" in str(error)
    refused("tool_choice", "grammar", tools=[WEATHER], tool_choice="required", grammar='root ::= "x"')
    refused("tool_choice", "json_schema", tools=[WEATHER], json_schema={"type": "object"},
            tool_choice={"type": "function", "function": {"name": "get_weather"}})


# -- request shapes -------------------------------------------------------------------------


def test_wrong_shapes_name_the_field():
    refused("response_format", "object", response_format="json")
    refused("response_format.type", "'yaml'", response_format={"type": "yaml"})
    refused("response_format.type", "None", response_format={})
    refused("response_format.json_schema", "schema", response_format={"type": "json_schema"})
    refused("response_format.json_schema.schema", "missing", response_format={"type": "json_schema",
                                                                              "json_schema": {"name": "x"}})
    refused("response_format.json_schema.schema", "JSON Schema object",
            response_format={"type": "json_schema", "json_schema": {"schema": "{}"}})
    refused("response_format.json_schema.strict", "bool",
            response_format={"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}})
    refused("response_format.json_schema.name", "str",
            response_format={"type": "json_schema", "json_schema": {"schema": {}, "name": 3}})
    refused("response_format.schema", "JSON Schema", response_format={"type": "json_object", "schema": [1]})
    refused("json_schema", "JSON Schema object", json_schema="{}")
    refused("grammar", "GBNF text", grammar=b'root ::= "x"')


def test_only_one_constraint_source():
    refused("grammar", "json_schema", grammar='root ::= "x"', json_schema={"type": "object"})
    refused("grammar", "response_format", grammar='root ::= "x"', response_format={"type": "json_object"})
    refused("json_schema", "both", json_schema={"type": "object"}, response_format={"type": "json_object"})
    assert grammar_for(grammar='root ::= "x"', response_format={"type": "text"}) == 'root ::= "x"'


def test_raw_grammar_bounds():
    refused("grammar", "empty", grammar="  \n")
    refused("grammar", "root", grammar='start ::= "x"')
    error = refused("grammar", "bytes", grammar='root ::= "x"\n' + "# " + "x" * (1 << 20))
    assert "65536" in str(error)
    refused("grammar", "NUL", grammar='root ::= "x\x00"')


# -- hostile schemas --------------------------------------------------------------------------


def test_huge_schema_is_refused():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                               for i in range(1000)}}
    schema_refused(schema, "bytes of JSON", "65536")


def test_ten_thousand_deep_nesting_is_refused_without_recursing():
    schema: dict = {"type": "string"}
    for _ in range(10_000):
        schema = {"type": "array", "items": schema}
    schema_refused(schema, "nested deeper than 32")


def test_recursive_refs_terminate():
    linked = {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}},
                        "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}},
              "$ref": "#/$defs/A"}
    r = rules(for_schema(linked))
    assert r["root"] == "A" and r["A-b"] == "B" and r["B-a"] == "A"
    assert rules(for_schema({"type": "object", "properties": {"next": {"$ref": "#"}}}))["next"] == "def"


def test_left_recursive_refs_are_refused():
    schema_refused({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
                   "left recursion")
    schema_refused({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, "left recursion")


def test_remote_and_odd_refs_are_refused_and_never_fetched(monkeypatch):
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("the grammar builder opened a connection")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    for ref in ("https://example.com/schema.json", "https://example.com/s.json#/$defs/A", "other.json#/a",
                "#anchor", 5):
        error = schema_refused({"$ref": ref}, "only local references")
        assert error.param == SCHEMA_PARAM
    schema_refused({"$ref": "#/$defs/Missing"}, "points at nothing", "/$ref")


def test_unknown_and_unenforced_keywords_are_refused_with_their_path():
    cases = [
        ({"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}}, ["'minimum'", "/properties/a"]),
        ({"type": "number", "maximum": 3}, ["'maximum'"]),
        ({"type": "integer", "multipleOf": 2}, ["'multipleOf'"]),
        ({"type": "string", "format": "email"}, ["'email'", "/format"]),
        ({"not": {"type": "null"}}, ["'not'"]),
        ({"if": {"type": "string"}, "then": {"maxLength": 2}}, ["'if'"]),
        ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}}, ["dependentRequired"]),
        ({"type": "object", "patternProperties": {"^x": {}}}, ["patternProperties"]),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, ["uniqueItems"]),
        ({"type": "array", "contains": {"type": "integer"}}, ["contains"]),
        ({"type": "string", "frobnicate": True}, ["unknown keyword 'frobnicate'"]),
        ({"type": "string", "nullable": True}, ["unknown keyword 'nullable'"]),
        ({"type": "strin"}, ["/type", "type must be one of"]),
        ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, ["allOf with more than one"]),
        ({"$ref": "#/$defs/A", "maxLength": 3, "$defs": {"A": {"type": "string"}}}, ["$ref next to 'maxLength'"]),
        ({"anyOf": [{"type": "string"}], "type": "string"}, ["anyOf next to 'type'"]),
        ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 2}]}, ["oneOf whose alternatives can overlap"]),
        ({"type": "object", "required": ["a"]}, ["required ['a'] not among properties"]),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, ["minProperties"]),
        ({"type": "string", "pattern": "^(?=a)b$"}, ["/pattern", "lookarounds"]),
        ({"type": "string", "pattern": "^(a)\\1$"}, ["escape \\1"]),
        ({"type": "string", "pattern": "^\\bword$"}, ["escape \\b"]),
        ({"type": "string", "pattern": "^(a?)*$"}, ["can match nothing"]),
        ({"type": "string", "pattern": "^a{5000}$"}, ["above 1000"]),
        ({"type": "string", "pattern": "^a$b$"}, ["anchor"]),
        ({"type": "string", "pattern": "^[\n]$"}, ["only characters a JSON string must escape"]),
        ({"type": "string", "pattern": "a", "maxLength": 3}, ["only one of format, pattern"]),
        ({"type": "string", "maxLength": 100_000}, ["maxLength 100000 is above 1000"]),
        ({"type": "array", "minItems": 5, "maxItems": 2}, ["nothing can match"]),
        ({"type": "string", "contentEncoding": "base64"}, ["contentEncoding"]),
        ({"enum": []}, ["/enum", "non-empty"]),
        ({"enum": [1, "a"], "type": "integer"}, ['"a"', "not of type integer"]),
        ({"const": "a", "maxLength": 0}, ["const/enum next to 'maxLength'"]),
        ({"type": "object", "properties": {"a": {"type": "string", "$id": "x"}}}, ["nested $id"]),
        ({"type": "object", "properties": {"": {}}}, ["empty property name"]),
        (False, ["a schema must be an object"]),
    ]
    for schema, words in cases:
        if schema is False:
            refused("json_schema", *words, json_schema={"type": "array", "items": {"anyOf": [False]}})
            continue
        schema_refused(schema, *words)


# -- integer ranges (which integers they accept: tests/e2e/test_grammar_compiles.py) --------------


class Ranges(BaseModel):
    age: int = Field(ge=0, le=120)
    offset: int = Field(gt=-5, lt=5)
    at_least: int = Field(ge=10)
    at_most: int = Field(le=-3)
    maybe: Optional[int] = Field(default=None, ge=1, le=9)


@pytest.mark.parametrize("make", [lambda m: m.model_json_schema(), to_strict_json_schema], ids=["pydantic", "strict"])
def test_pydantic_integer_ranges_give_a_grammar(make):
    r = rules(for_schema(make(Ranges)))
    assert r["age"] == '([0-9] | [1-9] [0-9] | "1" ([0-1] [0-9] | "20")) space'
    assert r["offset"] == '("-" [1-4] | [0-4]) space'
    assert r["at-least"] == "[1-9] [0-9]{1,15} space"
    assert r["at-most"] == '("-" ([3-9] | [1-9] [0-9]{1,15})) space'
    assert r["maybe"] == "maybe-0 | null" and r["maybe-0"] == "[1-9] space"


def test_integer_range_forms():
    def root(schema):
        return rules(grammar_for(json_schema=schema))["root"]

    assert root({"type": "integer", "minimum": 7, "maximum": 7}) == '"7" space'
    assert root({"type": "integer", "minimum": 0, "maximum": 0}) == '"0" space'
    assert root({"type": "integer", "minimum": 2.5, "maximum": 9.9}) == "[3-9] space"  # rounded inward
    assert root({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 9}) == "[3-8] space"
    assert root({"type": "integer", "minimum": 0, "exclusiveMinimum": 3, "maximum": 9}) == "[4-9] space"  # stricter
    # draft-4: boolean flags on minimum/maximum
    assert root({"type": "integer", "minimum": 2, "exclusiveMinimum": True, "maximum": 9,
                 "exclusiveMaximum": False}) == "[3-9] space"
    assert root({"type": "integer", "maximum": 2**53}).startswith('("-"')
    assert root({"type": ["integer", "null"], "minimum": 1, "maximum": 3}) == "alternative-0 | null"
    for schema in ({"type": "integer", "minimum": -(2**53), "maximum": 2**53}, {"type": "integer", "minimum": 1},
                   {"type": "integer", "maximum": -1}, {"type": "integer", "exclusiveMaximum": 0}):
        assert "space" in root(schema)


def test_integer_range_refusals():
    cases = [
        ({"type": "integer", "minimum": 5, "maximum": 4}, ["at /:", "no integer", "nothing can match"]),
        ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 2.2, "maximum": 2.8}}},
         ["/properties/a", "nothing can match"]),
        ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, ["nothing can match"]),
        ({"type": "integer", "minimum": 2**53 + 1}, ["/minimum", "2**53"]),
        ({"type": "integer", "maximum": -1e18}, ["/maximum", "2**53"]),
        ({"type": "integer", "exclusiveMaximum": 10**30}, ["/exclusiveMaximum", "2**53"]),
        ({"type": "integer", "minimum": "0"}, ["/minimum", "must be a number"]),
        ({"type": "integer", "minimum": True}, ["/minimum", "must be a number"]),
        ({"type": "integer", "maximum": float("nan")}, ["/maximum", "must be a number"]),
        ({"type": "integer", "exclusiveMinimum": True}, ["/exclusiveMinimum", "needs minimum"]),
        ({"type": "integer", "minimum": 0, "multipleOf": 2}, ["'multipleOf'", "integers' minimum"]),
        ({"type": "number", "minimum": 0, "maximum": 1}, ["'maximum', 'minimum' on a number", "integers"]),
        ({"type": "number", "multipleOf": 0.5}, ["'multipleOf' on a number"]),
        ({"type": ["integer", "number"], "minimum": 0}, ["on a number"]),
        ({"minimum": 0}, ["on a number", "type 'integer'"]),
        ({"type": "integer", "enum": [1, 2], "minimum": 0}, ["const/enum next to 'minimum'"]),
    ]
    for schema, words in cases:
        schema_refused(schema, *words)

    class Floats(BaseModel):
        ratio: float = Field(ge=0, le=1)

    for make in (Floats.model_json_schema, lambda: to_strict_json_schema(Floats)):
        schema_refused(make(), "/properties/ratio", "on a number")


def test_repetitions_in_all_are_bounded():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(11)}}
    schema_refused(schema, "more than 10000 repetitions")


def test_annotations_are_accepted():
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "https://example.com/p",
              "$comment": "c", "title": "T", "description": "d", "examples": [{}], "default": {}, "deprecated": False,
              "readOnly": True, "writeOnly": False, "x-vendor": 1, "type": "object",
              "properties": {"a": {"type": "string", "title": "A", "default": "x", "examples": ["x"]}}}
    assert '"a\\"" space ":" space string' in rules(for_schema(schema)).values()


def test_keywords_that_only_allow_more_give_the_stricter_grammar():
    r = rules(for_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}))
    assert "additional" not in "\n".join(r)  # only declared properties: no clash with them
    tuple_schema = {"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}
    assert rules(for_schema(tuple_schema))["root"] == '"[" space integer "]" space'
    assert rules(for_schema({"type": "string", "pattern": "ab"}))["root"] == '"\\"" "ab" "\\"" space'
    r = rules(for_schema({"type": "string", "pattern": "^a.[^x]\\d\\s\\.\"$"}))
    assert r["root"] == ('"\\"" "a" [^\\u2028-\\u2029\\x00-\\x1F\\x22\\x5C] [^x\\x00-\\x1F\\x22\\x5C] [0-9] [\\x20] '
                         '".\\\\\\"" "\\"" space')


def test_oneof_with_a_discriminator_or_disjoint_types_is_accepted():
    assert for_schema({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]})
    pets = {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
            "$defs": {"Cat": Cat.model_json_schema(), "Dog": Dog.model_json_schema()}}
    assert "Cat" in rules(for_schema(pets))


def test_type_lists_keep_their_keywords():
    r = rules(for_schema({"type": ["string", "null"], "maxLength": 2}))
    assert r["root"] == "alternative-0 | null" and r["alternative-0"] == '"\\"" (char (char)?)? "\\"" space'


def test_produced_grammar_is_bounded():
    """A small schema can still expand: long rule names repeated maxItems times."""
    props = {"p" * 200 + str(i): {"type": "array", "items": {"type": "object"}, "maxItems": 1000} for i in range(2)}
    schema_refused({"type": "object", "properties": props}, "bytes", "262144")


def test_the_daemon_does_not_import_llama_cpp():
    code = ("import sys; from daemon.grammar import grammar_for; grammar_for(json_schema={'type': 'object'}); "
            "print(sorted(m for m in sys.modules if m.startswith('llama_cpp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

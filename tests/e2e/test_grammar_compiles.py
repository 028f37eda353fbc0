"""The grammars daemon.grammar builds are accepted by the real llama.cpp grammar
sampler (llama_sampler_init_grammar, as the worker uses it), and they accept
valid output and refuse invalid output token by token. A broken grammar gives
NULL, which the worker turns into a 400. Only the bundled model's vocabulary is
loaded (vocab_only), so this takes about a second."""

from __future__ import annotations

import ctypes
import enum
import json
import random
import time
import uuid
from typing import Literal, Optional, Union

import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

from daemon.grammar import grammar_for

pytestmark = pytest.mark.e2e


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
    name: str = Field(description="full name")
    age: int
    color: Color
    address: Address
    tags: list[str]
    nickname: Optional[str] = None
    pet: Union[Cat, Dog] = Field(discriminator="kind")
    code: str = Field(pattern=r"^[A-Z]{3}-\d{2,4}$")
    short: str = Field(max_length=5)
    pair: tuple[int, str]
    scores: dict[str, float]
    id: uuid.UUID


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


_QUIET = None


@pytest.fixture(scope="module")
def vocab(bundled_model):
    from daemon.worker.llama_lib import llama

    global _QUIET
    # llama.cpp keeps the callback's address for the life of the process: the module holds it, so no later
    # model load in this process logs through freed memory.
    _QUIET = llama.llama_log_callback(lambda level, text, user_data: None)
    llama.llama_log_set(_QUIET, None)
    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    params.vocab_only = True
    model = llama.llama_model_load_from_file(bundled_model.encode(), params)
    assert model, "cannot load the bundled model's vocabulary"
    yield llama, llama.llama_model_get_vocab(model)
    llama.llama_model_free(model)
    # The backend stays up: freeing and initialising it again in one process is what the worker
    # process exists to avoid (the next module that loads a model here crashed in llama.cpp).


def compiles(vocab, gbnf: str) -> bool:
    llama, v = vocab
    sampler = llama.llama_sampler_init_grammar(v, gbnf.encode(), b"root")
    if not sampler:
        return False
    llama.llama_sampler_free(sampler)
    return True


def accepts(vocab, gbnf: str, text: str) -> bool:
    """Every token of `text` passes the grammar, and then end-of-generation does."""
    llama, v = vocab
    raw = text.encode()
    tokens = (llama.llama_token * (len(raw) + 8))()
    n = llama.llama_tokenize(v, raw, len(raw), tokens, len(tokens), False, False)
    assert n >= 0
    sampler = llama.llama_sampler_init_grammar(v, gbnf.encode(), b"root")
    assert sampler
    try:
        for token in [*tokens[:n], llama.llama_vocab_eos(v)]:
            candidate = llama.llama_token_data(token, 0.0, 0.0)
            array = llama.llama_token_data_array(ctypes.pointer(candidate), 1, -1, False)
            llama.llama_sampler_apply(sampler, ctypes.byref(array))
            if candidate.logit == float("-inf"):
                return False
            if token != llama.llama_vocab_eos(v):
                llama.llama_sampler_accept(sampler, token)
        return True
    finally:
        llama.llama_sampler_free(sampler)


REPRESENTATIVE = {
    "json_object": dict(response_format={"type": "json_object"}),
    "json_object with schema": dict(response_format={"type": "json_object", "schema": Address.model_json_schema()}),
    "pydantic person": dict(response_format=schema_format(Person.model_json_schema())),
    "openai strict person": dict(response_format=schema_format(to_strict_json_schema(Person))),
    "recursive node": dict(response_format=schema_format(Node.model_json_schema())),
    "llama-server json_schema": dict(json_schema={"type": "array", "items": {"type": "integer"}, "maxItems": 3}),
    "long string": dict(json_schema={"type": "string", "maxLength": 1000}),
    "escapes in const": dict(json_schema={"enum": ['a"b', "back\\slash", "é", "line\nbreak"]}),
    "pattern with escapes": dict(json_schema={"type": "string", "pattern": "^[A-Z]\\d{2}.[^x]\\s\\.\"(a|bc)*$"}),
    "property named like a def": dict(json_schema={
        "type": "object", "properties": {"Item": {"type": "object"}, "thing": {"$ref": "#/$defs/Item"}},
        "$defs": {"Item": {"type": "string"}}}),
    "tools required": dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True),
    "tools required, one call": dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False),
    "tools named": dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
    "raw grammar": dict(grammar='root ::= "yes" | "no"'),
}


@pytest.mark.parametrize("case", list(REPRESENTATIVE))
def test_every_built_grammar_compiles(vocab, case):
    gbnf = grammar_for(**REPRESENTATIVE[case])
    assert compiles(vocab, gbnf), gbnf


def test_a_broken_grammar_gives_null(vocab):
    assert not compiles(vocab, 'root ::= "a" undefined-rule')
    assert not compiles(vocab, "root ::= (")
    assert not compiles(vocab, 'root ::= root "a" | "b"')  # left recursion


def test_valid_output_passes_and_invalid_is_refused(vocab):
    person = grammar_for(response_format=schema_format(to_strict_json_schema(Person)))
    valid = {"name": "Ann", "age": 31, "color": "red", "address": {"street": "Main \"1\"", "zip_code": None},
             "tags": ["a", "b"], "nickname": None, "pet": {"kind": "dog", "weight": 3.5}, "code": "ABC-123",
             "short": "abc", "pair": [1, "x"], "scores": {"m": 1.5}, "id": str(uuid.uuid4())}
    assert accepts(vocab, person, json.dumps(valid))
    for wrong in ({"color": "blue"}, {"code": "AB-1"}, {"short": "toolong"}, {"pet": {"kind": "cat", "weight": 1}},
                  {"age": "31"}):
        assert not accepts(vocab, person, json.dumps({**valid, **wrong})), wrong
    assert not accepts(vocab, person, json.dumps({k: v for k, v in valid.items() if k != "age"}))

    calls = grammar_for(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True)
    assert accepts(vocab, calls, '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, '
                                 '{"name": "get_time", "arguments": {}}]')
    assert not accepts(vocab, calls, '[{"name": "get_time", "arguments": {"city": "Oslo"}}]')
    assert not accepts(vocab, calls, '[{"name": "get_date", "arguments": {}}]')
    assert not accepts(vocab, calls, "[]")
    one = grammar_for(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert not accepts(vocab, one, '[{"name": "get_time", "arguments": {}}, {"name": "get_time", "arguments": {}}]')

    pattern = grammar_for(json_schema={"type": "string", "pattern": "^[A-Z]\\d{2}.\"(a|bc)*$"})
    assert accepts(vocab, pattern, json.dumps('X12-"abca'))
    assert not accepts(vocab, pattern, json.dumps('X1-"a'))
    assert not accepts(vocab, pattern, json.dumps('X12""a'))  # '.' never writes a raw quote

    escapes = grammar_for(json_schema={"enum": ['a"b', "back\\slash", "line\nbreak"]})
    assert accepts(vocab, escapes, json.dumps("back\\slash"))
    assert accepts(vocab, escapes, json.dumps('a"b'))


INTEGER_RANGES = {  # schema -> the inclusive range it means (None: open)
    "[0, 120]": ({"minimum": 0, "maximum": 120}, 0, 120),
    "(-5, 5)": ({"exclusiveMinimum": -5, "exclusiveMaximum": 5}, -4, 4),
    "[10, inf)": ({"minimum": 10}, 10, None),
    "(-inf, -3]": ({"maximum": -3}, None, -3),
    "[-1000, -7]": ({"minimum": -1000, "maximum": -7}, -1000, -7),
    "[7, 7]": ({"minimum": 7, "maximum": 7}, 7, 7),
    "[0, 0]": ({"minimum": 0, "maximum": 0}, 0, 0),
    "[-123, 4567]": ({"minimum": -123, "maximum": 4567}, -123, 4567),
    "[99, 101]": ({"minimum": 99, "maximum": 101}, 99, 101),
    "[1, 1000000]": ({"minimum": 1, "maximum": 1000000}, 1, 1000000),
    "[2.5, 19.5] rounded": ({"minimum": 2.5, "maximum": 19.5}, 3, 19),
    "draft-4 (1, 1099]": ({"minimum": 1, "exclusiveMinimum": True, "maximum": 1099}, 2, 1099),
    "(-inf, 0)": ({"exclusiveMaximum": 0}, None, -1),
}


def _probes(low, high) -> set[int]:
    """Every integer near the bounds, 0 and the powers of ten up to 10**7, and a sample inside."""
    rng = random.Random(f"{low},{high}")
    probes = set(range(-25, 26))
    for edge in (low, high, *(s * 10**k for k in range(1, 8) for s in (1, -1))):
        if edge is not None:
            probes.update(range(edge - 25, edge + 26))
    inside_low, inside_high = -(10**9) if low is None else low, 10**9 if high is None else high
    probes.update(rng.randint(inside_low, inside_high) for _ in range(50))
    return probes


@pytest.mark.parametrize("case", list(INTEGER_RANGES))
def test_integer_ranges_accept_exactly_their_integers(vocab, case):
    bounds, low, high = INTEGER_RANGES[case]
    gbnf = grammar_for(json_schema={"type": "integer", **bounds})
    assert compiles(vocab, gbnf), gbnf
    wrong = [n for n in sorted(_probes(low, high))
             if accepts(vocab, gbnf, str(n)) != ((low is None or n >= low) and (high is None or n <= high))]
    assert not wrong, (wrong[:20], gbnf)
    inside = low if low is not None else high  # every case has a bound
    zero_padded = f"-0{-inside}" if inside < 0 else f"0{inside}"
    for text in ("01", "-0", "+5", "1.0", "1e2", "00", "-01", "", "-", " 5", zero_padded, f"{inside}.0",
                 f"{inside}e0", f"+{inside}", f"{inside}{inside}0000000000000000"):
        assert not accepts(vocab, gbnf, text), (text, gbnf)
    assert accepts(vocab, gbnf, f"{inside} ")  # the rule's one optional trailing space
    if high is None:  # an open side keeps the plain integer's 16 digits
        assert accepts(vocab, gbnf, "9" * 16) and not accepts(vocab, gbnf, "1" + "0" * 16)
    if low is None:
        assert accepts(vocab, gbnf, "-" + "9" * 16) and not accepts(vocab, gbnf, "-1" + "0" * 16)


class Ranged(BaseModel):
    age: int = Field(ge=0, le=120)
    offset: int = Field(gt=-5, lt=5)
    floor: int = Field(ge=10)
    ceiling: int = Field(le=-3)


def test_pydantic_integer_ranges_in_an_object(vocab):
    for schema in (Ranged.model_json_schema(), to_strict_json_schema(Ranged)):
        gbnf = grammar_for(response_format=schema_format(schema))
        valid = {"age": 120, "offset": -4, "floor": 10, "ceiling": -3}
        assert accepts(vocab, gbnf, json.dumps(valid))
        for wrong in ({"age": 121}, {"age": -1}, {"offset": 5}, {"offset": -5}, {"floor": 9}, {"ceiling": -2},
                      {"ceiling": 0}, {"age": 1.5}):
            assert not accepts(vocab, gbnf, json.dumps({**valid, **wrong})), wrong


def test_json_object_whitespace_is_bounded(vocab):
    """The converter's space rule is one optional space: no whitespace run-away."""
    gbnf = grammar_for(response_format={"type": "json_object"})
    assert accepts(vocab, gbnf, '{ "a": [1, 2] }')
    assert not accepts(vocab, gbnf, '{  "a": 1}')
    assert not accepts(vocab, gbnf, '{\n"a": 1}')


def test_build_time_for_a_typical_schema():
    schema = to_strict_json_schema(Person)
    start = time.perf_counter()
    for _ in range(20):
        grammar_for(response_format=schema_format(schema))
    print(f"\ngrammar for a typical schema: {(time.perf_counter() - start) / 20 * 1000:.2f} ms")


# -- issue 16: the grammars that bound what matching costs, in the real sampler -----------------


def test_an_enum_prefix_tree_accepts_exactly_its_values(vocab):
    rng = random.Random(16)
    strings = sorted({"".join(rng.choice("0123") for _ in range(rng.randint(1, 6))) for _ in range(200)})
    values = [*strings, "a", "ab", "abc", "b", "é", "x\"y", 1, 12, 123, -1, 1.5, True, None, "null",
              *(int("9" * i) for i in range(4, 15))]
    gbnf = grammar_for(json_schema={"enum": values})
    assert compiles(vocab, gbnf), gbnf
    for value in values:
        assert accepts(vocab, gbnf, json.dumps(value, ensure_ascii=False)), value
    near = {json.dumps(s + "0") for s in strings} | {json.dumps(s[:-1]) for s in strings if len(s) > 1}
    near -= {json.dumps(s) for s in strings}
    for text in [*sorted(near)[:60], '"abcd"', '"ac"', "1234", "2", "-12", "1.", "false", '"nul"']:
        assert not accepts(vocab, gbnf, text), text


@pytest.mark.parametrize("required", [[], ["r1", "r2"]])
def test_optional_properties_any_subset_in_order(vocab, required):
    optional = ["a", "b", "c", "d"]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in [*required, *optional]},
              "required": required}
    gbnf = grammar_for(json_schema=schema)
    assert compiles(vocab, gbnf), gbnf
    for mask in range(16):
        keys = [*required, *(k for i, k in enumerate(optional) if mask >> i & 1)]
        assert accepts(vocab, gbnf, json.dumps({k: 1 for k in keys})), keys
    head = "".join(f'"{k}": 1, ' for k in required)
    for wrong in ('{%s"b": 1, "a": 1}', '{%s"a": 1, "a": 1}', '{%s"a": 1,}', '{, %s"a": 1}', '{%s"e": 1}'):
        assert not accepts(vocab, gbnf, wrong % head), wrong % head
    if required:
        assert not accepts(vocab, gbnf, '{"a": 1}')


def test_tool_names_as_a_prefix_tree_each_lead_to_their_own_arguments(vocab):
    names = ["get", "get_a", "get_ab", "get_b", "set_a"]
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {f"arg_{n}": {"type": "integer"}}, "required": [f"arg_{n}"]}}} for n in names]
    gbnf = grammar_for(tools=tools, tool_choice="required", parallel_tool_calls=True)
    assert compiles(vocab, gbnf), gbnf
    for n in names:
        assert accepts(vocab, gbnf, json.dumps([{"name": n, "arguments": {f"arg_{n}": 1}}]))
    assert accepts(vocab, gbnf, json.dumps([{"name": n, "arguments": {f"arg_{n}": 2}} for n in names]))
    assert not accepts(vocab, gbnf, json.dumps([{"name": "get_a", "arguments": {"arg_get": 1}}]))
    assert not accepts(vocab, gbnf, json.dumps([{"name": "get_c", "arguments": {}}]))
    assert not accepts(vocab, gbnf, json.dumps([{"name": "ge", "arguments": {}}]))

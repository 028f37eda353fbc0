"""What building and matching a grammar may cost (issue 16, section 3): work
that grows linearly with a schema, limits checked before anything is
converted, refusals (never a RecursionError or a 500) that name the field and
the limit, enums and tool names as prefix trees so that llama.cpp's matcher
holds few parse stacks, and a bound on the stacks all of a grammar's
alternatives can add up to. Complexity is shown by counting work at two sizes,
never by a clock."""

from __future__ import annotations

import json
import random
import re
import time
from typing import Literal, Optional, Union

import pytest
from pydantic import BaseModel, Field

from daemon.grammar import GrammarRefused, grammar_for
from daemon.grammar import build
from daemon.grammar.limits import (MAX_ALTERNATIVES, MAX_ENUM_VALUES, MAX_LITERAL_BYTES, MAX_OPTIONAL_PROPERTIES,
                                   MAX_PROPERTIES, Deadline)


def optional_object(n: int) -> dict:
    return {"type": "object", "properties": {f"field_number_{i}": {"type": "string"} for i in range(n)}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def refusal(**fields) -> GrammarRefused:
    with pytest.raises(GrammarRefused) as info:
        grammar_for(**fields)
    return info.value


@pytest.fixture
def rules_added(monkeypatch):
    """Counts the converter's _add_rule calls: the work of a conversion, rule by rule."""
    converter = build._converter_class()
    counted = {"calls": 0}
    original = converter._add_rule

    def counting(self, name, rule):
        counted["calls"] += 1
        return original(self, name, rule)

    monkeypatch.setattr(converter, "_add_rule", counting)
    return counted


def alternatives_per_rule(gbnf: str) -> int:
    """The most top-level alternatives of any rule: the stacks a rule opens at once."""
    most = 0
    for line in gbnf.splitlines():
        body = line.split(" ::= ", 1)[1]
        depth, count, i = 0, 1, 0
        while i < len(body):
            c = body[i]
            if c in "\"[":
                close = '"' if c == '"' else "]"
                i += 1
                while body[i] != close:
                    i += 2 if body[i] == "\\" else 1
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            elif c == "|" and depth == 0:
                count += 1
            i += 1
        most = max(most, count)
    return most


# -- building: linear, bounded, refused by name -------------------------------------------


def test_conversion_work_grows_linearly_with_optional_properties(rules_added):
    """The stock converter added n(n-1)/2 rules for n optional properties (900 per tool froze the daemon)."""
    sizes = {}
    for n in (8, 64):
        rules_added["calls"] = 0
        gbnf = grammar_for(json_schema=optional_object(n))
        sizes[n] = (rules_added["calls"], len(gbnf))
    calls_ratio = sizes[64][0] / sizes[8][0]
    bytes_ratio = sizes[64][1] / sizes[8][1]
    # 8x the properties; quadratic would be ~45x (the names' tree adds a little
    # per property as it branches more: n log n, not n squared).
    assert calls_ratio <= 8 * 2, sizes
    assert bytes_ratio <= 8 * 2, sizes


def test_the_hostile_request_of_issue_16_is_refused_before_converting(rules_added):
    """12 forced tools x 900 optional properties (313 KB) froze every model for 38 s."""
    tools = [tool(f"tool_{i}", optional_object(900)) for i in range(12)]
    error = refusal(tools=tools, tool_choice="required")
    assert error.param == "tools[0].function.parameters"
    assert f"at most {MAX_OPTIONAL_PROPERTIES}" in str(error) and "900 optional properties" in str(error)
    assert rules_added["calls"] == 0  # nothing was converted


def test_990_optional_properties_are_a_refusal_not_a_recursion_error():
    error = refusal(response_format={"type": "json_schema", "json_schema": {"schema": optional_object(990)}})
    assert error.param == "response_format.json_schema.schema"
    assert "990 optional properties" in str(error)


def test_the_optional_limit_itself_builds():
    assert grammar_for(json_schema=optional_object(MAX_OPTIONAL_PROPERTIES))
    assert "at most" in str(refusal(json_schema=optional_object(MAX_OPTIONAL_PROPERTIES + 1)))


def test_optional_properties_open_few_alternatives_whatever_their_number():
    """Between two properties the matcher held a stack per property that may come next (64: ~200 ms per
    refused step); now one per way their names begin (a prefix tree of the names that may follow)."""
    for n in (8, MAX_OPTIONAL_PROPERTIES):
        assert alternatives_per_rule(grammar_for(json_schema=optional_object(n))) <= 11, n
    schema = {**optional_object(MAX_OPTIONAL_PROPERTIES), "properties": {
        **optional_object(MAX_OPTIONAL_PROPERTIES)["properties"], "id": {"type": "integer"}}, "required": ["id"]}
    assert alternatives_per_rule(grammar_for(json_schema=schema)) <= 11


def test_required_properties_are_not_limited_per_object():
    """Every property of an openai strict schema is required: one parse stack, whatever their number."""
    schema = {**optional_object(300), "required": [f"field_number_{i}" for i in range(300)]}
    assert grammar_for(json_schema=schema)


def test_limits_across_all_the_schemas_of_a_request_name_themselves():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(120)},
            "required": [f"p{i}" for i in range(120)]}
    error = refusal(tools=[tool(f"t{i}", wide) for i in range(MAX_PROPERTIES // 120 + 1)], tool_choice="required")
    assert f"more than {MAX_PROPERTIES} properties" in str(error)

    choices = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": i}}, "required": [f"k{i}"]}
                         for i in range(MAX_ALTERNATIVES + 1)]}
    assert f"more than {MAX_ALTERNATIVES} anyOf" in str(refusal(json_schema=choices))

    many = [tool(f"t{i}", {"type": "object", "properties": {"v": {"enum": list(range(i * 500, i * 500 + 500))}}})
            for i in range(MAX_ENUM_VALUES // 500 + 1)]
    assert f"more than {MAX_ENUM_VALUES} enum" in str(refusal(tools=many, tool_choice="required"))

    long_values = [tool(f"t{i}", {"type": "object", "properties": {"v": {"enum": [f"{i}-{j}" + "x" * 1000
                                                                                   for j in range(40)]}}})
                   for i in range(MAX_LITERAL_BYTES // 40_000 + 1)]
    assert f"more than {MAX_LITERAL_BYTES} bytes" in str(refusal(tools=long_values, tool_choice="required"))


def test_a_build_past_its_deadline_stops_itself_and_names_the_field():
    deadline = Deadline(0.0)
    time.sleep(0.001)
    error = refusal(json_schema=optional_object(4), deadline=deadline)
    assert error.param == "json_schema" and "took longer than 0s" in str(error)
    error = refusal(tools=[tool("f", optional_object(4))], tool_choice="required", deadline=deadline)
    assert error.param == "tools[0].function.parameters"


def test_a_recursion_error_anywhere_in_a_build_is_a_refusal(monkeypatch):
    def too_deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(build, "_convert", too_deep)
    error = refusal(json_schema={"type": "object"})
    assert error.param == "json_schema" and "nested too deeply" in str(error)


# -- matching: few parse stacks -----------------------------------------------------------


def test_an_enum_is_a_prefix_tree_of_few_alternatives():
    """Three requests with {"enum": [1400 forty-digit strings]} paused a neighbour stream 41 s: the
    matcher held a stack per value. As a tree, a rule has at most one alternative per digit."""
    rng = random.Random(16)
    values = sorted({"".join(rng.choice("0123456789") for _ in range(40)) for _ in range(1400)})
    gbnf = grammar_for(json_schema={"enum": values})
    assert alternatives_per_rule(gbnf) <= 10
    # Every value is spelled out in it, digit for digit, by the literals along its path.
    assert len(re.findall(r'"[0-9]+', gbnf)) < sum(map(len, values))


def test_values_that_are_prefixes_of_each_other_do_not_nest_groups():
    """llama.cpp's GBNF parser recurses once per nested group: a tree is rules, not groups in groups."""
    gbnf = grammar_for(json_schema={"enum": [int("1" * i) for i in range(1, 16)] + ["a" * i for i in range(1, 300)]})
    assert max(line.count("(") for line in gbnf.splitlines() if not line.startswith("integral-part")) <= 1


def test_values_that_differ_in_one_character_become_a_class():
    gbnf = grammar_for(json_schema={"enum": [f"item-{c}" for c in "abcdefghij"]})
    assert '[a-j]' in gbnf or "[abcdefghij]" in gbnf
    assert alternatives_per_rule(gbnf) == 1


def test_tool_names_are_a_prefix_tree():
    tools = [tool(f"tool_{i}", {"type": "object", "properties": {"q": {"type": "string"}}}) for i in range(128)]
    gbnf = grammar_for(tools=tools, tool_choice="required")
    assert alternatives_per_rule(gbnf) <= 11  # a digit, or the name ends here


@pytest.mark.parametrize("levels", [6, 7])
def test_alternatives_that_begin_alike_and_nest_are_refused(levels):
    """anyOf[array of X, array of X] doubles the live stacks at every level."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = json.loads(json.dumps({"anyOf": [{"type": "array", "items": schema}] * 2}))
    error = refusal(json_schema=schema)
    assert "ways at one point" in str(error) and error.param == "json_schema"


def test_ambiguous_recursion_is_refused_and_plain_recursion_is_not():
    ambiguous = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "array", "items": {"$ref": "#"}}]}
    assert "ways at one point" in str(refusal(json_schema=ambiguous))
    assert grammar_for(json_schema={"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "null"}]})


class Lit(BaseModel):
    value: float


class Expr(BaseModel):
    op: str
    left: Union["Expr", Lit]
    right: Union["Expr", Lit]


def _discriminated_union(n: int) -> dict:
    members = tuple(type(f"Kind{i}", (BaseModel,), {"__annotations__": {"kind": Literal[f"k{i}"], "a": Optional[int],
                                                                         "b": Optional[str]}, "a": None, "b": None})
                    for i in range(n))

    class Holder(BaseModel):
        item: Union[members] = Field(discriminator="kind")  # type: ignore[valid-type]

    return Holder.model_json_schema()


def test_real_models_stay_under_the_stack_bound():
    assert grammar_for(json_schema=Expr.model_json_schema())  # recursive, told apart by their first property
    assert grammar_for(json_schema=_discriminated_union(20))

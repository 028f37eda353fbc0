"""What compiling a request's structured output may cost (issue 16, section 3;
issue 28): llguidance bounds its own matching, so what is left to bound is
compile time and memory, by sizes counted before llguidance sees the schema.
Each limit is a refusal (never a RecursionError or a 500) naming the field
and the limit, and the limit itself still compiles."""

from __future__ import annotations

import time

import pytest

from daemon.grammar import GrammarRefused, grammar_for
from daemon.grammar.limits import (MAX_ENUM_VALUES, MAX_LITERAL_BYTES, MAX_OPTIONAL_PROPERTIES, MAX_PROPERTIES,
                                   Deadline)


def optional_object(n: int) -> dict:
    return {"type": "object", "properties": {f"field_number_{i}": {"type": "string"} for i in range(n)}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def refusal(**fields) -> GrammarRefused:
    with pytest.raises(GrammarRefused) as info:
        grammar_for(**fields)
    return info.value


def test_the_hostile_request_of_issue_16_is_refused_before_compiling():
    tools = [tool(f"t{i}", optional_object(900)) for i in range(12)]
    error = refusal(tools=tools, tool_choice="required")
    assert error.param == "tools[0].function.parameters"
    assert f"at most {MAX_OPTIONAL_PROPERTIES}" in str(error) and "900 optional properties" in str(error)


def test_990_optional_properties_are_a_refusal():
    """llguidance compiles it, then errors at the first token ("row has 3967 items; max is 2000")."""
    error = refusal(response_format={"type": "json_schema", "json_schema": {"schema": optional_object(990)}})
    assert error.param == "response_format.json_schema.schema" and "990 optional properties" in str(error)


def test_the_optional_limit_itself_builds():
    assert grammar_for(json_schema=optional_object(MAX_OPTIONAL_PROPERTIES))
    assert "at most" in str(refusal(json_schema=optional_object(MAX_OPTIONAL_PROPERTIES + 1)))


def test_required_properties_are_not_limited_per_object():
    schema = {**optional_object(300), "required": [f"field_number_{i}" for i in range(300)]}
    assert grammar_for(json_schema=schema)


def test_limits_across_all_the_schemas_of_a_request_name_themselves():
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(120)},
            "required": [f"p{i}" for i in range(120)]}
    error = refusal(tools=[tool(f"t{i}", wide) for i in range(MAX_PROPERTIES // 120 + 1)], tool_choice="required")
    assert f"more than {MAX_PROPERTIES} properties" in str(error)

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

"""JSON Schemas for the coverage part of bench/structured_engines.py: the
keywords daemon/grammar refuses today (daemon/grammar/keywords.py
UNSUPPORTED, schema_walk.py's refusals: allOf of several, overlapping oneOf,
number ranges, multipleOf, uniqueItems, patternProperties, formats beyond
dates and uuids...) and the common ones clients send.

Each case carries values that must match and values that must not; the
benchmark checks them with `jsonschema` first (so a wrong case shows up as
such), then asks each engine whether it accepts the value's tokens.
"""

from __future__ import annotations

_PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}
_TREE = {"$defs": {"node": {"type": "object", "properties": {
    "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 4}},
    "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}

# (name, schema, [values that match], [values that must not])
CASES: list[tuple[str, dict, list, list]] = [
    ("nested object, required, no extras", {"type": "object", "properties": {"person": _PERSON},
                                            "required": ["person"], "additionalProperties": False},
     [{"person": {"name": "Ann", "age": 3}}], [{"person": {"name": "Ann"}}, {"person": {"name": "A", "age": 1, "x": 1}}]),
    ("$ref / $defs", {"$defs": {"p": _PERSON}, "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 3},
     [[{"name": "A", "age": 1}]], [[{"name": "A", "age": "1"}]]),
    ("recursion ($ref to itself)", _TREE,
     [{"value": 1, "children": [{"value": 2, "children": []}]}], [{"value": 1, "children": [{"value": 2}]}]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}, [5, "abc"], ["abcd", 1.5]),
    ("oneOf, disjoint", {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, [5, True], ["x"]),
    ("oneOf, overlapping", {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, [-3, 2.5], [3]),
    ("allOf of two", {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     [{"a": 1, "b": "x"}], [{"a": 1}, {"b": "x"}]),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, ["ABC-1234"], ["abc-1234", "ABC-123"]),
    ("format date-time", {"type": "string", "format": "date-time"}, ["2024-05-01T10:20:30Z"], ["yesterday"]),
    ("format email", {"type": "string", "format": "email"}, ["ann@example.com"], ["not an email"]),
    ("format ipv4", {"type": "string", "format": "ipv4"}, ["10.0.0.1"], ["10.0.0"]),
    ("minLength / maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, ["ab", "abcd"], ["a", "abcde"]),
    ("pattern + maxLength", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}, ["abcd"], ["abcde", "AB"]),
    ("minItems / maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     [[1], [1, 2]], [[], [1, 2, 3]]),
    ("enum, const", {"type": "object", "properties": {"k": {"enum": ["red", "green", 3, None]}, "c": {"const": "x"}},
                     "required": ["k", "c"]}, [{"k": "red", "c": "x"}, {"k": None, "c": "x"}],
     [{"k": "blue", "c": "x"}, {"k": 3, "c": "y"}]),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{"a": 1, "b": 2}], [{"a": "x"}]),
    ("patternProperties", {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, [{"x_a": 1}], [{"y": 1}, {"x_a": "s"}]),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "integer"}},
     [{"abc": 1}], [{"abcd": 1}]),
    ("minProperties / maxProperties", {"type": "object", "additionalProperties": {"type": "integer"},
                                       "minProperties": 1, "maxProperties": 2}, [{"a": 1}], [{}, {"a": 1, "b": 2, "c": 3}]),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, [{"a": 1, "b": 2}, {"b": 1}], [{"a": 1}]),
    ("number minimum / maximum", {"type": "number", "minimum": 0, "maximum": 1}, [0.5, 1], [1.5, -0.1]),
    ("integer exclusiveMinimum", {"type": "integer", "exclusiveMinimum": 0, "maximum": 100}, [1, 100], [0, 101]),
    ("integer multipleOf", {"type": "integer", "multipleOf": 5}, [10], [7]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
     [[1, 2]], [[1, 1]]),
    ("prefixItems (tuple)", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}],
                             "items": False}, [["a", 1]], [[1, "a"], ["a", 1, 2]]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, [[1, 7]], [[1, 2]]),
    ("not", {"type": "integer", "not": {"const": 3}}, [4], [3]),
    ("if / then / else", {"type": "object", "properties": {"k": {"type": "string"}, "n": {"type": "integer"}},
                          "required": ["k", "n"], "if": {"properties": {"k": {"const": "big"}}},
                          "then": {"properties": {"n": {"minimum": 100}}}}, [{"k": "big", "n": 200}, {"k": "s", "n": 1}],
     [{"k": "big", "n": 1}]),
    ("type list + null", {"type": ["string", "null"]}, ["a", None], [1]),
    ("200 optional properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)},
                                 "additionalProperties": False}, [{"p7": 1, "p150": 2}], [{"p7": "x"}, {"q": 1}]),
]

"""What the schema walk asks of JSON values and schemas without walking them:
a value's JSON type, whether oneOf's alternatives can both match (types that
overlap, or no discriminating const property), and JSON Pointer escapes.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.grammar.keywords import ANY_VALUE_TYPES, COMBINATORS


def possible_types(schema: Any) -> set[str]:
    """JSON types a (ref-resolved) schema can match; integer counts as number."""
    if not isinstance(schema, dict) or any(k in schema for k in COMBINATORS):
        return set(ANY_VALUE_TYPES)
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else as_list(schema["enum"])
        return {_json_type(v) for v in values}
    declared = schema.get("type")
    if declared is None:
        return set(ANY_VALUE_TYPES)
    types = [declared] if isinstance(declared, str) else as_list(declared)
    return {"number" if t == "integer" else t for t in types}


def discriminated(alternatives: list, follow_refs) -> bool:
    """All alternatives are objects sharing a required property whose const/enum
    values do not overlap: at most one alternative matches any output."""
    if not all(isinstance(a, dict) and possible_types(a) == {"object"} for a in alternatives):
        return False
    common = set.intersection(*(set(as_list(a.get("required"))) for a in alternatives))
    for key in common:
        seen: set[str] = set()
        for alt in alternatives:
            properties = alt.get("properties")
            prop = follow_refs(properties.get(key)) if isinstance(properties, dict) else None
            if not isinstance(prop, dict) or not ("const" in prop or "enum" in prop):
                break
            values = {json.dumps(v, sort_keys=True) for v in ([prop["const"]] if "const" in prop
                                                               else as_list(prop["enum"]))}
            if values & seen:
                break
            seen |= values
        else:
            return True
    return False


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def is_json_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return _json_type(value) == "number" and float(value).is_integer()
    return _json_type(value) == kind


def same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def escape_pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def unescape_pointer(part: str) -> str:
    from urllib.parse import unquote

    return unquote(part).replace("~1", "/").replace("~0", "~")

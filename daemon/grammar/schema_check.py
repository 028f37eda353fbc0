"""What is checked of a JSON Schema before llguidance compiles it.

llguidance enforces the keywords it implements and refuses those it knows and
does not implement (`not`, `uniqueItems`, ...), but it skips a keyword it has
never heard of: a misspelt `maxLenght` would be silently ignored, against the
rule "enforced or refused". So every key of every schema is checked here
against the JSON Schema vocabulary (vendor `x-` keys are annotations), with
the path where it is. `x-guidance` is refused: it carries llguidance's own
compile options (`lenient` ignores every unimplemented keyword), which are the
server's to set, not a client's.

An object schema that lists its properties and says nothing of others gets
`additionalProperties: false`, as the GBNF converter before llguidance wrote
it: llguidance would follow JSON Schema and let the model add any key (a
pydantic model's schema says nothing of others), and a small model then
invents keys until max_tokens. The answer still matches the client's schema.
Not where allOf is used: it combines objects, each of which lists only its
own properties.

The walk is iterative (a schema 10,000 levels deep is refused at level 32, not
by a Python recursion), counts the sizes of limits.py, and can rebase local
`$ref`s, so that a tool's parameters schema can live under the `$defs` of the
schema of a forced call (tool_calls.py).
"""

from __future__ import annotations

import json
from typing import Any

from daemon.grammar.limits import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, LimitExceeded, Spending
from daemon.grammar.refused import GrammarRefused

ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$schema", "$comment", "deprecated", "readOnly",
    "writeOnly", "$anchor", "$vocabulary", "discriminator", "$id", "contentEncoding", "contentMediaType",
})
ONE_SCHEMA = frozenset({"not", "if", "then", "else", "additionalProperties", "propertyNames", "additionalItems",
                        "contains", "unevaluatedProperties", "unevaluatedItems", "contentSchema"})
SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems"})
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
VALUES = frozenset({
    "type", "enum", "const", "$ref", "required", "minProperties", "maxProperties", "dependentRequired",
    "minItems", "maxItems", "uniqueItems", "minContains", "maxContains", "pattern", "format", "minLength",
    "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "$dynamicRef",
    "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor",
})
OTHER_PROPERTIES = frozenset({"additionalProperties", "patternProperties", "unevaluatedProperties"})
INTEGER_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "enum",
                            "const"})
KEYWORDS = ANNOTATIONS | ONE_SCHEMA | SCHEMA_LISTS | SCHEMA_MAPS | VALUES | {"items", "dependencies"}


def check_schema(schema: Any, param: str, spending: Spending, rebase: str | None = None) -> Any:
    """The schema as llguidance is to get it: checked, counted, and with each
    local `$ref` ("#...") moved under `rebase` (a JSON pointer such as
    "/$defs/tool-0") when one is given. Raises GrammarRefused naming `param`."""
    try:
        size = len(json.dumps(schema, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass"))
    except RecursionError:  # json.dumps recurses: far deeper than the walk below would accept
        raise GrammarRefused(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} schemas", param) from None
    except (TypeError, ValueError) as exc:  # only JSON reaches here, but nothing is assumed
        raise GrammarRefused(f"{param} is not JSON: {exc}", param) from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarRefused(f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted", param)
    schema = json.loads(json.dumps(schema))  # a copy, completed and rebased in place
    todo: list[tuple[Any, str, int]] = [(schema, "", 1)]
    open_objects: list[dict] = []
    try:
        while todo:
            node, path, depth = todo.pop()
            _check_node(node, path, depth, param, spending, rebase, todo)
            if isinstance(node, dict) and "properties" in node and not OTHER_PROPERTIES.intersection(node):
                open_objects.append(node)
            if isinstance(node, dict) and node.get("type") == "integer" and not INTEGER_BOUNDS.intersection(node):
                # At most 16 digits, as the GBNF converter wrote integers: unbounded, the small
                # model writes zeros until max_tokens. Any value a double holds exactly passes.
                node["minimum"], node["maximum"] = -(2**53), 2**53
    except LimitExceeded as exc:
        raise GrammarRefused(f"{param}: {exc}", param) from None
    if '"allOf"' not in json.dumps(schema):
        for node in open_objects:
            node["additionalProperties"] = False
    return schema


def _check_node(node: Any, path: str, depth: int, param: str, spending: Spending, rebase: str | None,
                todo: list) -> None:
    where = path or "/"
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise GrammarRefused(f"{param} at {where}: a schema must be an object or a boolean", param)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarRefused(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} schemas (at {where})", param)
    spending.check_time()
    for key, value in node.items():
        here = f"{path}/{_escape(key)}"
        if key == "x-guidance":
            raise GrammarRefused(f"{param} at {here}: x-guidance (llguidance's compile options) is the server's "
                                 "to set", param)
        if key.startswith("x-"):
            continue
        if key not in KEYWORDS:
            raise GrammarRefused(f"{param} at {here}: unknown keyword {key!r} (it would be ignored, not enforced)",
                                 param)
        if key == "$id" and path:
            raise GrammarRefused(f"{param} at {here}: a nested $id is not supported (local $refs only)", param)
        if key in ONE_SCHEMA:
            todo.append((value, here, depth + 1))
        elif key in SCHEMA_LISTS or (key == "items" and isinstance(value, list)):
            if not isinstance(value, list):
                raise GrammarRefused(f"{param} at {here}: {key} must be a list of schemas", param)
            todo.extend((item, f"{here}/{i}", depth + 1) for i, item in enumerate(value))
        elif key == "items":
            todo.append((value, here, depth + 1))
        elif key in SCHEMA_MAPS or key == "dependencies":
            if not isinstance(value, dict):
                raise GrammarRefused(f"{param} at {here}: {key} must be an object of schemas", param)
            for name, sub in value.items():
                if key == "properties" and name == "":
                    raise GrammarRefused(f"{param} at {here}: an empty property name is not supported", param)
                if key == "dependencies" and isinstance(sub, list):
                    continue  # draft 7's dependentRequired
                todo.append((sub, f"{here}/{_escape(name)}", depth + 1))
        elif key == "$ref" and rebase and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            node[key] = "#" + rebase + value[1:]
    properties = node.get("properties")
    if isinstance(properties, dict):
        required = node.get("required")
        required = set(required) if isinstance(required, list) and all(isinstance(r, str) for r in required) else set()
        spending.object(len(properties), len(set(properties) - required))
    values = node.get("enum")
    if isinstance(values, list) or "const" in node:
        spelled = [*(values if isinstance(values, list) else ()), *([node["const"]] if "const" in node else ())]
        spending.literals([json.dumps(v, ensure_ascii=False) for v in spelled])


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")

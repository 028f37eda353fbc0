"""JSON Schema -> the converter's vocabulary: each schema of a request is
checked and rewritten by `SchemaWalk`.

Every keyword the grammar would not enforce is refused (GrammarRefused names
the field, the keyword and where it is); the rest is rewritten into the small,
annotation-free vocabulary that llama-cpp-python's converter handles
correctly: its `visit` takes the first matching branch and silently drops the
other keywords of a schema (a `type` list drops `properties`, `$ref` drops its
siblings, `allOf` keeps only the components' properties, numbers ignore
`minimum`...), so what reaches it must be unambiguous. Integer ranges reach it
as an inclusive `minimum`/`maximum` pair of ints (integer_range.py), patterns
as GBNF (patterns.py). Local `$ref`s become names in one `RefTable`; anything
else (remote URLs, which the converter would fetch with `requests`) is refused.
The walk counts what the request spends of limits.py and checks the build's
deadline at every schema node.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from daemon.grammar.converter import converter_module
from daemon.grammar.json_values import (as_list, discriminated, escape_pointer, is_json_type, possible_types,
                                        same_json, unescape_pointer)
from daemon.grammar.keywords import (ANNOTATIONS, ANY_VALUE_TYPES, COMBINATORS, CONTAINERS, FORMATS, RANGE_KEYWORDS,
                                     TYPES, UNSUPPORTED, VALUE_KEYWORDS, VOCABULARY)
from daemon.grammar.limits import MAX_REPEAT, MAX_REPEAT_TOTAL, LimitExceeded, Spending
from daemon.grammar.patterns import PatternTranslator
from daemon.grammar.refused import GrammarRefused

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_INTEGER_BOUND = 2**53  # |minimum|, |maximum| on integers: exact as a double, 16 digits at most


class RefTable:
    """Normalized schemas reached through $ref, under names unique in one grammar,
    and what the request's schemas have spent of the limits."""

    def __init__(self, spending: Spending) -> None:
        self.schemas: dict[str, dict] = {}
        self.spending = spending
        self.repeats = 0  # MAX_REPEAT_TOTAL is counted across every schema of a request

    def reserve(self, hint: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-")[:40] or "def"
        if base in converter_module().RESERVED_NAMES or base == "space":
            base += "-def"  # the converter adds its primitives later under exactly these names
        name, n = base, 1
        while name in self.schemas:
            name, n = f"{base}-{n}", n + 1
        self.schemas[name] = {}  # filled when walked; reserved now so recursion finds it
        return name


class SchemaWalk:
    """Checks one JSON Schema document and rewrites it for the converter.

    Every constraining keyword is either rewritten into something the converter
    enforces or refused; annotations are dropped. Where a keyword only allows
    more (additional properties next to declared ones, items beyond a tuple,
    an unanchored pattern) the output is the stricter grammar: still valid."""

    def __init__(self, document: dict, param: str, table: RefTable) -> None:
        self.document = document
        self.param = param
        self.table = table
        self.ref_names: dict[str, str] = {}  # "#/..." pointer -> table name
        self.pending: list[tuple[str, str]] = []
        self.heads: dict[str, set[str]] = {}  # table name -> names reachable before any character

    def run(self) -> dict:
        _check_bounds(self.document, self.param)
        root_heads: set[str] = set()
        root = self.node(self.document, "", root_heads, is_root=True)
        while self.pending:
            pointer, name = self.pending.pop()
            heads: set[str] = set()
            self.table.schemas[name] = self.node(self._target(pointer), pointer[1:], heads)
            self.heads[name] = heads
        self._refuse_left_recursion()
        return root

    def refuse(self, path: str, problem: str) -> GrammarRefused:
        return GrammarRefused(f"{self.param} at {path or '/'}: {problem}", self.param)

    def spend(self, path: str, charge: Callable[[], None]) -> None:
        try:
            charge()
        except LimitExceeded as exc:
            raise self.refuse(path, str(exc)) from None

    # -- one schema --

    def node(self, schema: Any, path: str, heads: set[str], is_root: bool = False) -> dict:
        self.spend(path, self.table.spending.check_time)
        if schema is True or schema == {}:
            return {"type": list(ANY_VALUE_TYPES)}
        if not isinstance(schema, dict):
            raise self.refuse(path, "a schema must be an object (or true)")
        self._check_keywords(schema, path, is_root)
        for combinator in ("$ref", "allOf", "anyOf", "oneOf"):
            if combinator in schema:
                return self._combinator(combinator, schema, path, heads)
        if "const" in schema or "enum" in schema:
            return self._values(schema, path)
        types = self._types(schema, path)
        if len(types) == 1:
            return self._typed(types[0], schema, path)
        self.spend(path, lambda: self.table.spending.choice(len(types)))
        return {"anyOf": [self._typed(t, schema, path) for t in types]}

    def _check_keywords(self, schema: dict, path: str, is_root: bool) -> None:
        for key in schema:
            if key == "$id" and not is_root:
                raise self.refuse(path, "a nested $id changes how $ref resolves; it is not supported")
            if key in ANNOTATIONS or key in CONTAINERS or key.startswith("x-"):
                continue
            if key in UNSUPPORTED:
                raise self.refuse(path, f"keyword {key!r} is not enforced by the grammar")
            known = key in COMBINATORS or key in VALUE_KEYWORDS or any(key in v for v in VOCABULARY.values())
            if not known:
                raise self.refuse(path, f"unknown keyword {key!r}")

    def _constraining(self, schema: dict, but: tuple[str, ...] = ()) -> list[str]:
        return [k for k in schema if k not in ANNOTATIONS and k not in CONTAINERS and not k.startswith("x-")
                and k not in but]

    def _combinator(self, combinator: str, schema: dict, path: str, heads: set[str]) -> dict:
        others = self._constraining(schema, but=(combinator,))
        if others:
            raise self.refuse(path, f"{combinator} next to {', '.join(map(repr, others))} is not enforced "
                                    f"(the converter keeps only the {combinator}); nest them in one schema")
        value = schema[combinator]
        here = f"{path}/{combinator}"
        if combinator == "$ref":
            name = self._ref_name(value, here)
            heads.add(name)
            return {"$ref": name}
        if not isinstance(value, list) or not value:
            raise self.refuse(here, f"{combinator} must be a non-empty list of schemas")
        if combinator == "allOf":
            if len(value) > 1:
                raise self.refuse(here, "allOf with more than one schema is not enforced by the grammar")
            return self.node(value[0], f"{here}/0", heads)
        if combinator == "oneOf" and len(value) > 1:
            self._require_exclusive(value, here)
        self.spend(here, lambda: self.table.spending.choice(len(value)))
        return {"anyOf": [self.node(alt, f"{here}/{i}", heads) for i, alt in enumerate(value)]}

    def _values(self, schema: dict, path: str) -> dict:
        others = self._constraining(schema, but=("const", "enum", "type"))
        if others:
            raise self.refuse(path, f"const/enum next to {', '.join(map(repr, others))} is not enforced")
        allowed = self._types(schema, path) if "type" in schema else None
        if "const" in schema:
            values = [schema["const"]]
            if "enum" in schema and not any(same_json(schema["const"], v) for v in as_list(schema["enum"])):
                raise self.refuse(path, "const is not among enum: nothing can match")
        else:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.refuse(f"{path}/enum", "enum must be a non-empty list")
        for value in values:
            if allowed is not None and not any(is_json_type(value, t) for t in allowed):
                raise self.refuse(path, f"value {json.dumps(value)[:60]} is not of type {' or '.join(allowed)}")
        self.spend(path, lambda: self.table.spending.literals([json.dumps(v, ensure_ascii=False) for v in values]))
        if len(values) == 1:
            return {"const": values[0]}
        return {"enum": values}

    def _types(self, schema: dict, path: str) -> list[str]:
        declared = schema.get("type")
        if declared is None:
            # No type: JSON Schema lets any type through, so emitting only the types
            # the keywords describe is stricter, still valid.
            inferred = [t for t in ("object", "array", "string", "number") if VOCABULARY[t] & schema.keys()]
            return inferred or list(ANY_VALUE_TYPES)
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list) or not types or any(t not in VOCABULARY for t in types):
            raise self.refuse(f"{path}/type", f"type must be one of {', '.join(TYPES)} (or a list of them)")
        return list(dict.fromkeys(types))

    def _typed(self, kind: str, schema: dict, path: str) -> dict:
        present = VOCABULARY[kind] & schema.keys()
        if kind in ("number", "integer") and present:
            return self._numeric(kind, schema, present, path)
        if kind == "string":
            return self._string(schema, path)
        if kind == "object":
            return self._object(schema, path)
        if kind == "array":
            return self._array(schema, path)
        return {"type": kind}

    # -- per type --

    def _numeric(self, kind: str, schema: dict, present: set[str], path: str) -> dict:
        if "multipleOf" in present:
            raise self.refuse(path, f"'multipleOf' on a {kind} is not enforced by the grammar (integers' minimum/"
                                    "maximum/exclusiveMinimum/exclusiveMaximum are; numbers' ranges are not)")
        if kind == "number":
            raise self.refuse(path, f"{', '.join(map(repr, sorted(present)))} on a number is not enforced by the "
                                    "grammar: ranges are enforced on integers (type 'integer'), not on numbers")
        low, high = self._integer_range(schema, path)
        return {"type": "integer", **({"minimum": low} if low is not None else {}),
                **({"maximum": high} if high is not None else {})}

    def _integer_range(self, schema: dict, path: str) -> tuple[int | None, int | None]:
        """The inclusive integer bounds (None: open) that minimum/maximum and their
        exclusive forms allow: JSON Schema 2020's numbers, or draft-4's boolean
        flags on minimum/maximum. Fractional bounds are rounded inward."""
        low: int | None = None
        high: int | None = None
        for key in RANGE_KEYWORDS:
            if key not in schema:
                continue
            value, here = schema[key], f"{path}/{key}"
            is_low = key in ("minimum", "exclusiveMinimum")
            base, flag = ("minimum", "exclusiveMinimum") if is_low else ("maximum", "exclusiveMaximum")
            if isinstance(value, bool):
                if key == base:
                    raise self.refuse(here, f"{key} must be a number")
                if value and base not in schema:
                    raise self.refuse(here, f"{key} true (the draft-4 form) needs {base}")
                continue  # a draft-4 flag: read with its base
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self.refuse(here, f"{key} must be a number")
            if abs(value) > MAX_INTEGER_BOUND:
                raise self.refuse(here, f"{key} is beyond ±2**53 ({MAX_INTEGER_BOUND}), the largest bound "
                                        "the grammar enforces")
            exclusive = key == flag or schema.get(flag) is True
            if is_low:
                bound = math.floor(value) + 1 if exclusive else math.ceil(value)
                low = bound if low is None else max(low, bound)
            else:
                bound = math.ceil(value) - 1 if exclusive else math.floor(value)
                high = bound if high is None else min(high, bound)
        if low is not None and high is not None and low > high:
            raise self.refuse(path, f"no integer is within the range (at least {low}, at most {high}): nothing "
                                    "can match")
        return low, high

    def _string(self, schema: dict, path: str) -> dict:
        unsupported = sorted({"contentEncoding", "contentMediaType", "contentSchema"} & schema.keys())
        if unsupported:
            raise self.refuse(path, f"{', '.join(map(repr, unsupported))} is not enforced by the grammar")
        kinds = [k for k in ("format", "pattern") if k in schema]
        lengths = "minLength" in schema or "maxLength" in schema
        if len(kinds) + lengths > 1:
            raise self.refuse(path, "only one of format, pattern and minLength/maxLength can be enforced together")
        if "format" in schema:
            if schema["format"] not in FORMATS:
                raise self.refuse(f"{path}/format", f"format {schema['format']!r} is not enforced by the grammar "
                                                    f"(enforced: {', '.join(sorted(FORMATS))})")
            return {"type": "string", "format": schema["format"]}
        if "pattern" in schema:
            pattern = schema["pattern"]
            if not isinstance(pattern, str):
                raise self.refuse(f"{path}/pattern", "pattern must be a string")
            try:
                translated = PatternTranslator(pattern).translate()
            except ValueError as exc:
                raise self.refuse(f"{path}/pattern", f"pattern {pattern[:80]!r}: {exc}") from None
            self._spend(translated.repeats, f"{path}/pattern")
            return {"type": "string", "pattern": translated.gbnf}
        if lengths:
            low, high = self._bounds(schema, "minLength", "maxLength", path)
            return {"type": "string", "minLength": low, **({"maxLength": high} if high is not None else {})}
        return {"type": "string"}

    def _object(self, schema: dict, path: str) -> dict:
        unsupported = sorted({"patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                              "dependencies", "unevaluatedProperties"} & schema.keys())
        if unsupported:
            raise self.refuse(path, f"{', '.join(map(repr, unsupported))} is not enforced by the grammar")
        properties = schema.get("properties")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise self.refuse(f"{path}/required", "required must be a list of property names")
        extra = schema.get("additionalProperties", True)
        if properties is None:
            return self._map(schema, path, required, extra)
        if not isinstance(properties, dict):
            raise self.refuse(f"{path}/properties", "properties must be an object of schemas")
        missing = [r for r in required if r not in properties]
        if missing:
            raise self.refuse(f"{path}/required", f"required {missing} not among properties: the grammar only "
                                                  "writes declared properties")
        self._check_property_counts(schema, path, len(set(required)), len(properties))
        self.spend(path, lambda: self.table.spending.object(len(properties), len(properties) - len(set(required))))
        # Only the declared properties are written (additional ones, which the
        # schema may allow, are left out: stricter, still valid).
        walked = {}
        for key, value in properties.items():
            if not key:
                raise self.refuse(f"{path}/properties", "an empty property name is not supported")
            walked[key] = self.node(value, f"{path}/properties/{escape_pointer(key)}", set())
        return {"type": "object", "properties": walked, "required": list(dict.fromkeys(required))}

    def _map(self, schema: dict, path: str, required: list, extra: Any) -> dict:
        """An object without declared properties: any keys, values per additionalProperties."""
        if required:
            raise self.refuse(f"{path}/required", f"required {required} not among properties: the grammar only "
                                                  "writes declared properties")
        for key in ("minProperties", "maxProperties"):
            if schema.get(key) not in (None, 0) and not (key == "maxProperties" and extra is False):
                raise self.refuse(f"{path}/{key}", f"{key} is not enforced by the grammar")
        if extra is False:
            return {"type": "object", "additionalProperties": False}  # exactly {}
        if extra is True or extra == {}:
            return {"type": "object"}
        return {"type": "object", "additionalProperties": self.node(extra, f"{path}/additionalProperties", set())}

    def _check_property_counts(self, schema: dict, path: str, n_required: int, n_declared: int) -> None:
        low, high = schema.get("minProperties"), schema.get("maxProperties")
        if low is not None and not (isinstance(low, int) and low <= n_required):
            raise self.refuse(f"{path}/minProperties", "minProperties above the number of required properties is "
                                                       "not enforced by the grammar")
        if high is not None and not (isinstance(high, int) and high >= n_declared):
            raise self.refuse(f"{path}/maxProperties", "maxProperties below the number of declared properties is "
                                                       "not enforced by the grammar")

    def _array(self, schema: dict, path: str) -> dict:
        unsupported = sorted({"contains", "minContains", "maxContains", "unevaluatedItems"} & schema.keys())
        if unsupported:
            raise self.refuse(path, f"{', '.join(map(repr, unsupported))} is not enforced by the grammar")
        low, high = self._bounds(schema, "minItems", "maxItems", path)
        items = schema.get("items", True)
        prefix = schema.get("prefixItems")
        if prefix is None and isinstance(items, list):  # draft-04 tuple form
            prefix, items = items, False
        if schema.get("uniqueItems") is True and (high is None or high > 1) and (prefix is None or len(prefix) > 1):
            raise self.refuse(f"{path}/uniqueItems", "uniqueItems is not enforced by the grammar")
        if prefix is not None:
            return self._tuple(prefix, low, high, path)
        if items is False:
            if low:
                raise self.refuse(f"{path}/minItems", "minItems above 0 with items false: nothing can match")
            return {"type": "array", "prefixItems": []}
        walked = self.node(items, f"{path}/items", set())
        return {"type": "array", "items": walked, "minItems": low, **({"maxItems": high} if high is not None else {})}

    def _tuple(self, prefix: Any, low: int, high: int | None, path: str) -> dict:
        """Exactly the prefix items (items after them, which the schema may allow, are left out)."""
        if not isinstance(prefix, list):
            raise self.refuse(f"{path}/prefixItems", "prefixItems must be a list of schemas")
        if low > len(prefix) or (high is not None and high < len(prefix)):
            raise self.refuse(path, f"minItems/maxItems other than the {len(prefix)} tuple items are not enforced")
        walked = [self.node(item, f"{path}/prefixItems/{i}", set()) for i, item in enumerate(prefix)]
        return {"type": "array", "prefixItems": walked}

    def _bounds(self, schema: dict, low_key: str, high_key: str, path: str) -> tuple[int, int | None]:
        low, high = schema.get(low_key, 0), schema.get(high_key)
        for key, value in ((low_key, low), (high_key, high)):
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise self.refuse(f"{path}/{key}", f"{key} must be a non-negative integer")
            if value > MAX_REPEAT:
                raise self.refuse(f"{path}/{key}", f"{key} {value} is above {MAX_REPEAT}, the most the grammar "
                                                   "expands")
        if high is not None and low > high:
            raise self.refuse(path, f"{low_key} is above {high_key}: nothing can match")
        self._spend(high if high is not None else low, path)
        return low, high

    def _spend(self, repeats: int, path: str) -> None:
        self.table.repeats += repeats
        if self.table.repeats > MAX_REPEAT_TOTAL:
            raise self.refuse(path, f"the schemas ask for more than {MAX_REPEAT_TOTAL} repetitions in all "
                                    "(minItems/maxItems/minLength/maxLength/pattern counts)")

    # -- $ref --

    def _ref_name(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise self.refuse(path, f"$ref {str(ref)[:80]!r}: only local references (#/...) are supported; "
                                    "remote schemas are never fetched")
        if ref not in self.ref_names:
            self._target(ref, path)  # refuse a dangling pointer now, where it is written
            name = self.table.reserve(ref.rsplit("/", 1)[-1] or "root")
            self.ref_names[ref] = name
            self.pending.append((ref, name))
        return self.ref_names[ref]

    def _target(self, pointer: str, path: str | None = None) -> Any:
        target: Any = self.document
        for part in pointer[2:].split("/") if pointer != "#" else []:
            key = unescape_pointer(part)
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                raise self.refuse(path or pointer[1:], f"$ref {pointer[:80]!r} points at nothing")
        return target

    def _refuse_left_recursion(self) -> None:
        """A $ref cycle that reads no character first (A is B | ..., B is A) would
        make llama.cpp refuse the grammar; say where instead."""
        for start in self.heads:
            seen, stack = set(), list(self.heads[start])
            while stack:
                name = stack.pop()
                if name == start:
                    raise self.refuse("/", f"$ref cycle through {start!r} reads nothing before recursing "
                                           "(left recursion)")
                if name not in seen:
                    seen.add(name)
                    stack.extend(self.heads.get(name, ()))

    # -- oneOf --

    def _require_exclusive(self, alternatives: list, path: str) -> None:
        """The grammar enforces oneOf as anyOf: accept it only where at most one
        alternative can match anyway (disjoint types, or a discriminator property)."""
        resolved = [self._follow_refs(alt) for alt in alternatives]
        type_sets = [possible_types(alt) for alt in resolved]
        if all(not (a & b) for i, a in enumerate(type_sets) for b in type_sets[i + 1:]):
            return
        if discriminated(resolved, self._follow_refs):
            return
        raise self.refuse(path, "oneOf whose alternatives can overlap is not enforced (the grammar matches any "
                                "of them); use anyOf, or tell them apart by a required const property")

    def _follow_refs(self, schema: Any) -> Any:
        for _ in range(MAX_SCHEMA_DEPTH):
            if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)
                    and (schema["$ref"] == "#" or schema["$ref"].startswith("#/"))):
                return schema
            schema = self._target(schema["$ref"])
        return schema


def _check_bounds(schema: Any, param: str) -> None:
    """Depth first (iteratively: a 10 000-deep schema must not recurse), then size."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarRefused(f"{param} is nested deeper than {MAX_SCHEMA_DEPTH} levels", param)
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)
    try:
        size = len(json.dumps(schema, ensure_ascii=False).encode("utf-8", errors="surrogatepass"))
    except (TypeError, ValueError) as exc:
        raise GrammarRefused(f"{param} is not JSON: {exc}", param) from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarRefused(f"{param} is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are accepted", param)

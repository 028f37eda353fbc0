"""How many parse stacks llama.cpp's grammar matcher may hold at once for a
schema, estimated before the grammar is built.

The matcher keeps a stack for every way the output can go on. A step whose
sampled token the grammar refuses checks the whole vocabulary against each
stack, on the thread that decodes every slot, so the most stacks a grammar can
hold bounds what it can cost a neighbour's stream per step. Where they come
from, in the grammars daemon.grammar writes:

- the optional properties of an object: between two properties, one stack per
  way the names of those that may come next begin (objects.py);
- an enum or const set: the widest branching of its prefix tree (literals.py);
- anyOf: every alternative is live at its start, and alternatives that begin
  alike (two arrays, two objects whose first property is the same and not told
  apart by a const) stay live together inside, adding up. Nested, that
  multiplies: anyOf[array of X, array of X] doubles at every level, and through
  a recursive $ref it has no end at all.

Each schema gets two figures: `head`, the stacks at its first character, and
`width`, the most at any point inside it. A $ref cycle is solved by iterating
from 1 until nothing grows; a cycle that keeps growing passes the limit and
the estimate stops there. The estimate errs high (alternatives that a character
or two tell apart are counted as if they were live together at the start).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daemon.grammar.integer_range import integer_range_gbnf
from daemon.grammar.limits import MAX_LIVE_STACKS
from daemon.grammar.literals import literal_tree
from daemon.grammar.objects import names_width
from daemon.grammar.refused import GrammarRefused

if TYPE_CHECKING:
    from daemon.grammar.schema_walk import RefTable

ALL_STARTS = frozenset("{[\"-tfn")  # what a JSON value can begin with ("-" stands for every number)
_FIXED = {"number": 3, "integer": 3, "boolean": 2, "null": 1}  # the converter's primitives
_FORMAT_WIDTH = 4  # date, time, date-time, uuid: fixed small grammars
_ANY_VALUE_WIDTH = 8  # the converter's generic JSON value, at any depth


@dataclass(frozen=True)
class Measure:
    head: int
    width: int


def literal_width(values: list[Any]) -> int:
    """The widest branching of the prefix tree of these values' JSON spellings."""
    spellings = sorted({json.dumps(v, ensure_ascii=False) for v in values})
    return literal_tree([(s, "") for s in spellings], lambda name, body: name, "w", json.dumps).width


class WidthEstimate:
    """The estimate over normalized schemas (what SchemaWalk returns) and their
    $ref table. integer_width(low, high): the alternatives of a ranged integer's
    rule. Stops counting past `limit` (the figure is then limit + 1)."""

    def __init__(self, refs: dict[str, dict], integer_width: Callable[[int | None, int | None], int],
                 limit: int, check_time: Callable[[], None] = lambda: None) -> None:
        self.refs = refs
        self.integer_width = integer_width
        self.limit = limit
        self.check_time = check_time
        self._ref_measures: dict[str, Measure] | None = None  # solved on the first width()
        self._literal_widths: dict[int, int] = {}

    def width(self, schema: dict) -> int:
        """The most stacks at any point of `schema` (the $refs are solved once,
        to a fixed point, for every schema of the table)."""
        if self._ref_measures is None:
            self._ref_measures = {name: Measure(1, 1) for name in self.refs}
            for _ in range(self.limit + 2):  # a growing cycle grows by at least one per round
                changed = False
                for name, target in self.refs.items():
                    measure = self._capped(self.measure(target))
                    if measure != self._ref_measures[name]:
                        self._ref_measures[name], changed = measure, True
                if not changed:
                    break
        return min(self.measure(schema).width, self.limit + 1)

    def _capped(self, m: Measure) -> Measure:
        cap = self.limit + 1
        return Measure(min(m.head, cap), min(m.width, cap))

    def measure(self, schema: dict) -> Measure:
        self.check_time()
        if "$ref" in schema:
            return self._ref_measures[schema["$ref"]]
        if "anyOf" in schema:
            return self._any_of(schema["anyOf"])
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            key = id(schema)
            if key not in self._literal_widths:
                self._literal_widths[key] = literal_width(values)
            width = self._literal_widths[key]
            return Measure(width, width)
        kind = schema.get("type")
        if isinstance(kind, list):
            return Measure(len(kind), _ANY_VALUE_WIDTH)
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind == "string":
            return Measure(1, self._string(schema))
        if kind == "integer" and ("minimum" in schema or "maximum" in schema):
            width = self.integer_width(schema.get("minimum"), schema.get("maximum"))
            return Measure(width, width)
        return Measure(1, _FIXED.get(kind, _ANY_VALUE_WIDTH))

    def _object(self, schema: dict) -> Measure:
        properties = schema.get("properties")
        extra = schema.get("additionalProperties", True)
        if properties is None:  # a map: any keys
            if extra is False:
                return Measure(1, 1)
            inner = _ANY_VALUE_WIDTH if extra is True else self.measure(extra).width
            return Measure(1, max(2, inner))
        required = set(schema.get("required", ()))
        # Between two properties: a comma or the end, then the tree of the optional names (objects.py).
        names = names_width([json.dumps(key) for key in properties if key not in required])
        widths = [self.measure(value).width for value in properties.values()]
        return Measure(1, max([2, names, *widths]))

    def _array(self, schema: dict) -> Measure:
        if "prefixItems" in schema:
            return Measure(1, max([2, *(self.measure(item).width for item in schema["prefixItems"])]))
        item = self.measure(schema["items"])
        return Measure(1, max(2, item.head + 1, item.width))

    def _string(self, schema: dict) -> int:
        if "pattern" in schema:
            return _pattern_width(schema["pattern"])
        if "format" in schema:
            return _FORMAT_WIDTH
        return 2  # one more character, or the closing quote

    def _any_of(self, alternatives: list[dict]) -> Measure:
        measures = [self.measure(alt) for alt in alternatives]
        head = sum(m.head for m in measures)
        # Alternatives that begin alike stay live together: group them by what
        # they begin with, and inside a group add up their widths, unless their
        # first property tells them apart (a discriminator).
        widest = max(m.width for m in measures)
        groups: dict[str, list[int]] = {}
        for i, alt in enumerate(alternatives):
            for start in self._starts(alt, set()):
                groups.setdefault(start, []).append(i)
        for start, members in groups.items():
            if len(members) < 2:
                continue
            if start == "{" and self._told_apart([alternatives[i] for i in members]):
                together = max(len(members), *(measures[i].width for i in members))
            else:
                together = sum(measures[i].width for i in members)
            widest = max(widest, together)
        return Measure(head, max(head, widest))

    def _starts(self, schema: dict, seen: set[str]) -> frozenset[str]:
        """The characters an output of `schema` can begin with ("-" for any number)."""
        if "$ref" in schema:
            name = schema["$ref"]
            if name in seen:
                return frozenset()
            return self._starts(self.refs[name], seen | {name})
        if "anyOf" in schema:
            return frozenset().union(*(self._starts(alt, seen) for alt in schema["anyOf"]))
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            return frozenset(_start_of(json.dumps(v)) for v in values)
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        starts: set[str] = set()
        for k in kinds:
            starts |= {"object": {"{"}, "array": {"["}, "string": {'"'}, "number": {"-"}, "integer": {"-"},
                       "boolean": {"t", "f"}, "null": {"n"}}.get(k, ALL_STARTS)
        return frozenset(starts)

    def _told_apart(self, objects: list[dict]) -> bool:
        """Objects whose first written property (the first required one) is the
        same key, with const or enum values no two of them share: the matcher
        drops all but one at that value."""
        resolved = [self._resolved(o) for o in objects]
        firsts = []
        for schema in resolved:
            required = schema.get("required") or []
            properties = schema.get("properties") or {}
            if schema.get("type") != "object" or not required or required[0] not in properties:
                return False
            firsts.append((required[0], self._resolved(properties[required[0]])))
        if len({key for key, _ in firsts}) != 1:
            return len({key for key, _ in firsts}) == len(firsts)  # all different keys: told apart by the key
        seen: set[str] = set()
        for _, value in firsts:
            if "const" not in value and "enum" not in value:
                return False
            spellings = {json.dumps(v, sort_keys=True) for v in ([value["const"]] if "const" in value
                                                                  else value["enum"])}
            if spellings & seen:
                return False
            seen |= spellings
        return True

    def _resolved(self, schema: dict) -> dict:
        for _ in range(len(self.refs) + 1):
            if "$ref" not in schema:
                return schema
            schema = self.refs[schema["$ref"]]
        return schema


def _start_of(spelling: str) -> str:
    first = spelling[:1]
    return "-" if first == "-" or first.isdigit() else first


def _pattern_width(gbnf: str) -> int:
    """An upper bound for a translated pattern: one more stack per alternative
    and per repetition, counted outside its literals and classes."""
    count, i = 1, 0
    while i < len(gbnf):
        c = gbnf[i]
        if c in "\"[":
            close = '"' if c == '"' else "]"
            i += 1
            while i < len(gbnf) and gbnf[i] != close:
                i += 2 if gbnf[i] == "\\" else 1
        elif c in "|*+?{":
            count += 1
        i += 1
    return count + 1


# -- one request's estimate, and its limit ------------------------------------------------


def width_estimate(table: RefTable) -> WidthEstimate:
    return WidthEstimate(table.schemas, _integer_width, MAX_LIVE_STACKS, table.spending.check_time)


def _integer_width(low: int | None, high: int | None) -> int:
    return integer_range_gbnf(low, high).count("|") + 1


def check_width(width: int, param: str) -> None:
    if width > MAX_LIVE_STACKS:
        raise GrammarRefused(
            f"{param}: the grammar would let the output go on in more than {MAX_LIVE_STACKS} ways at one point; "
            f"llama.cpp's grammar matcher checks the whole vocabulary against each of them at a step, on the thread "
            "every slot shares. Fewer optional properties in one object, or anyOf alternatives that do not begin "
            "alike (nested or recursive ones add up), keep it under the limit", param)

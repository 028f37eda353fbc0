"""From a request's structured-output fields to one GBNF grammar (root rule "root").

Three steps:

1. The request's fields are checked for shape and for conflicts (one grammar
   per request: a raw `grammar`, a JSON Schema, or a forced tool call).
2. Each JSON Schema is walked by `_SchemaWalk`, which refuses every keyword
   the grammar would not enforce and rewrites the rest into the small,
   annotation-free vocabulary that llama-cpp-python's converter handles
   correctly: its `visit` takes the first matching branch and silently drops
   the other keywords of a schema (a `type` list drops `properties`, `$ref`
   drops its siblings, `allOf` keeps only the components' properties, numbers
   ignore `minimum`...), so what reaches it must be unambiguous. Integer
   ranges (minimum/maximum, exclusive or not) reach it as an inclusive
   `minimum`/`maximum` pair of ints, which the subclass below turns into a
   digit-by-digit rule (`_integer_range_gbnf`). Local `$ref`s
   become names in one table; anything else (remote URLs, which the
   converter would fetch with `requests`) is refused.
3. `_Converter` (a subclass of the converter, loaded by file path so that the
   llama_cpp package and its shared library are never imported here) emits
   the GBNF. The subclass fixes what the stock one gets wrong: literals with a
   backslash, rule-name clashes between `$defs` and other rules, and string
   patterns (its own translation breaks on `\\d`, `.` and quotes); and it
   writes objects in linear time and size (objects.py) and enums as prefix
   trees (literals.py).

What a request's grammar may cost is bounded before it is converted: counts
while walking (limits.py: optional properties per object, properties,
alternatives, enum values) and the parse stacks the matcher may hold
(width.py). The whole build has a time bound, checked at every schema node,
so a build that runs long stops itself; off_loop.py runs it on a thread.

Whitespace: the converter's `space` rule is `" "?`, one optional space after
each token, so no rule can loop on whitespace; we keep it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from daemon.grammar.gbnf_check import GbnfRefused, check_gbnf
from daemon.grammar.limits import MAX_LIVE_STACKS, Deadline, LimitExceeded, Spending
from daemon.grammar.literals import literal_tree
from daemon.grammar.objects import object_rule
from daemon.grammar.width import WidthEstimate

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_GRAMMAR_TEXT_BYTES = 64 * 1024  # a raw `grammar` from the request
MAX_GRAMMAR_BYTES = 256 * 1024  # what we produce
MAX_REPEAT = 1000  # one minItems/maxItems/minLength/maxLength or {n,m}: expanded rule by rule
MAX_REPEAT_TOTAL = 10_000  # all of them in one request, so building stays cheap
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_GROUP_DEPTH = 16
MAX_TOOLS = 128
MAX_PARALLEL_TOOL_CALLS = 8
MAX_INTEGER_BOUND = 2**53  # |minimum|, |maximum| on integers: exact as a double, 16 digits at most
INTEGER_DIGITS = 16  # the converter's plain integer has at most 16 digits; an open range keeps that

# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "examples", "example", "default", "$schema", "$comment", "deprecated",
    "readOnly", "writeOnly", "$anchor", "$vocabulary", "discriminator", "$id",
})
CONTAINERS = frozenset({"$defs", "definitions"})  # hold schemas reached through $ref
STRING_KEYWORDS = frozenset({"pattern", "format", "minLength", "maxLength", "contentEncoding",
                             "contentMediaType", "contentSchema"})
RANGE_KEYWORDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
NUMBER_KEYWORDS = frozenset({*RANGE_KEYWORDS, "multipleOf"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "minProperties", "maxProperties",
                             "patternProperties", "propertyNames", "dependentRequired", "dependentSchemas",
                             "dependencies", "unevaluatedProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
                            "contains", "minContains", "maxContains", "unevaluatedItems"})
VOCABULARY = {"string": STRING_KEYWORDS, "number": NUMBER_KEYWORDS, "integer": NUMBER_KEYWORDS,
              "object": OBJECT_KEYWORDS, "array": ARRAY_KEYWORDS, "boolean": frozenset(), "null": frozenset()}
COMBINATORS = frozenset({"$ref", "allOf", "anyOf", "oneOf"})
VALUE_KEYWORDS = frozenset({"const", "enum", "type"})
# Known, but a grammar cannot enforce them (or the converter ignores them).
UNSUPPORTED = frozenset({"not", "if", "then", "else", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
                         "$recursiveAnchor"})
TYPES = tuple(VOCABULARY)
ANY_VALUE_TYPES = ["object", "array", "string", "number", "boolean", "null"]  # integer is a number
FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})


class GrammarRefused(ValueError):
    """A constraint the grammar cannot enforce, or a malformed one: a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# -- the request ------------------------------------------------------------------------


def grammar_for(*, response_format: dict | None = None, json_schema: dict | None = None, grammar: str | None = None,
                tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                parallel_tool_calls: bool = False, deadline: Deadline | None = None) -> str | None:
    """The GBNF (root rule "root") the request's output must match, or None.

    parallel_tool_calls: a forced call may be several (false, as llama-server's
    default: exactly one). deadline: when the whole build must be over (None:
    no bound). Raises GrammarRefused (param = the request field) for a
    malformed field, a conflict between fields, a schema keyword the grammar
    would not enforce, a schema over a limit, or a build past its deadline."""
    spending = Spending(deadline)
    if not isinstance(parallel_tool_calls, bool):
        raise GrammarRefused("parallel_tool_calls must be true or false", "parallel_tool_calls")
    declared = _tool_schemas(tools)
    forced = _forced_tools(tool_choice, declared)
    format_schema, format_param = _response_format_schema(response_format)
    if json_schema is not None:
        if not isinstance(json_schema, dict):
            raise GrammarRefused("json_schema must be a JSON Schema object", "json_schema")
        if format_param is not None:
            raise GrammarRefused("give either json_schema or a JSON response_format, not both", "json_schema")
        format_schema, format_param = json_schema, "json_schema"
    if grammar is not None and format_param is not None:
        raise GrammarRefused(f"give either grammar or {format_param.split('.')[0]}, not both", "grammar")
    if forced is not None:
        other = "grammar" if grammar is not None else format_param and format_param.split(".")[0]
        if other:
            raise GrammarRefused(f"{other} and tool_choice {_choice_text(tool_choice)} both constrain the output; "
                                 "give one of them", "tool_choice")
        return _tool_call_grammar(forced, single=not parallel_tool_calls or isinstance(tool_choice, dict),
                                  spending=spending)
    if grammar is not None:
        return _raw_grammar(grammar)
    if format_param is not None:
        return _schema_grammar(format_schema, format_param, spending)
    return None


def _choice_text(tool_choice: str | dict) -> str:
    return repr(tool_choice) if isinstance(tool_choice, str) else "(a named function)"


def _response_format_schema(response_format: Any) -> tuple[Any, str | None]:
    """(schema, its param) asked for by response_format; (None, None) for plain text."""
    if response_format is None:
        return None, None
    if not isinstance(response_format, dict):
        raise GrammarRefused("response_format must be an object with a type", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None, None
    if kind == "json_object":
        # llama-server also takes a schema right here; without one, any JSON object.
        schema = response_format.get("schema")
        if schema is None:
            return {"type": "object"}, "response_format"
        if not isinstance(schema, dict):
            raise GrammarRefused("response_format.schema must be a JSON Schema object", "response_format.schema")
        return schema, "response_format.schema"
    if kind == "json_schema":
        wrapper = response_format.get("json_schema")
        if not isinstance(wrapper, dict):
            raise GrammarRefused("response_format.json_schema must be an object with a schema",
                                 "response_format.json_schema")
        for key, expected in (("name", str), ("strict", bool), ("description", str)):
            if key in wrapper and wrapper[key] is not None and not isinstance(wrapper[key], expected):
                raise GrammarRefused(f"response_format.json_schema.{key} must be a {expected.__name__}",
                                     f"response_format.json_schema.{key}")
        schema = wrapper.get("schema")
        if not isinstance(schema, dict):
            what = "is missing" if schema is None else "must be a JSON Schema object"
            raise GrammarRefused(f"response_format.json_schema.schema {what}", "response_format.json_schema.schema")
        return schema, "response_format.json_schema.schema"
    raise GrammarRefused(f"response_format.type must be 'text', 'json_object' or 'json_schema', not {kind!r}",
                         "response_format.type")


def _raw_grammar(grammar: Any) -> str:
    """llama-server's `grammar`: GBNF passed through after bounds; llama.cpp parses it."""
    if not isinstance(grammar, str):
        raise GrammarRefused("grammar must be GBNF text", "grammar")
    if not grammar.strip():
        raise GrammarRefused("grammar is empty", "grammar")
    size = len(grammar.encode("utf-8", errors="surrogatepass"))
    if size > MAX_GRAMMAR_TEXT_BYTES:
        raise GrammarRefused(f"grammar is {size} bytes; at most {MAX_GRAMMAR_TEXT_BYTES} are accepted", "grammar")
    if not re.search(r"^[ \t]*root[ \t]*::=", grammar, re.MULTILINE):
        raise GrammarRefused("grammar must define the rule 'root' (root ::= ...)", "grammar")
    try:
        check_gbnf(grammar)
    except GbnfRefused as exc:
        raise GrammarRefused(f"grammar: {exc}", "grammar") from None
    return _checked_output(grammar, "grammar")


def _schema_grammar(schema: dict, param: str, spending: Spending) -> str:
    table = _RefTable(spending)
    with _refusals(param):
        root = _SchemaWalk(schema, param, table).run()
        _check_width(_width(table).width(root), param)
        return _convert(root, table, param)


@contextlib.contextmanager
def _refusals(param: str):
    """Whatever stops a build (a limit, its time bound, a recursion too deep
    for Python) is a refusal that names the field, never a 500."""
    try:
        yield
    except LimitExceeded as exc:
        raise GrammarRefused(f"{param}: {exc}", param) from None
    except RecursionError:
        raise GrammarRefused(f"{param} is nested too deeply to build a grammar for", param) from None


def _width(table: _RefTable) -> WidthEstimate:
    return WidthEstimate(table.schemas, _integer_width, MAX_LIVE_STACKS, table.spending.check_time)


def _integer_width(low: int | None, high: int | None) -> int:
    return _integer_range_gbnf(low, high).count("|") + 1


def _check_width(width: int, param: str) -> None:
    if width > MAX_LIVE_STACKS:
        raise GrammarRefused(
            f"{param}: the grammar would let the output go on in more than {MAX_LIVE_STACKS} ways at one point; "
            f"llama.cpp's grammar matcher checks the whole vocabulary against each of them at a step, on the thread "
            "every slot shares. Fewer optional properties in one object, or anyOf alternatives that do not begin "
            "alike (nested or recursive ones add up), keep it under the limit", param)


# -- tools ------------------------------------------------------------------------------


def _tool_schemas(tools: Any) -> dict[str, tuple[Any, str]]:
    """name -> (parameters schema or None, its param), in declared order; shapes checked."""
    if tools is None:
        return {}
    if not isinstance(tools, list):
        raise GrammarRefused("tools must be a list of {type: function, function: {...}}", "tools")
    if len(tools) > MAX_TOOLS:
        raise GrammarRefused(f"{len(tools)} tools given; at most {MAX_TOOLS} are accepted", "tools")
    declared: dict[str, tuple[Any, str]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise GrammarRefused(f"{where} must be an object with type 'function'", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise GrammarRefused(f"{where}.function must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarRefused(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if name in declared:
            raise GrammarRefused(f"tool {name!r} is declared twice", f"{where}.function.name")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise GrammarRefused(f"{where}.function.parameters must be a JSON Schema object",
                                 f"{where}.function.parameters")
        declared[name] = (parameters, f"{where}.function.parameters")
    return declared


def _forced_tools(tool_choice: Any, declared: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]] | None:
    """The tools a call must be made to, or None when the model may answer in text."""
    if tool_choice in (None, "none", "auto"):
        return None  # "auto": tool calls are recognised by the parser, not forced
    if tool_choice == "required":
        if not declared:
            raise GrammarRefused("tool_choice 'required' needs tools", "tool_choice")
        return declared
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise GrammarRefused("tool_choice must be 'none', 'auto', 'required' or "
                                 "{type: function, function: {name}}", "tool_choice")
        if name not in declared:
            raise GrammarRefused(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return {name: declared[name]}
    raise GrammarRefused("tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}",
                         "tool_choice")


def _tool_call_grammar(forced: dict[str, tuple[Any, str]], single: bool, spending: Spending) -> str:
    """Exactly `[{"name": <declared name>, "arguments": <that tool's parameters>}, ...]`:
    one call, or 1..MAX_PARALLEL_TOOL_CALLS. Each name is tied to its own arguments
    schema: the names are a prefix tree whose every leaf goes on with that tool's
    arguments, so a hundred tools are a few parse stacks, not a hundred."""
    table = _RefTable(spending)
    arguments = {}
    for name, (parameters, param) in forced.items():
        with _refusals(param):
            arguments[name] = _SchemaWalk(_arguments_schema(parameters, param), param, table).run()
    width = _width(table)
    for name, (_, param) in forced.items():
        with _refusals(param):
            _check_width(width.width(arguments[name]) + 1, param)  # + 1: the next call, or the array's end
    param = "tools" if len(forced) > 1 else next(iter(forced.values()))[1]
    with _refusals(param):
        converter = _converter_class()(table.schemas, spending)
        follow = []
        for name, schema in arguments.items():
            rule = converter.visit(schema, f"call-{name}-arguments")
            follow.append((json.dumps(name, ensure_ascii=False), f'"," space "\\"arguments\\"" space ":" space {rule}'))
        names = literal_tree(follow, converter._add_rule, "call-name", converter._format_literal)
        _check_width(names.width + 1, param)
        call = converter._add_rule("call", f'"{{" space "\\"name\\"" space ":" space {names.expression} "}}" space')
        most = 1 if single else MAX_PARALLEL_TOOL_CALLS
        repeated = _converter_module()._build_repetition(call, 1, most, separator_rule='"," space')
        converter._add_rule("root", f'"[" space {repeated} "]" space')
        return _checked_output(converter.format_grammar(), param)


def _arguments_schema(parameters: dict | None, param: str) -> dict:
    """The arguments are always a JSON object; no parameters: an empty one."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise GrammarRefused(f"{param} must describe an object (type 'object'), not {kind!r}", param)
    return {**parameters, "type": "object"}


# -- JSON Schema -> the converter's vocabulary ---------------------------------------------


class _RefTable:
    """Normalized schemas reached through $ref, under names unique in one grammar,
    and what the request's schemas have spent of the limits."""

    def __init__(self, spending: Spending) -> None:
        self.schemas: dict[str, dict] = {}
        self.spending = spending
        self.repeats = 0  # MAX_REPEAT_TOTAL is counted across every schema of a request

    def reserve(self, hint: str) -> str:
        base = re.sub(r"[^a-zA-Z0-9-]+", "-", hint).strip("-")[:40] or "def"
        if base in _converter_module().RESERVED_NAMES or base == "space":
            base += "-def"  # the converter adds its primitives later under exactly these names
        name, n = base, 1
        while name in self.schemas:
            name, n = f"{base}-{n}", n + 1
        self.schemas[name] = {}  # filled when walked; reserved now so recursion finds it
        return name


class _SchemaWalk:
    """Checks one JSON Schema document and rewrites it for the converter.

    Every constraining keyword is either rewritten into something the converter
    enforces or refused; annotations are dropped. Where a keyword only allows
    more (additional properties next to declared ones, items beyond a tuple,
    an unanchored pattern) the output is the stricter grammar: still valid."""

    def __init__(self, document: dict, param: str, table: _RefTable) -> None:
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
            if "enum" in schema and not any(_same_json(schema["const"], v) for v in _as_list(schema["enum"])):
                raise self.refuse(path, "const is not among enum: nothing can match")
        else:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise self.refuse(f"{path}/enum", "enum must be a non-empty list")
        for value in values:
            if allowed is not None and not any(_is_json_type(value, t) for t in allowed):
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
                translated = _PatternTranslator(pattern).translate()
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
            walked[key] = self.node(value, f"{path}/properties/{_escape_pointer(key)}", set())
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
            key = _unescape_pointer(part)
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
        type_sets = [_possible_types(alt) for alt in resolved]
        if all(not (a & b) for i, a in enumerate(type_sets) for b in type_sets[i + 1:]):
            return
        if _discriminated(resolved, self._follow_refs):
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


def _possible_types(schema: Any) -> set[str]:
    """JSON types a (ref-resolved) schema can match; integer counts as number."""
    if not isinstance(schema, dict) or any(k in schema for k in COMBINATORS):
        return set(ANY_VALUE_TYPES)
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else _as_list(schema["enum"])
        return {_json_type(v) for v in values}
    declared = schema.get("type")
    if declared is None:
        return set(ANY_VALUE_TYPES)
    types = [declared] if isinstance(declared, str) else _as_list(declared)
    return {"number" if t == "integer" else t for t in types}


def _discriminated(alternatives: list, follow_refs) -> bool:
    """All alternatives are objects sharing a required property whose const/enum
    values do not overlap: at most one alternative matches any output."""
    if not all(isinstance(a, dict) and _possible_types(a) == {"object"} for a in alternatives):
        return False
    common = set.intersection(*(set(_as_list(a.get("required"))) for a in alternatives))
    for key in common:
        seen: set[str] = set()
        for alt in alternatives:
            properties = alt.get("properties")
            prop = follow_refs(properties.get(key)) if isinstance(properties, dict) else None
            if not isinstance(prop, dict) or not ("const" in prop or "enum" in prop):
                break
            values = {json.dumps(v, sort_keys=True) for v in ([prop["const"]] if "const" in prop
                                                               else _as_list(prop["enum"]))}
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


def _is_json_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return _json_type(value) == "number" and float(value).is_integer()
    return _json_type(value) == kind


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _escape_pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _unescape_pointer(part: str) -> str:
    from urllib.parse import unquote

    return unquote(part).replace("~1", "/").replace("~0", "~")


# -- string patterns -----------------------------------------------------------------------


class _Translated:
    def __init__(self, gbnf: str, repeats: int) -> None:
        self.gbnf = gbnf
        self.repeats = repeats


# Characters a JSON string cannot hold unescaped: a pattern's classes and dots
# leave them out (stricter, still valid); literal ones are written escaped.
_JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_CLASS_ESCAPES = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
                  "s": [(0x20, 0x20)]}  # \s: only the space (the others need escapes in JSON)
_CONTROL_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v"}
_METACHARS = set(".^$|?*+()[]{}\\/-")


class _PatternTranslator:
    """An ECMA-262 regular expression -> GBNF for the inside of a JSON string.

    Whole-match: an unanchored pattern is matched as if anchored (stricter,
    still valid). Supported: literals, escapes of metacharacters, \\d \\w \\s
    (and \\D \\W \\S), classes and negated classes, '.', groups and (?:...),
    alternation, * + ? {n} {n,} {n,m} (lazy forms: the same strings).
    Refused: lookarounds, backreferences, word boundaries, \\p{...}, anchors
    inside the pattern, and repeating something that can match nothing."""

    def __init__(self, pattern: str) -> None:
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"longer than {MAX_PATTERN_CHARS} characters")
        body = pattern[1:] if pattern.startswith("^") else pattern
        if body.endswith("$"):
            before = body[:-1]
            if (len(before) - len(before.rstrip("\\"))) % 2 == 0:  # "\\$" is a literal dollar
                body = before
        self.text = body
        self.i = 0
        self.repeats = 0

    def translate(self) -> _Translated:
        gbnf, _ = self._alternation(0)
        if self.i < len(self.text):
            raise ValueError(f"unbalanced ')' at {self.i}")
        return _Translated(gbnf, self.repeats)

    def _peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def _alternation(self, depth: int) -> tuple[str, bool]:
        if depth > MAX_PATTERN_GROUP_DEPTH:
            raise ValueError(f"groups nested deeper than {MAX_PATTERN_GROUP_DEPTH}")
        branches = [self._sequence(depth)]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._sequence(depth))
        gbnf = " | ".join(b for b, _ in branches)
        return (f"({gbnf})" if len(branches) > 1 else gbnf), any(n for _, n in branches)

    def _sequence(self, depth: int) -> tuple[str, bool]:
        parts: list[str] = []
        nullable = True
        while self._peek() not in ("", "|", ")"):
            atom, atom_nullable = self._atom(depth)
            quantified, atom_nullable = self._quantified(atom, atom_nullable)
            if quantified == atom and _is_literal(atom) and parts and _is_literal(parts[-1]):
                parts[-1] = parts[-1][:-1] + atom[1:]  # "a" "b" -> "ab"
            else:
                parts.append(quantified)
            nullable = nullable and atom_nullable
        return (" ".join(parts) if parts else '""'), nullable

    def _atom(self, depth: int) -> tuple[str, bool]:
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self._peek() == "?":
                raise ValueError("lookarounds and named groups are not supported")
            inner, nullable = self._alternation(depth + 1)
            if self._peek() != ")":
                raise ValueError("unbalanced '('")
            self.i += 1
            return f"({inner})", nullable
        if c == "[":
            return self._class(), False
        if c == ".":
            return _gbnf_class([(0x2028, 0x2029)], negated=True), False
        if c == "\\":
            return self._escape(), False
        if c in "^$":
            raise ValueError(f"anchor {c!r} inside the pattern is not supported")
        if c in "*+?{":
            raise ValueError(f"quantifier {c!r} with nothing to repeat at {self.i - 1}")
        return _gbnf_literal(c), False

    def _escape(self) -> str:
        c = self._peek()
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _gbnf_class(_CLASS_ESCAPES[c], negated=False)
        if c.lower() in _CLASS_ESCAPES:
            return _gbnf_class(_CLASS_ESCAPES[c.lower()] if c != "S" else [(0x09, 0x0D), (0x20, 0x20)],
                               negated=True)
        return _gbnf_literal(self._escaped_char(c))

    def _escaped_char(self, c: str) -> str:
        if c in _METACHARS:
            return c
        if c in _CONTROL_ESCAPES:
            return _CONTROL_ESCAPES[c]
        for prefix, digits in (("x", 2), ("u", 4)):
            code = self.text[self.i:self.i + digits]
            if c == prefix and re.fullmatch(rf"[0-9a-fA-F]{{{digits}}}", code):
                self.i += digits
                return chr(int(code, 16))
        raise ValueError(f"escape \\{c} is not supported")

    def _class(self) -> str:
        negated = self._peek() == "^"
        self.i += negated
        ranges: list[tuple[int, int]] = []
        while self._peek() not in ("]", ""):
            low = self._class_char(ranges)
            if low is None:
                continue
            if self._peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                high = self._class_char(ranges)
                if high is None or high < low:
                    raise ValueError("bad range in a character class")
                ranges.append((low, high))
            else:
                ranges.append((low, low))
        if self._peek() != "]":
            raise ValueError("unbalanced '['")
        self.i += 1
        if not negated and not _subtract(ranges, _JSON_ESCAPED):
            raise ValueError("character class matches only characters a JSON string must escape")
        return _gbnf_class(ranges, negated)

    def _class_char(self, ranges: list[tuple[int, int]]) -> int | None:
        """One class member's code point; a \\d-like escape adds its ranges and gives None."""
        c = self.text[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self._peek()
        if not e:
            raise ValueError("unbalanced '['")
        self.i += 1
        if e in _CLASS_ESCAPES:
            ranges.extend(_CLASS_ESCAPES[e])
            return None
        if e == "b":
            raise ValueError("\\b in a class is not supported")
        if e in "]-^":
            return ord(e)
        return ord(self._escaped_char(e))

    def _quantified(self, atom: str, nullable: bool) -> tuple[str, bool]:
        c = self._peek()
        if c not in ("*", "+", "?", "{"):
            return atom, nullable
        low, high = self._quantifier()
        if self._peek() == "?":
            self.i += 1  # lazy: the same set of whole matches
        if self._peek() in ("*", "+", "?", "{"):
            raise ValueError("a quantifier cannot follow a quantifier")
        if nullable and (high is None or high > 1):
            raise ValueError("repeating an expression that can match nothing")
        self.repeats += high if high is not None else low
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
        if suffix is None:
            suffix = f"{{{low},{'' if high is None else high}}}" if high != low else f"{{{low}}}"
        return f"{atom}{suffix}", nullable or low == 0

    def _quantifier(self) -> tuple[int, int | None]:
        c = self.text[self.i]
        self.i += 1
        if c != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        match = re.match(r"(\d+)(,(\d*))?\}", self.text[self.i:])
        if not match:
            raise ValueError("'{' must start a quantifier {n}, {n,} or {n,m}")
        self.i += match.end()
        low = int(match.group(1))
        high = low if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
        if max(low, high or 0) > MAX_REPEAT:
            raise ValueError(f"a count above {MAX_REPEAT}")
        if high is not None and high < low:
            raise ValueError(f"{{{low},{high}}}: the bounds are reversed")
        return low, high


# -- integer ranges -------------------------------------------------------------------------


def _integer_range_gbnf(low: int | None, high: int | None) -> str:
    """A GBNF expression for exactly the JSON integers from `low` to `high`
    (inclusive; None: open, up to INTEGER_DIGITS digits like the plain integer):
    no leading zeros, no "-0", no "+", a sign only on negatives. Parenthesized
    where it holds an alternation, so that a rule can follow it with " space"."""
    top = 10**INTEGER_DIGITS - 1
    branches = []
    if low is None or low < 0:  # "-" and a magnitude from max(1, -high) to -low
        least = 1 if high is None or high >= 0 else -high
        branches.append(f'"-" {_grouped(_magnitudes(least, top if low is None else -low))}')
    if high is None or high >= 0:
        branches.append(_magnitudes(max(low or 0, 0), top if high is None else high))
    return _grouped(" | ".join(branches))


def _magnitudes(low: int, high: int) -> str:
    """Decimal spellings (no leading zeros) of low..high, 0 <= low <= high: one
    alternative per length, consecutive lengths whose every value is in range merged."""
    pieces: list[str] = []
    full: list[int] = []  # a run of lengths n, each whole (1-9 for n = 1): [1-9] then n-1 digits

    def flush() -> None:
        if full:
            pieces.append(f"[1-9] {_digits(full[0] - 1, full[-1] - 1)}".rstrip())
            full.clear()

    for n in range(len(str(low)), len(str(high)) + 1):
        first = low if n == len(str(low)) else 10 ** (n - 1)
        last = high if n == len(str(high)) else 10**n - 1
        if first == max(10 ** (n - 1), 1) and last == 10**n - 1:
            full.append(n)
            continue
        flush()
        pieces.append(_same_length(str(first), str(last)))
    flush()
    return " | ".join(pieces)


def _same_length(low: str, high: str) -> str:
    """The digit strings of one length from `low` to `high`: the common prefix,
    then at the first differing digit d1 < d2: d1 and a tail >= low's, the digits
    between and any tail, d2 and a tail <= high's (whole tails merged into the middle)."""
    i = 0
    while i < len(low) and low[i] == high[i]:
        i += 1
    prefix = f'"{low[:i]}"' if i else ""
    if i == len(low):
        return prefix
    d1, d2, tail_low, tail_high = low[i], high[i], low[i + 1:], high[i + 1:]
    k = len(tail_low)
    low_whole, high_whole = tail_low == "0" * k, tail_high == "9" * k
    alternatives = []
    if not low_whole:
        alternatives.append(_joined(f'"{d1}"', _same_length(tail_low, "9" * k)))
    start, end = (d1 if low_whole else chr(ord(d1) + 1)), (d2 if high_whole else chr(ord(d2) - 1))
    if start <= end:
        middle = f'"{start}"' if start == end else f"[{start}-{end}]"
        alternatives.append(f"{middle} {_digits(k, k)}".rstrip())
    if not high_whole:
        alternatives.append(_joined(f'"{d2}"', _same_length("0" * k, tail_high)))
    rest = " | ".join(alternatives)
    return _joined(prefix, rest) if prefix else rest


def _joined(literal: str, rest: str) -> str:
    """A literal followed by `rest` ("1" "2" -> "12")."""
    head, _, tail = rest.partition(" ")
    if re.fullmatch(r'"[0-9]+"', head) and " | " not in rest:
        return f"{literal[:-1]}{head[1:]} {tail}".rstrip()
    return f"{literal} {_grouped(rest)}"


def _digits(least: int, most: int) -> str:
    """least to most decimal digits, as GBNF ("" for none)."""
    if most == 0:
        return ""
    if least == most:
        return "[0-9]" if least == 1 else f"[0-9]{{{least}}}"
    return f"[0-9]{{{least},{most}}}"


def _grouped(alternatives: str) -> str:
    return f"({alternatives})" if " | " in alternatives else alternatives


def _is_literal(gbnf: str) -> bool:
    return len(gbnf) >= 2 and gbnf[0] == '"' and gbnf[-1] == '"'


def _subtract(ranges: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result = list(ranges)
    for r_low, r_high in removed:
        kept = []
        for low, high in result:
            if high < r_low or low > r_high:
                kept.append((low, high))
                continue
            if low < r_low:
                kept.append((low, r_low - 1))
            if high > r_high:
                kept.append((r_high + 1, high))
        result = kept
    return result


def _gbnf_class(ranges: list[tuple[int, int]], negated: bool) -> str:
    """A GBNF character class that never matches what JSON must escape."""
    if negated:
        members = ranges + _JSON_ESCAPED
    else:
        members = _subtract(ranges, _JSON_ESCAPED)
    body = "".join(_gbnf_char(lo) if lo == hi else f"{_gbnf_char(lo)}-{_gbnf_char(hi)}" for lo, hi in members)
    return f"[{'^' if negated else ''}{body}]"


def _gbnf_char(code: int) -> str:
    if chr(code).isascii() and chr(code).isalnum():
        return chr(code)
    if code <= 0xFF:
        return f"\\x{code:02X}"
    return f"\\u{code:04X}" if code <= 0xFFFF else f"\\U{code:08X}"


def _gbnf_literal(char: str) -> str:
    """A GBNF literal for one character of the decoded string: its JSON spelling."""
    spelled = json.dumps(char, ensure_ascii=False)[1:-1]
    return '"' + spelled.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- the converter ---------------------------------------------------------------------------


@functools.cache
def _converter_module() -> ModuleType:
    """llama-cpp-python's llama_grammar.py, loaded by its path.

    find_spec on the top-level package does not run its __init__ (which would
    load libllama); llama_grammar.py itself imports only the standard library.
    The module object is private to us (not in sys.modules), so the patch
    below touches no one else's copy."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llama-cpp-python is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "llama_grammar.py"
    module_spec = importlib.util.spec_from_file_location("_dormouse_llama_grammar", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    # Its JSON string character allows raw control characters, which JSON
    # forbids (json.loads rejects them); upstream llama.cpp excludes them too.
    module.PRIMITIVE_RULES["char"] = module.BuiltinRule(
        r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])', [])
    return module


@functools.cache
def _converter_class() -> type:
    base = _converter_module().SchemaConverter

    class Converter(base):
        """The stock converter with our fixes; schemas arrive normalized by _SchemaWalk."""

        def __init__(self, refs: dict[str, dict], spending: Spending) -> None:
            super().__init__(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
            self._refs = refs  # table name -> normalized schema; resolve_refs (which fetches) is never called
            self._ref_rules: dict[str, str] = {}
            self._spending = spending

        def _format_literal(self, literal: str) -> str:
            # The stock one escapes quotes but not backslashes, so a JSON escape
            # in a const (or a property name) ended the GBNF literal early.
            escaped = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
            return f'"{escaped}"'

        def _generate_constant_rule(self, value: Any) -> str:
            # Non-ASCII as itself, as a model writes it, rather than \\u escapes.
            return self._format_literal(json.dumps(value, ensure_ascii=False))

        def _resolve_ref(self, ref: str) -> str:
            # The stock one looks a $def up by its last path segment among all rules,
            # so a property rule with the same name stood in for it.
            rule = self._ref_rules.get(ref)
            if rule is None:
                rule = ref
                while rule in self._rules:
                    rule += "-ref"
                self._ref_rules[ref] = rule  # before visiting: recursion finds the name
                produced = self.visit(self._refs[ref], rule)
                if produced != rule:  # a primitive comes back under its own name
                    self._rules[rule] = produced
            return rule

        def visit(self, schema: dict, name: str) -> str:
            self._spending.check_time()  # raises LimitExceeded once the build's time is up
            rule_name = name + "-" if name in _converter_module().RESERVED_NAMES else name or "root"
            # An integer range from _SchemaWalk: inclusive int bounds, one of them possibly open.
            if schema.get("type") == "integer" and ("minimum" in schema or "maximum" in schema):
                gbnf = _integer_range_gbnf(schema.get("minimum"), schema.get("maximum"))
                return self._add_rule(rule_name, f"{gbnf} space")
            if "const" in schema or "enum" in schema:
                # A prefix tree: the matcher holds one stack per way the values go on, not one per value.
                values = [schema["const"]] if "const" in schema else schema["enum"]
                spellings = dict.fromkeys(json.dumps(v, ensure_ascii=False) for v in values)
                tree = literal_tree([(s, "") for s in spellings], self._add_rule, rule_name, self._format_literal)
                return self._add_rule(rule_name, tree.expression)
            return super().visit(schema, name)

        def _build_object_rule(self, properties: list[tuple[str, Any]], required: set[str], name: str,
                               additional_properties: Any) -> str:
            # The stock one is quadratic in optional properties, recurses once per
            # property, and leaves the matcher a stack per property that may come next.
            if properties and additional_properties not in (None, False):
                raise AssertionError("_SchemaWalk writes declared properties only")
            if not properties and (additional_properties is True or isinstance(additional_properties, dict)):
                return super()._build_object_rule(properties, required, name, additional_properties)  # a map
            prefix = f"{name}-" if name else ""
            values = {key: self.visit(value, f"{prefix}{key}") for key, value in properties}
            kvs = [self._add_rule(f"{prefix}{key}-kv", f"{self._format_literal(json.dumps(key))} space \":\" space "
                                                       f"{values[key]}") for key, _ in properties if key in required]
            optional = [(json.dumps(key), values[key]) for key, _ in properties if key not in required]
            return object_rule(kvs, optional, name, self._add_rule, self._format_literal)

        def _visit_pattern(self, pattern: str, name: str) -> str:
            # _SchemaWalk has already translated the pattern into GBNF.
            return self._add_rule(name, f'"\\"" {pattern} "\\"" space')

    return Converter


def _convert(root: dict, table: _RefTable, param: str) -> str:
    converter = _converter_class()(table.schemas, table.spending)
    converter.visit(root, "")
    return _checked_output(converter.format_grammar(), param)


def _checked_output(gbnf: str, param: str) -> str:
    try:
        size = len(gbnf.encode("utf-8"))
    except UnicodeEncodeError:
        raise GrammarRefused(f"{param} holds a lone UTF-16 surrogate, which is not text", param) from None
    if "\x00" in gbnf:
        raise GrammarRefused(f"{param} holds a NUL character", param)
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarRefused(f"the grammar for {param} would be {size} bytes; at most {MAX_GRAMMAR_BYTES} "
                             "are accepted", param)
    return gbnf


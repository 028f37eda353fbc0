"""From a request's structured-output fields to one GBNF grammar (root rule "root").

Three steps, each in its own module:

1. The request's fields are checked for shape and for conflicts (one grammar
   per request: a raw `grammar`, a JSON Schema, or a forced tool call, whose
   fields tool_calls.py reads).
2. Each JSON Schema is walked by `SchemaWalk` (schema_walk.py), which refuses
   every keyword the grammar would not enforce and rewrites the rest for the
   converter.
3. The converter (converter.py) emits the GBNF.

What a request's grammar may cost is bounded before it is converted: counts
while walking (limits.py: optional properties per object, properties,
alternatives, enum values) and the parse stacks the matcher may hold
(width.py). The whole build has a time bound, checked at every schema node,
so a build that runs long stops itself; off_loop.py runs it on a thread.
"""

from __future__ import annotations

import re
from typing import Any

# build._converter_class: the tests count the converter's rules through it.
from daemon.grammar.converter import converter_class as _converter_class
from daemon.grammar.gbnf_check import GbnfRefused, check_gbnf
from daemon.grammar.limits import Deadline, Spending
from daemon.grammar.refused import GrammarRefused, checked_output, refusals
from daemon.grammar.schema_walk import RefTable, SchemaWalk
from daemon.grammar.tool_calls import forced_tools, tool_call_grammar, tool_schemas
from daemon.grammar.width import check_width, width_estimate

MAX_GRAMMAR_TEXT_BYTES = 64 * 1024  # a raw `grammar` from the request


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
    declared = tool_schemas(tools)
    forced = forced_tools(tool_choice, declared)
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
        return tool_call_grammar(forced, single=not parallel_tool_calls or isinstance(tool_choice, dict),
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
    return checked_output(grammar, "grammar")


def _schema_grammar(schema: dict, param: str, spending: Spending) -> str:
    table = RefTable(spending)
    with refusals(param):
        root = SchemaWalk(schema, param, table).run()
        check_width(width_estimate(table).width(root), param)
        return _convert(root, table, param)


def _convert(root: dict, table: RefTable, param: str) -> str:
    converter = _converter_class()(table.schemas, table.spending)
    converter.visit(root, "")
    return checked_output(converter.format_grammar(), param)

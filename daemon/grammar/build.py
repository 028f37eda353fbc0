"""From a request's structured-output fields to one llguidance grammar.

1. The request's fields are checked for shape and for conflicts: one
   constraint per answer, a raw `grammar`, a JSON Schema, or a forced tool
   call (whose fields tool_calls.py reads). A forced call wins over a
   response_format or json_schema, as OpenAI's API does: instructor, LangChain
   and pydantic-ai send both on every call, and the call is the answer.
2. Each JSON Schema is checked and counted (schema_check.py), then compiled
   by llguidance; what llguidance refuses (a keyword it does not implement,
   an unknown format, a remote $ref, which it never fetches) is a 400 naming
   the request field, with llguidance's message.
3. A raw `grammar` is GBNF, read by llguidance's GBNF reader (gbnf_to_lark)
   after the bounds of gbnf_check.py.

The result is llguidance's grammar text, which the worker compiles against the
model's vocabulary (daemon/worker/structured.py). Here it is validated
without one, so a grammar llguidance refuses never reaches a worker.
"""

from __future__ import annotations

import re
from typing import Any

from daemon.grammar.gbnf_check import GbnfRefused, check_gbnf
from daemon.grammar.limits import Deadline, Spending
from daemon.grammar.refused import GrammarRefused, checked_output, refusals
from daemon.grammar.schema_check import check_schema
from daemon.grammar.tool_calls import forced_tools, tool_call_schema, tool_schemas

MAX_GRAMMAR_TEXT_BYTES = 64 * 1024  # a raw `grammar` from the request
# One optional space between JSON tokens, as the old GBNF's `space ::= " "?`: llguidance's
# default (any run of whitespace) lets a small model fill max_tokens with newlines.
JSON_OPTIONS = {"whitespace_pattern": "[ ]?"}


def grammar_for(*, response_format: dict | None = None, json_schema: dict | None = None, grammar: str | None = None,
                tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                parallel_tool_calls: bool = False, deadline: Deadline | None = None) -> str | None:
    """llguidance's grammar for what the request's output must match, or None.

    parallel_tool_calls: a forced call may be several (false, as llama-server's
    default: exactly one). deadline: when the whole build must be over (None:
    no bound). Raises GrammarRefused (param = the request field) for a
    malformed field, a conflict between fields, a schema keyword llguidance
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
        if grammar is not None:  # llama-server's raw GBNF: no API pairs it with tools, so say it is ambiguous
            raise GrammarRefused(f"grammar and tool_choice {_choice_text(tool_choice)} both constrain the output; "
                                 "give one of them", "tool_choice")
        # The forced call is the answer; response_format would shape a text answer, which there is none of.
        schema, param = tool_call_schema(forced, single=not parallel_tool_calls or isinstance(tool_choice, dict),
                                         spending=spending)
        return compile_schema(schema, param, spending)
    if grammar is not None:
        return _raw_grammar(grammar)
    if format_param is not None:
        return compile_schema(check_schema(format_schema, format_param, spending), format_param, spending)
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


def compile_schema(schema: Any, param: str, spending: Spending) -> str:
    """llguidance's grammar for a checked schema; its refusal is a GrammarRefused naming `param`."""
    from llguidance import LLMatcher

    with refusals(param):
        spending.check_time()
        try:
            grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarRefused(f"{param}: {exc}", param) from None
        _validate(grammar, param)
        spending.check_time()
    return checked_output(grammar, param)


def _raw_grammar(grammar: Any) -> str:
    """llama-server's `grammar`: GBNF, bounded, then read by llguidance's GBNF reader."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if not isinstance(grammar, str):
        raise GrammarRefused("grammar must be GBNF text", "grammar")
    if not grammar.strip():
        raise GrammarRefused("grammar is empty", "grammar")
    size = len(grammar.encode("utf-8", errors="surrogatepass"))
    if size > MAX_GRAMMAR_TEXT_BYTES:
        raise GrammarRefused(f"grammar is {size} bytes; at most {MAX_GRAMMAR_TEXT_BYTES} are accepted", "grammar")
    if not re.search(r"^[ \t]*root[ \t]*::=", grammar, re.MULTILINE):
        raise GrammarRefused("grammar must define the rule 'root' (root ::= ...)", "grammar")
    checked_output(grammar, "grammar")  # no NUL, no lone surrogate
    try:
        check_gbnf(grammar)
    except GbnfRefused as exc:
        raise GrammarRefused(f"grammar: {exc}", "grammar") from None
    with refusals("grammar"):
        try:
            lark = gbnf_to_lark(grammar)
        except Exception as exc:  # noqa: BLE001 - the reader's own errors (GbnfToLarkError, ValueError...)
            raise GrammarRefused(f"grammar is not GBNF that llguidance reads: {exc}", "grammar") from None
        text = LLMatcher.grammar_from_lark(lark)
        _validate(text, "grammar")
    return checked_output(text, "grammar")


def _validate(grammar: str, param: str) -> None:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarRefused(f"{param}: {_short(error)}", param)


def _short(message: str) -> str:
    """llguidance's message, without the grammar dump some of its errors append."""
    message = message.split("<state>", 1)[0].split("<grammar>", 1)[0].strip()
    return message if len(message) <= 600 else message[:600] + "..."

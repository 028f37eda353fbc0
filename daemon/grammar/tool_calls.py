"""Forced tool calls: the request's `tools` checked for shape, the tools
`tool_choice` forces a call to, and the grammar of that call: exactly
`[{"name": <declared name>, "arguments": <that tool's parameters>}, ...]`.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.grammar.converter import converter_class, converter_module
from daemon.grammar.limits import Spending
from daemon.grammar.literals import literal_tree
from daemon.grammar.refused import GrammarRefused, checked_output, refusals
from daemon.grammar.schema_walk import RefTable, SchemaWalk
from daemon.grammar.width import check_width, width_estimate

MAX_TOOLS = 128
MAX_PARALLEL_TOOL_CALLS = 8


def tool_schemas(tools: Any) -> dict[str, tuple[Any, str]]:
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


def forced_tools(tool_choice: Any, declared: dict[str, tuple[Any, str]]) -> dict[str, tuple[Any, str]] | None:
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


def tool_call_grammar(forced: dict[str, tuple[Any, str]], single: bool, spending: Spending) -> str:
    """Exactly `[{"name": <declared name>, "arguments": <that tool's parameters>}, ...]`:
    one call, or 1..MAX_PARALLEL_TOOL_CALLS. Each name is tied to its own arguments
    schema: the names are a prefix tree whose every leaf goes on with that tool's
    arguments, so a hundred tools are a few parse stacks, not a hundred."""
    table = RefTable(spending)
    arguments = {}
    for name, (parameters, param) in forced.items():
        with refusals(param):
            arguments[name] = SchemaWalk(_arguments_schema(parameters, param), param, table).run()
    width = width_estimate(table)
    for name, (_, param) in forced.items():
        with refusals(param):
            check_width(width.width(arguments[name]) + 1, param)  # + 1: the next call, or the array's end
    param = "tools" if len(forced) > 1 else next(iter(forced.values()))[1]
    with refusals(param):
        converter = converter_class()(table.schemas, spending)
        follow = []
        for name, schema in arguments.items():
            rule = converter.visit(schema, f"call-{name}-arguments")
            follow.append((json.dumps(name, ensure_ascii=False), f'"," space "\\"arguments\\"" space ":" space {rule}'))
        names = literal_tree(follow, converter._add_rule, "call-name", converter._format_literal)
        check_width(names.width + 1, param)
        call = converter._add_rule("call", f'"{{" space "\\"name\\"" space ":" space {names.expression} "}}" space')
        most = 1 if single else MAX_PARALLEL_TOOL_CALLS
        repeated = converter_module()._build_repetition(call, 1, most, separator_rule='"," space')
        converter._add_rule("root", f'"[" space {repeated} "]" space')
        return checked_output(converter.format_grammar(), param)


def _arguments_schema(parameters: dict | None, param: str) -> dict:
    """The arguments are always a JSON object; no parameters: an empty one."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise GrammarRefused(f"{param} must describe an object (type 'object'), not {kind!r}", param)
    return {**parameters, "type": "object"}

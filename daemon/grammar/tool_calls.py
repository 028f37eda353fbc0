"""Forced tool calls: the request's `tools` checked for shape, the tools
`tool_choice` forces a call to, and the JSON Schema of that call: exactly
`[{"name": <declared name>, "arguments": <that tool's parameters>}, ...]`,
which build.py compiles with llguidance as any other schema.
"""

from __future__ import annotations

from typing import Any

from daemon.grammar.limits import Spending
from daemon.grammar.refused import GrammarRefused
from daemon.grammar.schema_check import check_schema

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


def tool_call_schema(forced: dict[str, tuple[Any, str]], single: bool, spending: Spending) -> tuple[dict, str]:
    """(schema, param) of exactly `[{"name": <declared name>, "arguments": <that tool's parameters>}, ...]`:
    one call, or 1..MAX_PARALLEL_TOOL_CALLS, each name tied to its own arguments
    (an anyOf of the calls). Each tool's parameters are checked alone, so a
    refusal names that tool's field, and placed under $defs with their local
    $refs rebased, so that "#/$defs/X" inside them still finds X."""
    from daemon.grammar.build import compile_schema  # build.py imports this module

    defs: dict[str, Any] = {}
    calls = []
    for i, (name, (parameters, param)) in enumerate(forced.items()):
        key = f"tool-{i}"
        plain = _arguments_schema(parameters, param)
        compile_schema(check_schema(plain, param, spending), param, spending)  # counted once, here
        defs[key] = check_schema(plain, param, Spending(spending.deadline), rebase=f"/$defs/{key}")
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{key}"}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    most = 1 if single else MAX_PARALLEL_TOOL_CALLS
    schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
              "minItems": 1, "maxItems": most, "$defs": defs}
    param = "tools" if len(forced) > 1 else next(iter(forced.values()))[1]
    return schema, param


def _arguments_schema(parameters: dict | None, param: str) -> dict:
    """The arguments are always a JSON object; no parameters: an empty one."""
    if parameters is None:
        return {"type": "object", "properties": {}}
    kind = parameters.get("type", "object")
    if kind != "object":
        raise GrammarRefused(f"{param} must describe an object (type 'object'), not {kind!r}", param)
    return {**parameters, "type": "object"}

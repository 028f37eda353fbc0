"""The GBNF emitter: llama-cpp-python's JSON Schema converter, loaded by file
path so that the llama_cpp package and its shared library are never imported
here, with our fixes.

Its `visit` takes the first matching branch and silently drops the other
keywords of a schema, so what reaches it is normalized by schema_walk.py
first. The subclass fixes what the stock one gets wrong: literals with a
backslash, rule-name clashes between `$defs` and other rules, and string
patterns (translated by patterns.py); it writes integer ranges digit by digit
(integer_range.py), objects in linear time and size (objects.py) and enums as
prefix trees (literals.py).

Whitespace: the converter's `space` rule is `" "?`, one optional space after
each token, so no rule can loop on whitespace; we keep it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from daemon.grammar.integer_range import integer_range_gbnf
from daemon.grammar.limits import Spending
from daemon.grammar.literals import literal_tree
from daemon.grammar.objects import object_rule


@functools.cache
def converter_module() -> ModuleType:
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
def converter_class() -> type:
    base = converter_module().SchemaConverter

    class Converter(base):
        """The stock converter with our fixes; schemas arrive normalized by SchemaWalk."""

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
            rule_name = name + "-" if name in converter_module().RESERVED_NAMES else name or "root"
            # An integer range from SchemaWalk: inclusive int bounds, one of them possibly open.
            if schema.get("type") == "integer" and ("minimum" in schema or "maximum" in schema):
                gbnf = integer_range_gbnf(schema.get("minimum"), schema.get("maximum"))
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
                raise AssertionError("SchemaWalk writes declared properties only")
            if not properties and (additional_properties is True or isinstance(additional_properties, dict)):
                return super()._build_object_rule(properties, required, name, additional_properties)  # a map
            prefix = f"{name}-" if name else ""
            values = {key: self.visit(value, f"{prefix}{key}") for key, value in properties}
            kvs = [self._add_rule(f"{prefix}{key}-kv", f"{self._format_literal(json.dumps(key))} space \":\" space "
                                                       f"{values[key]}") for key, _ in properties if key in required]
            optional = [(json.dumps(key), values[key]) for key, _ in properties if key not in required]
            return object_rule(kvs, optional, name, self._add_rule, self._format_literal)

        def _visit_pattern(self, pattern: str, name: str) -> str:
            # SchemaWalk has already translated the pattern into GBNF.
            return self._add_rule(name, f'"\\"" {pattern} "\\"" space')

    return Converter

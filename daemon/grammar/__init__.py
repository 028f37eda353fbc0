"""Structured output: the GBNF grammar a request's constraints ask for.

`grammar_for` (in build.py) turns a request's `response_format`, llama-server's
`json_schema` and `grammar`, and a forced tool call (`tools` with `tool_choice`
"required" or a named function) into one GBNF text whose root rule is "root",
or None when nothing is to be constrained. The worker hands the text to
llama.cpp's grammar sampler.

A constraint is enforced or refused, never silently ignored: every JSON Schema
keyword that the grammar would not enforce raises GrammarRefused, naming the
request field, the keyword and where it is, so the HTTP layer can answer 400.

What a grammar may cost is bounded before it is built (limits.py, width.py:
optional properties, alternatives, enum values, the parse stacks llama.cpp's
matcher may hold at once), enums and tool names are written as prefix trees
(literals.py), objects in linear time (objects.py), and the HTTP layer builds
on a small thread pool with a time bound (off_loop.py), never on the event loop.

build.py composes the steps: tool_calls.py reads `tools` and `tool_choice`,
schema_walk.py checks and normalizes each JSON Schema (keywords.py: the
vocabulary, json_values.py: what oneOf's checks ask of values, patterns.py:
regular expressions, integer_range.py: minimum/maximum on integers), and
converter.py emits the GBNF; refused.py holds GrammarRefused.

Pure Python: the JSON Schema converter is llama-cpp-python's llama_grammar.py,
loaded by its path so that the daemon never imports the llama_cpp package
(whose __init__ loads the llama.cpp shared library).
"""

from daemon.grammar.build import grammar_for
from daemon.grammar.refused import GrammarRefused

__all__ = ["GrammarRefused", "grammar_for"]

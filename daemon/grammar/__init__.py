"""Structured output: the llguidance grammar a request's constraints ask for.

`grammar_for` (in build.py) turns a request's `response_format`, llama-server's
`json_schema` and `grammar` (GBNF), and a forced tool call (`tools` with
`tool_choice` "required" or a named function) into one llguidance grammar
text, or None when nothing is to be constrained. The worker compiles it
against the model's vocabulary (daemon/worker/structured.py) and samples under
it (daemon/worker/sampling.py).

A constraint is enforced or refused, never silently ignored: every JSON Schema
keyword outside the vocabulary (schema_check.py) and every keyword llguidance
does not implement raises GrammarRefused, naming the request field and the
keyword, so the HTTP layer can answer 400.

llguidance bounds what matching costs (its parser's own limits); what compiling
costs is bounded here by sizes (limits.py), and the HTTP layer builds on a
small thread pool with a time bound (off_loop.py), never on the event loop.
tool_calls.py reads `tools` and `tool_choice` and writes the call's schema;
gbnf_check.py bounds a raw GBNF grammar; refused.py holds GrammarRefused.

llguidance is a compiled extension with no Python dependencies: the daemon
still never imports the llama_cpp package here.
"""

from daemon.grammar.build import grammar_for
from daemon.grammar.refused import GrammarRefused

__all__ = ["GrammarRefused", "grammar_for"]
